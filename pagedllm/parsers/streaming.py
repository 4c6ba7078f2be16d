"""One streaming parser over reasoning and tool calls.

The contract: feed each new delta's text (and token ids); get back a
``DeltaMessage`` with new ``reasoning_content``, ``content`` and ``tool_calls``
pieces; ``finish()`` flushes what was held back. Parsing a whole text is the
same code: ``feed(text)`` then ``finish()``.

How any chunking gives the same message: after each feed the format parsers
re-read the whole output so far and report only what can no longer change
(each field only grows by appending); the delta is the difference from what
was already sent. ``finish()`` re-reads in final mode, which decides the held
parts. Reasoning and content are stripped of leading and trailing whitespace
(whitespace is held until text follows it), which keeps both properties.
Re-reading costs O(length) per delta; outputs are short enough for that.
"""

from __future__ import annotations

import logging
import uuid
from typing import Callable

from pagedllm.parsers.delta import DeltaMessage, DeltaToolCall, ParsedMessage, ToolCall
from pagedllm.parsers.reasoning import REASONING_PARSERS, ReasoningParser
from pagedllm.parsers.forced import ForcedCallsParser, ForcedFunctionParser, ForcedInMarkup
from pagedllm.parsers.tools import TOOL_PARSERS, CallState, ToolParser

logger = logging.getLogger(__name__)


