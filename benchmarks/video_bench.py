"""What a video costs: a 10-second clip at 2 frames per second through this project (ONNX Runtime, and OpenVINO
from the same kind of export, its any-grid vision graph reshaped per grid) next to OpenVINO GenAI's
``VLMPipeline`` on the same frames; and what OpenVINO holds with four vision grids compiled.

Not part of the test suite. The clip: a pan across the shipped photo, ``--seconds`` long at 30 fps, 1280 x 720,
H.264 (made here with PyAV). Per row, after one warm-up, the median of ``--runs``:

- ``read_ms``: decoding the clip and sampling its frames (2 per second: 20 frames);
- ``pixels_ms``: resizing and patchifying them (the checkpoint's video processor rule);
- ``vision_ms`` and ``vision_ms_per_pair``: the vision graph over all frame pairs, and per pair;
- ``ttft_ms``: the whole request, from the file to the first token (greedy), one question about the clip.

OpenVINO GenAI gets the same 20 sampled frames (``VLMPipeline.generate(..., videos=[frames])``; its own
processor sizes them) and reports its time to first token. llama.cpp is not in this table: its video input
runs an ``ffmpeg`` program, which these machines do not have.
OpenVINO grid memory: the portable export loaded on OpenVINO, then the clip's first frame pair at four video-token
limits (four grids), with the default one dynamic compile and with per-grid static compiles
(``--vision-grid-cache 4``): resident memory after loading and after each grid, each grid's first run and a
second run, and the compile time of each static grid.

Usage (from the repository root, in the development environment; exports made with this version)::

    .venv/bin/python benchmarks/video_bench.py --work-dir /tmp/vbench/qwen3.5-0.8b \\
        --optimum-python /tmp/vbench/.venv-optimum/bin/python \\
        --out benchmarks/video/amd-epyc-2c-qwen3.5-0.8b.json

``--work-dir`` holds ``ort-int4`` (``export --quantize int4``), ``portable-int4`` (``--ops portable --quantize
int4``), and ``optimum-int4`` (optimum-intel's int4 export of the same checkpoint, as ``qwen35-onnx bench``
makes it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

QUESTION = "What happens in this video?"
GRID_LIMITS = [1024, 600, 400, 250]
"""Video-token limits of the OpenVINO grid measurement: the default export's default (half its capacity of 2048)
and three smaller ones: four frame-pair grids."""


def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident memory (``VmRSS``) or its peak (``VmHWM``), bytes."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))


def make_clip(path: Path, seconds: float) -> Path:
    """A pan across the shipped photo, 1280 x 720 at 30 fps, H.264."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.clips import pan_frames, write_clip

    from qwen35_onnx.paths import photo_path

    frames = pan_frames(photo_path(), int(seconds * 30), 1280, 720)
    return write_clip(path, frames, fps=30)


def measure(pipe, clip: Path, runs: int, max_video_tokens=None) -> dict:
    """One row: the stages' median times (ms) over ``runs`` after a warm-up, and the clip's tokens."""
    from qwen35_onnx.conversation.videos import read_video
    from qwen35_onnx.runtime.sampling import SamplingConfig

    pre = pipe.preprocessor
    stages = {"read_ms": [], "pixels_ms": [], "vision_ms": [], "ttft_ms": []}
    pairs = tokens = prompt = None
    for i in range(runs + 1):
        start = time.perf_counter()
        frames = read_video(clip, pre.video_sizing.settings)
        read = time.perf_counter()
        _, grid, video = pre.video_pixel_values(frames, max_video_tokens)
        pixels = time.perf_counter()
        begin = time.perf_counter()  # the whole request to its first (and only) token
        result = pipe.generate(
            None, QUESTION, video=clip, max_new_tokens=1, sampling=SamplingConfig(), max_video_tokens=max_video_tokens
        )
        ttft = time.perf_counter() - begin
        if i:
            stages["read_ms"].append(1000 * (read - start))
            stages["pixels_ms"].append(1000 * (pixels - read))
            stages["vision_ms"].append(result.timings.vision_ms)
            stages["ttft_ms"].append(1000 * ttft)
        pairs, tokens, prompt = grid[0], video.total, result.prompt_tokens
    row = {name: round(statistics.median(values), 1) for name, values in stages.items()}
    row.update(
        frame_pairs=pairs,
        pair_grid=list(grid[1:]),
        video_tokens=tokens,
        prompt_tokens=prompt,
        vision_ms_per_pair=round(row["vision_ms"] / pairs, 1),
    )
    return row


