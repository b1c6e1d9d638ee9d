"""Constrained decoding: a reply that must be a tool call or follow a JSON schema is enforced token
by token with llguidance (Microsoft's grammar engine, also behind llama.cpp's and vLLM's structured
output), which computes the set of tokens that keep the text inside a grammar.

Why llguidance (measured on this project's tokenizer, 1,024 tokens, and on a synthetic
248,000-token byte vocabulary the size of Qwen3.5's, a nested JSON schema, 2 CPU cores):
no torch (xgrammar needs torch and triton), grammars with special tokens, lazy lexemes and
inline JSON schemas (the tool-call format needs them; outlines-core takes one regex), about 1 ms
to compile a grammar where outlines-core builds a 1.5 s index per schema at 248k tokens, and
0.5 ms per token for the mask at 248k tokens (0.02 ms at 1k), against 18-80 ms per decode step.

Grammars (Lark syntax of llguidance, ``docs/syntax.md`` of its repository):

- a JSON answer: ``start: WS answer`` with ``answer: %json {schema}``;
- tool calls: ``<tool_call>\\n<function=NAME>\\n`` then each parameter as
  ``<parameter=P>\\nVALUE\\n</parameter>\\n`` (declared order, required ones mandatory), then
  ``</function>\\n</tool_call>``; one call, or several separated by a newline when parallel
  calls are on. A string value is any text up to the first ``\\n</parameter>`` (a lazy terminal
  that takes the closing tag in; its ``maxLength`` / ``minLength`` kept), a string ``enum`` one
  of its values, any other type JSON of its schema.

What a token means to the grammar (:func:`grammar_tokenizer`): its bytes, read once from the
checkpoint's tokenizer, with the tokenizer's own ``special`` flag deciding which added tokens are
markers the grammar can only name by id. Published Qwen3.5 tokenizers add ``<tool_call>``,
``</tool_call>``, ``<think>`` ... as non-special tokens: to the grammar they are their text, so the
literal ``"<tool_call>\\n"`` is met by the added token or by the same text in ordinary tokens, and the
mask and the matcher agree on them (llguidance's own reading of a Hugging Face tokenizer makes
every added token special, so its mask offered ``</tool_call>`` where the matcher then refused it).
Text the grammar forces is tokenized with special tokens' spellings as plain text, so a forced
token is never a special one.

Reasoning comes first and is not constrained: when the prompt opened a ``<think>`` block the
grammar starts after the model's ``</think>`` token, and :class:`TokenConstraint` forces that token
once the reasoning has used its budget (so a constrained answer always gets room).
"""

from __future__ import annotations

import copy
import json
import threading

import numpy as np

from .messages import ChatInputError
from .tools import ReplyFormat, ToolSpec, schema_types

__all__ = ["GrammarCompiler", "GrammarError", "TokenConstraint", "grammar_tokenizer", "reply_grammar"]

_LEADING = 'WS: /[ \\n]{0,4}/\n'  # blank text a model may write before its answer
MAX_BOUNDED_LENGTH = 4096  # maxLength beyond this is left to the text rule (regex size)


def _json_rule(schema: dict) -> str:
    """``%json {schema}``, compact (no blanks between tokens, llguidance's ``whitespace_flexible``
    off), unless the schema sets its own ``x-guidance`` options."""
    schema = dict(schema)
    schema.setdefault("x-guidance", {"whitespace_flexible": False})
    return f"%json {json.dumps(schema)}"


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _value_rule(schema, rule: str, definitions: dict) -> list[str]:
    """Lark lines defining ``rule`` as one parameter value followed by ``\\n</parameter>`` (see the
    module docstring); ``definitions``: the tool's ``$defs`` / ``definitions``, which a JSON value's
    schema may point to."""
    types = schema_types(schema, definitions)
    schema = schema if isinstance(schema, dict) else {}
    if not types or "string" in types:
        values = schema.get("enum")
        if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
            return [f"{rule}: (" + " | ".join(_literal(v) for v in values) + ') "\\n</parameter>"']
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        bounds = "*?"
        if isinstance(high, int) and high <= MAX_BOUNDED_LENGTH or isinstance(low, int) and low > 0:
            bounds = f"{{{int(low or 0)},{int(high) if isinstance(high, int) else ''}}}?"
        return [f"{rule}[lazy]: /(?s:.{bounds})\\n<\\/parameter>/"]
    return [f'{rule}: {_json_rule({**definitions, **schema})} "\\n</parameter>"']


