"""gpt-oss's "harmony" output: reasoning on the ``analysis`` channel, answers on ``final``, calls by recipient.

Follows OpenAI's harmony response format guide (openai-cookbook ``articles/openai-harmony.md``;
the ``openai-harmony`` crate's ``docs/format.md``). A message is
``<|start|>{header}<|message|>{body}`` ended by ``<|end|>``, ``<|call|>`` or ``<|return|>``; the
header is a role, then ``<|channel|>`` and a channel name, with a recipient ``to=NAME`` after the
role or after the channel, and a content type (``json`` or ``<|constrain|>json``). The generation
prompt ends in ``<|start|>assistant``, so the output's first message starts at its header
(``<|channel|>analysis<|message|>...``). The engine drops the final EOS token (``<|return|>`` or
``<|call|>``), and ``max_tokens`` may cut a message anywhere, so a message need not be closed.

What each message is (``message_kind``): an assistant message whose recipient is
``functions.NAME`` is a call of NAME (its body the arguments), on any channel; otherwise the
``analysis`` channel is reasoning, and ``final``, recipient-less ``commentary`` (a preamble shown
to the user) or no channel at all are content. Anything else (another role, a built-in tool's
recipient outside ``analysis``, an unknown channel) is dropped. Text before any header (an output
without harmony markup, e.g. a constrained answer with thinking off) is content.

The markers are special tokens of gpt-oss's tokenizer: the server keeps them in the text for
these parsers (``needs_special_tokens``). vLLM's names: ``--reasoning-parser openai_gptoss``,
``--tool-call-parser openai``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.parsers.reasoning import ReasoningParser, ReasoningSplit, register_reasoning_parser
from pagedllm.parsers.tools import CallState, ToolParser, ToolSplit, register_tool_parser

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
_CLOSE = (END, RETURN, CALL)  # end a body and are consumed with it
_BREAK = (START, CHANNEL)  # end a body unconsumed: the next message's header starts there
_OPEN = (START, CHANNEL, MESSAGE, CONSTRAIN, " to=")  # what a header may start with
_FUNCTIONS = "functions."


@dataclass
class HarmonyMessage:
    """One message read from the output.

    Attributes:
        role: the author (``assistant`` when the header has no ``<|start|>``: the prompt gave it).
        channel: ``analysis``, ``commentary``, ``final``..., or ``None`` when the header names none.
        recipient: the ``to=`` target (``functions.get_weather``), or ``None``.
        constrain: the content type (``json``), or ``None``.
        body: the text after ``<|message|>`` (so far, in partial mode).
        terminated: True once its ``<|end|>`` / ``<|call|>`` / ``<|return|>`` (or the next
            message's header) was seen.
        start, end: its span in the text (``end`` is after its closing marker when it has one).
    """

    role: str
    channel: str | None
    recipient: str | None
    constrain: str | None
    body: str
    terminated: bool
    start: int
    end: int

    def markup(self) -> str:
        """The message written out in canonical harmony (``<|start|>role<|channel|>ch to=R
        <|constrain|>T<|message|>body``, then ``<|end|>`` when terminated): ``read_messages`` of
        it gives this message back, whatever text surrounded it."""
        head = self.role + (CHANNEL + self.channel if self.channel is not None else "")
        head += f" to={self.recipient}" if self.recipient is not None else ""
        head += f" {CONSTRAIN}{self.constrain}" if self.constrain is not None else ""
        return START + head + MESSAGE + self.body + (END if self.terminated else "")


def _first(text: str, markers: tuple[str, ...], start: int, stop: int | None = None) -> tuple[int, str]:
    """The earliest of ``markers`` in ``text[start:stop]``: ``(index, marker)``, or ``(-1, "")``."""
    best, which = -1, ""
    for mk in markers:
        i = text.find(mk, start, len(text) if stop is None else stop)
        if i != -1 and (best == -1 or i < best):
            best, which = i, mk
    return best, which


def _held(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``markers``."""
    for k in range(min(max(map(len, markers)) - 1, len(text)), 0, -1):
        if any(mk.startswith(text[-k:]) and len(mk) > k for mk in markers):
            return k
    return 0


def parse_header(raw: str, role: str | None) -> tuple[str, str | None, str | None, str | None]:
    """Read a header (the text between ``<|start|>``, or the output's start, and ``<|message|>``).

    Args:
        raw: the header text, e.g. ``assistant to=functions.f<|channel|>commentary <|constrain|>json``.
        role: the role when the prompt gave it (no ``<|start|>``), else ``None`` (the header's first word).
    Returns:
        ``(role, channel, recipient, constrain)``; missing parts are ``None`` (role ``""``). Raises nothing.
    """
    channel = recipient = ctype = None
    before, _, after = raw.partition(CHANNEL)
    for part, is_channel in ((before, False), (after, True)):
        for tok in part.replace(CONSTRAIN, " " + CONSTRAIN).split():
            if tok.startswith("to="):
                recipient = tok[3:] or recipient
            elif tok.startswith(CONSTRAIN):
                ctype = tok[len(CONSTRAIN):] or ctype
            elif is_channel and channel is None:
                channel = tok
            elif not is_channel and role is None:
                role = tok
            elif ctype is None:
                ctype = tok
    return role or "", channel, recipient, ctype


def _read_body(text: str, b: int, final: bool) -> tuple[str, bool, int]:
    """The body from ``text[b]`` on: ``(body, terminated, next position)``. Partial mode holds back a
    suffix that may still become a marker; final mode keeps it (a cut body is text)."""
    t, mk = _first(text, _CLOSE + _BREAK, b)
    if t != -1:
        return text[b:t], True, t + len(mk) if mk in _CLOSE else t
    end = len(text) if final else len(text) - _held(text[b:], _CLOSE + _BREAK)
    return text[b:end], False, len(text)


def read_messages(text: str, final: bool) -> list[HarmonyMessage]:
    """Split ``text`` (all output so far) into harmony messages.

    In partial mode a message appears once its header is complete (up to ``<|message|>``) and its
    body excludes a suffix that may still be a marker (``<|en`` ...), so every later reading extends
    this one. In final mode a message cut inside its header is dropped and a cut body is kept.
    A header broken by ``<|end|>`` / ``<|start|>``... before its ``<|message|>`` is skipped.

    Returns:
        The messages in order. Raises nothing: any text is a valid output.
    """
    out: list[HarmonyMessage] = []
    pos = 0
    while pos < len(text):
        rest = text[pos:]
        if rest.startswith(START):
            h, role = pos + len(START), None
        elif rest.startswith(_OPEN[1:]):
            h, role = pos, "assistant"
        elif any(o.startswith(rest) for o in _OPEN) and (not final or rest.startswith("<|")):
            return out  # a header may be starting (a marker cut by max_tokens: dropped)
        else:  # text before any header: a body without one
            body, done, nxt = _read_body(text, pos, final)
            out.append(HarmonyMessage("assistant", None, None, None, body, done, pos, nxt))
            pos = nxt
            continue
        m = text.find(MESSAGE, h)
        brk, mk = _first(text, _CLOSE + (START,), h, None if m == -1 else m)
        if brk != -1:  # a broken header: its message is dropped
            pos = brk + len(mk) if mk in _CLOSE else brk
            continue
        if m == -1:
            return out  # the header is still arriving (or was cut)
        role, channel, recipient, ctype = parse_header(text[h:m], role)
        body, done, nxt = _read_body(text, m + len(MESSAGE), final)
        out.append(HarmonyMessage(role, channel, recipient, ctype, body, done, pos, nxt))
        pos = nxt
    return out


def message_kind(m: HarmonyMessage) -> str | None:
    """What ``m`` is: ``"call"``, ``"reasoning"``, ``"content"``, or ``None`` (dropped); see the module
    docstring. Raises nothing."""
    if m.role != "assistant":
        return None
    if m.recipient is not None and m.recipient.startswith(_FUNCTIONS) and len(m.recipient) > len(_FUNCTIONS):
        return "call"
    if m.channel == "analysis":
        return "reasoning"
    if m.recipient is None and m.channel in (None, "final", "commentary"):
        return "content"
    return None


def _join(parts: list[str]) -> str:
    """Bodies stripped and joined by newlines, empty ones left out (append-only as bodies grow)."""
    return "\n".join(p for p in (s.strip() for s in parts) if p)


@register_tool_parser("openai")
class HarmonyToolParser(ToolParser):
    """gpt-oss's calls: a message to ``functions.NAME`` is a call of NAME whose arguments are its body
    (growing as it streams; whitespace at either end waits); ``final`` and recipient-less
    ``commentary`` bodies are the content, joined by newlines; ``analysis`` messages (which the
    ``openai_gptoss`` reasoning parser takes out first) are neither. Follows the harmony guide's
    "Receiving tool calls" and "Preambles".
    """

    needs_special_tokens = True
    #: False for ``HarmonyContentParser``: calls are dropped
    keeps_calls = True

    def parse(self, text: str, final: bool) -> ToolSplit:
        """Content and calls of ``text`` (harmony markup); see ``ToolParser.parse``. Raises nothing."""
        content: list[str] = []
        calls: list[CallState] = []
        for m in read_messages(text, final):
            kind = message_kind(m)
            if kind == "content":
                content.append(m.body)
            elif kind == "call" and self.keeps_calls:
                calls.append(CallState(m.recipient[len(_FUNCTIONS):], m.body.strip()))
        return ToolSplit(_join(content), calls)


class HarmonyContentParser(HarmonyToolParser):
    """The content of harmony markup for a request without a tool parser (no tools, or
    ``tool_choice: "none"``): the ``final`` and preamble text, clean of markup. A function-call
    message is dropped whole (its body is neither content nor, without tools, a call). Not a
    ``--tool-call-parser``: ``make_parser`` puts it after ``openai_gptoss`` (its ``rest_parser``)."""

    keeps_calls = False


@register_reasoning_parser("openai_gptoss")
class GptOssReasoningParser(ReasoningParser):
    """gpt-oss's reasoning: the ``analysis`` channel's bodies, joined by newlines when there are
    several (they may interleave with preambles and calls).

    ``rest`` is the markup of every other message (``HarmonyMessage.markup``: re-read alone it gives
    the same messages, which a cut-out slice of the text need not), for the ``openai`` tool parser
    (or, without one, ``rest_parser``). ``thinking`` and
    ``starts_in_reasoning`` change nothing: the channels say what each part is (gpt-oss cannot
    turn its analysis off; its length follows ``reasoning_effort``), and a thinking-off output
    without markup is all content anyway. ``end_tag`` is where an answer starts, for structured
    outputs: the final channel's header (without the ``<|start|>assistant`` before it, which the
    prompt holds when the final message is the first).
    """

    start_tag = CHANNEL + "analysis" + MESSAGE
    end_tag = CHANNEL + "final" + MESSAGE
    needs_special_tokens = True
    rest_parser = HarmonyContentParser

    def split(self, text: str, final: bool) -> ReasoningSplit:
        """Reasoning and the rest's markup of ``text`` (all output so far). Raises nothing."""
        reasoning: list[str] = []
        rest: list[str] = []
        for m in read_messages(text, final):
            kind = message_kind(m)
            if kind == "reasoning":
                reasoning.append(m.body)
            elif kind is not None:
                rest.append(m.markup())
        return ReasoningSplit(_join(reasoning), "".join(rest))
