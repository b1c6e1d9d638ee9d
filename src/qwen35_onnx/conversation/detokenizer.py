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
    ``decode_token``). Special tokens are skipped.

    Usage::

        streamer = TextStreamer(tokenizer)
        for token_id in generated:
            print(streamer.put(token_id), end="", flush=True)
        print(streamer.end())
    """

    def __init__(self, tokenizer, lock: threading.RLock | None = None) -> None:
        self.tokenizer = tokenizer
        self._lock = lock or threading.RLock()
        self.ids: list[int] = []
        self._prefix_offset = 0  # window start: ids before it are fully emitted
        self._read_offset = 0  # ids before it are emitted (the window's prefix part)

    def _decode(self, ids: list[int]) -> str:
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
