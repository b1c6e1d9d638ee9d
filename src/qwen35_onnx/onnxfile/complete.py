"""Whether an export folder holds what its manifest lists: every graph file, and every byte of weights each graph
reads from its external-data files (read from the protobuf wire format, no ``onnx`` import). The runtimes run these
before they open a graph, and ``qwen35-onnx quantize`` before it reads an export."""

from __future__ import annotations

from pathlib import Path

from ..contract import ContractError, ShapeContract
from .edit import read_model


def check_export_files(root: Path, contract: ShapeContract) -> None:
    """The manifest lists every graph the contract needs, and each listed file exists and is not empty.

    Raises:
        ContractError: naming the missing graph or file.
    """
    expected = {"decode", *contract.vision_graph_keys()}
    expected |= set(contract.prefill_keys)
    expected |= {contract.chunk_graph_key(c) for c in contract.prefill_chunks}
    expected |= {contract.verify_graph_key(c) for c in contract.verify_sizes}
    expected |= {contract.mtp_graph_key(c) for c in contract.mtp_sizes}
    missing = sorted(expected - set(contract.graphs))
    if missing:
        raise ContractError(f"manifest.json lists no graph for {missing} (has {sorted(contract.graphs)})")
    for key, rel in contract.graphs.items():
        path = Path(root) / rel
        if not path.is_file() or path.stat().st_size == 0:
            raise ContractError(f"{key} graph {str(path)!r} is missing or empty: the export is incomplete")


def check_external_data(key: str, path: Path) -> None:
    """Each external-data file the graph at ``path`` (manifest key ``key``) reads holds every byte
    it reads (the graph file is a few hundred kilobytes: its weights are skipped, never decoded;
    about 8 ms a graph at the demo size). Run before a runtime opens the graph, which would fail
    on a short file with an error that does not name it.

    Raises:
        ContractError: an unreadable graph file, or a missing or short data file, naming its size
            and the bytes the graph reads.
    """
    try:
        model = read_model(path.read_bytes())
    except (ValueError, IndexError) as exc:  # OnnxScanError is a ValueError
        raise ContractError(f"{key} graph {str(path)!r} is not a readable ONNX file: {exc}") from exc
    reads: dict[str, int] = {}
    for tensor in model.initializers.values():
        if tensor.location is not None:
            reads[tensor.location] = max(reads.get(tensor.location, 0), tensor.offset + tensor.length)
    for name, end in sorted(reads.items()):
        data = path.parent / name
        size = data.stat().st_size if data.is_file() else None
        if size is None or size < end:
            found = "is missing" if size is None else f"has {size} bytes"
            raise ContractError(
                f"{key} graph {str(path)!r} reads {end} bytes of weights from {str(data)!r}, which {found}: "
                "the export is incomplete or damaged (re-export it)"
            )
