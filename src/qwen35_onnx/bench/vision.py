"""What an image costs (``qwen35-onnx bench``, section "Images"): the vision graph's time per grid
and the time to first token of a one-line question about a 640 x 480 photo, next to OpenVINO
GenAI's ``VLMPipeline`` on the same photo (:mod:`.ovgenai_peer`). Times are milliseconds, each the
median of ``runs`` after one warm-up.

Time to first token here is the whole path a request takes: the image through the checkpoint's
processor, the chat template, the vision graph, the prefill and the first token's choice (greedy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from ..contract import PromptTooLongError
from ..image_grids import grid_tokens
from .protocol import median_ms

__all__ = ["PHOTO_SIZE", "QUESTION", "ImageCost", "image_costs", "image_lines", "photo"]

PHOTO_SIZE = (640, 480)
"""Width and height (pixels) of the bench's photo (the shipped photo resized)."""
QUESTION = "What is in this picture?"


def photo(path: Path | None = None) -> Image.Image:
    """The bench's photo: the shipped 256 x 256 photo resized (bicubic) to :data:`PHOTO_SIZE`."""
    from ..paths import photo_path

    with Image.open(path or photo_path()) as image:
        return image.convert("RGB").resize(PHOTO_SIZE, Image.Resampling.BICUBIC)


@dataclass
class ImageCost:
    """One row: the vision graph's ms per patch grid (``vision``: ``{"grid": [h, w], "tokens", "ms"}``
    each), the photo's grid and image tokens, its prompt's tokens and time to first token (ms)."""

    row: str
    vision: list[dict] = field(default_factory=list)
    grid: list[int] | None = None
    image_tokens: int | None = None
    ttft_ms: float | None = None
    prompt_tokens: int | None = None
    skipped: str | None = None
    """Why the photo's time to first token was not measured (its prompt does not fit the export)."""


def bench_grids(contract) -> list[tuple[int, int]]:
    """The grids timed: the export's static grids at the processor's minimum and at the budget
    (fewest and most patches, and the 640 x 480 photo's), or for an any-grid export the square
    grids of 64 tokens and of the budget and the photo's grid."""
    from ..image_grids import processor_grid

    merge = contract.spatial_merge_size
    width, height = PHOTO_SIZE
    exact = processor_grid(height, width, contract.patch_size, merge, contract.min_pixels, contract.image_max_pixels)
    if contract.static_vision:
        by_size = sorted(contract.vision_grids, key=lambda g: g[0] * g[1])
        grids = [by_size[0], by_size[-1]] + ([exact] if exact in contract.vision_grids else [])
    else:
        factor = contract.patch_size * merge
        smallest = merge * math.isqrt(-(-contract.min_pixels // factor**2))
        largest = merge * math.isqrt(contract.image_tokens)
        grids = [(smallest, smallest), exact, (largest, largest)]
    return sorted(set(grids), key=lambda g: g[0] * g[1])


def image_costs(row: str, pipe, runs: int = 5) -> ImageCost:
    """Measure ``pipe`` (a loaded :class:`~qwen35_onnx.pipeline.Pipeline`): the vision graph on each
    of :func:`bench_grids` (random patches), and the time to first token of :data:`QUESTION` about
    :func:`photo` (thinking off); that one is left out, with the reason in ``skipped``, where
    the prompt does not fit the export."""
    contract = pipe.contract
    cost = ImageCost(row)
    rng = np.random.default_rng(0)
    for grid in bench_grids(contract):
        pixels = rng.standard_normal((grid[0] * grid[1], contract.patch_dim)).astype(np.float32)
        ms = median_ms(lambda grid=grid, pixels=pixels: pipe.backend.run_vision(grid, pixels), 1, runs)
        cost.vision.append({"grid": list(grid), "tokens": grid_tokens(grid, contract.spatial_merge_size), "ms": ms})
    picture = photo()
    messages = [{"role": "user", "content": [{"type": "image", "image": picture}, {"type": "text", "text": QUESTION}]}]

    def first_token():
        prepared = pipe.prepare_chat(messages, {"enable_thinking": False})
        generation = pipe.generation(prepared)
        int(np.argmax(generation.prefill()))
        return prepared

    try:
        cost.ttft_ms = median_ms(first_token, 1, runs)  # a static grid compiles on its first run
    except PromptTooLongError as exc:  # e.g. the bench's --lengths 32 gives a bucket of 32 only
        cost.skipped = f"the photo's prompt: {exc}"
        return cost
    prepared = first_token()
    cost.grid = list(prepared.image_grids[0][1:])
    cost.image_tokens = grid_tokens(cost.grid, contract.spatial_merge_size)
    cost.prompt_tokens = prepared.prompt_len
    return cost


def image_lines(costs: list[ImageCost]) -> list[str]:
    """The markdown section for ``costs`` (this project's rows and OpenVINO GenAI's)."""
    if not costs:
        return []
    width, height = PHOTO_SIZE
    lines = [
        "",
        f"Images: vision graph per grid (random patches), and time to first token of '{QUESTION}' about a "
        f"{width} x {height} photo (processor, template, vision, prefill, first token; greedy, thinking off)",
        "",
        "| row | vision ms per grid (h x w patches: image tokens) | photo grid | image tokens | prompt tokens "
        "| time to first token ms |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for c in costs:
        vision = ", ".join(f"{v['grid'][0]}x{v['grid'][1]}: {v['tokens']} tok {v['ms']:.1f}" for v in c.vision)
        grid = f"{c.grid[0]}x{c.grid[1]}" if c.grid else "-"
        tokens = "-" if c.image_tokens is None else str(c.image_tokens)
        prompt = "-" if c.prompt_tokens is None else str(c.prompt_tokens)
        ttft = "-" if c.ttft_ms is None else f"{c.ttft_ms:.1f}"
        lines.append(f"| {c.row} | {vision or '-'} | {grid} | {tokens} | {prompt} | {ttft} |")
    return lines
