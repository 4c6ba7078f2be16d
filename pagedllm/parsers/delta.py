"""The messages the streaming parser produces: per-delta pieces and the final message.

Field names follow the OpenAI Chat Completions API (``delta.content``,
``delta.tool_calls[i].function.arguments``) plus ``reasoning_content`` as
vLLM and DeepSeek's API name it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DeltaToolCall:
    """One tool call's piece in a delta.

    Attributes:
        index: the call's position in the message (0, 1, ...).
        id: set only on the call's first delta.
        name: the function name, set only on the call's first delta.
        arguments: new text of the arguments JSON (may be empty).
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_dict(self) -> dict:
        """The OpenAI ``delta.tool_calls[i]`` object."""
        d: dict = {"index": self.index}
        if self.id is not None:
            d["id"] = self.id
            d["type"] = "function"
            d["function"] = {"name": self.name, "arguments": self.arguments}
        else:
            d["function"] = {"arguments": self.arguments}
        return d


@dataclass
class DeltaMessage:
    """What one fed delta (or ``finish()``) adds to the message.

    Attributes:
        reasoning_content: new reasoning text ("" when none).
        content: new answer text ("" when none).
        tool_calls: new tool calls and argument pieces.
    """

    reasoning_content: str = ""
    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning_content or self.content or self.tool_calls)


@dataclass
class ToolCall:
    """A complete (or, at ``max_tokens``, truncated) tool call.

    Attributes:
        id: unique id such as ``call_3f2a...``.
        name: function name.
        arguments: the arguments as JSON text, exactly the concatenation of the streamed pieces.
    """

    id: str
    name: str
    arguments: str

    def to_dict(self) -> dict:
        """The OpenAI ``message.tool_calls[i]`` object."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedMessage:
    """The whole message: the same code path as streaming, after ``finish()``.

    Attributes:
        reasoning_content: reasoning text, or ``None`` when there was none.
        content: answer text, or ``None`` when empty (a message of only tool calls).
        tool_calls: the calls in order.
    """

    reasoning_content: str | None
    content: str | None
    tool_calls: list[ToolCall]
