"""Parity against the reference implementation (transformers ``Qwen3_5ForConditionalGeneration``).

Needs torch (the ``export`` extra). The reference gets the raw images through the checkpoint's own
image processor (``Qwen2VLImageProcessorPil`` from the checkpoint folder, its ``min_pixels`` and
its ``max_pixels`` capped at the export's image-token budget, as a user would set
``max_pixels``), the conversation through the checkpoint's chat template, each image placeholder
expanded to the processor's grid (as ``Qwen3VLProcessor`` does); never our pixel values or ids.
Videos go through transformers' own PyAV reader and the checkpoint's ``Qwen3VLVideoProcessor``
(which needs torchvision), with ``size.longest_edge`` at the export's rule for that video
(:class:`~qwen35_onnx.conversation.processor.VideoSizing`), and ``Qwen3VLProcessor`` expands them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .paths import check_checkpoint_folder
from .pipeline import GenerationResult, Pipeline
from .runtime.prompt import PreparedPrompt
from .runtime.sampling import SamplingConfig


@dataclass
class TokenParity:
    """``identical`` leading tokens out of ``total`` compared (the longer of the two runs)."""

    ours: list[int]
    reference: list[int]

    @property
    def total(self) -> int:
        return max(len(self.ours), len(self.reference))

    @property
    def identical(self) -> int:
        n = 0
        for a, b in zip(self.ours, self.reference):
            if a != b:
                break
            n += 1
        return n

    @property
    def ok(self) -> bool:
        return self.ours == self.reference

    def line(self) -> str:
        return f"parity: {self.identical}/{self.total} tokens identical to transformers"


def load_reference(model_id: str | Path):
    """The transformers model of a checkpoint folder: fp32, eval mode, eager attention.

    Raises:
        ValueError: not a checkpoint folder (see :func:`~qwen35_onnx.paths.check_checkpoint_folder`).

    Eager attention because it is the accurate fp32 reference: on the demo checkpoint its
    last-token logits are within 1.4e-5 of an fp64 run, while the default SDPA kernel on CPU
    is 1.1e-4 away (measured with transformers 5.24, torch 2.13).
    """
    from transformers import Qwen3_5ForConditionalGeneration
    from transformers.utils import logging as hf_logging

    check_checkpoint_folder(model_id)
    # The reference runs transformers' own PyTorch kernels on purpose: its notices about
    # optional fused-kernel packages and its loading progress bar are noise here.
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    return Qwen3_5ForConditionalGeneration.from_pretrained(
        Path(model_id), dtype="float32", attn_implementation="eager"
    ).eval()


@dataclass
class ReferenceInputs:
    """The reference's own model inputs for a conversation: ``input_ids`` int64 ``[1, S]``; the images'
    ``pixel_values`` fp32 ``[P, patch_dim]`` and ``image_grid_thw`` int64 ``[n, 3]``; the videos'
    ``pixel_values_videos`` and ``video_grid_thw`` (None where the prompt has none)."""

    input_ids: object
    pixel_values: object = None
    image_grid_thw: object = None
    pixel_values_videos: object = None
    video_grid_thw: object = None

    def grids_in_prompt_order(self, kinds: list[str]) -> list[tuple[int, int, int]]:
        """Each image's grid and each video frame pair's ``(1, h, w)``, in the order of ``kinds`` (``"image"`` /
        ``"video"`` per part): how the runtime lists them."""
        images = iter([] if self.image_grid_thw is None else self.image_grid_thw)
        videos = iter([] if self.video_grid_thw is None else self.video_grid_thw)
        grids = []
        for kind in kinds:
            t, h, w = (int(v) for v in next(images if kind == "image" else videos))
            grids.extend([(t, h, w)] if kind == "image" else [(1, h, w)] * t)
        return grids


def reference_prompt(
    model_id: str | Path,
    messages: list[dict],
    max_pixels: int,
    chat_template_kwargs=None,
    video_max_pixels=(),
    fps: float | None = None,
) -> ReferenceInputs:
    """The reference's own inputs (:class:`ReferenceInputs`) for chat-template ``messages`` whose image parts are
    ``{"type": "image", "image": PIL image}`` and video parts ``{"type": "video", "video": path}``, made by the
    checkpoint's tokenizer, chat template, image processor (``max_pixels``: the processor's ``longest_edge``
    capped at this) and video processor (each video's ``longest_edge`` from ``video_max_pixels``, frames sampled
    at ``fps``; None: the processor's), the video placeholders expanded by ``Qwen3VLProcessor``.

    Raises:
        ImportError: a video, and transformers' video processor cannot load (it needs torchvision), naming it.
    """
    import numpy as np
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(model_id)
    processor = Qwen2VLImageProcessorPil.from_pretrained(model_id)
    parts = [p for m in messages if isinstance(m["content"], list) for p in m["content"]]
    images = [p["image"] for p in parts if p["type"] == "image"]
    videos = [p["video"] for p in parts if p["type"] == "video"]
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **(chat_template_kwargs or {})
    )
    out = ReferenceInputs(None)
    if images:
        size = {
            "shortest_edge": processor.size["shortest_edge"],
            "longest_edge": min(processor.size["longest_edge"], max_pixels),
        }
        images_out = processor(images=images, size=size, return_tensors="np")
        out.pixel_values, out.image_grid_thw = images_out["pixel_values"], images_out["image_grid_thw"]
        pad = "<|image_pad|>"
        pieces = text.split(pad)
        counts = [int(np.prod(g)) // processor.merge_size**2 for g in out.image_grid_thw]
        text = pieces[0] + "".join(pad * n + piece for n, piece in zip(counts, pieces[1:]))
    if videos:
        text = _reference_videos(model_id, tokenizer, processor, videos, list(video_max_pixels), fps, text, out)
    out.input_ids = np.asarray([tokenizer(text, add_special_tokens=False)["input_ids"]], dtype=np.int64)
    return out


def _reference_videos(
    model_id, tokenizer, image_processor, videos, max_pixels: list[int], fps, text: str, out: ReferenceInputs
) -> str:
    """The videos through transformers' PyAV reader and the checkpoint's video processor, into ``out``; returns
    ``text`` with each video placeholder expanded by ``Qwen3VLProcessor.replace_video_token``."""
    from functools import partial

    import numpy as np

    try:
        from transformers import AutoVideoProcessor, Qwen3VLProcessor
        from transformers.video_utils import load_video

        video_processor = AutoVideoProcessor.from_pretrained(model_id)
    except (ImportError, ValueError) as exc:
        raise ImportError(
            f"the reference reads videos with transformers' Qwen3VLVideoProcessor, which needs torchvision ({exc})"
        ) from None
    expander = Qwen3VLProcessor(image_processor, tokenizer, video_processor, chat_template="")
    values, grids, expansions = [], [], []
    for path, top in zip(videos, max_pixels):
        frames, metadata = load_video(
            str(path), backend="pyav", sample_indices_fn=partial(video_processor.sample_frames, fps=fps)
        )
        size = {"shortest_edge": video_processor.size["shortest_edge"], "longest_edge": int(top)}
        processed = video_processor(
            videos=[frames],
            video_metadata=[metadata],
            do_sample_frames=False,
            size=size,
            cap_pixels_per_frame=bool(video_processor.cap_pixels_per_frame),
            return_tensors="np",
            return_metadata=True,
        )
        values.append(processed["pixel_values_videos"])
        grids.append(processed["video_grid_thw"][0])
        expansions.append(expander.replace_video_token(processed, 0))
    out.pixel_values_videos = np.concatenate(values).astype(np.float32)
    out.video_grid_thw = np.asarray(grids, dtype=np.int64)
    wrapper = "<|vision_start|><|video_pad|><|vision_end|>"
    pieces = text.replace(wrapper, "<|video_pad|>").split("<|video_pad|>")
    return pieces[0] + "".join(expansion + piece for expansion, piece in zip(expansions, pieces[1:]))


def check_comparable(prepared: PreparedPrompt, reference_grids, contract) -> None:
    """Both sides run every image (and video frame pair) at the same grid (``reference_grids``: in prompt order).

    Raises:
        ValueError: an image the checkpoint's processor sizes to a grid this export cannot run (over
            its budget, which the processor's rounding up of a tiny or very thin image can give, or
            not among its static grids), naming both grids and what export would take it.
    """
    theirs = [] if reference_grids is None else [tuple(int(v) for v in g) for g in reference_grids]
    for i, (ours, grid) in enumerate(zip(prepared.image_grids, theirs)):
        if tuple(ours) != grid:
            tokens = grid[1] * grid[2] // contract.spatial_merge_size**2
            needs = [f"--image-tokens {tokens} or more"] if tokens > contract.image_tokens else []
            if contract.static_vision:
                needs.append(f"the {grid[1]}x{grid[2]} grid among its --vision-grids")
            raise ValueError(
                f"image {i + 1}: the checkpoint's processor gives it a {grid[1]}x{grid[2]} grid ({tokens} image "
                f"tokens) but this export runs it at {ours[1]}x{ours[2]}, so transformers cannot be compared on it; "
                f"an export with {' and '.join(needs)} can"
            )


def reference_generate(
    model, input_ids, pixel_values, image_grid_thw, max_new_tokens: int, eos_token_ids, videos=None
) -> list[int]:
    """Greedy ``model.generate`` on ``input_ids`` ``[1, S]`` (and ``pixel_values`` with each image's
    ``image_grid_thw`` row, when the prompt has images; ``videos``: ``(pixel_values_videos, video_grid_thw)``
    when it has videos); returns the new token ids, stopping at any of ``eos_token_ids`` (kept, as ours)."""
    import torch

    ids = torch.from_numpy(input_ids)
    vision = {}
    if pixel_values is not None:
        vision.update(pixel_values=torch.from_numpy(pixel_values), image_grid_thw=torch.from_numpy(image_grid_thw))
    if videos is not None:
        vision.update(
            pixel_values_videos=torch.from_numpy(videos[0]), video_grid_thw=torch.from_numpy(np.asarray(videos[1]))
        )
    if vision:  # the processor's modality of each token: 1 image, 2 video
        kinds = (ids == model.config.image_token_id).int() + 2 * (ids == model.config.video_token_id).int()
        vision["mm_token_type_ids"] = kinds
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=list(eos_token_ids) or None,
            pad_token_id=0,
            **vision,
        )
    return out[0, ids.shape[1] :].tolist()


def reference_generate_prepared(model, prepared: PreparedPrompt, max_new_tokens: int, eos_token_ids) -> list[int]:
    """:func:`reference_generate` on our own host inputs (``prepared``'s ids, pixel values and
    grids): for checks of the graphs and the decode loop alone, where both sides must see the same
    inputs."""
    import numpy as np

    grids = np.asarray(prepared.image_grids, dtype=np.int64).reshape(-1, 3) if prepared.image_grids else None
    return reference_generate(model, prepared.input_ids, prepared.pixel_values, grids, max_new_tokens, eos_token_ids)


def chat_parity(
    pipeline: Pipeline,
    model_id: str | Path,
    messages: list[dict],
    max_new_tokens: int,
    model=None,
    chat_template_kwargs: dict | None = None,
    result: GenerationResult | None = None,
    fps: float | None = None,
    max_video_tokens: int | None = None,
) -> TokenParity:
    """Greedy tokens of ``pipeline`` on chat ``messages`` (image parts ``{"type": "image", "image":
    path or PIL image}``, video parts ``{"type": "video", "video": path}``; ``result``: a greedy result for the
    same input, made already) against transformers on the checkpoint ``model_id`` fed the raw images and videos
    (:func:`reference_prompt`, ``max_pixels`` the export's budget, each video's by the export's rule), both
    stopping at ``pipeline.stop_token_ids``.

    Raises:
        ValueError: see :func:`check_comparable` (before anything runs).
        ImportError: a video without torchvision (see :func:`reference_prompt`).
    """
    from .conversation.images import load_image
    from .conversation.processor import media_kinds
    from .conversation.videos import read_video

    def raw(part):
        if part.get("type") != "image" or not isinstance(part.get("image"), (str, Path)):
            return part
        return {**part, "image": load_image(part["image"])}

    messages = [
        {**m, "content": [raw(p) for p in m["content"]]} if isinstance(m.get("content"), list) else m for m in messages
    ]
    prepared = pipeline.prepare_chat(messages, chat_template_kwargs, fps=fps, max_video_tokens=max_video_tokens)
    contract = pipeline.contract
    kinds = media_kinds(messages)
    video_pixels = []
    if "video" in kinds:
        sizing = pipeline.preprocessor.video_sizing
        for part in (p for m in messages if isinstance(m.get("content"), list) for p in m["content"]):
            if part.get("type") == "video":
                clip = read_video(part["video"], sizing.settings, fps)
                video_pixels.append(sizing.grid(len(clip.frames), clip.height, clip.width, max_video_tokens)[2])
    reference = reference_prompt(model_id, messages, contract.image_max_pixels, chat_template_kwargs, video_pixels, fps)
    check_comparable(prepared, reference.grids_in_prompt_order(kinds), contract)
    if result is None:
        result = pipeline.generate_prepared(prepared, max_new_tokens=max_new_tokens, sampling=SamplingConfig())
    model = model if model is not None else load_reference(model_id)
    # the export stops when its capacity is full; transformers has no such limit, so it is asked
    # for no more than fit
    fits = pipeline.token_room(prepared)
    videos = None if reference.video_grid_thw is None else (reference.pixel_values_videos, reference.video_grid_thw)
    tokens = reference_generate(
        model,
        reference.input_ids,
        reference.pixel_values,
        reference.image_grid_thw,
        min(max_new_tokens, fits),
        pipeline.stop_token_ids,
        videos,
    )
    return TokenParity(result.token_ids, tokens)


def token_parity(
    pipeline: Pipeline,
    model_id: str | Path,
    image,
    prompt: str,
    max_new_tokens: int,
    result: GenerationResult | None = None,
    model=None,
    video=None,
    fps: float | None = None,
    max_video_tokens: int | None = None,
) -> TokenParity:
    """:func:`chat_parity` of one user turn: the raw ``image`` (a path, a PIL image, a list of them or
    None) first, then ``video`` (a path, a list of them or None), then ``prompt``."""
    pictures = [] if image is None else list(image) if isinstance(image, (list, tuple)) else [image]
    clips = [] if video is None else list(video) if isinstance(video, (list, tuple)) else [video]
    content = [{"type": "image", "image": p} for p in pictures] + [{"type": "video", "video": v} for v in clips]
    content.append({"type": "text", "text": prompt})
    messages = [{"role": "user", "content": content}]
    return chat_parity(pipeline, model_id, messages, max_new_tokens, model, None, result, fps, max_video_tokens)
