"""The checkpoint's multi-token-prediction (MTP) head as a torch module (transformers' Qwen3.5 model skips the
``mtp.*`` tensors: ``_keys_to_ignore_on_load_unexpected``).

Layout of the published checkpoints (``text_config.mtp_num_hidden_layers`` = 1): ``mtp.fc`` (``[H, 2H]``, no
bias), ``mtp.pre_fc_norm_embedding`` and ``mtp.pre_fc_norm_hidden`` (RMSNorms, zero-centred weights like every
Qwen3.5 norm), one full-attention decoder layer ``mtp.layers.0`` (gated attention with q/k norms, mRoPE, the
SwiGLU MLP), and ``mtp.norm``; the head reads the model's token embedding and ``lm_head``.

Definition (vLLM's ``Qwen3_5MultiTokenPredictor.forward`` and its MTP proposer): at position ``i`` the head
takes the target's hidden state ``h_i`` (after the final norm: the tensor ``lm_head`` reads, transformers'
``last_hidden_state``) and the embedding of the token at ``i + 1``, and predicts the token at ``i + 2``::

    x = fc(concat(pre_fc_norm_embedding(embed(token[i+1])), pre_fc_norm_hidden(h_i)))
    x = decoder_layer(x, position i)          # attends over the head's own KV of positions <= i
    m_i = norm(x); logits = lm_head(m_i)

A further draft step feeds ``m_i`` as the hidden state of position ``i + 1`` with the drafted token.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

MTP_PREFIX = "mtp."
"""The checkpoint keys of the head start with this."""


class ExportMtpError(ValueError):
    """The checkpoint's MTP head has a layout this exporter does not read."""


class MtpHead(nn.Module):
    """``mtp.*`` of a Qwen3.5 checkpoint (see the module docstring), built from ``text_config``; its parameter
    names below ``mtp`` are the checkpoint's keys.

    :meth:`forward` is the reference computation (transformers' eager decoder layer): inputs ``embeds [B, S, H]``
    (the next tokens' embeddings), ``hidden [B, S, H]`` (the target's hidden states), ``position_embeddings``
    (cos, sin of the positions, as transformers' rotary embedding returns them) and an additive or boolean
    ``attention_mask [B, 1, S, S]``; returns the normed output ``[B, S, H]`` (``lm_head`` of it are the draft
    logits).

    Raises (constructor):
        ExportMtpError: ``mtp_num_hidden_layers`` other than 1.
    """

    def __init__(self, text_config):
        super().__init__()
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

        n_layers = getattr(text_config, "mtp_num_hidden_layers", 1)
        if n_layers != 1:
            raise ExportMtpError(
                f"text_config.mtp_num_hidden_layers {n_layers!r}: this exporter reads MTP heads of one layer (the "
                "published Qwen3.5 checkpoints')"
            )
        hidden, eps = text_config.hidden_size, text_config.rms_norm_eps
        config = copy.deepcopy(text_config)
        config.layer_types = ["full_attention"]
        config._attn_implementation = "eager"
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(hidden, eps=eps)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(config, 0)])
        self.norm = Qwen3_5RMSNorm(hidden, eps=eps)

    def forward(self, embeds, hidden, position_embeddings, attention_mask=None) -> torch.Tensor:
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        x = self.layers[0](x, position_embeddings=position_embeddings, attention_mask=attention_mask)
        if isinstance(x, tuple):
            x = x[0]
        return self.norm(x)


def attach_mtp(model: nn.Module, dtype: torch.dtype | None = None, empty: bool = True) -> MtpHead:
    """Give ``model`` (a ``Qwen3_5ForConditionalGeneration``) the attribute ``mtp``, an :class:`MtpHead` of its
    text config in ``dtype`` (default: the model's), so that its parameters are named by the checkpoint's
    ``mtp.*`` keys; ``empty``: uninitialized storage, as :func:`.weight_source.empty_model` builds the rest.
    Returns the head.

    Raises:
        ExportMtpError: see :class:`MtpHead`.
    """
    from transformers.initialization import no_init_weights

    dtype = dtype or model.model.language_model.embed_tokens.weight.dtype
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        if empty:
            with no_init_weights():
                head = MtpHead(model.config.text_config)
        else:
            head = MtpHead(model.config.text_config)
    finally:
        torch.set_default_dtype(default)
    model.mtp = head.eval()
    return head


