"""Choosing a runtime by name: :func:`open_backend`, the one place that imports the backends (each
backend imports only :mod:`.backend`)."""

from __future__ import annotations

from pathlib import Path

from ..contract import ShapeContract
from .backend import Backend, Runtime, RuntimeOptions


def open_backend(root: Path, contract: ShapeContract, options: RuntimeOptions | None = None) -> Backend:
    """Load the graphs of the export at ``root`` with the runtime ``options`` name.

    Raises:
        ValueError: unknown runtime, device or precision (naming the value and the choices), or
            the runtime is not installed.
        ContractError: see :class:`~.backend.GraphSet`; with OpenVINO also exports it cannot run
            (operators it cannot read, dynamic shapes).
    """
    options = options or RuntimeOptions()
    options.validate()
    if options.runtime == Runtime.ONNXRUNTIME:
        from .onnxruntime.backend import OrtBackend

        return OrtBackend(root, contract, options)
    try:
        from .openvino.backend import OpenVinoBackend
    except ImportError as exc:
        raise ValueError(
            f"runtime 'openvino' needs the openvino package (pip install 'qwen35-onnx[openvino]'): {exc}"
        ) from None
    return OpenVinoBackend(root, contract, options)
