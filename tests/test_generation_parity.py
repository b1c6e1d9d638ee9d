"""Acceptance: greedy generation with an image, >= 32 new tokens, identical token ids to
transformers `generate`, in fixed and dynamic KV mode, with and without host-state roundtrip."""

from __future__ import annotations

import pytest

from qwen35_onnx.pipeline import Pipeline

from .conftest import MAX_NEW_TOKENS, PROMPT

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("mode", ["fixed", "dynamic"])
@pytest.mark.parametrize("host_state_roundtrip", [False, True], ids=["iobinding", "host-roundtrip"])
def test_tokens_identical_to_transformers(request, mode, host_state_roundtrip, reference_tokens, photo):
    export_dir = request.getfixturevalue(f"{mode}_export")
    pipe = Pipeline.from_exported(export_dir, host_state_roundtrip=host_state_roundtrip)
    result = pipe.generate(photo, PROMPT, max_new_tokens=MAX_NEW_TOKENS)
    assert len(reference_tokens) >= 32, "the demo checkpoint must not stop before 32 tokens"
    assert result.token_ids == reference_tokens
    assert result.finish_reason == "length"
    assert result.timings.decode_steps == len(result.token_ids) - 1


def test_stream_pieces_concatenate_to_text(fixed_export, photo):
    pipe = Pipeline.from_exported(fixed_export)
    stream = pipe.stream(photo, PROMPT, max_new_tokens=12)
    pieces = list(stream)
    assert stream.result is not None
    assert "".join(pieces) == stream.result.text
    assert len(stream.result.token_ids) == 12


def test_verify_compares_only_the_tokens_that_fit(fixed_export, checkpoint, reference_model, photo):
    """Asked for more tokens than the capacity holds, the export stops early (finish 'length');
    verify asks transformers for as many and reports parity, not a false mismatch."""
    from qwen35_onnx.verify import token_parity

    pipe = Pipeline.from_exported(fixed_export)
    prompt_len = pipe.prepare(photo, PROMPT).prompt_len
    parity = token_parity(pipe, checkpoint, photo, PROMPT, 500, model=reference_model)
    assert parity.total <= pipe.contract.capacity - prompt_len + 1
    assert parity.ok
