"""``qwen35-onnx chat``: an interactive multi-turn conversation in the terminal (a thin loop over
:meth:`Pipeline.stream_chat`).

Each line is a user turn; ``/image PATH`` attaches an image to the next turn (repeatable, up to
the export's ``max_images`` per prompt in total), ``/reset`` starts a new conversation,
``/quit`` (or end of input) leaves. The reply's content streams to stdout, its reasoning (if the
chat template turns thinking on) to stderr.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TextIO

from .conversation.messages import ChatInputError
from .pipeline import Pipeline
from .runtime.sampling import SamplingConfig

HELP = "commands: /image PATH (attach to the next message), /reset, /quit"


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
) -> int:
    """Run the conversation over input ``lines``; returns the number of answered turns.

    A turn whose input is refused (unreadable image, too many images, prompt over the capacity)
    prints one ``error: ...`` line to ``err`` and is dropped from the history with its attached
    images, so the conversation goes on (``/reset`` when the history outgrows the capacity).
    """
    history: list[dict] = [{"role": "system", "content": system}] if system else []
    pending_images: list[str] = []
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
            elif not Path(path).expanduser().is_file():
                err.write(f"error: no image file at {path}\n")
            else:
                pending_images.append(str(Path(path).expanduser()))
                err.write(f"[image {len(pending_images)} attached to the next message]\n")
        elif line.strip() == "/reset":
            history, pending_images = history[:1] if system else [], []
            err.write("[new conversation]\n")
        elif line.startswith("/"):
            err.write(f"error: unknown command {line.split()[0]!r}; {HELP}\n")
        elif line.strip() or pending_images:
            content = [{"type": "image_url", "image_url": {"url": p}} for p in pending_images]
            content.append({"type": "text", "text": line})
            turn = history + [{"role": "user", "content": content}]
            try:
                stream = pipe.stream_chat(turn, max_new_tokens, sampling, (), chat_template_kwargs)
            except (ChatInputError, ValueError, OSError) as exc:
                err.write(f"error: {exc}\n" + ("[attached images dropped]\n" if pending_images else ""))
                pending_images = []
            else:
                pending_images = []
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
                err.write(
                    f"[{result.finish_reason}] {result.completion_tokens} tokens | "
                    f"{result.generation.timings.summary()}\n"
                )
                history = turn + [{"role": "assistant", "content": result.content}]
                answered += 1
        if prompt:
            prompt()
    return answered
