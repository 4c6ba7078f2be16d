"""The error of a structured-output constraint that cannot be built (its own module, so that
``params`` and ``limits`` both import it without importing each other)."""

from __future__ import annotations


class StructuredOutputError(ValueError):
    """A structured-output request that cannot be built; ``param`` names the field
    (``structured_outputs.json``, ...), in the names of the offline API."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


__all__ = ["StructuredOutputError"]
