"""Video clips made from the shipped photo for the video tests (PyAV encodes them; no files are stored).

Each clip is a camera move over the photo: a pan (the frame slides across a wider picture), a zoom, a
portrait crop, an odd number of frames, a clip shorter than the processor's ``min_frames``, and a
variable frame rate (presentation times that do not step evenly). Small frames keep the video tokens
within the test exports' capacity.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np
from PIL import Image


def pan_frames(photo: Path, count: int, width: int, height: int) -> list[np.ndarray]:
    """``count`` RGB frames of ``width x height`` sliding left to right across the photo (scaled to twice
    the frame width)."""
    base = Image.open(photo).convert("RGB")
    wide = base.resize((2 * width, max(height, round(2 * width * base.height / base.width))), Image.Resampling.BICUBIC)
    array = np.asarray(wide)
    top = (array.shape[0] - height) // 2
    steps = max(count - 1, 1)
    return [
        np.ascontiguousarray(array[top : top + height, round(i * width / steps) : round(i * width / steps) + width])
        for i in range(count)
    ]


def write_clip(
    path: Path, frames: list[np.ndarray], fps: int = 4, codec: str = "libx264", pts: list[int] | None = None
) -> Path:
    """Encode ``frames`` (uint8 ``[H, W, 3]``) at ``fps`` (``pts``: each frame's presentation time in
    ``1 / (fps * 4)`` s units, for a variable frame rate); lossless-ish H.264 (``crf`` 0 is refused
    by some players, 1 keeps the pixels close), yuv420p."""
    import av

    height, width = frames[0].shape[:2]
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if codec == "libx264":
            stream.options = {"crf": "1", "preset": "ultrafast"}
        if pts is not None:
            stream.codec_context.time_base = Fraction(1, fps * 4)
        for i, array in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(array, format="rgb24")
            if pts is not None:
                frame.pts, frame.time_base = pts[i], Fraction(1, fps * 4)
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


CLIP_GRIDS = {(8, 10), (8, 8), (6, 8), (8, 6)}
"""The frame-pair grids the demo checkpoint's video processor gives the clips (pan 8 x 10; vfr and short 8 x 8;
odd 6 x 8; portrait 8 x 6), checked in tests/test_video.py."""

CLIP_FILES = {"pan": "pan.mp4", "portrait": "portrait.mp4", "odd": "odd.mp4", "short": "short.mp4", "vfr": "vfr.mp4"}


def clip_paths(folder: Path) -> dict[str, Path]:
    """The clips' paths in a folder :func:`make_clips` wrote."""
    return {name: folder / file for name, file in CLIP_FILES.items()}


def make_clips(photo: Path, folder: Path) -> dict[str, Path]:
    """The test clips, written under ``folder``: ``{name: path}``.

    - ``pan``: 12 frames of 160 x 120 at 4 fps (3 s: 6 frames sampled at 2 fps);
    - ``portrait``: 10 frames of 96 x 144 at 4 fps;
    - ``odd``: 7 frames of 128 x 96 at 2 fps (7 sampled: padded to 8);
    - ``short``: 3 frames of 128 x 128 at 8 fps (fewer than min_frames 4: all 3, padded to 4);
    - ``vfr``: 10 frames of 144 x 112 whose presentation times step by 1, 2 or 3 quarter frames.
    """
    folder.mkdir(parents=True, exist_ok=True)
    paths = clip_paths(folder)
    steps = [1, 3, 2, 1, 3, 2, 2, 1, 3, 2]
    write_clip(paths["pan"], pan_frames(photo, 12, 160, 120), fps=4)
    write_clip(paths["portrait"], pan_frames(photo, 10, 96, 144), fps=4)
    write_clip(paths["odd"], pan_frames(photo, 7, 128, 96), fps=2)
    write_clip(paths["short"], pan_frames(photo, 3, 128, 128), fps=8)
    write_clip(paths["vfr"], pan_frames(photo, 10, 144, 112), fps=4, pts=[int(v) for v in np.cumsum([0, *steps[:-1]])])
    return paths