def _calls_rules(tools: tuple[ToolSpec, ...], parallel: bool) -> list[str]:
    lines = ['calls: call ("\\n" call)*' if parallel else "calls: call"]
    lines.append('call: "<tool_call>\\n" (' + " | ".join(f"fn_{i}" for i in range(len(tools))) + ') "</tool_call>"')
    for i, tool in enumerate(tools):
        properties = tool.parameters.get("properties") or {}
        required = set(tool.parameters.get("required") or ())
        parts = []
        for j, (name, schema) in enumerate(properties.items()):
            rule = f"p_{i}_{j}"
            lines.append(f'{rule}: "<parameter={name}>\\n" v_{i}_{j} "\\n"')
            lines += _value_rule(schema, f"v_{i}_{j}", tool.definitions)
            parts.append(rule if name in required else f"{rule}?")
        lines.append(" ".join([f'fn_{i}: "<function={tool.name}>\\n"', *parts, '"</function>\\n"']))
    return lines


def reply_grammar(reply: ReplyFormat) -> str | None:
    """The Lark grammar (llguidance dialect) a reply must follow, None when it is free text."""
    fields = reply.constrained_fields
    if not fields:
        return None
    lines = ["%llguidance {}"]
    choices = []
    if "tools" in fields:
        choices.append("calls")
        lines += _calls_rules(reply.called_tools(), reply.parallel_tool_calls and reply.tool_choice.mode != "function")
    if reply.json_schema is not None:
        choices.append("answer")
        lines.append(f"answer: {_json_rule(reply.json_schema)}")
    lines.insert(1, f"start: WS ({' | '.join(choices)})")
    lines.append(_LEADING)
    return "\n".join(lines)


class GrammarError(RuntimeError):
    """The grammar engine failed in the middle of a reply (it refused the token its own mask
    allowed, allowed no token, or raised). ``str(error)`` is short and safe to show a client;
    ``details`` holds llguidance's own report (matcher state, grammar text) for the log.

    Args:
        message: what went wrong, in one line.
        details: the engine's report ('' when it gave none).
    """

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


class _TextEncoder:
    """The callable llguidance tokenizes text with (``llguidance.TokenizerWrapper``'s input): a copy
    of the Hugging Face fast tokenizer's backend that reads special tokens' spellings as plain text
    (non-special added tokens are still matched) and does not normalize (the text a grammar forces
    must come back as tokens of exactly its bytes: NFC would turn a decomposed ``e\u0301`` of a
    schema's ``const`` into the precomposed character, a token the matcher refuses), with the token
    bytes and special ids it is paired with."""

    def __init__(self, tokenizer, tokens: list[bytes], special_ids: list[int], eos_token_id: int):
        backend = copy.copy(tokenizer.backend_tokenizer)
        backend.no_padding()
        backend.no_truncation()
        backend.encode_special_tokens = True
        backend.normalizer = None
        self._backend = backend
        self.tokens = tokens
        self.special_token_ids = special_ids
        self.eos_token_id = eos_token_id
        self.bos_token_id = None

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._backend.encode(text, add_special_tokens=False).ids


