"""Acceptance: static fixed decode graph, slot writes, prefill KV width, manifest and metadata
round trip, atomic export, export-time checks and the capacity cross-check."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import pytest

from qwen35_onnx.contract import FORMAT_VERSION, METADATA_KEY, ContractError, GraphKind, ShapeContract, read_manifest
from qwen35_onnx.export import exporter
from qwen35_onnx.export.exporter import export
from qwen35_onnx.export.options import ExportError, ExportOptions
from qwen35_onnx.pipeline import Pipeline

from .conftest import CAPACITY, IMAGE_TOKENS
from .onnx_graphs import all_nodes, node_counts, symbolic_dims

pytestmark = pytest.mark.slow


def _fixed_graphs(export_dir):
    contract = read_manifest(export_dir)
    return contract, {key: onnx.load(str(export_dir / path)) for key, path in contract.graphs.items()}


def test_every_fixed_mode_graph_is_static(fixed_export):
    """The text graphs of a fixed-KV export are fully static; its one any-grid vision graph (the
    default --vision-grids any) has one dynamic size, the patch count (whole merge blocks, up to the
    budget). The static-grid vision graphs have none (tests/test_vision_grids.py)."""
    contract, graphs = _fixed_graphs(fixed_export)
    assert not contract.static_vision and contract.vision_graph_keys() == ["vision"]
    assert set(graphs) == {"vision", "decode", *(f"prefill_{b}" for b in contract.prefill_buckets)}
    assert contract.prefill_buckets == (32, CAPACITY)
    for key, model in graphs.items():
        if key != "vision":
            assert symbolic_dims(model) == [], key
    vision = graphs["vision"]
    shapes = {
        io.name: [d.dim_value or d.dim_param for d in io.type.tensor_type.shape.dim]
        for io in [*vision.graph.input, *vision.graph.output]
    }
    patches = "4*image_tokens"  # spatial_merge_size**2 patches per image token
    tokens = shapes["image_embeds"][0]  # the merged count (torch.export names it, e.g. 's87')
    assert isinstance(tokens, str) and tokens
    assert shapes == {
        "pixel_values": [patches, contract.patch_dim],
        "pos_embed_indices": [patches, 4],
        "pos_embed_weights": [patches, 4],
        "rotary_position_ids": [patches, 2],
        "image_embeds": [tokens, contract.image_embed_dim],
    }
    # inside too, nothing but the patch count and the token count is dynamic
    assert {d.split(":", 1)[1] for d in symbolic_dims(vision)} == {patches, tokens}


def test_decode_writes_one_slot_per_k_and_v(fixed_export):
    contract, graphs = _fixed_graphs(fixed_export)
    scatters = [n for n in all_nodes(graphs["decode"].graph) if n.op_type in ("ScatterElements", "ScatterND")]
    assert len(scatters) == 2 * contract.n_full
    for io in [*graphs["decode"].graph.input, *graphs["decode"].graph.output]:
        if "kv_cache" in io.name or io.name == "attention_mask":
            dims = [d.dim_value for d in io.type.tensor_type.shape.dim]
            assert dims[-1 if io.name == "attention_mask" else 3] == CAPACITY


def test_prefill_buckets_have_equal_node_counts_and_kv_width_capacity(fixed_export):
    contract, graphs = _fixed_graphs(fixed_export)
    counts = {b: node_counts(graphs[f"prefill_{b}"]) for b in contract.prefill_buckets}
    first = counts[contract.prefill_buckets[0]]
    for b, c in counts.items():
        assert c == first, f"bucket {b} differs from bucket {contract.prefill_buckets[0]}"
    assert first.get("Scan", 0) == contract.n_linear, "one Scan per Gated DeltaNet layer"
    for b in contract.prefill_buckets:
        model = graphs[f"prefill_{b}"]
        outputs = {o.name: [d.dim_value for d in o.type.tensor_type.shape.dim] for o in model.graph.output}
        assert outputs["present_kv_cache"][3] == CAPACITY
        assert outputs["logits"] == [1, 1, contract.vocab_size], "last-token logits only"
        inputs = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
        assert inputs["input_ids"] == [1, b]


def test_node_count_does_not_grow_from_32_to_2048_tokens(bigram_export):
    """Issue acceptance: prefill graphs at 32 and 2048 tokens have the same node count (``--ops ort``
    here; the portable graphs' Scan form in
    :func:`test_prefill_buckets_have_equal_node_counts_and_kv_width_capacity`, 32 and 128 tokens:
    the same graph code with 1 and 4 chunks, where 2048 tokens have 64). The graphs are those of the
    server tests' bigram export (conftest's ``bigram_export``, capacity 2048): a graph's structure does
    not depend on its weights."""
    contract = read_manifest(bigram_export)
    assert (contract.ops, contract.kv_mode, contract.capacity) == ("ort", "fixed", 2048)
    assert {32, 2048} <= set(contract.prefill_buckets)
    graphs = {
        key: onnx.load(str(bigram_export / contract.graphs[key]), load_external_data=False)
        for key in ("prefill_32", "prefill_2048")
    }
    small, large = node_counts(graphs["prefill_32"]), node_counts(graphs["prefill_2048"])
    print(f"prefill nodes: 32 tokens {sum(small.values())}, 2048 tokens {sum(large.values())}")
    assert small == large


def test_dynamic_decode_grows_kv(dynamic_export):
    model = onnx.load(str(dynamic_export / read_manifest(dynamic_export).graphs["decode"]))
    (past,) = [i for i in model.graph.input if i.name == "past_kv_cache"]
    (present,) = [o for o in model.graph.output if o.name == "present_kv_cache"]
    assert past.type.tensor_type.shape.dim[3].dim_param
    assert present.type.tensor_type.shape.dim[3].dim_param != past.type.tensor_type.shape.dim[3].dim_param


def test_manifest_and_metadata_round_trip(fixed_export):
    contract = read_manifest(fixed_export)
    assert ShapeContract.from_json(contract.to_json()) == contract
    raw = json.loads((fixed_export / "manifest.json").read_text())
    assert raw["capacity"] == CAPACITY and raw["kv_mode"] == "fixed"
    assert raw["format_version"] == FORMAT_VERSION == 3 and "image_size" not in raw
    # the image-token budget, the checkpoint processor's range, any grid
    assert raw["image_tokens"] == IMAGE_TOKENS and raw["vision_grids"] == []
    assert (raw["min_pixels"], raw["max_pixels"]) == (65536, 16777216)
    assert raw["graphs"]["vision"] == "vision/model.onnx"
    assert raw["derived"]["vision"] == "any grid"
    assert raw["derived"]["max_patches"] == 4 * IMAGE_TOKENS
    assert raw["derived"]["image_max_pixels"] == IMAGE_TOKENS * 32 * 32
    assert raw["derived"]["n_image_rows"] == contract.max_images * IMAGE_TOKENS
    assert raw["derived"]["kv_shape"] == [
        2 * contract.n_full,
        1,
        contract.num_key_value_heads,
        CAPACITY,
        contract.head_dim,
    ]
    for path in contract.graphs.values():
        model = onnx.load(str(fixed_export / path), load_external_data=False)
        meta = {p.key: p.value for p in model.metadata_props}
        assert ShapeContract.from_json(meta[METADATA_KEY]) == contract
    # the tokenizer/processor files travel with the export
    for f in ("tokenizer.json", "preprocessor_config.json", "generation_config.json"):
        assert (fixed_export / f).is_file()


def test_interrupted_export_leaves_nothing_generate_accepts(checkpoint, tmp_path, monkeypatch):
    real = exporter.export_graph
    calls = []

    def failing(job, *args, **kwargs):
        calls.append(job.kind)
        if job.kind == "chunk":  # the default export's first text graph
            raise KeyboardInterrupt("simulated interruption")
        return real(job, *args, **kwargs)

    monkeypatch.setattr(exporter, "export_graph", failing)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        export(checkpoint, out, ExportOptions(capacity=CAPACITY, image_tokens=IMAGE_TOKENS))
    assert calls == ["vision", "chunk"]
    assert not out.exists()
    assert list(tmp_path.iterdir()) == [], "no temporary folder may be left behind"
    with pytest.raises(ContractError, match="does not exist"):
        Pipeline.from_exported(out)


def test_folder_without_manifest_is_rejected(fixed_export, tmp_path):
    partial = tmp_path / "partial"
    shutil.copytree(fixed_export, partial)
    (partial / "manifest.json").unlink()
    with pytest.raises(ContractError, match="not a complete qwen35-onnx export"):
        Pipeline.from_exported(partial)


def test_capacity_mismatch_between_graphs_is_a_clear_error(fixed_export, small_export, tmp_path):
    """A decode graph exported at another --max-seq-len, copied into an export."""
    mixed = tmp_path / "mixed"
    shutil.copytree(fixed_export, mixed)  # capacity CAPACITY
    decode = read_manifest(fixed_export).graphs["decode"]
    # capacity CAPACITY // 2, weights inline (the export's shared weights file stays as it is)
    onnx.save(onnx.load(str(small_export / decode)), str(mixed / decode))
    with pytest.raises(
        ContractError,
        match=rf"decode graph was exported with a different contract.*capacity: {CAPACITY // 2} != {CAPACITY}",
    ):
        Pipeline.from_exported(mixed)


def test_component_export_keeps_the_existing_contract(checkpoint, small_export, tmp_path):
    target = tmp_path / "comp"
    shutil.copytree(small_export, target)
    before = read_manifest(target)
    # only --component given: capacity, buckets and kv mode come from the existing export
    export(checkpoint, target, ExportOptions(component="decode"), explicit=set())
    assert read_manifest(target) == before
    Pipeline.from_exported(target)
    # an explicit conflicting option is refused before anything is written
    with pytest.raises(ExportError, match=rf"--max-seq-len 2048 \(the export has {CAPACITY // 2}\)"):
        export(checkpoint, target, ExportOptions(component="decode", capacity=2048), explicit={"capacity"})
    assert read_manifest(target) == before


def test_overwrite_refuses_folders_that_are_not_exports(checkpoint, tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(ExportError, match="--overwrite only replaces a previous qwen35-onnx export"):
        export(checkpoint, precious, ExportOptions(capacity=CAPACITY, image_tokens=IMAGE_TOKENS, overwrite=True))
    assert (precious / "notes.txt").read_text() == "keep me"
    with pytest.raises(ExportError, match="holds the checkpoint --model-id"):
        export(checkpoint, checkpoint, ExportOptions(capacity=CAPACITY, image_tokens=IMAGE_TOKENS, overwrite=True))
    with pytest.raises(ExportError, match="holds the checkpoint --model-id"):
        export(
            checkpoint, checkpoint.parent, ExportOptions(capacity=CAPACITY, image_tokens=IMAGE_TOKENS, overwrite=True)
        )
    assert (checkpoint / "model.safetensors").is_file()
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ExportError, match="is a file, not a folder"):
        export(checkpoint, a_file, ExportOptions(capacity=CAPACITY, image_tokens=IMAGE_TOKENS))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(capacity=1), r"--max-seq-len \(capacity\) must be an integer >= 2, got 1"),
        (dict(capacity=100000), r"--max-seq-len 100000 is above the model's max_position_embeddings 4096"),
        (
            dict(image_tokens=32),
            r"--image-tokens 32 gives 32768 pixels \(32x32 per token\), below the image processor's min_pixels 65536: "
            r"use at least 64 tokens",
        ),
        (
            dict(image_tokens=16385),
            r"--image-tokens 16385 gives 16778240 pixels .* above the image processor's max_pixels 16777216: "
            r"use at most 16384 tokens",
        ),
        (dict(image_tokens=0), r"--image-tokens must be an integer >= 1, got 0"),
        (
            dict(capacity=128),
            r"--max-images 1 with --image-tokens 256 needs 1 x 256 = 256 image tokens, more than the capacity 128",
        ),
        (
            dict(max_images=5, image_tokens=1024),
            r"--max-images 5 with --image-tokens 1024 needs 5 x 1024 = 5120 image tokens, more than the capacity 4096",
        ),
        (
            dict(vision_grids=((16, 15),)),
            r"vision grid 16x15: both sides must be multiples of the spatial merge size 2",
        ),
        (
            dict(vision_grids=((32, 34),)),
            r"vision grid 32x34 is 272 image tokens \(278528 pixels\), above the budget of 256 tokens",
        ),
        (dict(vision_grids=((16, 16), (32, 32), (16, 16))), r"vision grid 16x16 is listed twice"),
        (dict(vision_grids=((0, 16),)), r"vision grid 0x16 must be two positive integers"),
        (dict(vision_grids="some"), r"--vision-grids 'some' must be 'any', 'static' or a list of \(h, w\) patch grids"),
        (dict(image_tokens=32, vision_grids="static"), r"--image-tokens 32 gives 32768 pixels"),
        (dict(capacity=16, dummy_seq_len=16), r"--dummy-seq-len 16 leaves no decode slot.*--max-seq-len 16"),
        (dict(dummy_seq_len=0), r"--dummy-seq-len must be an integer >= 1, got 0"),
        (dict(kv_mode="paged"), r"--kv-cache 'paged' must be one of fixed, dynamic"),
        (dict(dtype="int3"), r"--dtype 'int3' must be one of fp32, fp16, bf16"),
        (dict(component="audio"), r"--component 'audio' must be one of"),
        (dict(prefill_buckets=(64, 32)), r"strictly increasing, got 32 after 64"),
        (
            dict(prefill_buckets=(32, 4096), capacity=2048),
            r"--prefill-buckets: prefill bucket 4096 is above the capacity 2048",
        ),
        (dict(kv_dtype="bf16"), r"--kv-dtype bf16 needs --ops portable"),
        (dict(kv_dtype="int4"), r"--kv-dtype .int4. must be one of fp32, fp16, bf16, int8"),
        (dict(prefill_buckets=()), r"--prefill-buckets is empty"),
        (dict(kv_mode="dynamic", prefill_buckets=(32,)), r"--prefill-buckets needs --kv-cache fixed"),
        (dict(prefill_logits="some"), r"--prefill-logits 'some' must be one of last, all"),
        (
            dict(quantize="int4", quant_block_size=2**40),
            r"--quant-block-size 1099511627776 must be a power of two from 16 to 256",
        ),
        (dict(quantize="int4", quant_accuracy_level=5), r"--quant-accuracy-level 5 must be one of 0, 1, 2, 3, 4"),
        (dict(quantize="int4", quant_accuracy_level=4.0), r"--quant-accuracy-level 4.0 must be one of"),
        (dict(quantize="int4", quant_accuracy_level=True), r"--quant-accuracy-level True must be one of"),
        (dict(quant_accuracy_level=0), r"--quant-accuracy-level 0 applies to quantized exports only"),
        (dict(quantize_embedding=True), r"--quantize-embedding applies to quantized exports only"),
        (dict(quantize="int4", quantize_embedding=1), r"--quantize-embedding must be true or false, got 1"),
        (dict(quantize="int4", quant_block_size=256), r"hidden size 128 is not a multiple of --quant-block-size 256"),
        (dict(dtype="bf16", ops="ort"), r"--dtype bf16 needs --ops portable"),
        (dict(ops="onnx"), r"--ops 'onnx' must be one of portable, ort"),
    ],
)
def test_export_time_checks(checkpoint, tmp_path, options, message):
    with pytest.raises(ExportError, match=message):
        export(checkpoint, tmp_path / "out", ExportOptions(**options))
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture_is_rejected(checkpoint, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(checkpoint, other)
    config = json.loads((other / "config.json").read_text())
    config["model_type"] = "qwen2_vl"
    config["architectures"] = ["Qwen2VLForConditionalGeneration"]
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="unsupported architecture: model_type 'qwen2_vl'"):
        export(other, tmp_path / "out", ExportOptions(capacity=CAPACITY, image_tokens=IMAGE_TOKENS))


@pytest.mark.parametrize(
    ("processor", "found"),
    [
        ({"size": {"shortest_edge": 65536}}, "65536 / None"),
        ({"size": {"shortest_edge": 65536, "longest_edge": 4096}}, "65536 / 4096"),
        ({"min_pixels": 0, "max_pixels": 65536}, "0 / 65536"),
        ({"size": {"height": 224, "width": 224}}, "None / None"),
    ],
)
def test_checkpoint_without_a_processor_pixel_range_is_refused(checkpoint, tmp_path, processor, found):
    other = tmp_path / "other"
    shutil.copytree(checkpoint, other)
    config = json.loads((other / "preprocessor_config.json").read_text())
    config.pop("size", None)
    (other / "preprocessor_config.json").write_text(json.dumps({**config, **processor}))
    with pytest.raises(ExportError, match=rf"must give the image processor's pixel range .* got {found}"):
        export(other, tmp_path / "out", ExportOptions(capacity=CAPACITY, image_tokens=IMAGE_TOKENS))
    assert not (tmp_path / "out").exists()


def test_the_processors_range_reaches_the_contract(checkpoint, tmp_path):
    """The earlier spelling (min_pixels / max_pixels) is read too, and a budget is checked against
    it: 32 tokens is enough where min_pixels is 32768."""
    from qwen35_onnx.export.exporter import build_contract, load_config, processor_pixel_range

    other = tmp_path / "other"
    shutil.copytree(checkpoint, other)
    config = json.loads((other / "preprocessor_config.json").read_text())
    config.pop("size")
    (other / "preprocessor_config.json").write_text(json.dumps({**config, "min_pixels": 32768, "max_pixels": 1 << 20}))
    assert processor_pixel_range(other) == (32768, 1 << 20)
    contract = build_contract(
        *load_config(other), ExportOptions(capacity=CAPACITY, image_tokens=32), processor_pixel_range(other)
    )
    assert (contract.min_pixels, contract.max_pixels, contract.image_tokens) == (32768, 1 << 20, 32)
    with pytest.raises(ExportError, match="--image-tokens 1025 gives 1049600 pixels .* max_pixels 1048576"):
        build_contract(*load_config(other), ExportOptions(image_tokens=1025), processor_pixel_range(other))


def test_existing_output_needs_overwrite(checkpoint, fixed_export):
    with pytest.raises(ExportError, match="exists and is not empty; pass --overwrite"):
        export(checkpoint, fixed_export, ExportOptions(capacity=CAPACITY, image_tokens=IMAGE_TOKENS))


def test_text_graphs_share_one_weights_file(fixed_export):
    """Every text graph reads its weights from text/weights.data, each distinct tensor stored
    once: the file is no larger than one graph's weights."""
    contract = read_manifest(fixed_export)
    text = {k: v for k, v in contract.graphs.items() if GraphKind.of(k) != GraphKind.VISION}
    assert {str(Path(p).parent) for p in text.values()} == {"text"}
    files = sorted(p.name for p in (fixed_export / "text").iterdir())
    assert files == sorted([Path(p).name for p in text.values()] + ["weights.data"])
    per_graph = {}
    for key, rel in text.items():
        model = onnx.load(str(fixed_export / rel), load_external_data=False)
        refs = {}
        for tensor in model.graph.initializer:
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                info = {e.key: e.value for e in tensor.external_data}
                assert info["location"] == "weights.data"
                refs[tensor.name] = (int(info.get("offset", 0)), int(info["length"]))
        per_graph[key] = refs
    decode, prefill = per_graph["decode"], per_graph[contract.prefill_graph_key(contract.prefill_buckets[0])]
    shared = set(decode.values()) & set(prefill.values())
    assert len(shared) >= 0.8 * len(decode)  # the same weights at the same offsets
    size = (fixed_export / "text" / "weights.data").stat().st_size
    assert size <= 1.2 * max(sum(n for _, n in refs.values()) for refs in per_graph.values())