def openvino_grids(export: Path, clip: Path, limits: list[int], cache: int) -> dict:
    """Resident memory of the portable export on OpenVINO (``vision_grid_cache`` ``cache``: 0 one dynamic compile,
    N per-grid static compiles) after loading and after the vision graphs of four grids ran; each grid's first
    run (ms, its compile included) and, per grid compiled, the compile alone."""
    from qwen35_onnx.pipeline import Pipeline

    before = rss_bytes()
    pipe = Pipeline.from_exported(export, runtime="openvino", vision_grid_cache=cache)
    loaded = rss_bytes()
    grids = []
    for limit in limits:
        prepared = pipe.prepare(None, QUESTION, video=clip, max_video_tokens=limit)
        grid = tuple(prepared.image_grids[0][1:])
        h, w = grid
        pixels = prepared.pixel_values[: h * w]
        start = time.perf_counter()
        pipe.backend.run_vision(grid, pixels)
        first = time.perf_counter() - start
        start = time.perf_counter()
        pipe.backend.run_vision(grid, pixels)
        again = time.perf_counter() - start
        compile_ms = pipe.backend.graphs.grids.compile_ms.get(grid)
        grids.append(
            {
                "max_video_tokens": limit,
                "grid": list(grid),
                "first_run_ms": round(1000 * first, 1),
                "run_ms": round(1000 * again, 1),
                "compile_ms": None if compile_ms is None else round(compile_ms, 1),
                "rss_bytes": rss_bytes(),
            }
        )
    return {
        "vision_grid_cache": cache,
        "rss_before_load_bytes": before,
        "rss_loaded_bytes": loaded,
        "grids": grids,
        "peak_rss_bytes": rss_bytes("VmHWM"),
    }


def peer_video_processor(checkpoint: Path, model_dir: Path, max_pixels: int) -> None:
    """Give OpenVINO's pipeline the checkpoint's video processor settings (optimum-intel's export leaves
    ``video_preprocessor_config.json`` out, and openvino-genai then falls back to 14-pixel patches), with
    ``size.longest_edge`` at the pixels this project's rule gives the clip, so that both sides give it the same
    tokens."""
    config = json.loads((checkpoint / "video_preprocessor_config.json").read_text())
    config["size"] = {"shortest_edge": config["size"]["shortest_edge"], "longest_edge": int(max_pixels)}
    (model_dir / "video_preprocessor_config.json").write_text(json.dumps(config, indent=2))


def ovgenai(python: Path, model_dir: Path, frames: np.ndarray, runs: int, work: Path) -> dict:
    """OpenVINO GenAI's time to first token on the same sampled frames, in its own environment."""
    path = work / "frames.npy"
    np.save(path, frames)
    script = Path(__file__).resolve().parents[1] / "src" / "qwen35_onnx" / "bench" / "ovgenai_peer.py"
    spec = {
        "video_only": True,
        "model_dir": str(model_dir),
        "precision": "f32",
        "video": {"path": str(path), "question": QUESTION, "warmup": 1, "runs": runs},
    }
    done = subprocess.run([str(python), "-P", str(script)], input=json.dumps(spec), capture_output=True, text=True)
    if done.returncode:
        return {"skipped": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, required=True)
    parser.add_argument("--optimum-python", type=Path)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--grids-of", type=Path, help="(internal) only the OpenVINO grid memory of this clip")
    parser.add_argument("--grid-cache", type=int, default=0, help="(internal) vision_grid_cache of --grids-of")
    args = parser.parse_args()
    from qwen35_onnx.bench.results import run_info

    if args.grids_of:
        export = args.work_dir / "portable-int4"
        print(json.dumps(openvino_grids(export, args.grids_of, GRID_LIMITS, args.grid_cache)))
        return
    from qwen35_onnx.conversation.videos import read_video
    from qwen35_onnx.pipeline import Pipeline

    result = {
        "run": run_info(program="benchmarks/video_bench.py"),
        "clip": {"seconds": args.seconds, "fps": 30, "size": "1280x720", "codec": "h264", "sampled_fps": 2},
        "question": QUESTION,
        "rows": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        clip = make_clip(Path(tmp) / "pan.mp4", args.seconds)
        ort = Pipeline.from_exported(args.work_dir / "ort-int4")
        result["rows"]["this project, onnxruntime int4"] = measure(ort, clip, args.runs)
        print(result["rows"], flush=True)
        sizing = ort.preprocessor.video_sizing
        frames = read_video(clip, sizing.settings).frames
        top = sizing.grid(len(frames), frames.shape[1], frames.shape[2])[2]
        del ort
        openvino = Pipeline.from_exported(args.work_dir / "portable-int4", runtime="openvino")
        result["rows"]["this project, openvino int4 (any-grid export)"] = measure(openvino, clip, args.runs)
        print(result["rows"], flush=True)
        del openvino
        if args.optimum_python:
            peer_video_processor(args.work_dir / "checkpoint", args.work_dir / "optimum-int4", top)
            peer = ovgenai(args.optimum_python, args.work_dir / "optimum-int4", frames, args.runs, Path(tmp))
            result["rows"]["openvino-genai VLMPipeline int4"] = peer
            print(peer, flush=True)
        # four grids (the default limit's and three smaller limits), each mode in a process of its own
        result["openvino_grids"] = []
        for cache in (0, 4):
            command = [sys.executable, __file__, "--work-dir", str(args.work_dir), "--grids-of", str(clip)]
            done = subprocess.run([*command, "--grid-cache", str(cache)], capture_output=True, text=True, check=True)
            result["openvino_grids"].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(result["openvino_grids"][-1], flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
