"""Where the project keeps files on this machine: its cache folder, the demo checkpoint's
default folder and the shipped photograph (no torch, no runtime import)."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

__all__ = ["cache_root", "check_folder", "demo_checkpoint_dir", "photo_path"]


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
    path = Path(str(resources.files("qwen35_onnx").joinpath("assets").joinpath("photo.jpg")))
    if not path.is_file():
        raise FileNotFoundError(f"shipped photo missing: {path} (package installed without its assets?)")
    return path