def test_component_export_of_an_older_layout_is_refused(checkpoint, small_export, tmp_path):
    target = tmp_path / "old"
    shutil.copytree(small_export, target)
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["graphs"]["decode"] = "decode/model.onnx"
    (target / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ExportError, match="another graph layout.*re-export all graphs"):
        export(checkpoint, target, ExportOptions(component="decode"), explicit=set())


def test_component_export_that_would_change_the_contract_is_refused(checkpoint, small_export, tmp_path):
    """A checkpoint whose generation config differs would make the kept graphs disagree with the
    manifest: refused before anything is written."""
    other = tmp_path / "other-ckpt"
    shutil.copytree(checkpoint, other)
    generation = json.loads((other / "generation_config.json").read_text())
    generation["eos_token_id"] = [1010]
    (other / "generation_config.json").write_text(json.dumps(generation))
    target = tmp_path / "comp"
    shutil.copytree(small_export, target)
    before = (target / "manifest.json").read_text()
    with pytest.raises(ExportError, match=r"would not match the graphs kept.*eos_token_ids"):
        export(other, target, ExportOptions(component="decode"), explicit=set())
    assert (target / "manifest.json").read_text() == before
    Pipeline.from_exported(target)


def test_corrupt_weights_are_a_clear_error_not_garbage(fixed_export, tmp_path, photo):
    broken = tmp_path / "broken"
    shutil.copytree(fixed_export, broken)
    data = broken / "text" / "weights.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 4 : len(raw) // 2] = b"\xff" * (len(raw) // 2 - len(raw) // 4)  # NaN patterns
    data.write_bytes(bytes(raw))
    stream = Pipeline.from_exported(broken).stream(photo, "Describe this image.", max_new_tokens=8)
    with pytest.raises(ContractError, match="logits are not finite"):
        list(stream)


