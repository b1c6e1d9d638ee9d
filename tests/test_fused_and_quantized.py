"""`--ops ort` (ONNX Runtime fused operators) and `--quantize int4|int8` (MatMulNBits)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from qwen35_onnx.contract import read_manifest
from qwen35_onnx.pipeline import Pipeline

from .conftest import CAPACITY, MAX_NEW_TOKENS, PROMPT, export_to
from .onnx_graphs import all_nodes, symbolic_dims

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ort_export(checkpoint, tmp_path_factory):
    return export_to(checkpoint, tmp_path_factory.mktemp("exp") / "ort", ops="ort")


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized_export(request, checkpoint, tmp_path_factory):
    out = export_to(checkpoint, tmp_path_factory.mktemp("exp") / request.param, ops="ort", quantize=request.param)
    return request.param, out


def _last_logits(pipe, photo):
    prepared = pipe.prepare(photo, PROMPT)
    logits, _ = pipe.run_prefill(prepared, pipe.run_vision(prepared))
    return prepared, logits


def test_ort_graphs_use_the_fused_operators(ort_export):
    contract = read_manifest(ort_export)
    assert contract.ops == "ort"
    for key, path in contract.graphs.items():
        model = onnx.load(str(ort_export / path))
        ops = [n.op_type for n in all_nodes(model.graph)]
        if key == "vision":
            continue
        assert ops.count("LinearAttention") == contract.n_linear, key
        assert ops.count("CausalConvWithState") == contract.n_linear, key
        assert "Scan" not in ops, key
        assert symbolic_dims(model) == [], key
    decode = onnx.load(str(ort_export / contract.graphs["decode"]))
    scatters = [n for n in all_nodes(decode.graph) if n.op_type == "ScatterElements"]
    assert len(scatters) == 2 * contract.n_full


def test_ort_matches_transformers_and_portable(ort_export, fixed_export, reference_model, reference_tokens, photo):
    import torch

    pipe = Pipeline.from_exported(ort_export)
    prepared, logits = _last_logits(pipe, photo)
    ids = torch.from_numpy(prepared.input_ids)
    with torch.no_grad():
        ref = reference_model(
            input_ids=ids, pixel_values=torch.from_numpy(prepared.pixel_values),
            image_grid_thw=torch.tensor([list(pipe.contract.grid_thw)]),
            mm_token_type_ids=(ids == pipe.contract.image_token_id).int(),
        ).logits[0, -1].numpy()
    assert float(np.abs(logits - ref).max()) <= 1e-3
    result = pipe.generate(photo, PROMPT, max_new_tokens=MAX_NEW_TOKENS)
    assert len(result.token_ids) >= 32
    assert result.token_ids == reference_tokens
    portable = Pipeline.from_exported(fixed_export).generate(photo, PROMPT, max_new_tokens=MAX_NEW_TOKENS)
    assert result.token_ids == portable.token_ids
    host = Pipeline.from_exported(ort_export, host_state_roundtrip=True).generate(photo, PROMPT, max_new_tokens=MAX_NEW_TOKENS)
    assert host.token_ids == result.token_ids


def test_quantized_graphs(quantized_export, ort_export, photo):
    scheme, out = quantized_export
    contract = read_manifest(out)
    assert contract.quantize == scheme and contract.quant_block_size == 32
    bits = {"int4": 4, "int8": 8}[scheme]
    for key, path in contract.graphs.items():
        model = onnx.load(str(out / path))
        nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
        if key == "vision":
            assert not nbits
            continue
        assert nbits, key
        assert all(next(a.i for a in n.attribute if a.name == "bits") == bits for n in nbits)
    _, reference = _last_logits(Pipeline.from_exported(ort_export), photo)
    pipe = Pipeline.from_exported(out)
    _, logits = _last_logits(pipe, photo)
    assert np.isfinite(logits).all()
    cosine = float(logits @ reference / np.linalg.norm(logits) / np.linalg.norm(reference))
    print(f"{scheme}: last-logit cosine {cosine:.4f} against fp32")
    if scheme == "int8":
        assert cosine >= 0.99
        assert int(reference.argmax()) in np.argsort(-logits)[:5]
    assert len(pipe.generate(photo, PROMPT, max_new_tokens=8).token_ids) == 8
