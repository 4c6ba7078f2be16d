"""Structured outputs: constrained decoding to a JSON schema, regex, choice or grammar (llguidance)."""

from pagedllm.structured_output.params import StructuredOutputError, StructuredOutputsParams

__all__ = ["StructuredOutputError", "StructuredOutputsParams"]
