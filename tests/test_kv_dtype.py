"""`--kv-dtype` (issue 54, item 2): the KV cache's precision independent of the weights and activations. The decode
and verify graphs' KV inputs and outputs are in it, the prompt graphs' in the activations' dtype, and the runtime
converts the cache once between them (runtime/kv_codec.py); fp16 and bf16 caches leave the greedy tokens of the
trained demo checkpoint as fp32's; an int8 cache (per-channel scales calibrated on the checkpoint) stays close and a
chat continues from its kept states as it runs cold; the int8 GroupQueryAttention node and its reference agree;
the calibration reads the checkpoint one layer at a time and finds what the whole model finds; a precision the
runtime lacks is refused in one line."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from qwen35_onnx.contract import GraphKind, KvDtype, read_manifest
from qwen35_onnx.pipeline import Pipeline

from .conftest import PHOTO_GRID, PROMPT, Reference, build_once, export_to, logit_cosine, split_margin

NEW_TOKENS = 32
ONNX_TYPE = {"fp32": onnx.TensorProto.FLOAT, "fp16": onnx.TensorProto.FLOAT16, "bf16": onnx.TensorProto.BFLOAT16}
ONNX_TYPE["int8"] = onnx.TensorProto.INT8


@pytest.fixture(scope="module")
def int8_chunked(trained_checkpoint, tmp_path_factory):
    """The trained demo checkpoint, ``--ops ort --kv-dtype int8`` with prefill chunks 8 and 32 (the prompt's chunks
    hold an fp32 cache, the decode graph int8 codes)."""
    return build_once(
        tmp_path_factory,
        "trained-ort-int8-chunks",
        lambda folder: export_to(trained_checkpoint, folder, ops="ort", kv_dtype="int8", prefill_chunks=(8, 32)),
    )


def _kv_types(path) -> set[int]:
    graph = onnx.load(str(path), load_external_data=False).graph
    return {v.type.tensor_type.elem_type for v in [*graph.input, *graph.output] if "kv_cache" in v.name}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ops", "kv_dtype", "runtime"),
    [("ort", "fp16", "onnxruntime"), ("ort", "int8", "onnxruntime"), ("portable", "bf16", "openvino")],
)
def test_kv_precision_against_fp32(ops, kv_dtype, runtime, trained_export, int8_chunked, photo):
    """The decode graph's KV inputs and outputs are of the cache's dtype, the prefill graph's of the activations'
    (fp32); last-logit cosine against the fp32 cache >= 0.999; greedy tokens equal for fp16 and bf16, and for int8
    equal or parting where fp32's own margin is a near tie."""
    # portable: the photo's static vision grid, as tests/test_dtypes.py's OpenVINO exports (its fp32 one is this
    # test's reference: one export less for the suite)
    grids = {"vision_grids": (PHOTO_GRID,)} if ops == "portable" else {}
    out = int8_chunked if kv_dtype == KvDtype.INT8 else trained_export(ops, kv_dtype=kv_dtype, **grids)
    contract = read_manifest(out)
    assert (contract.dtype, contract.kv_precision, contract.prompt_kv_dtype) == ("fp32", kv_dtype, "fp32")
    assert contract.state_dtypes == {"conv": "fp32", "recurrent": "fp32", "kv": kv_dtype}
    for key, path in contract.graphs.items():
        kind = GraphKind.of(key)
        if kind != GraphKind.VISION:
            held = kv_dtype if kind in (GraphKind.DECODE, GraphKind.VERIFY) else "fp32"
            assert _kv_types(out / path) == {ONNX_TYPE[held]}, key
    reference = Reference(trained_export(ops, **grids), photo) if runtime == "onnxruntime" else None
    pipe = Pipeline.from_exported(out, runtime=runtime)
    if reference is None:  # OpenVINO: its own fp32 run of the portable fp32 export
        reference = Reference(trained_export(ops, **grids), photo)
        reference.pipe = Pipeline.from_exported(reference.path, runtime="openvino")
    prepared = pipe.prepare(photo, PROMPT)
    logits = np.asarray(pipe.generation(prepared).prefill(), dtype=np.float64)
    cosine = logit_cosine(logits, reference.last_logits())
    tokens = pipe.generate(photo, PROMPT, max_new_tokens=NEW_TOKENS).token_ids
    fp32_tokens = reference.greedy(NEW_TOKENS)
    split, margin = split_margin(reference.pipe, reference.prepared(), fp32_tokens, tokens)
    print(f"--ops {ops} --kv-dtype {kv_dtype} on {runtime}: cosine {cosine:.6f}, first {split} tokens equal")
    assert cosine >= 0.999
    if kv_dtype == KvDtype.INT8:
        assert split >= NEW_TOKENS // 2 or margin < 0.05, f"int8 parts at token {split} (fp32's margin {margin:.4f})"
    else:
        assert tokens == fp32_tokens, f"parts at token {split}, where fp32's logit margin is {margin:.4f}"


