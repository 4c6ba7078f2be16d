"""Reasoning parsers: split a model's output into reasoning and the rest.

Each parser is a pure function of the text so far. In partial mode it returns
only what cannot change any more (a suffix that may be the start of the end
tag is held back); in final mode it decides everything. Whether thinking is on,
and whether the prompt already opened the reasoning block, are told to the
parser, never guessed from the output.
"""

from __future__ import annotations

from dataclasses import dataclass

REASONING_PARSERS: dict[str, type["ReasoningParser"]] = {}


def register_reasoning_parser(name: str):
    """Class decorator adding a parser to ``REASONING_PARSERS`` under ``name`` (vLLM's names)."""
    def deco(cls):
        REASONING_PARSERS[name] = cls
        cls.name = name
        return cls
    return deco


def held_back(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


@dataclass
class ReasoningSplit:
    """Result of a split.

    Attributes:
        reasoning: reasoning text decided so far.
        rest: output after the reasoning block, decided so far (raw, for the tool parser);
            ``None`` while the reasoning block is still open (or undecided).
    """

    reasoning: str
    rest: str | None


class ReasoningParser:
    """``<think>`` ... ``</think>`` reasoning.

    Args:
        thinking: False when the request turned thinking off (``enable_thinking: false``):
            all output is then content.
        starts_in_reasoning: True when the prompt ends inside an open reasoning block
            (the chat template emitted ``<think>``).
    """

    name = ""
    start_tag = "<think>"
    end_tag = "</think>"
    #: True when reasoning is assumed even without an opening tag (DeepSeek-R1's templates)
    implicit_start = False
    #: True when the format's markers are special tokens: the server keeps them in the text
    needs_special_tokens = False
    #: the tool parser class ``make_parser`` puts after this one when the request has no tool parser
    #: (a format whose ``rest`` is markup, not content); ``None``: the rest is the content as it is
    rest_parser: type | None = None

    def __init__(self, thinking: bool = True, starts_in_reasoning: bool = False) -> None:
        self.thinking = thinking
        self.starts_in_reasoning = starts_in_reasoning

    def split(self, text: str, final: bool) -> ReasoningSplit:
        """Split ``text`` (all output so far).

        Raises nothing: any text is a valid output.
        """
        if not self.thinking:
            return ReasoningSplit("", text)
        body = text
        if not self.starts_in_reasoning:
            lead = text.lstrip()
            if lead.startswith(self.start_tag):
                body = lead[len(self.start_tag):]
            elif self.start_tag.startswith(lead) and not final:
                return ReasoningSplit("", None)  # could still become the opening tag
            elif not self.implicit_start:
                return ReasoningSplit("", text)  # no reasoning block: all content
        end = body.find(self.end_tag)
        if end != -1:
            return ReasoningSplit(body[:end], body[end + len(self.end_tag):])
        if final:  # unterminated (max_tokens): it stays reasoning
            return ReasoningSplit(body, None)
        return ReasoningSplit(body[:len(body) - held_back(body, self.end_tag)], None)


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: output is reasoning until ``</think>``, with or without an opening ``<think>``
    (R1's templates put it in the prompt)."""

    implicit_start = True


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: reasoning only inside ``<think>`` ... ``</think>`` at the start of the output (or
    when the prompt opened it); ``enable_thinking: false`` means no reasoning at all."""
