"""A chat reply's text split as it streams: content, reasoning (a ``<think>`` block) and tool
calls.

``ReplySyntax`` is what a model's tokenizer says of its replies: its thinking markers (mlx-lm
infers them from the vocabulary) and, where its chat template renders tools, its tool-call
markers and parser (mlx-lm's ``tool_parsers``). ``ReplySplitter`` reads one reply's text
deltas and hands out :class:`Content`, :class:`Reasoning` and :class:`Called` pieces; text that
may be the start of a marker is held until the next delta says. A call that does not parse is
handed out as content, so that nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .tools import CALL_END, CALL_START, Tool, ToolCall, ToolChoice, parse_generic_call

logger = logging.getLogger(__name__)

Parser = Callable[[str, Any], Any]


@dataclass(frozen=True, slots=True)
class Content:
    text: str


@dataclass(frozen=True, slots=True)
class Reasoning:
    text: str


@dataclass(frozen=True, slots=True)
class Called:
    call: ToolCall
    index: int  # among the reply's calls, from 0 (OpenAI's ``tool_calls[].index``)


Piece = Content | Reasoning | Called


@dataclass(frozen=True)
class ReplySyntax:
    """``think``: the thinking block's start and end text, and ``think_ids`` their token ids;
    ``native_calls``: the model's own tool-call markers and ``native_parser`` its parser (None
    where its chat template has no tools: the generic format is used)."""

    think: tuple[str, str] | None = None
    think_ids: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    native_calls: tuple[str, str] | None = None
    native_parser: Parser | None = None

    @classmethod
    def of(cls, tokenizer: Any) -> ReplySyntax:
        """From an mlx-lm ``TokenizerWrapper``."""
        think = think_ids = native_calls = None
        if getattr(tokenizer, "has_thinking", False):
            think = (tokenizer.think_start, tokenizer.think_end)
            think_ids = (tuple(tokenizer.think_start_tokens), tuple(tokenizer.think_end_tokens))
        native = getattr(tokenizer, "has_tool_calling", False) and tokenizer.has_chat_template
        if native:
            native_calls = (tokenizer.tool_call_start, tokenizer.tool_call_end)
        parser = tokenizer.tool_parser if native else None
        return cls(think, think_ids, native_calls, parser)

    def opens_thinking(self, prompt_tokens: Sequence[int]) -> bool:
        """Whether the prompt ends inside a thinking block (templates that open it for the
        model), so that the reply starts as reasoning."""
        if self.think_ids is None:
            return False
        start, end = self.think_ids
        return _rfind(prompt_tokens, start) > _rfind(prompt_tokens, end)

    def splitter(
        self,
        prompt_tokens: Sequence[int] = (),
        tools: Sequence[Tool] = (),
        choice: ToolChoice | None = None,
    ) -> ReplySplitter:
        """A splitter for one reply to a prompt that offered ``tools`` with ``choice``: calls
        are parsed in the model's format, or in the generic one where it has none or the call
        was forced (``tool_choice`` ``required`` or a function: the grammar writes it)."""
        choice = choice or ToolChoice()
        markers: tuple[str, str] | None = None
        parse: Parser = parse_generic_call
        if tools and choice.mode != "none":
            markers = (CALL_START, CALL_END)
            if self.native_calls is not None and not choice.forces_call:
                markers = self.native_calls
                parse = self.native_parser or parse_generic_call
        return ReplySplitter(
            think=self.think,
            thinking=self.opens_thinking(prompt_tokens),
            calls=markers,
            parse=parse,
            tools=[t.openai() for t in tools],
        )


def _rfind(tokens: Sequence[int], sequence: tuple[int, ...]) -> int:
    n = len(sequence)
    for i in range(len(tokens) - n, -1, -1):
        if tuple(tokens[i : i + n]) == sequence:
            return i
    return -1


State = Literal["content", "reasoning", "call"]


class ReplySplitter:
    """One reply's text in, its pieces out (see the module docstring). Whitespace at the end of
    content is held until more content comes, so that content is never only whitespace and
    the pieces do not depend on how the deltas were cut; before a call, after a thinking block
    and after the last call it is dropped."""

    def __init__(
        self,
        *,
        think: tuple[str, str] | None = None,
        thinking: bool = False,
        calls: tuple[str, str] | None = None,
        parse: Parser = parse_generic_call,
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        self._think = think
        self._calls = calls
        self._parse = parse
        self._tools = tools or []
        self._state: State = "reasoning" if thinking and think is not None else "content"
        self._pending = ""
        self._strip_leading = False  # just after a thinking block
        self._gap = ""  # the whitespace before a call's marker
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[Piece]:
        self._pending += text
        pieces: list[Piece] = []
        while self._step(pieces):
            pass
        return pieces

    def finish(self) -> list[Piece]:
        """The pieces left once the reply has ended."""
        pieces: list[Piece] = []
        pending, self._pending = self._pending, ""
        match self._state:
            case "reasoning" if pending:
                pieces.append(Reasoning(pending))
            case "call":
                assert self._calls is not None
                pieces.extend(self._called(pending, (self._calls[0], "")))
            case "content":
                if self._strip_leading:
                    pending = pending.lstrip()
                if pending.strip() or (pending and not self.calls):
                    pieces.append(Content(pending))
        return pieces

    def _step(self, pieces: list[Piece]) -> bool:
        """Hand out what the pending text settles; whether a marker was passed (so that the
        rest may settle more)."""
        pending = self._pending
        if self._state == "call":
            assert self._calls is not None
            end = self._calls[1]
            at = pending.find(end) if end else -1
            if at < 0:
                return False
            self._pending = pending[at + len(end) :]
            self._state = "content"
            pieces.extend(self._called(pending[:at], self._calls))
            return True
        if self._state == "reasoning":
            assert self._think is not None
            at = pending.find(self._think[1])
            if at < 0:
                kept = _held(pending, (self._think[1],))
                if len(pending) > kept:
                    pieces.append(Reasoning(pending[: len(pending) - kept]))
                    self._pending = pending[len(pending) - kept :]
                return False
            if at:
                pieces.append(Reasoning(pending[:at]))
            self._pending = pending[at + len(self._think[1]) :]
            self._state = "content"
            self._strip_leading = True
            return True
        starts = [m for m in (self._think and self._think[0], self._calls and self._calls[0]) if m]
        found = [(pending.find(m), m) for m in starts if m in pending]
        if not found:
            settled = pending[: len(pending) - _held(pending, starts)].rstrip()
            self._content(settled, pieces)
            self._pending = pending[len(settled) :]
            return False
        at, marker = min(found)
        before = pending[:at].rstrip()
        self._content(before, pieces)
        self._gap = pending[len(before) : at]  # given back if the call does not parse
        self._pending = pending[at + len(marker) :]
        self._state = "reasoning" if self._think and marker == self._think[0] else "call"
        return True

    def _content(self, text: str, pieces: list[Piece]) -> None:
        if self._strip_leading:
            text = text.lstrip()
        if text:
            pieces.append(Content(text))
            self._strip_leading = False

    def _called(self, text: str, markers: tuple[str, str]) -> list[Piece]:
        """The calls ``text`` (between the markers) makes; itself as content if it makes none."""
        try:
            parsed = self._parse(text, self._tools)
            calls = [_tool_call(c) for c in (parsed if isinstance(parsed, list) else [parsed])]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            logger.info("a tool call did not parse (%s); kept as content", exc)
            return [Content(self._gap + markers[0] + text + markers[1])]
        first = len(self.calls)
        self.calls.extend(calls)
        return [Called(c, first + i) for i, c in enumerate(calls)]


def _tool_call(parsed: Any) -> ToolCall:
    """A parser's ``{"name", "arguments"}`` (arguments a value or JSON text) as a call."""
    arguments = parsed["arguments"]
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(str(parsed["name"]), arguments, str(parsed.get("id") or ""))


def _held(text: str, markers: Sequence[str]) -> int:
    """How many characters at the end of ``text`` may be the start of one of ``markers``."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-n:]):
                longest = n
                break
    return longest
