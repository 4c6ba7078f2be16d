"""Reasoning and tool-call parsing of model output, streamed or whole, through one ``StreamingParser``."""

from pagedllm.parsers import harmony  # noqa: F401  (registers openai_gptoss and openai)
from pagedllm.parsers.delta import DeltaMessage, DeltaToolCall, ParsedMessage, ToolCall
from pagedllm.parsers.reasoning import REASONING_PARSERS
from pagedllm.parsers.streaming import StreamingParser, make_parser, parse_whole
from pagedllm.parsers.tools import TOOL_PARSERS

__all__ = ["DeltaMessage", "DeltaToolCall", "ParsedMessage", "ToolCall", "StreamingParser", "make_parser",
           "parse_whole", "REASONING_PARSERS", "TOOL_PARSERS"]