def grammar_tokenizer(tokenizer, stop_token_ids: tuple[int, ...]):
    """The ``llguidance.LLTokenizer`` of a Hugging Face fast tokenizer, with the tokenizer's own
    ``special`` flags: every token's bytes as llguidance decodes them (byte-level BPE pieces, added
    tokens as their text), special only where ``added_tokens_decoder`` says ``special=True``.

    Args:
        tokenizer: a transformers fast tokenizer (``PreTrainedTokenizerFast``).
        stop_token_ids: ids that end a reply (the grammar allows them once it is complete).

    Returns:
        llguidance.LLTokenizer: ``vocab_size`` = the tokenizer's size with its added tokens.

    Cost: llguidance's own reading of the tokenizer, one ``decode_bytes`` per token, a copy of the
    tokenizer and a second llguidance build: 3.6 s at 248,077 tokens where llguidance's reading
    alone takes 1.8 s (AMD EPYC, 2 cores, 2026-12-05, ``benchmarks/grammar_vocab.json``); once per
    pipeline, on its first constrained request.
    """
    import llguidance
    import llguidance.hf

    stops = [int(i) for i in stop_token_ids] or None
    base = llguidance.hf.from_tokenizer(tokenizer, eos_token=stops)
    tokens = [base.decode_bytes([i]) for i in range(base.vocab_size)]
    special = sorted(int(i) for i, added in tokenizer.added_tokens_decoder.items() if added.special)
    eos = stops[0] if stops else base.eos_token
    encoder = _TextEncoder(tokenizer, tokens, special, eos)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(encoder), n_vocab=base.vocab_size, eos_token=stops or eos)


