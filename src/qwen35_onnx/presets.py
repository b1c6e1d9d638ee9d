"""Model sizes: the tiny demo preset and the published Qwen3.5 sizes (no torch at import).

Each preset is the keyword arguments of ``transformers.Qwen3_5Config``; every preset uses the
token ids of the demo tokenizer (:data:`ADDED_TOKENS` after the byte-level BPE entries), since
the published tokenizer cannot be downloaded here. :mod:`.checkpoints` builds checkpoints from
them (random weights); ``qwen35-onnx bench --preset`` picks one by name.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = [
    "ADDED_TOKENS",
    "MINIMAL_ADDED_TOKENS",
    "PRESETS",
    "PUBLISHED_ADDED_TOKENS",
    "QWEN35_0_8B_PRESET",
    "QWEN35_2B_PRESET",
    "QWEN35_4B_PRESET",
    "QWEN35_9B_PRESET",
    "TINY_PRESET",
    "preset_config",
    "preset_dtype",
    "tiny_config",
    "token_id",
]

# ---------------------------------------------------------------------------
# Tokenizer layout of the demo tokenizer
# ---------------------------------------------------------------------------

#: The added tokens of the published Qwen3.5 tokenizers, in their published order (ids right after
#: the base vocabulary), each with its ``special`` flag: ``<tool_call>``, ``<think>``, the FIM and
#: ``<tool_response>`` markers are added tokens that are NOT special (kept by
#: ``decode(..., skip_special_tokens=True)``, and text to a grammar). The demo tokenizer has them all.
PUBLISHED_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
)

#: A smaller layout for the one test tokenizer without the tool-call, FIM and audio markers (the
#: markers are then spelled in ordinary tokens): the first 14 published tokens and the thinking pair.
MINIMAL_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    *PUBLISHED_ADDED_TOKENS[:14],
    ("<think>", False),
    ("</think>", False),
)

#: The demo tokenizer's added tokens (:data:`PUBLISHED_ADDED_TOKENS`' contents, in order).
ADDED_TOKENS: tuple[str, ...] = tuple(token for token, _ in PUBLISHED_ADDED_TOKENS)

VOCAB_SIZE = 1024  # 256 byte tokens + 735 BPE merges + 33 added tokens
BPE_SIZE = VOCAB_SIZE - len(ADDED_TOKENS)


def token_id(token: str) -> int:
    """Id of an added token in the demo tokenizer (the trainer is checked to match)."""
    return BPE_SIZE + ADDED_TOKENS.index(token)


# ---------------------------------------------------------------------------
# The tiny preset
# ---------------------------------------------------------------------------

#: Keyword arguments for ``transformers.Qwen3_5Config(**TINY_PRESET)``: a small
#: but real Qwen3.5 (2.0 M parameters, 0.27 M of them in the vision tower).
#: Text: vocab 1024, hidden 128, 8 layers in the published pattern (3 Gated
#: DeltaNet layers then 1 full-attention layer, twice); GQA with 4 query and 2
#: KV heads of dim 64; Gated DeltaNet with 2 key and 4 value heads of dim 32,
#: conv kernel 4; partial rotary (25 % of 64 = 16 dims = 8 frequencies, split
#: 3/3/2 over t/h/w, interleaved), theta 1e7. Vision: 2 blocks of width 64, patch
#: 16, temporal patch 2, 2x2 merge into image tokens of width 128 (= text hidden).
#: Token ids are those of the demo tokenizer. ``initializer_range`` is 0.08
#: instead of the usual 0.02 so that random weights give clear greedy argmax
#: margins (logits std ~0.9; see :func:`~.checkpoints.build_demo_checkpoint`). Treat as read-only;
#: :func:`tiny_config` works on a copy.
TINY_PRESET: dict[str, Any] = {
    "text_config": {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 8,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
        "initializer_range": 0.08,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
        },
        "eos_token_id": token_id("<|endoftext|>"),
    },
    "vision_config": {
        "depth": 2,
        "hidden_size": 64,
        "num_heads": 4,
        "intermediate_size": 128,
        "hidden_act": "gelu_pytorch_tanh",
        "patch_size": 16,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "out_hidden_size": 128,
        "num_position_embeddings": 64,
        "in_channels": 3,
        "initializer_range": 0.08,
    },
    "image_token_id": token_id("<|image_pad|>"),
    "video_token_id": token_id("<|video_pad|>"),
    "vision_start_token_id": token_id("<|vision_start|>"),
    "vision_end_token_id": token_id("<|vision_end|>"),
    "tie_word_embeddings": False,
}

# ---------------------------------------------------------------------------
# Published sizes
# ---------------------------------------------------------------------------


TEXT_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "linear_num_value_heads",
)
"""The text sizes in which the published Qwen3.5 sizes differ, in the order :func:`_published` takes them."""
VISION_SIZES = ("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size")
"""The vision sizes in which they differ, in the same way."""


def _published(text_sizes: tuple[int, ...], vision_sizes: tuple[int, ...], tied: bool) -> dict[str, Any]:
    """A published Qwen3.5 size on :data:`TINY_PRESET`'s token ids: the settings every published
    size shares (Gated DeltaNet key/value heads of 128, conv kernel 4, attention heads of 256,
    3 Gated DeltaNet layers then 1 full-attention layer, vocabulary 248320, rotary theta 1e7 on
    25 % of each head with interleaved mRoPE sections 11/11/10; vision patch 16, temporal 2, 2x2
    merge, 48x48 learned position grid), then ``text_sizes`` (:data:`TEXT_SIZES`) and
    ``vision_sizes`` (:data:`VISION_SIZES`)."""
    text, vision = dict(zip(TEXT_SIZES, text_sizes, strict=True)), dict(zip(VISION_SIZES, vision_sizes, strict=True))
    preset = copy.deepcopy(TINY_PRESET)
    preset["text_config"].update(
        {
            "vocab_size": 248320,
            "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * (text["num_hidden_layers"] // 4),
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "tie_word_embeddings": tied,
            "max_position_embeddings": 262144,
            "initializer_range": 0.02,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e7,
                "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10],
                "mrope_interleaved": True,
            },
            **text,
        }
    )
    preset["vision_config"].update({"num_position_embeddings": 2304, "initializer_range": 0.02, **vision})
    preset["tie_word_embeddings"] = tied
    return preset


#: Keyword arguments for ``transformers.Qwen3_5Config`` with the published dimensions of
#: ``Qwen/Qwen3.5-0.8B`` (0.85 B parameters, 254 M of them in the tied embedding / lm_head).
#: Source: the checkpoint's ``config.json`` on the Hugging Face Hub
#: (https://huggingface.co/Qwen/Qwen3.5-0.8B/blob/main/config.json, revision
#: 2fc06364715b967f1860aea9cf38778875588b17), numbers cross-checked against two independent
#: mirrors of it (github.com/wlejon/brolm ``tests/test_qwen35_config.cpp`` @ 5544049e and
#: github.com/hvasconcelos/mlxforge ``tests/core/config_test.cpp`` @ 410e2169) and, for the
#: vision tower, pytorch-image-models PR #2765. Text: hidden 1024, 24 layers (3 Gated DeltaNet
#: + 1 gated full attention, six times), MLP 3584, attention 8 query / 2 KV heads of 256,
#: Gated DeltaNet 16 key and 16 value heads of 128, conv kernel 4, vocab 248320, tied
#: embeddings, rotary theta 1e7 on 25 % of each head with mRoPE sections 11/11/10
#: interleaved. Vision: 12 blocks of width 768 (MLP 3072, 12 heads), patch 16, temporal 2,
#: 2x2 merge to 1024. Weights are random (``initializer_range`` 0.02, transformers' default)
#: and the token ids are the demo tokenizer's (the published tokenizer cannot be downloaded
#: here); only the sizes matter for speed. Treat as read-only.
QWEN35_0_8B_PRESET: dict[str, Any] = _published((1024, 3584, 24, 8, 2, 16), (12, 768, 12, 3072, 1024), tied=True)

#: ``Qwen/Qwen3.5-2B`` (2.2 B parameters; revision 15852e8c16360a2fea060d615a32b45270f8a8fc of its
#: ``config.json``): hidden 2048, MLP 6144, 24 layers (18 Gated DeltaNet + 6 full attention),
#: attention 8 query / 2 KV heads, Gated DeltaNet 16 key / 16 value heads, tied embeddings. Vision
#: tower (the 2B and 4B share it): 24 blocks of width 1024 (MLP 4096, 16 heads) merged to 2048,
#: from pytorch-image-models ``timm/models/qwen3_vit.py`` @ 30eb5c9d and its PR #2765. Random
#: weights and demo token ids as :data:`QWEN35_0_8B_PRESET`.
QWEN35_2B_PRESET: dict[str, Any] = _published((2048, 6144, 24, 8, 2, 16), (24, 1024, 16, 4096, 2048), tied=True)

#: ``Qwen/Qwen3.5-4B`` (4.5 B parameters, 9.1 GB in bf16, the reference system's model; ``config.json`` revision
#: 851bf6e806efd8d0a36b00ddf55e13ccb7b8cd0a): hidden 2560, MLP 9216, 32 layers (24 Gated DeltaNet +
#: 8 full attention), attention 16 query / 4 KV heads of 256, Gated DeltaNet 16 key / 32 value
#: heads of 128 (the 2:1 value/key ratio), vocab 248320. The published config ties the lm_head to
#: the token embedding (``tie_word_embeddings: true``, and the model card: "LM Output: 248320
#: (Tied to token embedding)"); the reference system's listing says untied, the published config
#: wins. Vision: 24 blocks of width 1024 (MLP 4096, 16 heads) merged to 2560, no deepstack.
QWEN35_4B_PRESET: dict[str, Any] = _published((2560, 9216, 32, 16, 4, 32), (24, 1024, 16, 4096, 2560), tied=True)

#: ``Qwen/Qwen3.5-9B`` (9.4 B parameters, 18.8 GB in bf16: the published 19.3 GB also hold the
#: multi-token-prediction layer, which transformers does not build; ``config.json`` revision
#: c202236235762e1c871ad0ccb60c8ee5ba337b9a, of which only the first 50 lines were readable here;
#: the rest from copies that agree with each other and with its weight index, which lists an
#: ``lm_head.weight``): hidden 4096, MLP 12288, 32 layers (24 + 8), attention 16 query / 4 KV heads,
#: Gated DeltaNet 16 key / 32 value heads, untied lm_head. Vision: 27 blocks of width 1152 (MLP
#: 4304, 16 heads) merged to 4096 (pytorch-image-models ``qwen3_vit.py`` @ 30eb5c9d).
QWEN35_9B_PRESET: dict[str, Any] = _published((4096, 12288, 32, 16, 4, 32), (27, 1152, 16, 4304, 4096), tied=False)

#: Checkpoint presets by name (``qwen35-onnx bench --preset``).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": TINY_PRESET,
    "qwen3.5-0.8b": QWEN35_0_8B_PRESET,
    "qwen3.5-2b": QWEN35_2B_PRESET,
    "qwen3.5-4b": QWEN35_4B_PRESET,
    "qwen3.5-9b": QWEN35_9B_PRESET,
}


def preset_config(name: str = "tiny"):
    """Return a fresh ``transformers.Qwen3_5Config`` for the preset ``name`` (see :data:`PRESETS`).

    Returns:
        transformers.Qwen3_5Config: a new config object (the preset is deep-copied,
        so changing the result never changes the preset).

    Raises:
        ValueError: unknown preset name.
    """
    from transformers import Qwen3_5Config

    if name not in PRESETS:
        raise ValueError(f"preset {name!r} is not one of {', '.join(PRESETS)}")
    return Qwen3_5Config(**copy.deepcopy(PRESETS[name]))


def tiny_config():
    """Return a fresh ``transformers.Qwen3_5Config`` built from :data:`TINY_PRESET`."""
    return preset_config("tiny")


def preset_dtype(preset: str) -> str:
    """Storage dtype of a preset's checkpoint: fp32 for ``tiny`` (the parity tests' reference),
    bf16 for the published sizes, as Qwen publishes them (a 4B fp32 checkpoint would be 18 GB)."""
    return "fp32" if preset == "tiny" else "bf16"
