"""transformers' own video processing of test cases, run in the reference environment (``.venv-video-ref``:
torch + torchvision, which ``Qwen3VLVideoProcessor`` needs and the project's environment does not hold).

Usage: ``python tests/video_reference.py SPEC.json OUT.npz``. ``SPEC``: ``{"checkpoint": folder, "cases":
[{"name", "messages", "fps"?, "size"?, "template"?, "image_size"?}], "resizes": [[seed, h, w, out_h, out_w]]}``
where ``messages`` are chat-template messages whose
video parts are ``{"type": "video", "path": file}`` and image parts ``{"type": "image", "path": file}``. For
each case, transformers' PyAV reader (``transformers.video_utils.load_video(backend="pyav")``) decodes the
frames the checkpoint's video processor samples (``sample_frames``, at ``fps``), and the checkpoint's
``Qwen3VLProcessor`` (image processor PIL backend, as the runtime's; video processor ``Qwen3VLVideoProcessor``
with ``size`` when given) renders and tokenizes the messages. ``OUT`` holds, per case ``name``:
``{name}/input_ids``, ``/mm_token_type_ids``, ``/pixel_values_videos``, ``/video_grid_thw``,
``/pixel_values``, ``/image_grid_thw`` (when present), and per video ``{name}/frames{i}`` (the decoded
uint8 frames) and ``{name}/indices{i}``; ``defaults/*`` the video processor class's defaults; per resize
``resize{k}/out``: torchvision's antialiased bicubic resize (as the video processor calls it) of seeded random
uint8 frames ``[2, h, w, 3]`` (``numpy.random.default_rng(seed).integers(0, 256)``).
"""

from __future__ import annotations

import json
import sys
from functools import partial

import numpy as np

KEYS = ("input_ids", "mm_token_type_ids", "pixel_values_videos", "video_grid_thw", "pixel_values", "image_grid_thw")


def main(spec_path: str, out_path: str) -> None:
    from PIL import Image
    from transformers import AutoTokenizer, AutoVideoProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.video_utils import load_video

    spec = json.loads(open(spec_path).read())
    folder = spec["checkpoint"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    out: dict[str, np.ndarray] = {
        "defaults/size": np.array(
            [Qwen3VLVideoProcessor.size["shortest_edge"], Qwen3VLVideoProcessor.size["longest_edge"]]
        ),
        "defaults/frames": np.array([Qwen3VLVideoProcessor.min_frames, Qwen3VLVideoProcessor.max_frames]),
        "defaults/fps": np.array(Qwen3VLVideoProcessor.fps, dtype=np.float64),
        "defaults/max_video_tokens": np.array(Qwen3VLVideoProcessor.max_video_tokens),
    }
    for case in spec["cases"]:
        kwargs = {"cap_pixels_per_frame": bool(case.get("cap_pixels_per_frame", False))}
        if case.get("size"):
            kwargs["size"] = case["size"]
        video_processor = AutoVideoProcessor.from_pretrained(folder, **kwargs)
        processor = Qwen3VLProcessor(
            image_processor=Qwen2VLImageProcessorPil.from_pretrained(folder),
            tokenizer=tokenizer,
            video_processor=video_processor,
            chat_template=tokenizer.chat_template,
        )
        videos, metadata, images = [], [], []
        for message in case["messages"]:
            for part in message["content"] if isinstance(message["content"], list) else []:
                if part["type"] == "video":
                    sample = partial(video_processor.sample_frames, fps=case.get("fps"))
                    frames, meta = load_video(part["path"], backend="pyav", sample_indices_fn=sample)
                    videos.append(frames)
                    metadata.append(meta)
                elif part["type"] == "image":
                    images.append(Image.open(part["path"]).convert("RGB"))
        text = tokenizer.apply_chat_template(
            case["messages"], tokenize=False, add_generation_prompt=True, **case.get("template", {})
        )
        image_size = case.get("image_size")
        inputs = processor(
            text=[text],
            images=images or None,
            images_kwargs={"size": image_size} if image_size else {},
            videos=videos or None,
            video_metadata=metadata or None,
            do_sample_frames=False,
            return_tensors="np",
        )
        name = case["name"]
        for key in (
            "input_ids",
            "mm_token_type_ids",
            "pixel_values_videos",
            "video_grid_thw",
            "pixel_values",
            "image_grid_thw",
        ):
            if key in inputs and inputs[key] is not None:
                out[f"{name}/{key}"] = np.asarray(inputs[key])
        for i, (frames, meta) in enumerate(zip(videos, metadata)):
            out[f"{name}/frames{i}"] = np.asarray(frames)
            out[f"{name}/indices{i}"] = np.asarray(meta.frames_indices)
    import torch
    import torchvision.transforms.v2.functional as tvF

    for k, (seed, h, w, out_h, out_w) in enumerate(spec.get("resizes", [])):
        frames = np.random.default_rng(seed).integers(0, 256, (2, h, w, 3), dtype=np.uint8)
        tensor = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()
        resized = tvF.resize(tensor, [out_h, out_w], interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)
        out[f"resize{k}/out"] = resized.permute(0, 2, 3, 1).numpy()
    np.savez(out_path, **out)


if __name__ == "__main__":
    main(*sys.argv[1:])
