"""How an image becomes a patch grid: the checkpoint's resolution rule and the grids an export serves
(no torch; the rule itself is transformers' ``smart_resize``).

A Qwen3.5 image of ``H x W`` pixels is resized to ``h*P x w*P`` pixels and cut into an ``h x w``
grid of ``P x P`` patches (P = ``patch_size``, 16); every ``merge x merge`` block of patches
(merge = ``spatial_merge_size``, 2) becomes one image token, so an image costs ``h*w / merge**2``
tokens. The checkpoint's image processor picks ``(h, w)`` with ``smart_resize`` (transformers
``models/qwen2_vl/image_processing_pil_qwen2_vl.py``): sides rounded to multiples of ``P*merge``,
aspect ratio kept, pixels clamped to ``[min_pixels, max_pixels]``. An export caps ``max_pixels`` at
its image-token budget (``image_tokens * (P*merge)**2`` pixels) and serves either any grid up to
the budget (one vision graph with a dynamic patch count) or a fixed set of static grids
(:func:`default_grids`, or the user's list), in which case :func:`choose_grid` picks the grid:

1. the processor's own grid for the image, when the export has it;
2. else the grid closest to it in shape and size: the smallest ``|log(aspect ratio / the image's)|
   + 1/2 |log(patches / the processor grid's patches)|`` (ties: the fewer patches).

The image is resized to the chosen grid (never padded).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from .contract import MAX_ASPECT_RATIO

__all__ = [
    "ASPECT_RATIOS",
    "Grid",
    "budget_pixels",
    "choose_grid",
    "default_grids",
    "fit_budget",
    "format_grids",
    "grid_tokens",
    "parse_grids",
    "processor_grid",
]

Grid = tuple[int, int]
"""A patch grid ``(h, w)``: patches down, patches across (before the spatial merge)."""

ASPECT_RATIOS: tuple[tuple[int, int], ...] = ((1, 1), (4, 3), (3, 4), (16, 9), (9, 16), (2, 1), (1, 2))
"""Aspect ratios ``(width, height)`` of the default static grids: square, photos (landscape and
portrait), screens and phones (16:9, 9:16), wide and tall strips (2:1, 1:2)."""


_SMALL_SIDE = 64
"""Long side (pixels) of the small synthetic picture whose processor grid (at ``min_pixels``,
upscaled) becomes the small default grid of each aspect ratio."""


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' ``smart_resize`` (the image processor's own function): the resized ``(height,
    width)`` in pixels, multiples of ``factor``.

    Raises:
        ValueError: the aspect ratio is above 200 (the processor's limit), or a side is not positive.
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as resize

    if height < 1 or width < 1:
        raise ValueError(f"an image needs positive sides, got {width}x{height} pixels")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(
            f"the image is {width}x{height} pixels, an aspect ratio of {ratio:.4g}:1, above the image processor's "
            f"limit of {MAX_ASPECT_RATIO}:1"
        )
    return resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)


def budget_pixels(image_tokens: int, patch_size: int, merge_size: int) -> int:
    """Pixels of ``image_tokens`` image tokens: ``image_tokens * (patch_size * merge_size)**2``."""
    return image_tokens * (patch_size * merge_size) ** 2


def grid_tokens(grid: Grid, merge_size: int) -> int:
    """Image tokens of a patch grid ``(h, w)``: ``h * w / merge**2``."""
    return grid[0] * grid[1] // merge_size**2


def processor_grid(height: int, width: int, patch_size: int, merge_size: int, min_pixels: int, max_pixels: int) -> Grid:
    """The patch grid the checkpoint's image processor gives an ``width x height`` image
    (:func:`smart_resize` with factor ``patch_size * merge_size``).

    Raises:
        ValueError: see :func:`smart_resize`.
    """
    h, w = smart_resize(height, width, patch_size * merge_size, min_pixels, max_pixels)
    return h // patch_size, w // patch_size


def _aspect_error(grid: Grid, height: int, width: int) -> float:
    return abs(math.log((grid[1] / grid[0]) / (width / height)))


def choose_grid(height: int, width: int, grids: Sequence[Grid], preferred: Grid) -> Grid:
    """The static grid for an image of ``width x height`` pixels whose processor grid is
    ``preferred``: ``preferred`` itself when it is one of ``grids``; else the one minimising
    ``|log(aspect ratio / the image's)| + 1/2 |log(patches / preferred's patches)|``, ties to the
    fewer patches (module docstring).

    Raises:
        ValueError: ``grids`` is empty.
    """
    if not grids:
        raise ValueError("no grid to choose from")
    if tuple(preferred) in {tuple(g) for g in grids}:
        return tuple(preferred)
    area = preferred[0] * preferred[1]

    def key(grid: Grid):
        size_error = abs(math.log(grid[0] * grid[1] / area))
        return (round(_aspect_error(grid, height, width) + size_error / 2, 9), grid[0] * grid[1])

    return tuple(min(grids, key=key))


def fit_budget(grid: Grid, image_tokens: int, merge_size: int) -> Grid:
    """``grid`` scaled down (aspect kept, sides multiples of ``merge_size``, at least one merge
    block) to at most ``image_tokens`` tokens; unchanged when it fits. The processor's rule can
    exceed its ``max_pixels`` when it rounds a tiny or very thin image up to ``min_pixels``, and an
    export cannot hold more than its budget."""
    if grid_tokens(grid, merge_size) <= image_tokens:
        return tuple(grid)
    scale = math.sqrt(image_tokens / grid_tokens(grid, merge_size))
    h, w = (max(1, math.floor(side // merge_size * scale)) for side in grid)
    while h * w > image_tokens:  # floor of a product can still be one row over
        h, w = (h - 1, w) if h >= w else (h, w - 1)
    return h * merge_size, w * merge_size


def default_grids(
    image_tokens: int, patch_size: int, merge_size: int, min_pixels: int, max_pixels: int
) -> tuple[Grid, ...]:
    """The default static grids of an export with a budget of ``image_tokens`` tokens per image:
    for each of :data:`ASPECT_RATIOS`, the processor's grid of a large picture of that ratio at the
    budget, and of a small one (upscaled to ``min_pixels``); those within ``[min_pixels, budget]``
    pixels, sorted, without repeats.

    Raises:
        ValueError: the budget is below ``min_pixels``.
    """
    top = min(max_pixels, budget_pixels(image_tokens, patch_size, merge_size))
    if top < min_pixels:
        raise ValueError(f"the image-token budget {image_tokens} gives {top} pixels, below min_pixels {min_pixels}")
    grids = set()
    for across, down in ASPECT_RATIOS:
        # a picture above the budget: smart_resize's floor rounding is then the same at every size, so
        # photos of that exact ratio larger than the budget get that grid
        for side, limit in ((4 * math.isqrt(top), top), (_SMALL_SIDE, min_pixels)):
            scale = side / max(across, down)
            height, width = max(1, round(down * scale)), max(1, round(across * scale))
            grids.add(processor_grid(height, width, patch_size, merge_size, min_pixels, limit))
    return tuple(sorted(g for g in grids if min_pixels <= g[0] * g[1] * patch_size**2 <= top))


def parse_grids(text: str) -> tuple[Grid, ...]:
    """``"16x16,12x20"`` -> ``((16, 16), (12, 20))`` (patches down x across).

    Raises:
        ValueError: not comma-separated ``HxW`` pairs of integers, naming the text.
    """
    grids = []
    for part in text.split(","):
        pieces = part.strip().lower().split("x")
        try:
            if len(pieces) != 2:
                raise ValueError
            grids.append((int(pieces[0]), int(pieces[1])))
        except ValueError:
            raise ValueError(
                f"vision grid {part.strip()!r} must be HxW (patches down x across, integers), e.g. 16x16,12x20"
            ) from None
    return tuple(grids)


def format_grids(grids: Iterable[Grid]) -> str:
    """``((16, 16), (12, 20))`` -> ``"16x16,12x20"``."""
    return ",".join(f"{h}x{w}" for h, w in grids)