@pytest.mark.slow
def test_int8_chat_continues_from_kept_states_as_it_runs_cold(int8_chunked):
    """A chunked int8 export: the chunks prefill with an fp32 cache and the reply decodes with int8 codes (one
    conversion); a kept state (int8 codes) continues the next turn through the chunks again, and its greedy
    tokens equal those of the whole conversation prefilled cold; the kept snapshot holds int8 codes."""
    pipe = Pipeline.from_exported(int8_chunked)
    assert pipe.backend.kv_codec.converts
    cache = pipe.state_cache()
    turn = [{"role": "user", "content": "Tell me about the water cycle."}]
    first = pipe.chat(turn, max_new_tokens=12, state_cache=cache)
    follow = [*turn, {"role": "assistant", "content": first.content}, {"role": "user", "content": "And rain?"}]
    kept = pipe.chat(follow, max_new_tokens=12, state_cache=cache)
    assert kept.generation.cached_tokens > 0
    prepared = pipe.prepare_chat(follow)
    snapshot = cache.longest_prefix(pipe.backend.export_id, prepared.input_ids[0], ())
    assert snapshot is not None and snapshot.state_arrays()["present_kv_cache"].dtype == np.int8
    cold = pipe.chat(follow, max_new_tokens=12)
    assert cold.generation.cached_tokens == 0 and kept.generation.token_ids == cold.generation.token_ids


def test_kv_codec_round_trips():
    """int8 codes: round to nearest, saturate at +-127 / -128, decode to code times scale; bf16 rounds to nearest
    even and fp16 is a cast; the identity where the prompt and decode dtypes agree."""
    from dataclasses import dataclass

    from qwen35_onnx.contract import ContractError
    from qwen35_onnx.runtime.kv_codec import KvCodec

    @dataclass
    class Contract:
        kv_precision: str
        prompt_kv_dtype: str = "fp32"
        n_full: int = 1
        num_key_value_heads: int = 2
        head_dim: int = 3

    scales = np.array([[[[0.5, 1.0, 2.0], [1.0, 1.0, 1.0]], [[0.1, 0.1, 0.1], [4.0, 4.0, 4.0]]]], np.float32)
    kv = np.zeros((2, 1, 2, 2, 3), np.float32)
    kv[0, 0, 0, 0] = [0.26, 1000.0, -3.0]  # keys, head 0: 0.52 -> 1, saturates, -1.5 -> -2 (nearest even)
    kv[1, 0, 1, 1] = [-1000.0, 2.0, 5.0]  # values, head 1: saturates at -128, 0.5 -> 0, 1.25 -> 1
    codec = KvCodec(Contract("int8"), scales)
    codes = codec.to_decode(kv)
    assert codes.dtype == np.int8
    assert codes[0, 0, 0, 0].tolist() == [1, 127, -2] and codes[1, 0, 1, 1].tolist() == [-128, 0, 1]
    back = codec.to_prompt(codes)
    assert back.dtype == np.float32 and back[0, 0, 0, 0].tolist() == [0.5, 127.0, -4.0]
    assert (codec.to_decode(back) == codes).all()  # codes survive a round trip exactly
    with pytest.raises(ContractError, match=r"int8 KV cache's scales must be \[1, 2, 2, 3\] fp32, found none"):
        KvCodec(Contract("int8"))
    bf16 = KvCodec(Contract("bf16")).to_decode(np.array([[1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5]], np.float32))
    as_float = (bf16.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    assert as_float.tolist() == [[1.0, 1.0 + 2**-6, -2.5]]  # ties to even
    assert KvCodec(Contract("fp16")).to_decode(np.ones((1, 2), np.float32)).dtype == np.float16
    same = KvCodec(Contract("fp32"))
    assert not same.converts and (same.to_decode(kv) == kv).all()


def test_int8_attention_node_matches_its_reference():
    """ONNX Runtime's GroupQueryAttention over an int8 cache (PER_CHANNEL scales) writes the codes the reference
    writes and attends as the reference does, for a decode step and a chunk continuing a past."""
    import onnxruntime as ort
    import torch
    from onnx import TensorProto, helper

    from qwen35_onnx.export import fused

    heads, kv_heads, dim, width = 4, 2, 16, 24
    rng = np.random.default_rng(0)
    scales = (rng.random((1, kv_heads, 1, dim)) * 0.05 + 0.01).astype(np.float32)
    for steps, past in ((1, 9), (5, 7)):
        q = rng.standard_normal((1, steps, heads * dim)).astype(np.float32)
        k, v = (rng.standard_normal((1, steps, kv_heads * dim)).astype(np.float32) for _ in range(2))
        cache = [np.zeros((1, kv_heads, width, dim), np.int8) for _ in range(2)]
        for c in cache:
            c[:, :, :past] = rng.integers(-127, 128, size=(1, kv_heads, past, dim))
        seqlens, total = np.array([past + steps - 1], np.int32), np.array(past + steps, np.int32)
        node = helper.make_node(
            "GroupQueryAttention",
            ["q", "k", "v", "pk", "pv", "seqlens", "total", "", "", "", "", "", "ks", "vs"],
            ["out", "present_k", "present_v"],
            domain="com.microsoft",
            num_heads=heads,
            kv_num_heads=kv_heads,
            scale=dim**-0.5,
            k_quant_type="PER_CHANNEL",
            v_quant_type="PER_CHANNEL",
            kv_cache_bit_width=8,
        )
        tensor = helper.make_tensor_value_info
        inputs = [tensor(n, TensorProto.FLOAT, None) for n in ("q", "k", "v")]
        inputs += [tensor(n, TensorProto.INT8, None) for n in ("pk", "pv")]
        inputs += [tensor("seqlens", TensorProto.INT32, None), tensor("total", TensorProto.INT32, None)]
        inits = [onnx.numpy_helper.from_array(scales, "ks"), onnx.numpy_helper.from_array(scales * 1.5, "vs")]
        outputs = [tensor("out", TensorProto.FLOAT, None)] + [
            tensor(n, TensorProto.INT8, None) for n in ("present_k", "present_v")
        ]
        model = helper.make_model(
            helper.make_graph([node], "gqa", inputs, outputs, inits),
            opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)],
        )
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        got = session.run(None, dict(q=q, k=k, v=v, pk=cache[0], pv=cache[1], seqlens=seqlens, total=total))
        want = fused.group_query_attention_int8(
            *(torch.from_numpy(a) for a in (q, k, v, *cache, seqlens, total, scales, scales * 1.5)),
            heads,
            kv_heads,
            dim**-0.5,
        )
        written = slice(past, past + steps)
        for g, w in zip(got[1:], want[1:]):
            assert np.abs(g[:, :, written].astype(int) - w.numpy()[:, :, written].astype(int)).max() <= 1
        np.testing.assert_allclose(got[0], want[0].numpy(), rtol=2e-3, atol=2e-3)


