"""Incremental detokenization for streamed output (no torch).

Source: text-generation-inference's ``decode_token`` and transformers' ``TextStreamer``
(generation/streamers.py).
"""

from __future__ import annotations

import threading

__all__ = ["TextStreamer"]


class TextStreamer:
    """Incremental detokenizer: token ids in, newly printable text out.

    Byte-level BPE splits multi-byte UTF-8 characters across tokens; decoding such a
    prefix ends in U+FFFD. The streamer decodes a short window of recent ids and
    emits only text past what was already emitted, holding back while the decoded
    text ends in U+FFFD. The window (``prefix_offset`` .. end) makes each step O(1)
    instead of re-decoding the whole output (text-generation-inference's
    ``decode_token``). Special tokens are skipped, except ``keep``: token ids whose text the reply
    needs whatever their ``special`` flag (the reasoning markers ``<think>`` / ``</think>``, which the
    chat API splits the reply at: a tokenizer may mark them special, and a skipped marker would leave
    the whole reply as reasoning). Their text is their token's content, decoded alone.

    Usage::

        streamer = TextStreamer(tokenizer)
        for token_id in generated:
            print(streamer.put(token_id), end="", flush=True)
        print(streamer.end())
    """

    def __init__(self, tokenizer, lock: threading.RLock | None = None, keep: tuple[int, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self._lock = lock or threading.RLock()
        with self._lock:
            self._kept = {int(i): tokenizer.decode([int(i)], skip_special_tokens=False) for i in keep}
        self.ids: list[int] = []
        self._prefix_offset = 0  # window start: ids before it are fully emitted
        self._read_offset = 0  # ids before it are emitted (the window's prefix part)

    def _decode(self, ids: list[int]) -> str:
        if not self._kept or not any(i in self._kept for i in ids):
            return self._decode_run(ids)
        parts, run = [], []
        for i in ids:  # a kept token splits the ids: byte-level pieces never span an added token
            if i in self._kept:
                parts += [self._decode_run(run), self._kept[i]]
                run = []
            else:
                run.append(i)
        parts.append(self._decode_run(run))
        return "".join(parts)

    def _decode_run(self, ids: list[int]) -> str:
        if not ids:
            return ""
        with self._lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def put(self, token_id: int) -> str:
        """Add one token id; return the text it completes ("" while a character is split)."""
        self.ids.append(int(token_id))
        prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""

    def end(self) -> str:
        """Return whatever is still held back (possibly ending in U+FFFD) and reset."""
        prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.ids[self._prefix_offset :])
        self.ids, self._prefix_offset, self._read_offset = [], 0, 0
        return full[len(prefix) :]
