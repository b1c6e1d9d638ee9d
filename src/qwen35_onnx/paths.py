"""Where the project keeps files on this machine: its cache folder, the demo checkpoint's
default folder and the shipped photograph (no torch, no runtime import)."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

__all__ = [
    "cache_root",
    "check_checkpoint_folder",
    "check_folder",
    "demo_checkpoint_dir",
    "has_mtp_weights",
    "asset_path",
    "photo_path",
]

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
"""The weight files (one is enough) of a Hugging Face checkpoint folder that transformers loads."""


def cache_root() -> Path:
    """The project's cache folder: the environment variable ``QWEN35_ONNX_CACHE`` if it is set
    and non-empty, else ``~/.cache/qwen35-onnx`` (absolute, ``~`` expanded; not created)."""
    return Path(os.environ.get("QWEN35_ONNX_CACHE") or "~/.cache/qwen35-onnx").expanduser().absolute()


def check_folder(path: str | os.PathLike, what: str) -> Path:
    """``path`` as a folder this process may create or fill: it, or its nearest existing parent,
    is a folder (not a file). Nothing is created.

    Args:
        path: the folder.
        what: how the user named it, for the message (e.g. ``'--cache-dir'``).

    Raises:
        ValueError: naming ``what``, ``path`` and the file in the way.
    """
    path = Path(path).expanduser()
    for candidate in (path, *path.parents):
        if candidate.exists():
            if not candidate.is_dir():
                where = "is a file" if candidate == path else f"is inside {str(candidate)!r}, a file"
                raise ValueError(f"{what} {str(path)!r} {where}, not a folder")
            break
    return path


def check_checkpoint_folder(model_id: str | os.PathLike) -> Path:
    """``model_id`` as a local Hugging Face checkpoint folder: ``config.json`` and one of
    :data:`WEIGHT_FILES` (read by ``export`` and ``verify``; nothing is loaded).

    Raises:
        ValueError: naming the folder and what it lacks (an export folder has a ``config.json``
            but no checkpoint weights).
    """
    folder = Path(model_id)
    if not (folder / "config.json").is_file():
        raise ValueError(f"--model-id {str(model_id)!r} is not a local Hugging Face checkpoint folder (no config.json)")
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        export = (folder / "manifest.json").is_file()
        hint = " (it is an export folder: pass the checkpoint it was exported from)" if export else ""
        raise ValueError(f"--model-id {str(model_id)!r} has no checkpoint weights ({' or '.join(WEIGHT_FILES)}){hint}")
    return folder


def has_mtp_weights(checkpoint: str | os.PathLike) -> bool:
    """Whether the safetensors of the checkpoint folder ``checkpoint`` carry ``mtp.*`` tensors (the published
    Qwen3.5 checkpoints' multi-token-prediction head; transformers' model ignores them). Reads the shard index,
    or each file's header only."""
    import json

    folder = Path(checkpoint)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = list(json.loads(index.read_text())["weight_map"])
    else:
        from safetensors import safe_open

        names = []
        for shard in sorted(folder.glob("*.safetensors")):
            with safe_open(str(shard), "np") as f:
                names += list(f.keys())
    return any(n.startswith("mtp.") for n in names)


def demo_checkpoint_dir() -> Path:
    """Return the default folder of the demo checkpoint: ``<cache_root()>/demo-checkpoint``.
    Nothing is created or checked.

    Returns:
        Path: absolute path (``~`` expanded) of the demo checkpoint folder.
    """
    return cache_root() / "demo-checkpoint"


def photo_path() -> Path:
    """Return the path of the photograph shipped with the package.

    The photo is ``qwen35_onnx/assets/photo.jpg``: a 256x256 RGB JPEG of the
    astronaut Eileen Collins (NASA, public domain; see ``assets/README.md``).

    Returns:
        Path: a file-system path to the JPEG.

    Raises:
        FileNotFoundError: if the package was installed without its assets.
    """
    return asset_path("photo.jpg")


def asset_path(name: str) -> Path:
    """The path of the shipped file ``qwen35_onnx/assets/NAME`` (see ``assets/README.md``).

    Raises:
        FileNotFoundError: if the package was installed without its assets.
    """
    path = Path(str(resources.files("qwen35_onnx").joinpath("assets").joinpath(name)))
    if not path.is_file():
        raise FileNotFoundError(f"shipped file missing: {path} (package installed without its assets?)")
    return path
