"""The parser of a chat answer whose ``tool_choice`` named one function (structured outputs make
the whole answer that function's arguments)."""

from __future__ import annotations

from pagedllm.parsers.tools import CallState, ToolParser, ToolSplit


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
