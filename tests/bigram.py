"""A "bigram checkpoint": the demo architecture rewired to emit a chosen text forever.

Random-weight models emit random bytes (invalid UTF-8, so U+FFFD) and may stop early; the
server tests need long, deterministic replies with multi-byte characters instead. Zeroing the
output projection of every layer (full attention ``o_proj``, Gated DeltaNet ``out_proj``, MLP
``down_proj``) makes every layer add nothing, so the residual stream at each position is the
token's embedding and the final hidden state depends on the current token only: the model is
a bigram table. ``lm_head`` then encodes the wanted transitions ``a -> b``: row ``b`` is
``scale * h_a / |h_a|^2`` summed over its sources ``a`` (``h_a`` = the final norm of ``a``'s
embedding), so the logit of ``b`` after ``a`` is ``scale`` while every other row is zero or
a small multiple of ``scale`` (random directions in 128 dimensions are nearly orthogonal).
The chain never reaches an end-of-sequence id: generations run to ``max_tokens`` or capacity.
"""

from __future__ import annotations

import shutil
from pathlib import Path

REASONING = "hm,ok"
CYCLE = "é日→ "
CYCLE_TOKENS = 9  # é = 2 byte tokens, 日 = 3, → = 3, space = 1
LEAD_TOKENS = 5  # h m , ok </think>
CAPACITY = 2048
PROMPT_TOKENS = 12  # "Hi" with the thinking template
PREFILL_BUCKETS = (32, 512, CAPACITY)
"""Prefill buckets of :func:`build_bigram_export`: 32 for the short prompts ("Hi": 12 tokens), 512 for a
prompt with the server tests' weather tool (369-391 tokens with the thinking template) and those with an
image (78 tokens and up), the capacity for the rest. 32 and 2048 are also the two lengths whose node
counts tests/test_export_contract.py compares."""


def chain(start: int, tail: list[int], cycle: list[int]) -> dict[int, int]:
    """Transitions ``start -> tail[0] -> ... -> tail[-1] -> cycle[0] -> ... -> cycle[-1] -> cycle[0]``.

    Raises:
        ValueError: an id would need two successors (it appears twice in the path).
    """
    path = [start, *tail, *cycle]
    if len(set(path)) != len(path):
        raise ValueError(f"every id must appear once in the path, got {path}")
    transitions = dict(zip(path, path[1:]))
    transitions[cycle[-1]] = cycle[0]
    return transitions


def build_bigram_checkpoint(source: Path, out: Path, transitions: dict[int, int], scale: float = 16.0) -> Path:
    """Copy the checkpoint folder ``source`` to ``out`` (tokenizer, processor, template files)
    and overwrite its weights with the bigram model of ``transitions``. Returns ``out``."""
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    model = Qwen3_5ForConditionalGeneration.from_pretrained(source, dtype=torch.float32).eval()
    text = model.model.language_model
    with torch.no_grad():
        for layer in text.layers:
            mixer = getattr(layer, "self_attn", None) or getattr(layer, "linear_attn", None)
            projection = mixer.o_proj if hasattr(mixer, "o_proj") else mixer.out_proj
            projection.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        hidden = text.norm(text.embed_tokens.weight)  # [V, H]: the final hidden state of each token
        head = torch.zeros_like(model.lm_head.weight)
        for a, b in transitions.items():
            head[b] += scale * hidden[a] / hidden[a].square().sum()
        model.lm_head.weight.copy_(head)
    shutil.copytree(source, out)
    (out / ".qwen35_onnx_demo").unlink(missing_ok=True)  # not the demo checkpoint any more
    model.save_pretrained(out)
    return out


def reference_greedy(checkpoint: Path, input_ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens of ``transformers`` for a text-only prompt (no end-of-sequence stop)."""
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    model = Qwen3_5ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = torch.tensor([input_ids])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    return out[0, len(input_ids) :].tolist()


def build_bigram_export(source: Path, folder: Path) -> Path:
    """The bigram checkpoint of the demo checkpoint ``source`` in ``folder / "checkpoint"``, with the
    Qwen3.5-style thinking template: for the thinking prompt "Hi" it writes :data:`REASONING`, then
    ``</think>`` and :data:`CYCLE` forever (checked in transformers); and its export in
    ``folder / "export"`` (returned): ``--ops ort``, capacity :data:`CAPACITY`, two images, prefill
    buckets :data:`PREFILL_BUCKETS`."""
    from transformers import AutoTokenizer

    from qwen35_onnx.checkpoints import THINKING_CHAT_TEMPLATE, set_chat_template
    from qwen35_onnx.export.exporter import export
    from qwen35_onnx.export.options import ExportOptions

    tokenizer = AutoTokenizer.from_pretrained(source)

    def ids(text):
        return tokenizer.encode(text, add_special_tokens=False)

    think_end = tokenizer.convert_tokens_to_ids("</think>")
    cycle = ids(CYCLE)
    assert len(cycle) == CYCLE_TOKENS and tokenizer.decode(cycle) == CYCLE
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}],
        chat_template=THINKING_CHAT_TEMPLATE,
        add_generation_prompt=True,
        tokenize=False,
    )
    prompt_ids = ids(prompt)
    assert len(prompt_ids) == PROMPT_TOKENS and prompt.endswith("<think>\n")
    lead = ids(REASONING) + [think_end]
    assert len(lead) == LEAD_TOKENS
    ckpt = build_bigram_checkpoint(source, folder / "checkpoint", chain(prompt_ids[-1], lead, cycle))
    set_chat_template(ckpt, THINKING_CHAT_TEMPLATE)
    # the checkpoint does what the tests expect, in transformers itself
    n = LEAD_TOKENS + 2 * CYCLE_TOKENS
    assert tokenizer.decode(reference_greedy(ckpt, prompt_ids, n)) == REASONING + "</think>" + CYCLE * 2
    out = folder / "export"
    export(ckpt, out, ExportOptions(capacity=CAPACITY, max_images=2, ops="ort", prefill_buckets=PREFILL_BUCKETS))
    return out
