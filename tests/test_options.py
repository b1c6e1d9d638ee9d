"""Options declared once: the command line is built from the option dataclasses (their flags, help
and defaults), the contract-shaping export options are the contract's fields, every surface that
runs an export takes the same runtime options, and what the user gave reaches the exporter."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from qwen35_onnx.cli import app
from qwen35_onnx.contract import DEFAULT_CAPACITY, ShapeContract
from qwen35_onnx.export.options import ANY_GRID, ExportOptions
from qwen35_onnx.options import declared
from qwen35_onnx.runtime import backend
from qwen35_onnx.runtime.backend import RuntimeOptions
from qwen35_onnx.runtime.sampling import SamplingConfig
from qwen35_onnx.server.options import ServerOptions


def help_of(command: str) -> str:
    result = CliRunner().invoke(app, [command, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize(
    ("command", "groups"),
    [
        ("export", (ExportOptions,)),
        ("generate", (RuntimeOptions, SamplingConfig)),
        ("chat", (RuntimeOptions, SamplingConfig)),
        ("serve", (RuntimeOptions, ServerOptions)),
        ("verify", (RuntimeOptions,)),
    ],
)
def test_each_command_takes_every_declared_option_of_its_groups(command, groups):
    text = help_of(command)
    for group in groups:
        for option in declared(group):
            for flag in option.flag.split("/"):
                assert flag in text, (command, flag)


def test_contract_shaping_export_options_are_the_contract_fields():
    fields = {f.name for f in dataclasses.fields(ShapeContract)}
    shaping = ExportOptions.contract_fields()
    assert set(shaping) <= fields
    assert {"capacity", "kv_mode", "dtype", "prefill_buckets", "ops", "quantize", "max_images"} <= set(shaping)
    assert {"image_tokens", "vision_grids"} <= set(shaping) and "image_size" not in fields
    assert "component" not in shaping and "overwrite" not in shaping
    defaults = _fitted(ExportOptions())  # the default capacity, or the demo sizes' max_position_embeddings
    assert defaults.capacity == min(DEFAULT_CAPACITY, 4096)
    assert (
        ExportOptions.from_contract(ShapeContract.from_dict(_manifest(ExportOptions()))).contract_values()
        == defaults.contract_values()
    )


@pytest.mark.parametrize("grids", [ANY_GRID, "static", ((16, 16), (14, 20))])
def test_image_options_round_trip_through_the_contract(grids):
    """--image-tokens and --vision-grids reach the contract; a one-graph re-export rebuilds the same
    contract from it, the static default set resolved to its grids."""
    from qwen35_onnx.export.exporter import build_contract
    from qwen35_onnx.image_grids import default_grids
    from qwen35_onnx.presets import tiny_config

    contract = ShapeContract.from_dict(_manifest(ExportOptions(image_tokens=96, vision_grids=grids)))
    expected = {ANY_GRID: (), "static": default_grids(96, 16, 2, 65536, 16777216)}.get(grids, grids)
    assert contract.image_tokens == 96 and contract.vision_grids == expected
    assert contract.static_vision == bool(expected)
    again = ExportOptions.from_contract(contract)
    assert again.image_tokens == 96 and again.vision_grids == (expected or ANY_GRID)
    assert build_contract(tiny_config(), None, again) == replace(contract, graphs={})


def _fitted(options: ExportOptions) -> ExportOptions:
    """``options`` as the exporter takes them for the demo sizes (the default capacity lowered to their
    max_position_embeddings)."""
    from qwen35_onnx.export.options import fit_capacity
    from qwen35_onnx.presets import tiny_config

    return fit_capacity(options, tiny_config().text_config.max_position_embeddings, None)


def _manifest(options: ExportOptions) -> dict:
    """A contract dict of ``options`` on the demo sizes (no checkpoint needed)."""
    from qwen35_onnx.export.exporter import build_contract
    from qwen35_onnx.presets import tiny_config

    return build_contract(tiny_config(), None, _fitted(options)).to_dict()


@pytest.mark.parametrize(
    ("args", "given"),
    [
        ([], set()),
        (["--no-quantize-embedding", "--kv-cache", "fixed"], {"quantize_embedding", "kv_mode"}),
        (["--quantize-embedding", "--max-seq-len", "2048"], {"quantize_embedding", "capacity"}),
        (["--overwrite", "--prefill-buckets", "32,64"], {"overwrite", "prefill_buckets"}),
        (["--image-tokens", "64", "--vision-grids", "16x16, 12X20"], {"image_tokens", "vision_grids"}),
        (["--vision-grids", "static"], {"vision_grids"}),
        (["--vision-grids", "any"], {"vision_grids"}),
    ],
)
def test_the_options_a_user_gave_reach_the_exporter(args, given, monkeypatch):
    """A one-graph re-export refuses an option given explicitly that differs from the export's,
    the default value included, so the exporter must know exactly which were given."""
    from qwen35_onnx.export import exporter

    seen = {}

    def fake(model_id, output_dir, options, show_progress, explicit):
        seen.update(options=options, explicit=explicit)
        raise ValueError("stopped before exporting")

    monkeypatch.setattr(exporter, "export", fake)
    result = CliRunner().invoke(app, ["export", "--model-id", "m", "--output-dir", "o", *args])
    assert result.exit_code == 2 and "error: stopped before exporting" in result.stderr
    assert seen["explicit"] == given
    if "prefill_buckets" in given:
        assert seen["options"].prefill_buckets == (32, 64)
    if "image_tokens" in given:
        assert seen["options"].image_tokens == 64
    grids = {"static": "static", "any": ANY_GRID}.get(args[-1], ((16, 16), (12, 20))) if args else ANY_GRID
    assert seen["options"].vision_grids == (grids if "vision_grids" in given else ANY_GRID)


def test_bad_option_values_are_one_error_line():
    result = CliRunner().invoke(app, ["export", "--model-id", "m", "--output-dir", "o", "--prefill-buckets", "32,x"])
    assert result.exit_code == 2 and result.stderr.strip() == (
        "error: --prefill-buckets '32,x' must be comma-separated integers, e.g. 32,512,1024,2048"
    )
    result = CliRunner().invoke(app, ["export", "--model-id", "m", "--output-dir", "o", "--vision-grids", "16x"])
    assert result.exit_code == 2 and result.stderr.strip() == (
        "error: --vision-grids '16x': vision grid '16x' must be HxW (patches down x across, integers), e.g. "
        "16x16,12x20; or 'any' or 'static'"
    )
    assert "--vision-image-size" not in help_of("export")
    result = CliRunner().invoke(app, ["chat", "--model", "nowhere", "--top-p", "0"])
    assert result.exit_code == 2 and result.stderr.strip() == "error: top_p must be in (0, 1], got 0.0"


def test_runtime_options(monkeypatch):
    with pytest.raises(ValueError, match="runtime 'tensorrt' must be one of onnxruntime, openvino"):
        RuntimeOptions(runtime="tensorrt").validate()
    with pytest.raises(ValueError, match="precision 'bf16' needs runtime 'openvino'"):
        RuntimeOptions(precision="bf16").validate()
    with pytest.raises(ValueError, match="threads must be an integer >= 0"):
        RuntimeOptions(threads=-1).validate()
    monkeypatch.delenv("QWEN35_ONNX_THREADS", raising=False)
    assert RuntimeOptions().intra_op_threads == 0
    monkeypatch.setattr(backend, "usable_cpus", lambda: 4)
    monkeypatch.setenv("QWEN35_ONNX_THREADS", "3")
    assert RuntimeOptions().intra_op_threads == 3 and RuntimeOptions(threads=2).intra_op_threads == 2
    with pytest.raises(ValueError, match="threads 5 is more than the 4 CPUs this process may run on"):
        RuntimeOptions(threads=5).validate()
    for bad in ("many", "5"):
        monkeypatch.setenv("QWEN35_ONNX_THREADS", bad)
        with pytest.raises(ValueError, match=rf"\$QWEN35_ONNX_THREADS '{bad}' must be an integer from 0 to 4"):
            RuntimeOptions().validate()


def test_from_exported_takes_the_runtime_options_by_name(tmp_path):
    from qwen35_onnx.pipeline import Pipeline

    with pytest.raises(TypeError, match="options must be a RuntimeOptions or None, got str"):
        Pipeline.from_exported(tmp_path, "cuda")
    with pytest.raises(TypeError, match="unexpected keyword argument 'gpu'"):
        Pipeline.from_exported(tmp_path, gpu=True)
    with pytest.raises(ValueError, match="precision 'f16' needs runtime 'openvino'"):  # before the export is read
        Pipeline.from_exported(tmp_path / "missing", precision="f16")


def test_whole_generation_methods_take_the_streaming_methods_arguments():
    from qwen35_onnx.pipeline import Pipeline

    for at_once, streaming in (
        ("generate", "stream"),
        ("generate_prepared", "stream_prepared"),
        ("chat", "stream_chat"),
    ):
        a, b = inspect.signature(getattr(Pipeline, at_once)), inspect.signature(getattr(Pipeline, streaming))
        assert list(a.parameters) == list(b.parameters), at_once
