"""OpenAI-style chat messages -> chat-template messages + images (no torch).

Accepted messages (the OpenAI Chat Completions format, as vLLM and llama.cpp's server accept it)::

    {"role": "system" | "developer" | "user" | "assistant" | "tool",
     "content": "text" | [part, ...] | None (assistant only)}

An assistant message may carry ``tool_calls`` (``[{"id", "type": "function", "function": {"name",
"arguments": JSON object text}}]``) and a ``tool`` message answers one (``tool_call_id``, text content).

with parts ``{"type": "text", "text": ...}``, ``{"type": "image_url", "image_url": {"url": ...}}``
(or ``"image_url": "..."``), ``{"type": "video_url", "video_url": {"url": ...}}`` (as vLLM accepts
it) and, from Python, ``{"type": "image", "image": PIL image or path}`` and ``{"type": "video",
"video": path or bytes}``. Images and videos are allowed in user messages only (as in the OpenAI API).
A video URL is a ``data:video/...;base64,...`` URL or a local file as for images; its bytes are
checked here, its frames are read later (:mod:`.videos`, with the policy's duration and frame-size
limits). An image URL is a
``data:image/{png,jpeg,webp,gif};base64,...`` URL, or a local file (a path or a ``file://`` URL)
when the :class:`ImagePolicy` allows it; ``http(s)`` URLs are refused (the runtime fetches
nothing from the network). ``developer`` is OpenAI's newer name for ``system`` and is rendered
as ``system``. The template gets one system message, first: leading system messages are joined, a later
one becomes a user message where it stands (:func:`_system_first`). An assistant message's
``reasoning_content`` is dropped (Qwen templates drop earlier turns' reasoning too).

What the chat template receives: ``{"role", "content"}`` with content a string, or a list of
``{"type": "text", "text"}``, ``{"type": "image"}`` and ``{"type": "video"}`` parts (one placeholder each), the
form transformers' processors pass to ``apply_chat_template``; an assistant's calls as
``tool_calls: [{"type": "function", "function": {"name", "arguments": dict}}]`` (the form chat
templates iterate).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from PIL import Image, ImageOps, UnidentifiedImageError

from .images import to_rgb

__all__ = [
    "ChatImage",
    "ChatVideo",
    "ChatInputError",
    "DETAILS",
    "ImageTooLarge",
    "ImagePolicy",
    "ROLES",
    "normalize_messages",
    "decode_image_url",
]

DETAILS = ("auto", "low", "high")
"""OpenAI's ``image_url.detail``: ``low`` the processor's grid at its ``min_pixels`` (the smallest of
the image's aspect ratio; on a static-grid export the exported grid closest to it), ``high`` and
``auto`` (the default) the export's image-token budget."""


@dataclass(frozen=True)
class ChatImage:
    """One image of a conversation: the RGB picture, its ``detail`` (one of :data:`DETAILS`) and the
    request field it came from (``param``, e.g. ``messages[0].content[1]``)."""

    image: Image.Image
    detail: str = "auto"
    param: str = "messages"


@dataclass(frozen=True)
class ChatVideo:
    """One video of a conversation, not yet decoded: its file (``path``) or encoded bytes (``data``), and the
    request field it came from (``param``)."""

    path: Path | None = None
    data: bytes | None = None
    param: str = "messages"

    @property
    def source(self) -> Path | bytes:
        """What :func:`.videos.read_video` reads: the file, else the bytes."""
        return self.path if self.path is not None else self.data


ROLES = ("system", "developer", "user", "assistant", "tool")
IMAGE_MEDIA_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif")
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000
VIDEO_MEDIA_TYPES = (
    "video/mp4",
    "video/webm",
    "video/quicktime",
    "video/x-matroska",
    "video/x-msvideo",
    "video/mpeg",
    "video/ogg",
    "video/3gpp",
)
DEFAULT_MAX_VIDEO_BYTES = 100 * 1024 * 1024
DEFAULT_MAX_VIDEO_SECONDS = 600.0
DEFAULT_MAX_VIDEO_FRAME_PIXELS = 3840 * 2160
DEFAULT_MAX_VIDEO_FRAMES = 36_000  # 10 minutes at 60 frames per second
_DATA_URL = re.compile(r"^data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,", re.I)


class ChatInputError(ValueError):
    """A chat request that cannot be rendered: ``param`` names the offending field in the
    OpenAI request (e.g. ``messages[2].content[1].image_url.url``), None for the whole request."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ImageTooLarge(ChatInputError):
    """An image or video over the :class:`ImagePolicy` limits (bytes or pixels); a server answers 413."""


@dataclass(frozen=True)
class ImagePolicy:
    """Where images may come from.

    Attributes:
        local_dir: local image files are read only from inside this folder (after resolving
            symbolic links and ``..``); None with ``allow_any_local`` False: no local files.
        allow_any_local: read local image files from anywhere (the Python API's default, where
            the caller is the operator; the server never sets it).
        max_image_bytes: largest encoded image (bytes of a file or of a decoded data URL).
        max_image_pixels: largest image (width x height) decoded from a data URL; checked from
            the header, before the pixels are decoded (a small file can hold a huge image).
        max_video_bytes: largest encoded video (a data URL's decoded bytes or a file).
        max_video_seconds: longest video, seconds (from its stream header, before decoding).
        max_video_frame_pixels: largest video frame (width x height, from its stream header).
        max_video_frames: most frames in a video (from its header: decoding reads through them).
    """

    local_dir: Path | None = None
    allow_any_local: bool = False
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_video_bytes: int = DEFAULT_MAX_VIDEO_BYTES
    max_video_seconds: float = DEFAULT_MAX_VIDEO_SECONDS
    max_video_frame_pixels: int = DEFAULT_MAX_VIDEO_FRAME_PIXELS
    max_video_frames: int = DEFAULT_MAX_VIDEO_FRAMES

    @classmethod
    def trusted(cls) -> ImagePolicy:
        """Local files from anywhere: for a caller that is the operator (the Python API)."""
        return cls(allow_any_local=True)


def normalize_messages(messages, policy: ImagePolicy | None = None) -> tuple[list[dict], list[ChatImage | ChatVideo]]:
    """Check OpenAI-style ``messages`` and split them into template messages, images and videos.

    Args:
        messages: a non-empty list of message dicts (see the module docstring).
        policy: where images may come from (default :meth:`ImagePolicy.trusted`).

    Returns:
        ``(template_messages, media)``: messages for ``apply_chat_template`` (one
        ``{"type": "image"}`` part per image, one ``{"type": "video"}`` per video) and the images
        (:class:`ChatImage`: RGB ``PIL.Image`` and ``detail``) and videos (:class:`ChatVideo`, not yet
        decoded) in prompt order.

    Raises:
        ChatInputError: naming the field: not a list, empty, unknown role, bad content or part
            type, an image or video outside a user message, an image or video URL that is remote, not
            allowed, too large or (an image) not decodable.
    """
    policy = policy or ImagePolicy.trusted()
    if not isinstance(messages, (list, tuple)):
        raise ChatInputError(f"messages must be a list of message objects, got {type(messages).__name__}", "messages")
    if not messages:
        raise ChatInputError("messages must hold at least one message", "messages")
    rendered: list[dict] = []
    images: list[ChatImage | ChatVideo] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ChatInputError(f"{where} must be an object, got {type(message).__name__}", where)
        role = message.get("role")
        if role not in ROLES:
            raise ChatInputError(f"{where}.role {role!r} is not one of {', '.join(ROLES)}", f"{where}.role")
        content = message.get("content")
        if content is None and role == "assistant":
            content = ""
        calls = _tool_calls(message, where) if role == "assistant" else {}
        if role == "tool":
            call_id = message.get("tool_call_id")
            if call_id is not None and not isinstance(call_id, str):
                raise ChatInputError(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
        if isinstance(content, str):
            rendered.append({"role": _template_role(role), "content": content, **calls})
            continue
        if not isinstance(content, (list, tuple)):
            raise ChatInputError(
                f"{where}.content must be a string or a list of content parts, got {type(content).__name__}",
                f"{where}.content",
            )
        parts = []
        for j, part in enumerate(content):
            here = f"{where}.content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise ChatInputError(f"{here}.text must be a string, got {type(text).__name__}", f"{here}.text")
                parts.append({"type": "text", "text": text})
            elif kind in ("image_url", "image"):
                if role != "user":
                    raise ChatInputError(f"{here}: images are allowed in user messages only, not in {role!r}", here)
                images.append(ChatImage(_part_image(part, here, policy), _detail(part, here), here))
                parts.append({"type": "image"})
            elif kind in ("video_url", "video"):
                if role != "user":
                    raise ChatInputError(f"{here}: videos are allowed in user messages only, not in {role!r}", here)
                images.append(_part_video(part, here, policy))
                parts.append({"type": "video"})
            else:
                if not isinstance(part, dict):
                    raise ChatInputError(
                        f"{here} must be a content part object ({{'type': 'text', ...}} or {{'type': 'image_url', "
                        f"...}}), got {type(part).__name__} {_clip(part)}",
                        here,
                    )
                raise ChatInputError(f"{here}.type {kind!r} must be 'text', 'image_url' or 'video_url'", f"{here}.type")
        rendered.append({"role": _template_role(role), "content": parts, **calls})
    return _system_first(rendered), images


def _system_first(rendered: list[dict]) -> list[dict]:
    """One system message, first: the system messages before the first other message joined into one (their
    text, paragraphs apart), and a system message after it made a user message where it stands. Chat templates
    take one system message, first (Qwen3.5's refuses any other: "System message must be at the beginning"), and
    clients send more: Codex several developer messages first, Claude Code its context as a system message after
    the user's; a late one made a user turn keeps the prompt's start (and its kept state) unchanged."""
    lead = 0
    while lead < len(rendered) and rendered[lead]["role"] == "system":
        lead += 1
    out = rendered[lead:]
    if lead > 1:
        texts = [_text(m["content"]) for m in rendered[:lead]]
        out = [{"role": "system", "content": "\n\n".join(t for t in texts if t)}, *out]
    else:
        out = rendered[:lead] + out
    return [{**m, "role": "user"} if m["role"] == "system" and i > 0 else m for i, m in enumerate(out)]


def _text(content) -> str:
    """A system message's text (its text parts joined)."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if p.get("type") == "text")


def _tool_calls(message: dict, where: str) -> dict:
    """An assistant message's ``tool_calls`` in the template's form (``{}`` when it has none).

    Raises:
        ChatInputError: not a list of function calls, a name that is not a string, arguments
            that are not a JSON object (text or dict).
    """
    calls = message.get("tool_calls")
    if not calls:
        return {}
    if not isinstance(calls, (list, tuple)):
        raise ChatInputError(f"{where}.tool_calls must be a list, got {type(calls).__name__}", f"{where}.tool_calls")
    out = []
    for k, call in enumerate(calls):
        here = f"{where}.tool_calls[{k}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ChatInputError(
                f"{here} must be {{'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}}", here
            )
        arguments = function.get("arguments")
        if arguments is None or arguments == "":
            arguments = {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError as exc:
                raise ChatInputError(
                    f"{here}.function.arguments is not valid JSON: {exc}", f"{here}.function.arguments"
                ) from None
        if not isinstance(arguments, dict) or not all(isinstance(key, str) for key in arguments):
            raise ChatInputError(
                f"{here}.function.arguments must be a JSON object (string keys), got {type(arguments).__name__}",
                f"{here}.function.arguments",
            )
        out.append({"type": "function", "function": {"name": function["name"], "arguments": arguments}})
    return {"tool_calls": out}


def _detail(part: dict, here: str) -> str:
    """The part's ``detail`` (``image_url.detail``, or ``detail`` beside a Python ``image``), 'auto' when absent.

    Raises:
        ChatInputError: not one of :data:`DETAILS`.
    """
    value, param = part.get("detail"), f"{here}.detail"
    if part["type"] == "image_url" and isinstance(part.get("image_url"), dict):
        value, param = part["image_url"].get("detail"), f"{here}.image_url.detail"
    if value is None:
        return "auto"
    if value not in DETAILS:
        raise ChatInputError(f"{param} {value!r:.80} must be one of {', '.join(DETAILS)}", param)
    return value


def _template_role(role: str) -> str:
    return "system" if role == "developer" else role


def _part_image(part: dict, here: str, policy: ImagePolicy) -> Image.Image:
    if part["type"] == "image":
        value = part.get("image")
        if isinstance(value, Image.Image):
            return to_rgb(value)
        if isinstance(value, (str, os.PathLike)):
            return _local_image(os.fspath(value), f"{here}.image", policy)
        raise ChatInputError(f"{here}.image must be a PIL image or a path, got {type(value).__name__}", f"{here}.image")
    return decode_image_url(*_part_url(part, here, "image_url"), policy)


def _part_url(part: dict, here: str, key: str) -> tuple[str, str]:
    """``(url, param)`` of an ``image_url`` / ``video_url`` part (``{"url": ...}`` or the URL itself).

    Raises:
        ChatInputError: not a non-empty string.
    """
    value = part.get(key)
    field_name = f"{here}.{key}"
    if isinstance(value, dict):
        value, field_name = value.get("url"), f"{here}.{key}.url"
    if not isinstance(value, str) or not value:
        raise ChatInputError(f"{field_name} must be a non-empty string URL, got {value!r:.80}", field_name)
    return value, field_name


def _part_video(part: dict, here: str, policy: ImagePolicy) -> ChatVideo:
    if part["type"] == "video":
        value = part.get("video")
        if isinstance(value, (bytes, bytearray)):
            if len(value) > policy.max_video_bytes:
                raise ImageTooLarge(
                    f"{here}.video: the video is {len(value)} bytes, more than the limit of {policy.max_video_bytes} "
                    "bytes",
                    f"{here}.video",
                )
            return ChatVideo(data=bytes(value), param=f"{here}.video")
        if isinstance(value, (str, os.PathLike)):
            return _local_video(os.fspath(value), f"{here}.video", policy)
        raise ChatInputError(f"{here}.video must be a path or bytes, got {type(value).__name__}", f"{here}.video")
    return decode_video_url(*_part_url(part, here, "video_url"), policy)


def decode_video_url(url: str, param: str, policy: ImagePolicy) -> ChatVideo:
    """The video of a ``data:video/...;base64,`` URL, a ``file://`` URL or a local path (as the policy allows),
    not yet decoded.

    Raises:
        ChatInputError: naming ``param``: remote URL, unsupported media type, bad base64, too many bytes
            (:class:`ImageTooLarge`), local files not allowed or outside the allowed folder, a missing file.
    """
    if url[:5].lower() == "data:":
        data = _data_url_bytes(url, param, VIDEO_MEDIA_TYPES, policy.max_video_bytes, "video")
        return ChatVideo(data=data, param=param)
    return _local_video(_url_path(url, param, "video"), param, policy)


def _local_video(path: str, param: str, policy: ImagePolicy) -> ChatVideo:
    """A local video file as the policy allows (:func:`_local_file`): by its path for a trusted caller, else its
    bytes, read here: FFmpeg then opens it from memory, where a playlist (HLS, concat) cannot name other files."""
    resolved = _local_file(path, param, policy, "video")
    if policy.allow_any_local:
        return ChatVideo(path=resolved, param=param)
    try:
        return ChatVideo(data=resolved.read_bytes(), param=param)
    except OSError as exc:
        raise ChatInputError(f"{param}: cannot read {path[:200]!r}: {exc.strerror or exc}", param) from None


def _data_url_bytes(url: str, param: str, media_types: tuple[str, ...], limit: int, kind: str) -> bytes:
    """The decoded payload of a base64 ``data:`` URL of one of ``media_types``, at most ``limit`` bytes."""
    match = _DATA_URL.match(url)
    example = "data:image/png;base64,<data>" if kind == "image" else "data:video/mp4;base64,<data>"
    if not match or not match.group("b64"):
        raise ChatInputError(f"{param}: a data URL must look like {example}", param)
    media = (match.group("type") or "").lower()
    if media not in media_types:
        raise ChatInputError(f"{param}: media type {media or 'none'!r} is not one of {', '.join(media_types)}", param)
    payload = url[match.end() :]
    decoded_size = len(payload.rstrip("=")) * 3 // 4  # exact for valid base64
    if decoded_size > limit:
        raise ImageTooLarge(f"{param}: the {kind} is {decoded_size} bytes, more than the limit of {limit} bytes", param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ChatInputError(f"{param}: the data URL is not valid base64 ({exc})", param) from None
    if len(data) > limit:
        raise ImageTooLarge(f"{param}: the {kind} is {len(data)} bytes, more than the limit of {limit} bytes", param)
    return data


def _url_path(url: str, param: str, kind: str) -> str:
    """The local path of a ``file://`` URL or a plain path; remote URLs are refused."""
    scheme = urlparse(url).scheme.lower()
    if scheme == "file":
        return unquote(urlparse(url).path)
    if len(scheme) > 1:  # a one-letter "scheme" is a Windows drive
        raise ChatInputError(
            f"{param}: {scheme}:// {kind} URLs are not fetched; send the {kind} as a data: URL (base64)", param
        )
    return url


def decode_image_url(url: str, param: str, policy: ImagePolicy) -> Image.Image:
    """Image of a ``data:`` URL, a ``file://`` URL or a local path (as the policy allows).

    Raises:
        ChatInputError: naming ``param``: remote URL, unsupported media type, bad base64, too many
            bytes, local files not allowed or outside the allowed folder, missing or
            undecodable image.
    """
    if url[:5].lower() == "data:":
        data = _data_url_bytes(url, param, IMAGE_MEDIA_TYPES, policy.max_image_bytes, "image")
        return _open_image_bytes(data, param, policy.max_image_pixels)
    return _local_image(_url_path(url, param, "image"), param, policy)


def _local_image(path: str, param: str, policy: ImagePolicy) -> Image.Image:
    """A local image file as the policy allows (:func:`_local_file`), decoded."""
    resolved = _local_file(path, param, policy, "image")
    try:
        data = resolved.read_bytes()
    except OSError as exc:
        raise ChatInputError(f"{param}: cannot read {path[:200]!r}: {exc.strerror or exc}", param) from None
    return _open_image_bytes(data, param, policy.max_image_pixels, formats=None)


def _local_file(path: str, param: str, policy: ImagePolicy, kind: str) -> Path:
    """A local image or video file as the policy allows: a relative path is taken inside ``local_dir``
    (the current folder with ``allow_any_local``); the resolved path (links and ``..`` followed)
    must lie inside ``local_dir``; the file must be a regular file within the byte limit."""
    if not policy.allow_any_local and policy.local_dir is None:
        raise ChatInputError(
            f"{param}: local {kind} paths are not allowed here (the server reads local files only from a folder "
            f"given with --allowed-image-dir); send the {kind} as a data: URL",
            param,
        )
    limit = policy.max_image_bytes if kind == "image" else policy.max_video_bytes
    shown = repr(path[:200])
    outside = False
    try:
        candidate = Path(path).expanduser()
        if not policy.allow_any_local and not candidate.is_absolute():
            candidate = Path(policy.local_dir) / candidate
        resolved = candidate.resolve()
        outside = not policy.allow_any_local and not resolved.is_relative_to(Path(policy.local_dir).resolve())
        exists, regular = resolved.exists(), resolved.is_file()
        size = resolved.stat().st_size if regular else 0
    except (OSError, ValueError, RuntimeError) as exc:  # embedded NUL, name too long, symlink loop
        raise ChatInputError(f"{param}: {shown} is not a usable file path ({exc})", param) from None
    if outside:
        raise ChatInputError(f"{param}: {shown} is outside the allowed {kind} folder", param)
    if not exists:
        raise ChatInputError(f"{param}: {kind} file not found: {shown}", param)
    if not regular:
        raise ChatInputError(f"{param}: {kind} path {shown} is not a regular file", param)
    if size > limit:
        raise ImageTooLarge(f"{param}: {shown} is {size} bytes, more than the limit of {limit} bytes", param)
    return resolved


WEB_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
"""Image formats accepted in data URLs (local files may be any format PIL reads)."""


def _open_image_bytes(data: bytes, param: str, max_pixels: int, formats=WEB_FORMATS) -> Image.Image:
    """Decode an encoded image: the format (``formats``, None: any) and the pixel count (from the
    header, before the pixels are decoded) are checked first; EXIF orientation applied; RGB."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            if formats is not None and image.format not in formats:
                raise ChatInputError(f"{param}: image format {image.format} is not PNG, JPEG, WebP or GIF", param)
            width, height = image.size
            if width * height > max_pixels:
                raise ImageTooLarge(
                    f"{param}: the image is {width}x{height} = {width * height} pixels, more than the limit of "
                    f"{max_pixels} pixels",
                    param,
                )
            image.load()  # the first frame of an animated GIF / WebP
            return to_rgb(ImageOps.exif_transpose(image))
    except Image.DecompressionBombError as exc:  # raised by Image.open itself above ~179 megapixels
        raise ImageTooLarge(
            f"{param}: the image is more than the limit of {max_pixels} pixels ({exc})", param
        ) from None
    except UnidentifiedImageError:
        raise ChatInputError(f"{param}: the data is not a readable image (no known image format)", param) from None
    except (OSError, SyntaxError, ValueError) as exc:
        if isinstance(exc, ChatInputError):
            raise
        raise ChatInputError(f"{param}: the data is not a readable image ({exc})", param) from None


def _clip(value, limit: int = 40) -> str:
    """``repr(value)``, cut to ``limit`` characters for a message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
