"""The options of ``qwen35-onnx serve`` besides the export, the address and the runtime, declared
once (no HTTP import: the command line reads them without the 'serve' extra)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..conversation.messages import ImagePolicy
from ..options import option
from ..runtime.snapshot_disk import DEFAULT_DISK_BYTES

__all__ = ["API_KEY_ENV", "ServerOptions"]

MIB = 1024 * 1024
API_KEY_ENV = "QWEN35_ONNX_API_KEY"


@dataclass(frozen=True)
class ServerOptions:
    """What ``qwen35-onnx serve`` takes besides the export folder, the address and the runtime.

    Attributes:
        model_name: the served model id (``/v1/models``, echoed in replies; the CLI's default is
            the export folder's name).
        api_key: when set, ``/v1/*`` and ``/metrics`` need ``Authorization: Bearer <api_key>`` (or ``x-api-key``).
        max_queue: requests allowed to wait while every decode slot is taken (0: none).
        max_body_bytes: largest request body.
        max_image_bytes: largest encoded image (a data URL's decoded bytes or a file).
        max_image_pixels: largest image (width x height), read from its header before decoding.
        max_video_bytes: largest encoded video (a data URL's decoded bytes or a file).
        max_video_seconds: longest video, read from its header before decoding.
        max_video_frame_pixels: largest video frame (width x height), read from its header.
        max_video_frames: most frames in a video, read from its header.
        allowed_image_dir: local image and video paths / file:// URLs are read from inside this folder
            only; None: no local files (data: URLs only).
        state_cache_bytes: host bytes of kept states (an export with prefill chunks): a request whose
            messages begin as an earlier one's continues from that state; 0: none kept.
        state_cache_dir: a folder where kept states are written too, so that a restarted server (or another one on
            the folder) continues from them; None: memory only.
        state_cache_disk_bytes: bytes of kept states in ``state_cache_dir``, least recently used removed first.
        max_tokens: most tokens of any reply, on every route (llama-server's ``--n-predict``); a request asking
            for more is served up to it and ends with the length reason; None: the capacity's.
        response_store_bytes: bytes of stored Responses API responses (``store: true``, for
            ``previous_response_id`` and ``GET /v1/responses/{id}``), least recently used dropped first; 0: none.
    """

    model_name: str | None = option(
        None, "--model-name", "Model id shown in /v1/models and replies; by default the export folder's name."
    )
    api_key: str | None = option(
        None,
        "--api-key",
        f"Require `Authorization: Bearer KEY` (or `x-api-key: KEY`) on /v1/* and /metrics (or set {API_KEY_ENV}); by "
        "default no auth.",
        env=API_KEY_ENV,
    )
    max_queue: int = option(8, "--max-queue", "Requests that may wait while every decode slot is taken; more get 429.")
    max_body_bytes: int = option(32 * MIB, "--max-body-bytes", "Largest request body; larger gets 413.")
    max_image_bytes: int = option(20 * MIB, "--max-image-bytes", "Largest encoded image; larger gets 413.")
    max_image_pixels: int = option(
        50_000_000,
        "--max-image-pixels",
        "Largest image in pixels (width x height, read before decoding); larger gets 413.",
    )
    max_video_bytes: int = option(100 * MIB, "--max-video-bytes", "Largest encoded video; larger gets 413.")
    max_video_seconds: float = option(
        600.0, "--max-video-seconds", "Longest video in seconds (read before decoding); longer gets 413."
    )
    max_video_frame_pixels: int = option(
        3840 * 2160,
        "--max-video-frame-pixels",
        "Largest video frame in pixels (width x height, read before decoding); larger gets 413.",
    )
    max_video_frames: int = option(
        36_000, "--max-video-frames", "Most frames in a video (read before decoding); more gets 413."
    )
    allowed_image_dir: Path | None = option(
        None,
        "--allowed-image-dir",
        "Folder from which local image and video paths / file:// URLs may be read; by default none (data: URLs only).",
    )

    state_cache_bytes: int = option(
        1 << 30,
        "--state-cache-bytes",
        "Host bytes of kept conversation states (exports with --prefill-chunks): a request that resends an earlier "
        "conversation prefills only its new messages; least recently used dropped first; 0: off.",
    )
    state_cache_dir: Path | None = option(
        None,
        "--state-cache-dir",
        "Folder where kept conversation states are written too (exports with --prefill-chunks): a restarted server, "
        "or a new session whose system prompt and tools were seen before, continues from them; by default none "
        "(memory only).",
    )
    state_cache_disk_bytes: int = option(
        DEFAULT_DISK_BYTES,
        "--state-cache-disk-bytes",
        "Bytes of kept states in --state-cache-dir (all its exports' files together); least recently used removed "
        "first.",
    )

    max_tokens: int | None = option(
        None,
        "--max-tokens",
        "Most tokens of any reply, on every route (llama-server's --n-predict): a request asking for more (agents ask "
        "32k) is served up to it and ends with finish reason 'length'; by default what the capacity leaves.",
    )
    response_store_bytes: int = option(
        64 * MIB,
        "--response-store-bytes",
        "Bytes of stored Responses API responses (store: true; previous_response_id, GET /v1/responses/ID), least "
        "recently used dropped first; 0: none stored.",
    )

    def validate(self) -> None:
        """Raises ValueError naming the option and its allowed range."""
        if not isinstance(self.model_name, str) or not self.model_name.strip():
            raise ValueError(f"--model-name must be a non-empty string, got {self.model_name!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must not be empty")
        if self.max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_image_bytes < 1:
            raise ValueError(f"--max-image-bytes must be >= 1, got {self.max_image_bytes}")
        if self.max_image_pixels < 1:
            raise ValueError(f"--max-image-pixels must be >= 1, got {self.max_image_pixels}")
        if self.max_video_bytes < 1:
            raise ValueError(f"--max-video-bytes must be >= 1, got {self.max_video_bytes}")
        if not self.max_video_seconds > 0:
            raise ValueError(f"--max-video-seconds must be > 0, got {self.max_video_seconds}")
        if self.max_video_frame_pixels < 1:
            raise ValueError(f"--max-video-frame-pixels must be >= 1, got {self.max_video_frame_pixels}")
        if self.max_video_frames < 2:
            raise ValueError(f"--max-video-frames must be >= 2, got {self.max_video_frames}")
        if isinstance(self.state_cache_bytes, bool) or not isinstance(self.state_cache_bytes, int):
            raise ValueError(f"--state-cache-bytes must be an integer, got {self.state_cache_bytes!r}")
        if self.state_cache_bytes < 0:
            raise ValueError(f"--state-cache-bytes must be >= 0 (0: off), got {self.state_cache_bytes}")
        disk = self.state_cache_disk_bytes
        if isinstance(disk, bool) or not isinstance(disk, int) or disk < 1:
            raise ValueError(f"--state-cache-disk-bytes must be a positive integer, got {disk!r}")
        if self.state_cache_dir is not None and self.state_cache_bytes == 0:
            raise ValueError(
                "--state-cache-dir needs kept states in memory too (--state-cache-bytes > 0): a state is kept in "
                "memory while it is written and when it is read back"
            )
        if self.max_tokens is not None and (
            isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise ValueError(f"--max-tokens must be an integer >= 1, got {self.max_tokens!r}")
        if isinstance(self.response_store_bytes, bool) or not isinstance(self.response_store_bytes, int):
            raise ValueError(f"--response-store-bytes must be an integer, got {self.response_store_bytes!r}")
        if self.response_store_bytes < 0:
            raise ValueError(f"--response-store-bytes must be >= 0 (0: off), got {self.response_store_bytes}")
        if self.allowed_image_dir is not None and not Path(self.allowed_image_dir).is_dir():
            raise ValueError(f"--allowed-image-dir {str(self.allowed_image_dir)!r} is not a folder")

    @property
    def image_policy(self) -> ImagePolicy:
        local = Path(self.allowed_image_dir).resolve() if self.allowed_image_dir is not None else None
        return ImagePolicy(
            local_dir=local,
            allow_any_local=False,
            max_image_bytes=self.max_image_bytes,
            max_image_pixels=self.max_image_pixels,
            max_video_bytes=self.max_video_bytes,
            max_video_seconds=self.max_video_seconds,
            max_video_frame_pixels=self.max_video_frame_pixels,
            max_video_frames=self.max_video_frames,
        )
