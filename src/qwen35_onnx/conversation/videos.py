"""Video files to sampled RGB frames, and frames to the vision graph's patches, as the checkpoint's
video processor does it (PyAV + numpy + PIL, no torch).

A Qwen3.5 video becomes tokens in four steps (transformers 5.25, ``Qwen3VLVideoProcessor`` in
``models/qwen3_vl/video_processing_qwen3_vl.py`` and ``Qwen3VLProcessor.replace_video_token`` in
``processing_qwen3_vl.py``):

1. **Sampling** (:func:`sample_indices`): ``n = int(total_frames / source_fps * fps)`` frames (``fps`` 2 by
   default), clamped to ``[min_frames, max_frames]`` and to the frames there are, at
   ``linspace(0, total_frames - 1, n)`` rounded. The source's frame count and frame rate are its
   stream header's (``frames``, ``average_rate``), as transformers' PyAV reader takes them.
2. **Sizing** (:func:`video_smart_resize`): one size for every frame, sides multiples of
   ``patch * merge`` (32 pixels), the aspect ratio kept, ``frames x height x width`` within the
   processor's pixel range (``size.shortest_edge`` / ``size.longest_edge``: the budget is spread over
   all frames), optionally each frame capped (``cap_pixels_per_frame``).
3. **Patches** (:func:`video_patches`): frames resized (bicubic, antialiased, as torchvision does it),
   rescaled and normalised, an odd frame count padded with the last frame, then cut into temporal patches
   of 2 frames: a ``t x h x w`` grid.
4. **Prompt**: each temporal patch (frame pair) is written ``<{t:.1f} seconds>`` (the mean of its two
   frames' times, :func:`frame_timestamps`) then ``<|vision_start|>``, ``h * w / merge**2`` video pads
   and ``<|vision_end|>``; for mRoPE each pair is an image of grid ``(1, h, w)``
   (``Qwen3_5Model.get_rope_index``), and the vision tower attends within each pair only, so the
   runtime runs the vision graph once per pair.

The frames are decoded with PyAV (FFmpeg's libraries in its wheel; no ffmpeg program). Its RGB frames
equal OpenCV's and imageio-ffmpeg's on H.264 and VP9 (``benchmarks/video/amd-epyc-2c-decoders.json``).
"""

from __future__ import annotations

import io
import math
import numbers
import os
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import numpy as np

from .frame_resize import resize_frames

__all__ = [
    "VideoClip",
    "VideoLimitError",
    "VideoLimits",
    "VideoSettings",
    "check_fps",
    "frame_timestamps",
    "probe_video",
    "read_video",
    "sample_indices",
    "video_patches",
    "video_smart_resize",
]

MAX_ASPECT_RATIO = 200
"""The video processor's limit on ``max(h, w) / min(h, w)``."""