def write_mtp_head(folder, head: MtpHead | None = None, seed: int = 0) -> MtpHead:
    """Add an MTP head to the Hugging Face checkpoint ``folder`` (one ``model.safetensors``) as the published
    checkpoints carry it: the ``mtp.*`` tensors of ``head`` (by default a new head with weights drawn after
    ``torch.manual_seed(seed)``: random, acceptance about 0) written into ``model.safetensors`` beside the model's,
    in the checkpoint's dtype, and ``text_config.mtp_num_hidden_layers`` = 1 in ``config.json``. Returns the head.

    Raises:
        FileNotFoundError: ``folder`` has no ``model.safetensors`` (a sharded checkpoint is not rewritten).
    """
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    folder = Path(folder)
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{str(weights)!r} not found: the MTP head is written into one safetensors file")
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    tensors = {k: v for k, v in load_file(weights).items() if not k.startswith(MTP_PREFIX)}
    dtype = next(iter(tensors.values())).dtype
    if head is None:
        from transformers import AutoConfig

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            head = MtpHead(AutoConfig.from_pretrained(folder).text_config)
    tensors.update({MTP_PREFIX + k: v.detach().to(dtype).contiguous() for k, v in head.state_dict().items()})
    tmp = weights.with_suffix(".tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    tmp.replace(weights)
    config.setdefault("text_config", {})["mtp_num_hidden_layers"] = 1
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return head


def load_mtp_head(folder, dtype: torch.dtype = torch.float32) -> MtpHead:
    """The MTP head of the Hugging Face checkpoint ``folder`` (its ``mtp.*`` tensors, one file or shards) as an
    :class:`MtpHead` in ``dtype``, eval mode: the reference the exported MTP graph is compared with, and what
    self-distillation trains.

    Raises:
        ExportMtpError: the checkpoint has no ``mtp.*`` tensors, or they do not fit its config.
    """
    import json
    from pathlib import Path

    from safetensors import safe_open
    from transformers import AutoConfig

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else None
    files = [folder / f for f in files] if files else sorted(folder.glob("*.safetensors"))
    state = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key.startswith(MTP_PREFIX):
                    state[key.removeprefix(MTP_PREFIX)] = f.get_tensor(key)
    if not state:
        raise ExportMtpError(f"the checkpoint {str(folder)!r} has no {MTP_PREFIX}* tensors (no MTP head)")
    head = MtpHead(AutoConfig.from_pretrained(folder).text_config)
    try:
        head.load_state_dict(state)
    except RuntimeError as exc:
        raise ExportMtpError(f"the MTP head of {str(folder)!r} does not fit its config: {exc}") from exc
    return head.to(dtype).eval()


def link_mtp_checkpoint(source, dest, head: MtpHead | None = None, seed: int = 0):
    """A checkpoint folder ``dest`` that is ``source`` (one ``model.safetensors``, linked, not copied: a 4B
    checkpoint is 8.5 GB) with an MTP head added as a second shard (``model.safetensors.index.json`` lists both;
    the head as :func:`write_mtp_head` draws it, in the checkpoint's dtype); the other files are copied, and
    ``config.json`` says ``mtp_num_hidden_layers`` = 1. Returns ``dest`` (a Path); an existing ``dest`` is
    replaced.

    Raises:
        FileNotFoundError: ``source`` has no ``model.safetensors``.
    """
    import json
    import shutil
    from pathlib import Path

    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoConfig

    source, dest = Path(source).resolve(), Path(dest)
    weights = source / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{str(weights)!r} not found: the MTP head is linked beside one safetensors file")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for path in source.iterdir():
        if path.is_file() and path.name != "model.safetensors" and not path.name.startswith("model.safetensors"):
            shutil.copy2(path, dest / path.name)
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    (dest / first).symlink_to(weights)
    with safe_open(str(weights), framework="pt") as f:
        keys = list(f.keys())
        dtype = f.get_tensor(keys[0]).dtype
    if head is None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            head = MtpHead(AutoConfig.from_pretrained(source).text_config)
    tensors = {MTP_PREFIX + k: v.detach().to(dtype).contiguous() for k, v in head.state_dict().items()}
    save_file(tensors, dest / second, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {**dict.fromkeys(keys, first), **dict.fromkeys(tensors, second)}}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config = json.loads((dest / "config.json").read_text())
    config.setdefault("text_config", {})["mtp_num_hidden_layers"] = 1
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return dest