def test_calibration_one_layer_at_a_time_equals_the_whole_model(checkpoint):
    """The export calibrates an empty model from the checkpoint layer by layer (its parameters empty again
    after); the scales equal those of the real model (transformers' from_pretrained) on the same tokens."""
    import torch
    from transformers import AutoModelForImageTextToText

    from qwen35_onnx.export.calibration import calibration_ids, kv_scales
    from qwen35_onnx.export.exporter import load_config, open_weights

    ids = calibration_ids(checkpoint, max_tokens=96)
    assert ids.shape == (1, 96)
    config, _ = load_config(checkpoint)
    model, source = open_weights(checkpoint, config)
    scales = kv_scales(model, source, ids)
    real = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).eval()
    expected = kv_scales(real, None, ids)
    assert len(scales) == sum(t == "full_attention" for t in config.text_config.layer_types)
    for pair, want in zip(scales, expected):
        for got, ref in zip(pair, want):
            assert got.shape == (config.text_config.num_key_value_heads, config.text_config.head_dim)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-8)
    with pytest.raises(ValueError, match=r"calibration ids must be \[1, N\]"):
        kv_scales(model, source, ids[0])


def test_a_kv_precision_the_runtime_lacks_is_refused(checkpoint, tmp_path):
    """bf16 with --ops ort: one line at export naming the flag; a manifest asking for it is refused."""
    from qwen35_onnx.export.exporter import export
    from qwen35_onnx.export.options import ExportError, ExportOptions

    with pytest.raises(ExportError, match=r"--kv-dtype bf16 needs --ops portable"):
        export(checkpoint, tmp_path / "out", ExportOptions(kv_dtype="bf16", capacity=64))
    assert not (tmp_path / "out").exists()
    with pytest.raises(ExportError, match=r"--kv-dtype int8 .* needs --kv-cache fixed"):
        export(checkpoint, tmp_path / "out", ExportOptions(kv_dtype="int8", kv_mode="dynamic", capacity=64))
