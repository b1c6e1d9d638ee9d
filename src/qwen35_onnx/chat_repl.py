"""``qwen35-onnx chat``: an interactive multi-turn conversation in the terminal (a thin loop over
:meth:`Pipeline.stream_chat`).

Each line is a user turn; ``/image PATH`` attaches an image to the next turn (repeatable, up to
the export's ``max_images`` per prompt in total), ``/video PATH`` a video (repeatable; its frames are
read when the turn is sent, and again by each later turn whose prompt holds it: the kept states spare
only the prefill), ``/reset`` starts a new conversation,
``/quit`` (or end of input) leaves. The reply's content streams to stdout, its reasoning (if the
chat template turns thinking on) to stderr.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TextIO

from .contract import PromptTooLongError
from .conversation.images import load_image
from .conversation.messages import ChatInputError
from .conversation.videos import probe_video
from .pipeline import Pipeline
from .runtime.sampling import SamplingConfig

HELP = "commands: /image PATH, /video PATH (attach to the next message), /reset, /quit"


def run_chat(
    pipe: Pipeline,
    lines: Iterable[str],
    out: TextIO,
    err: TextIO,
    *,
    system: str | None = None,
    max_new_tokens: int | None = None,
    sampling: SamplingConfig | None = None,
    chat_template_kwargs: dict | None = None,
    prompt: Callable[[], None] | None = None,
    max_image_tokens: int | None = None,
    fps: float | None = None,
    max_video_tokens: int | None = None,
) -> int:
    """Run the conversation over input ``lines``; returns the number of answered turns.

    A video is checked when attached from its header (readable, a video stream with frames), its frames when
    the turn is sent (``fps`` and ``max_video_tokens`` as :meth:`Pipeline.prepare_chat` takes them). An image
    is checked when attached (readable, within the export's ``max_images`` counting the
    conversation's earlier images). A turn whose input is refused (prompt over the largest prefill
    bucket) prints one ``error: ...`` line to ``err`` and is dropped from the history with its
    attached images, so the conversation goes on (``/reset`` when the history outgrows the export).
    On an export with prefill chunks each turn continues from the states the earlier turns kept
    (:meth:`Pipeline.state_cache`) and prefills only its new tokens.
    """
    history: list[dict] = [{"role": "system", "content": system}] if system else []
    states = pipe.state_cache() if pipe.contract.prefill_chunks else None
    pending_images: list[str] = []
    pending: list[dict] = []  # the attached parts, in order
    answered = 0
    if prompt:
        prompt()
    for raw in lines:
        line = raw.rstrip("\n")
        if line.strip() in ("/quit", "/exit"):
            break
        if line.startswith("/image"):
            path = line[len("/image") :].strip()
            if not path:
                err.write(f"error: /image needs a file path\n{HELP}\n")
            else:
                problem = _image_problem(
                    Path(path).expanduser(), history, pending_images, pipe.contract.max_images, pipe.preprocessor.sizing
                )
                if problem:
                    err.write(f"error: {problem}\n")
                else:
                    pending_images.append(str(Path(path).expanduser()))
                    pending.append({"type": "image_url", "image_url": {"url": pending_images[-1]}})
                    err.write(f"[image {len(pending_images)} attached to the next message]\n")
        elif line.startswith("/video"):
            path = line[len("/video") :].strip()
            try:
                if not path:
                    raise ValueError("/video needs a file path")
                probe_video(Path(path).expanduser())
            except (OSError, ValueError) as exc:
                err.write(f"error: {exc}\n{HELP if not path else ''}".rstrip("\n") + "\n")
            else:
                pending.append({"type": "video", "video": str(Path(path).expanduser())})
                err.write(f"[video {sum(p['type'] == 'video' for p in pending)} attached to the next message]\n")
        elif line.strip() == "/reset":
            history, pending_images, pending = history[:1] if system else [], [], []
            err.write("[new conversation]\n")
        elif line.startswith("/"):
            err.write(f"error: unknown command {line.split()[0]!r}; {HELP}\n")
        elif line.strip() or pending:
            content = [*pending, {"type": "text", "text": line}]
            turn = history + [{"role": "user", "content": content}]
            try:
                stream = pipe.stream_chat(
                    turn,
                    max_new_tokens,
                    sampling,
                    (),
                    chat_template_kwargs,
                    max_image_tokens=max_image_tokens,
                    state_cache=states,
                    fps=fps,
                    max_video_tokens=max_video_tokens,
                )
            except (ChatInputError, ValueError, OSError) as exc:
                hint = "; /reset starts a new conversation" if isinstance(exc, PromptTooLongError) and history else ""
                err.write(f"error: {exc}{hint}\n" + ("[attachments dropped]\n" if pending else ""))
                pending_images, pending = [], []
            else:
                pending_images, pending = [], []
                for delta in stream:
                    if delta.reasoning_content:
                        err.write(delta.reasoning_content)
                        err.flush()
                    if delta.content:
                        out.write(delta.content)
                        out.flush()
                out.write("\n")
                out.flush()
                result = stream.result
                cached = f" | {result.generation.cached_tokens} prompt tokens from the kept state" if states else ""
                capacity = pipe.contract.capacity
                left = max(capacity - result.prompt_tokens - result.completion_tokens, 0)
                err.write(
                    f"[{result.finish_reason}] {result.completion_tokens} tokens | "
                    f"{result.generation.timings.summary()}{cached} | {left} of {capacity} tokens left\n"
                )
                history = turn + [{"role": "assistant", "content": result.content}]
                answered += 1
        if prompt:
            prompt()
    return answered


def _image_problem(path: Path, history: list[dict], pending: list[str], max_images: int, sizing) -> str | None:
    """Why the image at ``path`` cannot join the next turn (unreadable, a shape the image processor
    refuses (``sizing``: the export's :class:`~.conversation.processor.ImageSizing`), or one image
    more than the export's ``max_images`` per prompt, whose prompt holds the whole conversation), or
    None."""
    try:
        picture = load_image(path)
        sizing.grid(picture.height, picture.width)  # the processor's limits (aspect ratio)
    except (OSError, ValueError) as exc:
        return str(exc)
    earlier = sum(
        1
        for message in history
        if isinstance(message["content"], list)
        for part in message["content"]
        if part.get("type") == "image_url"
    )
    if earlier + len(pending) >= max_images:
        return (
            f"cannot attach {path}: the export takes at most {max_images} image(s) per prompt and this "
            f"conversation already has {earlier + len(pending)}; /reset starts a new conversation"
        )
    return None
