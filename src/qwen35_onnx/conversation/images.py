"""Image files to RGB pictures, and pictures to the exported grid (numpy + PIL, no torch).

* :func:`load_image`: a file to a fully loaded RGB ``PIL.Image`` (EXIF orientation applied,
  transparency composited on white);
* :func:`to_rgb`: any PIL mode to 8-bit RGB (high bit depths scaled, not clipped);
* :func:`fit_to_grid`: pad to a centred square and resize to the exported image size.

Source: ``transformers.image_utils.load_image`` (transformers 5.24) for the EXIF handling.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

__all__ = ["fit_to_grid", "load_image", "to_rgb"]

PAD_COLOUR = (0, 0, 0)  # fit_to_grid square padding: black
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


MAX_PAD_SIDE = 4096
"""Largest padded square (pixels per side) built at full resolution in :func:`fit_to_grid`."""


def fit_to_grid(image: Image.Image, image_size: int) -> Image.Image:
    """Bring ``image`` to the exported grid as the reference system does: pad it to a centred
    square (black fill, side ``max(width, height)``), then resize (bicubic) to
    ``image_size x image_size``. Black is the fill because it does not depend on the
    processor's normalisation constants.

    A square wider than :data:`MAX_PAD_SIDE` pixels (a very long, thin image) would cost
    gigabytes, so such images are resized first (the short side keeping at least one pixel)
    and padded after, which differs only by edge rounding.

    Args:
        image: ``PIL.Image`` of any size and mode (converted with :func:`to_rgb`).
        image_size: output side in pixels (> 0).

    Returns:
        RGB ``PIL.Image`` of size ``(image_size, image_size)``; a square input of that
        size comes back as an unchanged copy.

    Raises:
        ValueError: ``image_size`` is not positive.
    """
    if image_size <= 0:
        raise ValueError(f"image_size must be positive, got {image_size}")
    image = to_rgb(image)
    width, height = image.size
    side = max(width, height)
    if side > MAX_PAD_SIDE:
        # resize first (the short side keeps at least one pixel), then pad
        scale = image_size / side
        size = (max(1, round(width * scale)), max(1, round(height * scale)))
        resized = image.resize(size, Image.Resampling.BICUBIC)
        canvas = Image.new("RGB", (image_size, image_size), PAD_COLOUR)
        canvas.paste(resized, ((image_size - size[0]) // 2, (image_size - size[1]) // 2))
        return canvas
    if width != height:
        square = Image.new("RGB", (side, side), PAD_COLOUR)
        square.paste(image, ((side - width) // 2, (side - height) // 2))
        image = square
    if side == image_size:
        return image.copy()
    return image.resize((image_size, image_size), Image.Resampling.BICUBIC)