class TokenConstraint:
    """The tokens a constrained reply may take next, for one generation.

    Args:
        matcher: an ``llguidance.LLMatcher`` of the reply's grammar.
        vocab_size: the llguidance tokenizer's size (the mask's length; logits beyond it are masked).
        think_end: the ``</think>`` token id when the reply starts inside a reasoning block
            (the grammar starts after it), else None.
        reasoning_budget: tokens of reasoning after which ``</think>`` is forced.
        stop_token_ids: ids that end a reply, refused during the reasoning (the answer must come).
    """

    def __init__(
        self,
        matcher,
        vocab_size: int,
        think_end: int | None = None,
        reasoning_budget: int | None = None,
        stop_token_ids: tuple[int, ...] = (),
    ):
        import llguidance.numpy as llg_numpy

        self._llg_numpy = llg_numpy
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.think_end = think_end
        self.reasoning_budget = reasoning_budget
        self.reasoning_tokens = 0
        self.stop_token_ids = [int(i) for i in stop_token_ids]
        self._bitmask = llg_numpy.allocate_token_bitmask(1, vocab_size)
        self._allowed: np.ndarray | None = None  # the last mask's allowed tokens [V] bool, until accepted

    @property
    def in_reasoning(self) -> bool:
        return self.think_end is not None

    def forced(self) -> int | None:
        """A token that must come next regardless of the logits (``</think>`` at the budget)."""
        if self.in_reasoning and self.reasoning_budget is not None and self.reasoning_tokens >= self.reasoning_budget:
            return self.think_end
        return None

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` ``[V]`` (a new array) with the tokens the grammar forbids set to -inf; during
        the reasoning only the end-of-reply tokens.

        Raises:
            GrammarError: the grammar allows no token, or llguidance failed (its report in ``details``).
        """
        if self.in_reasoning:
            logits = np.array(logits).reshape(-1)
            logits[[i for i in self.stop_token_ids if i < logits.shape[0]]] = -np.inf
            return logits
        try:
            self._llg_numpy.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        except Exception as exc:  # noqa: BLE001 - any engine failure ends the reply with a GrammarError
            raise GrammarError("the grammar engine failed computing the next tokens", repr(exc)) from exc
        allowed = np.unpackbits(self._bitmask[0].view(np.uint8), bitorder="little")
        logits = np.asarray(logits).reshape(-1)
        keep = np.zeros(logits.shape[0], dtype=bool)
        n = min(keep.shape[0], self.vocab_size)
        keep[:n] = allowed[:n].astype(bool)
        if not keep.any() or self.matcher.is_error():
            raise GrammarError("the reply's grammar allows no next token", self.matcher.get_error() or "dead end")
        self._allowed = keep
        return np.where(keep, logits, np.float32(-np.inf)).astype(logits.dtype, copy=False)

    def accept(self, token: int) -> None:
        """Advance past ``token`` (the one sampled from :meth:`mask`'s logits or :meth:`forced`).

        Raises:
            GrammarError: the grammar refused the token (for a masked choice: the engine disagrees
                with its own mask), or llguidance failed; its report in ``details``.
        """
        if self.in_reasoning:
            self.reasoning_tokens += 1
            if token == self.think_end:
                self.think_end = None
            return
        try:
            taken = self.matcher.consume_token(int(token))
        except Exception as exc:  # noqa: BLE001
            raise GrammarError(f"the grammar engine failed at token {token}", repr(exc)) from exc
        if not taken:
            offered = self._allowed is not None and token < self._allowed.shape[0] and self._allowed[token]
            what = "the token its own mask allowed" if offered else "a token outside its mask"
            raise GrammarError(f"the reply's grammar refused token {token} ({what})", self.matcher.get_error())
        self._allowed = None


class GrammarCompiler:
    """Grammars over one tokenizer: the llguidance tokenizer (:func:`grammar_tokenizer`) is built on
    first use and shared by every request.

    Args:
        tokenizer: a transformers fast tokenizer.
        stop_token_ids: ids that end a reply (the grammar allows them once it is complete).
        lock: held while the tokenizer is read (it is shared with the other preparation threads).
    """

    def __init__(self, tokenizer, stop_token_ids: tuple[int, ...], lock: threading.Lock | None = None):
        self._tokenizer = tokenizer
        self._stops = [int(i) for i in stop_token_ids]
        self._lock = lock or threading.Lock()
        self._llg_tokenizer = None

    @property
    def llg_tokenizer(self):
        if self._llg_tokenizer is None:
            with self._lock:
                if self._llg_tokenizer is None:  # another thread may have built it while this one waited
                    self._llg_tokenizer = grammar_tokenizer(self._tokenizer, tuple(self._stops))
        return self._llg_tokenizer

    def check(self, reply: ReplyFormat) -> None:
        """Compile ``reply``'s grammar to check it, before any graph runs (free text: nothing to do).

        Raises:
            ChatInputError: llguidance cannot compile it (e.g. a schema feature it lacks), named.
        """
        grammar = reply_grammar(reply)
        if grammar is not None:
            import llguidance

            self._refuse(reply, llguidance.LLMatcher.validate_grammar(grammar, self.llg_tokenizer))

    def _refuse(self, reply: ReplyFormat, error: str) -> None:
        """Raise the :class:`ChatInputError` for llguidance's ``error`` (none when empty), naming
        ``response_format`` when its schema alone fails to compile, else ``tools``."""
        if not error:
            return
        import llguidance

        param = "tools"
        if reply.json_schema is not None:
            alone = reply_grammar(ReplyFormat(json_schema=reply.json_schema))
            if llguidance.LLMatcher.validate_grammar(alone, self.llg_tokenizer):
                param = "response_format"
        raise ChatInputError(f"{param} cannot be enforced: {error.strip()[:400]}", param)

    def constraint(
        self, reply: ReplyFormat, think_end: int | None = None, reasoning_budget: int | None = None
    ) -> TokenConstraint | None:
        """A fresh :class:`TokenConstraint` for one reply (None: free text).

        Raises:
            ChatInputError: see :meth:`check`.
        """
        grammar = reply_grammar(reply)
        if grammar is None:
            return None
        import llguidance

        matcher = llguidance.LLMatcher(self.llg_tokenizer, grammar, log_level=0)
        self._refuse(reply, matcher.get_error() if matcher.is_error() else "")
        return TokenConstraint(matcher, self.llg_tokenizer.vocab_size, think_end, reasoning_budget, self._stops)