@dataclass(frozen=True)
class VideoSettings:
    """The checkpoint's video processor settings (``video_preprocessor_config.json``), with the defaults of
    transformers' ``Qwen3VLVideoProcessor`` for keys the file lacks.

    Attributes:
        patch_size, temporal_patch_size, merge_size: the vision tower's patch side (pixels), frames per
            temporal patch, spatial merge.
        min_pixels, max_pixels: ``size.shortest_edge`` / ``size.longest_edge``: the pixel range of all
            sampled frames together (frames x height x width).
        fps: frames sampled per second of video.
        min_frames, max_frames: bounds of the sampled frame count.
        image_mean, image_std, rescale_factor: normalisation, ``(x * rescale_factor - mean) / std``.
        resample: PIL resampling filter of the resize (3: bicubic).
        cap_pixels_per_frame: cap each frame at ``max_frame_tokens`` tokens' pixels or an even share of
            ``max_pixels`` (transformers' ``cap_pixels_per_frame``; off by default in transformers 5.25).
        max_frame_tokens: that cap in tokens (transformers' ``max_video_tokens``).
    """

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 128 * 32 * 32
    max_pixels: int = 32 * 32 * 768
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    resample: int = 3
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    cap_pixels_per_frame: bool = False
    max_frame_tokens: int = 768

    @property
    def factor(self) -> int:
        """Pixels per merged token side: ``patch_size * merge_size``."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, config: dict) -> VideoSettings:
        """Settings from a video processor dict (``size`` or the older ``min_pixels`` / ``max_pixels``).

        Raises:
            ValueError: a value of the wrong type or out of range, naming the key; a setting this runtime
                does not apply (``do_resize`` false).
        """
        size = config.get("size") or {}
        values = {
            "patch_size": config.get("patch_size", cls.patch_size),
            "temporal_patch_size": config.get("temporal_patch_size", cls.temporal_patch_size),
            "merge_size": config.get("merge_size", cls.merge_size),
            "min_pixels": size.get("shortest_edge", config.get("min_pixels", cls.min_pixels)),
            "max_pixels": size.get("longest_edge", config.get("max_pixels", cls.max_pixels)),
            "fps": config.get("fps", cls.fps),
            "min_frames": config.get("min_frames", cls.min_frames),
            "max_frames": config.get("max_frames", cls.max_frames),
            "rescale_factor": config.get("rescale_factor", cls.rescale_factor),
            "resample": config.get("resample", cls.resample),
            "max_frame_tokens": config.get("max_video_tokens", cls.max_frame_tokens),
        }
        for key in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels", "min_frames"):
            value = values[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"video processor setting {key} must be a positive integer, got {value!r}")
        for key in ("max_frames", "max_frame_tokens", "resample"):
            if isinstance(values[key], bool) or not isinstance(values[key], int) or values[key] < 0:
                raise ValueError(f"video processor setting {key} must be a non-negative integer, got {values[key]!r}")
        for key in ("fps", "rescale_factor"):
            if isinstance(values[key], bool) or not isinstance(values[key], (int, float)) or not values[key] > 0:
                raise ValueError(f"video processor setting {key} must be a positive number, got {values[key]!r}")
        mean = tuple(_channels(config.get("image_mean", cls.image_mean), "image_mean"))
        std = tuple(_channels(config.get("image_std", cls.image_std), "image_std"))
        flags = {
            key: bool(config.get(key, getattr(cls, key)))
            for key in ("do_resize", "do_rescale", "do_normalize", "cap_pixels_per_frame")
            if config.get(key, getattr(cls, key)) is not None
        }
        if not flags.get("do_resize", True):
            raise ValueError("video processor setting do_resize false is not supported (frames must fit a patch grid)")
        return cls(**values, image_mean=mean, image_std=std, **flags)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> VideoSettings:
        """The settings of a checkpoint or export folder, found as transformers finds them
        (``VideoProcessorMixin.get_video_processor_dict``: ``processor_config.json``'s ``video_processor``, else
        ``video_preprocessor_config.json``, else ``preprocessor_config.json``).

        Raises:
            OSError: the folder has none of those files.
            ValueError: see :meth:`from_dict`.
        """
        from transformers.video_processing_utils import VideoProcessorMixin

        config, _ = VideoProcessorMixin.get_video_processor_dict(str(path), local_files_only=True)
        return cls.from_dict(config)

    def frame_budget(self, num_frames: int) -> int:
        """The processor's ``max_pixels`` for ``num_frames`` frames: ``max_pixels``, or with
        :attr:`cap_pixels_per_frame` each frame's share ``max(min(max_frame_tokens * factor**2, max_pixels //
        num_frames), int(1.05 * min_pixels))`` times the frames (``Qwen3VLVideoProcessor.resize``)."""
        if not self.cap_pixels_per_frame:
            return self.max_pixels
        cap = self.max_frame_tokens * self.factor**2
        return max(min(cap, self.max_pixels // num_frames), int(self.min_pixels * 1.05)) * num_frames


def _channels(value, key: str) -> list[float]:
    values = [value] * 3 if isinstance(value, (int, float)) else list(value or ())
    if len(values) != 3 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise ValueError(f"video processor setting {key} must be 3 numbers, got {value!r}")
    if key == "image_std" and not all(v > 0 for v in values):
        raise ValueError(f"video processor setting {key} must be positive, got {value!r}")
    return [float(v) for v in values]


class VideoLimitError(ValueError):
    """A video over the caller's :class:`VideoLimits` (a server answers 413)."""


MAX_FPS = 1000.0
"""The most frames per second a caller may ask to sample (more than any video has)."""


def check_fps(fps) -> float:
    """``fps`` as a float.

    Raises:
        ValueError: not a number in ``(0, MAX_FPS]`` (frames per second).
    """
    if isinstance(fps, bool) or not isinstance(fps, numbers.Real) or not 0 < fps <= MAX_FPS:
        raise ValueError(f"fps must be a positive number of frames per second, at most {MAX_FPS:g}, got {fps!r}")
    return float(fps)


@dataclass(frozen=True)
class VideoLimits:
    """What a caller accepts from a video before its frames are decoded (a server's limits).

    Attributes:
        max_seconds: longest video (``total_frames / source_fps``), seconds; None: no limit.
        max_frame_pixels: largest frame (width x height of the stream); None: no limit.
        max_frames: most frames in the stream (decoding reads up to the last sampled one, near the end: a short
            video of a very high frame rate costs its frames); None: no limit.
    """

    max_seconds: float | None = None
    max_frame_pixels: int | None = None
    max_frames: int | None = None


