"""Image files to RGB pictures (numpy + PIL, no torch).

* :func:`load_image`: a file to a fully loaded RGB ``PIL.Image`` (EXIF orientation applied,
  transparency composited on white);
* :func:`to_rgb`: any PIL mode to 8-bit RGB (high bit depths scaled, not clipped).

How a picture is sized for the model is the checkpoint's own rule (:mod:`qwen35_onnx.image_grids`,
:class:`.processor.ImageSizing`).

Source: ``transformers.image_utils.load_image`` (transformers 5.24) for the EXIF handling.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

__all__ = ["load_image", "to_rgb"]

WHITE = (255, 255, 255)  # background for transparent pixels in load_image


def load_image(path: str | os.PathLike) -> Image.Image:
    """Read an image file into a fully loaded RGB ``PIL.Image``.

    EXIF orientation is applied (as ``transformers.image_utils.load_image`` does).
    Modes with transparency (RGBA, LA, PA, P with a transparency entry) are
    composited on white; every other mode (L, P, CMYK, I, ...) goes through
    ``Image.convert("RGB")``.

    Args:
        path: image file path.

    Returns:
        ``PIL.Image.Image`` of mode ``"RGB"``, pixels loaded (the file is closed).

    Raises:
        FileNotFoundError: no file at ``path`` (message names the path).
        ValueError: the file exists but is not a readable image (directory,
            unknown format, truncated or corrupt data); the message names the path.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"image file not found: {path}")
    if not path.is_file():
        raise ValueError(f"image path is not a file: {path}")
    try:
        with Image.open(path) as image:
            image.load()
            image = ImageOps.exif_transpose(image)
            return to_rgb(image)
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise ValueError(f"cannot read image {path}: {err}") from err


def to_rgb(image: Image.Image) -> Image.Image:
    """Convert any PIL mode to 8-bit RGB.

    Transparent pixels (RGBA, LA, PA, P with a transparency entry) are composited on white.
    High-bit-depth modes are scaled to 8 bits rather than clipped: 16-bit integer modes
    (``I;16*``) by 1/257; 32-bit integer ``I`` by its value range (16-bit data stored as
    ``I`` is common); float ``F`` from [0, 1] when its values lie there, else clipped to
    [0, 255]. Other modes go through ``Image.convert("RGB")``.
    """
    if image.mode.startswith("I;16") or image.mode in ("I", "F"):
        values = np.asarray(image, dtype=np.float64)
        if image.mode == "F":
            finite = values[np.isfinite(values)]
            top = float(finite.max()) if finite.size else 0.0
            values = values * 255.0 if top <= 1.0 else values
        elif image.mode == "I" and values.size and values.max() > 65535:
            values = values / 2**24
        else:
            values = values / 257.0
        values = np.nan_to_num(values, nan=0.0, posinf=255.0, neginf=0.0)
        return Image.fromarray(np.clip(np.rint(values), 0, 255).astype(np.uint8), "L").convert("RGB")
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, WHITE + (255,))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")
