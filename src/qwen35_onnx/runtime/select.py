"""Choosing a runtime by name: :func:`open_backend`, the one place that imports the backends (each
backend imports only :mod:`.backend`)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from ..contract import ShapeContract
from .backend import Backend, Runtime, RuntimeOptions

THREAD_POOL_ENV = "QWEN35_ONNX_THREAD_POOL"
"""Environment variable: ``shared`` (the default) or ``session``, see :func:`share_threads`."""


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


def share_threads(options: RuntimeOptions | None = None) -> None:
    """For a program that owns its process (the command line, the server): with ONNX Runtime, run every
    session on one shared pool of ``options``' intra-op threads
    (:func:`~.onnxruntime.sessions.shared_thread_pool`, which says why), unless ``$QWEN35_ONNX_THREAD_POOL``
    is ``session`` (a pool per session, as a Python program gets by default); with OpenVINO nothing.

    Raises:
        ValueError: bad ``options`` (see :meth:`~.backend.RuntimeOptions.validate`), a bad
            ``$QWEN35_ONNX_THREAD_POOL``, or a pool of another size made before in this process.
    """
    options = options or RuntimeOptions()
    options.validate()
    pool = os.environ.get(THREAD_POOL_ENV, "shared").strip() or "shared"
    if pool not in ("shared", "session"):
        raise ValueError(f"${THREAD_POOL_ENV} {pool!r} must be 'shared' (the default) or 'session'")
    if options.runtime == Runtime.ONNXRUNTIME and pool == "shared":
        from .onnxruntime.sessions import shared_thread_pool

        if not shared_thread_pool(options.intra_op_threads):
            warnings.warn(
                "other code in this process made ONNX Runtime's global thread pools first: the sessions run on "
                f"those, at their size, not at threads={options.intra_op_threads}",
                RuntimeWarning,
                stacklevel=2,
            )