@dataclass
class VideoClip:
    """Frames sampled from a video.

    Attributes:
        frames: uint8 ``[T, H, W, 3]`` RGB, the sampled frames in order.
        frame_indices: int64 ``[T]``, each frame's index in the stream (decode order).
        source_fps: the stream's average frame rate (frames per second), which timestamps divide by.
        total_frames: frames in the stream (its header's count, else the packets counted).
        source: the file (or ``"<bytes>"``) for messages.
    """

    frames: np.ndarray
    frame_indices: np.ndarray
    source_fps: float
    total_frames: int
    source: str = "<frames>"
    codec: str = field(default="", repr=False)
    frame_size: tuple[int, int] | None = None
    """The stream's frame ``(height, width)`` where ``frames`` were resized as they were decoded (None: ``frames``
    are at the stream's size)."""

    @property
    def duration_s(self) -> float:
        """Length of the video in seconds: ``total_frames / source_fps``."""
        return self.total_frames / self.source_fps

    @property
    def height(self) -> int:
        """The stream's frame height in pixels (the frames' own, unless resized as decoded)."""
        return int(self.frame_size[0] if self.frame_size else self.frames.shape[1])

    @property
    def width(self) -> int:
        """The stream's frame width in pixels."""
        return int(self.frame_size[1] if self.frame_size else self.frames.shape[2])


def sample_indices(total_frames: int, source_fps: float, fps: float, min_frames: int, max_frames: int) -> np.ndarray:
    """Indices of the frames to sample: ``int(total_frames / source_fps * fps)`` frames clamped to
    ``[min_frames, max_frames]`` and to ``total_frames``, spread evenly (``linspace`` rounded) from the first frame
    to the last (``Qwen3VLVideoProcessor.sample_frames``).

    Returns:
        int64 ``[n]``, ascending, within ``[0, total_frames)``; empty when the video has no frames.

    Raises:
        ValueError: a non-positive ``source_fps`` or ``fps``.
    """
    if not source_fps > 0 or not fps > 0:
        raise ValueError(f"frame rates must be positive, got source {source_fps!r} and sampling {fps!r}")
    count = int(total_frames / source_fps * fps)
    count = min(max(count, min_frames), max_frames, total_frames)
    return np.linspace(0, total_frames - 1, count).round().astype(np.int64)


def frame_timestamps(frame_indices, source_fps: float, temporal_patch_size: int) -> list[float]:
    """Time of each temporal patch in seconds: the indices padded with the last to a multiple of
    ``temporal_patch_size``, divided by ``source_fps``, and the first and last of each patch averaged
    (``Qwen3VLProcessor._calculate_timestamps``)."""
    indices = [int(i) for i in frame_indices]
    if len(indices) % temporal_patch_size:
        indices += [indices[-1]] * (temporal_patch_size - len(indices) % temporal_patch_size)
    times = [i / source_fps for i in indices]
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)]