def make_tool_call_id() -> str:
    """A fresh tool call id, ``call_`` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


class PrefixViolation(AssertionError):
    """A format parser took back text it had already reported (a bug in that parser)."""


class StreamingParser:
    """Per-request parser of reasoning and tool calls.

    Args:
        reasoning: a reasoning parser, or ``None`` (no reasoning is split off).
        tools: a tool parser, or ``None`` (no tool calls are parsed).
        id_factory: makes tool call ids.
    """

    def __init__(self, reasoning: ReasoningParser | None = None, tools: ToolParser | None = None,
                 id_factory: Callable[[], str] = make_tool_call_id) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.id_factory = id_factory
        self.text = ""
        self._reasoning_sent = ""
        self._content_sent = ""
        self._calls_sent: list[CallState] = []
        self._ids: list[str] = []
        self.finished = False

    def _state(self, final: bool) -> tuple[str, str, list[CallState]]:
        """(reasoning, content, calls) decided for the text so far."""
        reasoning, rest = "", self.text
        if self.reasoning is not None:
            split = self.reasoning.split(self.text, final)
            reasoning, rest = split.reasoning, split.rest
        calls: list[CallState] = []
        content = ""
        if rest is not None:
            if self.tools is not None:
                ts = self.tools.parse(rest, final)
                content, calls = ts.content, ts.calls
            else:
                content = rest
        return _strip(reasoning, final), _strip(content, final), calls

    def _diff(self, final: bool) -> DeltaMessage:
        reasoning, content, calls = self._state(final)
        delta = DeltaMessage(_grow(self._reasoning_sent, reasoning, "reasoning"),
                             _grow(self._content_sent, content, "content"))
        self._reasoning_sent, self._content_sent = reasoning, content
        for i, call in enumerate(calls):
            if i < len(self._calls_sent):
                sent = self._calls_sent[i]
                if call.name != sent.name:
                    raise PrefixViolation(f"tool call {i} renamed from {sent.name!r} to {call.name!r}")
                piece = _grow(sent.arguments, call.arguments, f"tool call {i} arguments")
                if piece:
                    delta.tool_calls.append(DeltaToolCall(i, arguments=piece))
                sent.arguments = call.arguments
            else:
                self._ids.append(self.id_factory())
                delta.tool_calls.append(DeltaToolCall(i, self._ids[i], call.name, call.arguments))
                self._calls_sent.append(CallState(call.name, call.arguments))
        if len(calls) < len(self._calls_sent):
            raise PrefixViolation(f"{len(self._calls_sent)} tool calls sent, now {len(calls)}")
        return delta

    def feed(self, text: str, token_ids: list[int] | None = None) -> DeltaMessage:
        """Add a delta of output text (``token_ids``: its tokens, for parsers keyed on ids).

        Raises:
            RuntimeError: after ``finish()``.
            PrefixViolation: a format parser broke the append-only rule (a bug).
        """
        if self.finished:
            raise RuntimeError("feed() after finish()")
        self.text += text
        return self._diff(final=False)

    def finish(self) -> DeltaMessage:
        """Decide everything held back (the output has ended)."""
        if self.finished:
            return DeltaMessage()
        self.finished = True
        return self._diff(final=True)

    @property
    def message(self) -> ParsedMessage:
        """The message sent so far (the final message once ``finish()`` was called)."""
        calls = [ToolCall(self._ids[i], c.name, c.arguments) for i, c in enumerate(self._calls_sent)]
        return ParsedMessage(self._reasoning_sent or None, self._content_sent or None, calls)


def _strip(text: str, final: bool) -> str:
    # leading whitespace never shows; trailing whitespace waits for text after it
    return text.strip()


def _grow(sent: str, now: str, what: str) -> str:
    if not now.startswith(sent):
        raise PrefixViolation(f"{what}: {sent!r} is not a prefix of {now!r}")
    return now[len(sent):]


def make_parser(reasoning_parser: str | None = None, tool_parser: str | None = None, *,
                thinking: bool = True, starts_in_reasoning: bool = False,
                tools: list[dict] | None = None, forced_function: str | None = None,
                forced_calls: bool = False) -> StreamingParser:
    """Build a ``StreamingParser`` from registry names.

    Args:
        reasoning_parser: a name in ``REASONING_PARSERS`` (``deepseek_r1``, ``qwen3``,
            ``openai_gptoss``) or ``None``.
        tool_parser: a name in ``TOOL_PARSERS`` (``hermes``, ``json``, ``llama3_json``, ``mistral``,
            ``openai``, ``pythonic``) or ``None``. A reasoning parser whose rest is markup
            (``rest_parser``, e.g. ``openai_gptoss``) brings its own content parser when none is
            given, and a forced answer is then read out of that markup first (``ForcedInMarkup``).
        thinking: False when the request turned thinking off.
        starts_in_reasoning: True when the prompt ends inside an open reasoning block.
        tools: the request's tools.
        forced_function: the function a named ``tool_choice`` forces: the answer is its
            arguments (``ForcedFunctionParser``; ``tool_parser`` is then not used).
        forced_calls: ``tool_choice: "required"``: the answer is a JSON array of calls
            (``ForcedCallsParser``; ``tool_parser`` is then not used).
    Raises:
        ValueError: an unknown parser name (the message lists the known ones).
    """
    if reasoning_parser and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {reasoning_parser!r}; known: {sorted(REASONING_PARSERS)}")
    if tool_parser and tool_parser not in TOOL_PARSERS:
        raise ValueError(f"unknown tool parser {tool_parser!r}; known: {sorted(TOOL_PARSERS)}")
    r = REASONING_PARSERS[reasoning_parser](thinking, starts_in_reasoning) if reasoning_parser else None
    t = TOOL_PARSERS[tool_parser](tools) if tool_parser else None
    if forced_function is not None:
        t = ForcedFunctionParser(forced_function)
    elif forced_calls:
        t = ForcedCallsParser(tools)
    markup = r.rest_parser if r is not None else None
    if markup is not None and t is None:
        t = markup(tools)
    elif markup is not None and (forced_function is not None or forced_calls):
        t = ForcedInMarkup(markup(tools), t)
    return StreamingParser(r, t)


def parse_whole(text: str, reasoning_parser: str | None = None, tool_parser: str | None = None,
                **kwargs) -> ParsedMessage:
    """Parse a complete output through the streaming code path (``feed`` then ``finish``)."""
    p = make_parser(reasoning_parser, tool_parser, **kwargs)
    p.feed(text)
    p.finish()
    return p.message
