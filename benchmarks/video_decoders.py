"""Which pip-installable decoder reads video frames for the runtime: PyAV, OpenCV (headless) and
imageio-ffmpeg side by side on the same clips.

Not part of the test suite. For each clip (H.264 and VP9, made here from the shipped photo: a pan
across it, ``--seconds`` long at ``--fps``), each decoder decodes every frame to 8-bit RGB (the
frames a 2-fps sample needs are spread over the whole clip, and an inter-coded stream is decoded
from its key frames anyway; the ``converted`` rows turn only the 2-fps sample into RGB); reported:
the median time of ``--repeats`` decodes (ms), the frame count it saw, the largest absolute
difference of its pixels from PyAV's (0: the same RGB frames), and the installed size of the
package with its bundled libraries (MB, as pip installed it here).

Usage (from the repository root; installs nothing: ``pip install av opencv-python-headless
imageio-ffmpeg`` first)::

    .venv/bin/python benchmarks/video_decoders.py --out benchmarks/video/amd-epyc-2c-decoders.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

SAMPLE_EVERY = 15
"""The ``* converted`` rows decode every frame but convert to RGB only every 15th (2 fps of a 30-fps clip), as the
runtime does."""
PHOTO = Path(__file__).resolve().parents[1] / "src" / "qwen35_onnx" / "assets" / "photo.jpg"


def make_clip(path: Path, codec: str, seconds: float, fps: int, width: int, height: int) -> None:
    """A pan across the photo (upscaled to twice the frame width), encoded with PyAV."""
    import av

    photo = Image.open(PHOTO).convert("RGB")
    wide = photo.resize((2 * width, int(2 * width * photo.height / photo.width)), Image.Resampling.BICUBIC)
    wide = np.asarray(wide.resize((2 * width, max(height, wide.height))))
    frames = int(seconds * fps)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            x = int(i * (wide.shape[1] - width) / max(frames - 1, 1))
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(wide[:height, x : x + width]), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())


def decode_pyav(path: Path, every: int = 1) -> np.ndarray:
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"  # frame and slice threads, as ffmpeg's own command line decodes
        frames = container.decode(stream)
        return np.stack([f.to_ndarray(format="rgb24") for i, f in enumerate(frames) if i % every == 0])


def decode_opencv_sampled(path: Path, every: int) -> np.ndarray:
    import cv2

    capture, frames, i = cv2.VideoCapture(str(path)), [], 0
    try:
        while capture.grab():
            if i % every == 0:
                frames.append(cv2.cvtColor(capture.retrieve()[1], cv2.COLOR_BGR2RGB))
            i += 1
    finally:
        capture.release()
    return np.stack(frames)


def decode_opencv(path: Path) -> np.ndarray:
    import cv2

    capture, frames = cv2.VideoCapture(str(path)), []
    try:
        while True:
            ok, frame = capture.read()
            if not ok:
                break
            frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
    finally:
        capture.release()
    return np.stack(frames)


def decode_imageio_ffmpeg(path: Path) -> np.ndarray:
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(str(path), pix_fmt="rgb24")
    meta = next(reader)
    width, height = meta["size"]
    return np.stack([np.frombuffer(f, np.uint8).reshape(height, width, 3) for f in reader])


DECODERS = {
    "pyav": (decode_pyav, "av"),
    "pyav, 2 fps converted": (lambda path: decode_pyav(path, SAMPLE_EVERY), "av"),
    "opencv, 2 fps converted": (lambda path: decode_opencv_sampled(path, SAMPLE_EVERY), "opencv-python-headless"),
    "opencv": (decode_opencv, "opencv-python-headless"),
    "imageio-ffmpeg": (decode_imageio_ffmpeg, "imageio-ffmpeg"),
}


def installed_mb(distribution: str) -> float:
    """Bytes of a distribution's installed files (its bundled libraries included), in MB."""
    files = importlib.metadata.distribution(distribution).files or []
    return round(sum(f.locate().stat().st_size for f in files if f.locate().is_file()) / 1e6, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--fps", type=int, default=30)
    parser.add_argument("--size", default="1280x720", help="frame size WxH")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from qwen35_onnx.bench.results import run_info

    width, height = (int(v) for v in args.size.split("x"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for codec, suffix in (("libx264", "mp4"), ("libvpx-vp9", "webm")):
            clip = Path(tmp) / f"pan.{suffix}"
            make_clip(clip, codec, args.seconds, args.fps, width, height)
            reference = decode_pyav(clip)
            for name, (decode, distribution) in DECODERS.items():
                times, frames = [], None
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    frames = decode(clip)
                    times.append((time.perf_counter() - start) * 1e3)
                expected = reference[::SAMPLE_EVERY] if "converted" in name else reference
                same_shape = frames.shape == expected.shape
                diff = int(np.abs(frames.astype(np.int16) - expected).max()) if same_shape else None
                rows.append(
                    {
                        "codec": codec,
                        "decoder": name,
                        "version": importlib.metadata.version(distribution),
                        "decode_ms": round(statistics.median(times), 1),
                        "frames": int(frames.shape[0]),
                        "max_abs_diff_vs_pyav": diff,
                        "installed_mb": installed_mb(distribution),
                    }
                )
                print(rows[-1], flush=True)
    result = {
        "run": run_info(program="benchmarks/video_decoders.py"),
        "clip": {"seconds": args.seconds, "fps": args.fps, "size": args.size, "source": "pan across assets/photo.jpg"},
        "rows": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