def video_smart_resize(
    num_frames: int, height: int, width: int, temporal_factor: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """The resized ``(height, width)`` of every frame: sides multiples of ``factor``, the aspect ratio kept,
    ``frames x height x width`` within ``[min_pixels, max_pixels]`` (``smart_resize`` of
    ``video_processing_qwen3_vl.py``, the same arithmetic).

    Raises:
        ValueError: fewer than ``temporal_factor`` frames; an aspect ratio above 200.
    """
    if num_frames < temporal_factor:
        raise ValueError(
            f"a video needs at least {temporal_factor} sampled frames (one temporal patch), got {num_frames}"
        )
    shown = f"{width}x{height}"
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(
            f"the video's frames are {shown} pixels, an aspect ratio of {ratio:.4g}:1 (as the processor scales "
            f"them), above the video processor's limit of {MAX_ASPECT_RATIO}:1"
        )
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def video_patches(frames: np.ndarray, grid: tuple[int, int], settings: VideoSettings) -> tuple[np.ndarray, int]:
    """Sampled frames -> the vision graph's patches (``Qwen3VLVideoProcessor._preprocess``).

    Each frame is resized to ``grid * patch_size`` pixels (:func:`.frame_resize.resize_frames`, as torchvision
    does it for the processor, bit for bit), rescaled and
    normalised in float32 as transformers fuses them (``(x - mean / rescale) / (std / rescale)``), an odd frame
    count is padded with copies of the last frame, and the frames are cut into temporal patches.

    Args:
        frames: uint8 ``[T, H, W, 3]`` RGB, T >= 1.
        grid: ``(h, w)`` patches of each frame (multiples of ``merge_size``).
        settings: the video processor's settings.

    Returns:
        ``(pixel_values, t)``: float32 ``[t * h * w, 3 * temporal * patch * patch]`` with the rows of temporal
        patch ``i`` at ``[i * h * w, (i + 1) * h * w)`` (merge blocks in raster order inside), and ``t`` the number
        of temporal patches (``ceil(T / temporal)``).
    """
    s = settings
    h, w = grid
    values = resize_frames(frames, h * s.patch_size, w * s.patch_size, s.resample).astype(np.float32)
    if s.do_rescale and s.do_normalize:
        mean = (np.asarray(s.image_mean, dtype=np.float64) / s.rescale_factor).astype(np.float32)
        std = (np.asarray(s.image_std, dtype=np.float64) / s.rescale_factor).astype(np.float32)
        values = (values - mean) / std
    elif s.do_rescale:
        values = values * np.float32(s.rescale_factor)
    elif s.do_normalize:
        values = (values - np.float32(s.image_mean)) / np.float32(s.image_std)
    values = values.transpose(0, 3, 1, 2)  # [T, C, H, W]
    if pad := -values.shape[0] % s.temporal_patch_size:
        values = np.concatenate([values, np.repeat(values[-1:], pad, axis=0)])
    t, m, p, k = values.shape[0] // s.temporal_patch_size, s.merge_size, s.patch_size, s.temporal_patch_size
    patches = values.reshape(t, k, 3, h // m, m, p, w // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(patches.reshape(t * h * w, 3 * k * p * p), dtype=np.float32), t


def read_video(
    source: str | os.PathLike | bytes,
    settings: VideoSettings,
    fps: float | None = None,
    limits: VideoLimits | None = None,
    size=None,
) -> VideoClip:
    """Decode a video and sample its frames as the checkpoint's processor does (:func:`sample_indices`).

    The first video stream is read with PyAV (frame and slice threads); only the sampled frames are converted
    to RGB. The frame count is the stream header's (the packets counted where the header has none) and the
    frame rate its average rate, as transformers' PyAV reader takes them.

    Args:
        source: a video file, or its bytes.
        settings: the video processor's settings (frames per second, min / max frames).
        fps: frames to sample per second (None: ``settings.fps``).
        limits: checked from the header, before any frame is decoded.
        size: ``size(num_frames, height, width) -> (height, width)``, called with the sampled frame count and the
            stream's frame size before any frame is decoded (it may raise to refuse the video): each frame is
            resized to that size as it is decoded (:func:`.frame_resize.resize_frames`, as the processor resizes
            them), so that a long video never holds its frames at full size. None: frames at full size.

    Returns:
        The sampled :class:`VideoClip`.

    Raises:
        FileNotFoundError: no file at ``source``.
        ValueError: naming the source: not a video container, no video stream, a stream without frames or with
            no known frame rate, a codec the decoder lacks, fewer frames decoded than the header counts, frames
            of another size than the header's, a bad ``fps``; :class:`VideoLimitError` for a video over ``limits``
            (its length in seconds or frames, its frame size); what ``size`` raises.
    """
    name, handle = _source(source)
    fps = check_fps(settings.fps if fps is None else fps)
    with _open(handle, name) as container:
        stream, source_fps, total, codec = _header(container, handle, name, limits)
        indices = sample_indices(total, source_fps, fps, settings.min_frames, settings.max_frames)
        height, width = stream.codec_context.height, stream.codec_context.width
        target = None if size is None else size(len(indices), height, width)
        frames = _decode(container, stream, indices, name, total, codec, (height, width), target, settings.resample)
    return VideoClip(frames, indices, source_fps, total, name, codec, None if target is None else (height, width))


def probe_video(source: str | os.PathLike | bytes, limits: VideoLimits | None = None) -> VideoClip:
    """Check that ``source`` is a readable video within ``limits`` from its header alone (no frame decoded):
    a :class:`VideoClip` without frames (``frames`` ``[0, H, W, 3]``).

    Raises:
        FileNotFoundError / ValueError / VideoLimitError: as :func:`read_video` (a damaged stream is found only
            when decoded).
    """
    name, handle = _source(source)
    with _open(handle, name) as container:
        stream, source_fps, total, codec = _header(container, handle, name, limits)
        empty = np.zeros((0, stream.codec_context.height, stream.codec_context.width, 3), dtype=np.uint8)
    return VideoClip(empty, np.zeros(0, dtype=np.int64), source_fps, total, name, codec)


def _source(source) -> tuple:
    """``(name, handle)``: a name for messages and a function giving what ``av.open`` reads (a new stream of the
    bytes each call, or the path).

    Raises:
        FileNotFoundError: no file at ``source``; ValueError: not a file.
    """
    if isinstance(source, (bytes, bytearray)):
        data = bytes(source)
        return "<bytes>", lambda: io.BytesIO(data)
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"video file not found: {path}")
    if not path.is_file():
        raise ValueError(f"video path is not a file: {path}")
    return str(path), lambda: str(path)


def _open(handle, name: str):
    """The container ``av.open`` makes of ``handle()``.

    Raises:
        ValueError: not a container FFmpeg reads, naming ``name``.
    """
    import av

    try:
        return av.open(handle(), "r")
    except (av.error.FFmpegError, OSError, ValueError) as err:
        raise ValueError(f"cannot read video {name}: {err}") from None


def _header(container, handle, name: str, limits: VideoLimits | None):
    """``(stream, source_fps, total_frames, codec)`` of the first video stream, checked against ``limits``."""
    if not container.streams.video:
        raise ValueError(f"{name} has no video stream")
    stream = container.streams.video[0]
    if stream.codec_context is None:  # FFmpeg knows no decoder for the stream's codec
        tag = getattr(stream, "codec_tag", "") or "unknown"
        raise ValueError(f"cannot decode the video stream of {name}: its codec ({tag}) is not one FFmpeg reads")
    codec = stream.codec_context.name
    rate = stream.average_rate or stream.guessed_rate
    if not rate or Fraction(rate) <= 0:
        raise ValueError(f"the video stream of {name} has no frame rate")
    source_fps = float(rate)
    width, height = stream.codec_context.width, stream.codec_context.height
    limits = limits or VideoLimits()
    if limits.max_frame_pixels is not None and width * height > limits.max_frame_pixels:
        raise VideoLimitError(
            f"the frames of {name} are {width}x{height} = {width * height} pixels, more than the limit of "
            f"{limits.max_frame_pixels} pixels"
        )
    total = int(stream.frames) or _count_packets(handle(), name)
    if total < 1:
        raise ValueError(f"the video stream of {name} holds no frames")
    if limits.max_frames is not None and total > limits.max_frames:
        raise VideoLimitError(f"{name} holds {total} frames, more than the limit of {limits.max_frames} frames")
    if limits.max_seconds is not None and total / source_fps > limits.max_seconds:
        raise VideoLimitError(
            f"{name} is {total / source_fps:.1f} seconds long ({total} frames at {source_fps:.3g} fps), more "
            f"than the limit of {limits.max_seconds:g} seconds"
        )
    return stream, source_fps, total, codec


def _count_packets(source, name: str) -> int:
    """Frames of the first video stream of a container whose header does not count them: its packets with data
    (a pass over the file of its own, so the decoding pass starts at the beginning)."""
    import av

    try:
        with av.open(source, "r") as container:
            return sum(1 for packet in container.demux(container.streams.video[0]) if packet.size)
    except av.error.FFmpegError as err:
        raise ValueError(f"cannot read video {name}: {err}") from None


def _decode(
    container, stream, indices: np.ndarray, name: str, total: int, codec: str, shape, target, resample: int
) -> np.ndarray:
    """RGB frames ``[len(indices), H, W, 3]`` at ``indices`` (ascending, repeats allowed), each resized to
    ``target`` ``(height, width)`` as it is decoded (None: kept at the stream's ``shape``)."""
    import av

    wanted = {int(i) for i in indices}
    last, got, decoded = int(indices[-1]), {}, 0
    stream.thread_type = "AUTO"
    try:
        for i, frame in enumerate(container.decode(stream)):
            decoded = i + 1
            if (frame.height, frame.width) != tuple(shape):
                raise ValueError(
                    f"the frames of {name} change size within the stream: frame {i} is {frame.width}x{frame.height}, "
                    f"the stream header says {shape[1]}x{shape[0]}"
                )
            if i in wanted:
                rgb = frame.to_ndarray(format="rgb24")
                got[i] = rgb if target is None else resize_frames(rgb[None], *target, resample)[0]
            if i >= last:
                break
    except av.error.FFmpegError as err:
        if not got:
            raise ValueError(f"cannot decode the {codec} video stream of {name}: {err}") from None
        raise ValueError(f"the {codec} video stream of {name} is damaged after frame {decoded}: {err}") from None
    if len(got) < len(wanted):
        raise ValueError(
            f"the video stream of {name} ended after {decoded} decoded frames, but its header counts {total} "
            f"(a truncated or damaged file, or a {codec} stream this decoder cannot read)"
        )
    return np.stack([got[int(i)] for i in indices])
