"""ONNX Runtime sessions for the exported graphs, and the cross-check of every graph's
shapes and metadata against the manifest (no torch).

The capacity comes from two sources that must agree: the manifest and the graphs' own
static shapes (decode ``attention_mask`` width == ``past_kv_cache`` token axis ==
``present_kv_cache`` token axis, and prefill's ``present_kv_cache`` token axis). Any
disagreement is a :class:`~qwen35_onnx.contract.ContractError` raised at load time, before
the first decode step; there is no silent fallback to another flow.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnxruntime as ort

from ..contract import GRAPH_NAMES, METADATA_KEY, ContractError, ShapeContract

DEVICES = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


def providers_for(device: str) -> list[str]:
    """ONNX Runtime providers for ``device`` ('cpu' or 'cuda').

    Raises:
        ValueError: unknown device, or the installed onnxruntime lacks its provider.
    """
    if device not in DEVICES:
        raise ValueError(f"device {device!r} must be one of {', '.join(DEVICES)}")
    provider = DEVICES[device]
    available = ort.get_available_providers()
    if provider not in available:
        raise ValueError(f"device {device!r} needs {provider}, but this onnxruntime only has {available}")
    return [provider] if device == "cpu" else [provider, "CPUExecutionProvider"]


@dataclass
class GraphSession:
    """One loaded graph: its session, its contract (from ``metadata_props``) and its I/O shapes.

    Shapes are lists whose entries are ints (static) or strings (symbolic).
    """

    name: str
    session: ort.InferenceSession
    contract: ShapeContract
    inputs: dict[str, list]
    outputs: dict[str, list]

    @classmethod
    def load(cls, name: str, path: Path, device: str = "cpu", threads: int = 0) -> "GraphSession":
        """Load ``path`` with the providers of ``device``; ``threads`` 0 lets ORT choose.

        Raises:
            ContractError: the file is missing or carries no qwen35-onnx contract.
        """
        if not path.is_file():
            raise ContractError(f"{name} graph {str(path)!r} not found")
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            options.intra_op_num_threads = threads
        session = ort.InferenceSession(str(path), sess_options=options, providers=providers_for(device))
        meta = session.get_modelmeta().custom_metadata_map
        if METADATA_KEY not in meta:
            raise ContractError(f"{name} graph {str(path)!r} has no {METADATA_KEY!r} metadata: not a qwen35-onnx export")
        return cls(
            name=name,
            session=session,
            contract=ShapeContract.from_json(meta[METADATA_KEY]),
            inputs={i.name: list(i.shape) for i in session.get_inputs()},
            outputs={o.name: list(o.shape) for o in session.get_outputs()},
        )

    def dim(self, kind: str, tensor: str, axis: int):
        """Static size of ``tensor``'s ``axis`` (an int), or its symbolic name (a str)."""
        table = self.inputs if kind == "input" else self.outputs
        if tensor not in table:
            raise ContractError(f"{self.name} graph has no {kind} named {tensor!r} (has {sorted(table)})")
        return table[tensor][axis]


def load_sessions(root: Path, contract: ShapeContract, device: str = "cpu", threads: int = 0) -> dict[str, GraphSession]:
    """Load the vision, prefill and decode graphs of an export and cross-check them.

    Raises:
        ContractError: a graph is missing, or disagrees with the manifest (see :func:`check_sessions`).
    """
    sessions = {
        name: GraphSession.load(name, Path(root) / contract.graphs.get(name, f"{name}/model.onnx"), device, threads)
        for name in GRAPH_NAMES
    }
    check_sessions(contract, sessions)
    return sessions


def _expect(what: str, actual, expected) -> None:
    if actual != expected:
        raise ContractError(f"{what} is {actual!r} but the manifest says {expected!r}")


def check_sessions(contract: ShapeContract, sessions: dict[str, GraphSession]) -> None:
    """Cross-check each graph's metadata contract and static shapes against the manifest.

    Raises:
        ContractError: naming the graph, the tensor and both values. In particular, a prefill
            graph exported with one ``--max-seq-len`` and a decode graph with another fail here.
    """
    for name, graph in sessions.items():
        diff = graph.contract.same_shapes(contract)
        if diff:
            raise ContractError(
                f"{name} graph was exported with a different contract than manifest.json: {'; '.join(diff)} "
                "(were the graphs exported separately with different options?)"
            )
    vision, prefill, decode = sessions["vision"], sessions["prefill"], sessions["decode"]
    _expect("vision input pixel_values shape", vision.inputs.get("pixel_values"), [contract.n_patches, contract.patch_dim])
    _expect(
        "vision output image_embeds shape",
        vision.outputs.get("image_embeds"),
        [contract.n_image_tokens, contract.image_embed_dim],
    )
    for graph, kind, prefix in ((prefill, "output", "present"), (decode, "input", "past"), (decode, "output", "present")):
        table = graph.inputs if kind == "input" else graph.outputs
        _expect(f"{graph.name} {prefix}_conv_states shape", table.get(f"{prefix}_conv_states"), list(contract.conv_state_shape))
        _expect(
            f"{graph.name} {prefix}_recurrent_states shape",
            table.get(f"{prefix}_recurrent_states"),
            list(contract.recurrent_state_shape),
        )
    if contract.kv_mode == "fixed":
        widths = {
            "decode attention_mask width": decode.dim("input", "attention_mask", 1),
            "decode past_kv_cache token axis": decode.dim("input", "past_kv_cache", 3),
            "decode present_kv_cache token axis": decode.dim("output", "present_kv_cache", 3),
            "prefill present_kv_cache token axis": prefill.dim("output", "present_kv_cache", 3),
        }
        for what, width in widths.items():
            if width != contract.capacity:
                listing = ", ".join(f"{k} = {v!r}" for k, v in widths.items())
                raise ContractError(
                    f"capacity mismatch: {what} is {width!r} but manifest capacity is {contract.capacity} "
                    f"({listing}); re-export all graphs with the same --max-seq-len"
                )