def test_decode_graph_with_stacked_states_is_refused_when_the_manifest_says_per_entry(fixed_export):
    """A decode graph that takes the stacked states (portable, or an export made before the
    states went one entry at a time) does not pass for an ``--ops ort`` fixed-KV contract."""
    from dataclasses import replace

    from qwen35_onnx.runtime.checks import check_decode
    from qwen35_onnx.runtime.onnxruntime.sessions import GraphSession

    contract = read_manifest(fixed_export)
    decode = GraphSession.load("decode", fixed_export / contract.graphs["decode"])
    check_decode(contract, decode)  # its own contract passes
    per_entry = replace(contract, ops="ort")
    assert per_entry.decode_state_names("conv_states", "past") == [
        f"past_conv_states.{n}" for n in range(contract.n_linear)
    ]
    with pytest.raises(
        ContractError,
        match=r"decode graph inputs do not match the manifest: unexpected \['past_conv_states', "
        r".*missing \['past_conv_states\.0'.*re-export",
    ):
        check_decode(per_entry, decode)


def test_decode_graph_with_an_extra_input_or_another_element_type_is_refused(fixed_export):
    from dataclasses import replace

    from qwen35_onnx.runtime.checks import check_decode
    from qwen35_onnx.runtime.onnxruntime.sessions import GraphSession

    contract = read_manifest(fixed_export)
    decode = GraphSession.load("decode", fixed_export / contract.graphs["decode"])
    extra = replace(decode, inputs={**decode.inputs, "past_conv_states.6": [1, 2, 3]})
    with pytest.raises(
        ContractError, match=r"decode graph inputs do not match the manifest: unexpected \['past_conv_states\.6'\]"
    ):
        check_decode(contract, extra)
    half = replace(decode, types={**decode.types, "past_recurrent_states": "tensor(float16)"})
    with pytest.raises(
        ContractError,
        match=r"decode input past_recurrent_states element type is 'tensor\(float16\)' "
        r"but the manifest says 'tensor\(float\)'",
    ):
        check_decode(contract, half)
    # an fp16 manifest naming no KV dtype (as before 0.15.0): conv states fp16 as it says, the KV cache left fp32
    # (the KV follows the dtype ...)
    fp16_conv = replace(
        decode, types={**decode.types, "past_conv_states": "tensor(float16)", "present_conv_states": "tensor(float16)"}
    )
    with pytest.raises(
        ContractError,
        match=r"decode input past_kv_cache element type is 'tensor\(float\)' but the manifest says 'tensor\(float16\)'",
    ):
        check_decode(replace(contract, dtype="fp16", kv_dtype=None), fp16_conv)
    with pytest.raises(
        ContractError,
        match=r"decode input past_kv_cache element type is 'tensor\(float\)' but the manifest says 'tensor\(int8\)'",
    ):
        check_decode(replace(contract, kv_dtype="int8"), decode)  # ... or the manifest's kv_dtype
    half_logits = replace(decode, types={**decode.types, "logits": "tensor(float16)"})  # ... the logits never do
    with pytest.raises(
        ContractError,
        match=r"decode output logits element type is 'tensor\(float16\)' "
        r"but the contract keeps host-facing tensors fp32",
    ):
        check_decode(contract, half_logits)


@pytest.mark.parametrize("kind", ["linear_attention", "full_attention"])
def test_checkpoint_with_one_layer_type_is_refused(checkpoint, tmp_path, kind):
    other = tmp_path / "other"
    shutil.copytree(checkpoint, other)
    config = json.loads((other / "config.json").read_text())
    config["text_config"]["layer_types"] = [kind] * len(config["text_config"]["layer_types"])
    (other / "config.json").write_text(json.dumps(config))
    missing = "full_attention" if kind == "linear_attention" else "linear_attention"
    with pytest.raises(ExportError, match=f"has no '{missing}' layer"):
        export(other, tmp_path / "out", ExportOptions(capacity=CAPACITY, image_tokens=IMAGE_TOKENS))
    assert not (tmp_path / "out").exists()
