"""The parsers of a chat answer whose ``tool_choice`` forces calls, so that structured outputs make
the whole answer the calls: one named function's arguments, or (``"required"``) a JSON array of
``{"name", "parameters"}`` objects."""

from __future__ import annotations

from pagedllm.parsers.json_scan import skip_ws
from pagedllm.parsers.tools import CallState, ToolParser, ToolSplit, _json_calls_from


class ForcedFunctionParser(ToolParser):
    """The answer of a request whose ``tool_choice`` named one function: the whole answer is
    that function's arguments (a JSON object, which structured outputs guarantee).

    Not a ``--tool-call-parser`` format: the chat server picks it for a named ``tool_choice``.
    The call appears at once, with its name; its arguments grow as the text does
    (whitespace at either end waits, so the pieces always join to the final arguments).

    Args:
        name: the forced function's name.
    """

    keeps_finish_reason = True  # OpenAI answers a forced function with finish_reason "stop"

    def __init__(self, name: str) -> None:
        super().__init__()
        self.function_name = name

    def parse(self, text: str, final: bool) -> ToolSplit:
        """The one call, with the arguments so far; see ``ToolParser.parse``."""
        return ToolSplit("", [CallState(self.function_name, text.strip())])


class ForcedCallsParser(ToolParser):
    """The answer of a request with ``tool_choice: "required"`` (or Anthropic's ``any``): a JSON
    array of ``{"name": ..., "parameters": {...}}`` objects, which structured outputs guarantee
    (``server/structured.py``, vLLM's form).

    None of it is ever content, even cut short by ``max_tokens``: a call whose name is complete is
    returned with the arguments written so far (an incomplete call, as OpenAI returns one cut off,
    with ``finish_reason: "length"``); before any name is complete there is no call yet. Not a
    ``--tool-call-parser`` format: the chat server picks it for ``required``.
    """

    def parse(self, text: str, final: bool) -> ToolSplit:
        """The calls so far, never content; see ``ToolParser.parse``."""
        i = skip_ws(text, 0)
        if i == len(text) or text[i] != "[":
            return ToolSplit()
        j = skip_ws(text, i + 1)
        if j == len(text) or text[j] != "{":
            return ToolSplit()
        calls, _ = _json_calls_from(text, j, [], ",", "]", final)
        return ToolSplit("", calls)


class ForcedInMarkup(ToolParser):
    """A forced answer written inside a format's markup (gpt-oss's harmony messages, where structured
    outputs constrain the ``final`` body): ``markup`` (the reasoning parser's ``rest_parser``) reads
    the content out of the markup, and ``forced`` parses that content as it would a bare answer.
    Both are append-only, so this is too.

    Args:
        markup: the parser of the markup (its calls are not used).
        forced: a ``ForcedFunctionParser`` or ``ForcedCallsParser``.
    """

    def __init__(self, markup: ToolParser, forced: ToolParser) -> None:
        super().__init__()
        self.markup, self.forced = markup, forced
        self.keeps_finish_reason = getattr(forced, "keeps_finish_reason", False)

    def parse(self, text: str, final: bool) -> ToolSplit:
        """``forced``'s split of the content of ``text``; see ``ToolParser.parse``."""
        return self.forced.parse(self.markup.parse(text, final).content, final)
