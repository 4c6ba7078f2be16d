"""Pydantic bodies of the pooling endpoints: ``/v1/embeddings`` (OpenAI's embeddings API reference),
``/pooling``, ``/score``, ``/rerank`` and ``/classify`` (vLLM's pooling API; ``/rerank`` also takes the Jina and
Cohere bodies). Fields not listed are ignored, as OpenAI ignores unknown fields.
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import Field

from pagedllm.pooling_params import PoolingParams
from pagedllm.server.protocol import Bool, Int, RequestBody

# OpenAI's ``input``: a string, a list of strings, a list of token ids, or a list of such lists
EmbeddingInput = Union[str, list[str], list[Int], list[list[Int]]]


class _PoolingBody(RequestBody):
    """What every pooling request takes besides its input (vLLM's extra fields included)."""

    model: str | None = None
    dimensions: Int | None = None
    truncate_prompt_tokens: Int | None = None
    normalize: Bool | None = None
    use_activation: Bool | None = None
    user: str | None = None

    def pooling_params(self) -> PoolingParams:
        """The body's ``PoolingParams`` (validated by the processor)."""
        return PoolingParams(dimensions=self.dimensions, truncate_prompt_tokens=self.truncate_prompt_tokens,
                             normalize=self.normalize, use_activation=self.use_activation)


class EmbeddingRequest(_PoolingBody):
    """``POST /v1/embeddings``: ``input`` to embed, ``encoding_format`` ``float`` (JSON numbers) or
    ``base64`` (little-endian float32 bytes, as the openai SDK decodes them), ``dimensions``
    (Matryoshka: the first ``dimensions`` entries, renormalized)."""

    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"

    def inputs(self) -> list[str | list[int]]:
        """The inputs as a list of strings or token-id lists (``[]`` when ``input`` is an empty list)."""
        p = self.input
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return list(p)


class PoolingRequest(EmbeddingRequest):
    """``POST /pooling`` (vLLM): the same body as ``/v1/embeddings``; the answer names its vectors
    ``data`` of objects ``pooling``."""


class ClassificationRequest(EmbeddingRequest):
    """``POST /classify`` (vLLM): ``input`` as ``/v1/embeddings`` takes it, for a cross-encoder."""


class ScoreRequest(_PoolingBody):
    """``POST /score`` (vLLM): ``text_1`` against ``text_2`` (1 -> 1, 1 -> N or N -> N pairs)."""

    text_1: Union[str, list[str]]
    text_2: Union[str, list[str]]


class RerankDocument(RequestBody):
    """A document of a Cohere-style rerank body (``{"text": ...}``)."""

    text: str


class RerankRequest(_PoolingBody):
    """``POST /rerank`` (vLLM, Jina and Cohere's body): ``query``, ``documents`` (strings or
    ``{"text": ...}`` objects), ``top_n`` (0 to 2**31 - 1; 0 or absent: all), ``return_documents``."""

    query: str
    documents: list[Union[str, RerankDocument]]
    # above the documents' count means all of them; bounded so that no integer past int32 passes as a count
    top_n: Int | None = Field(default=None, ge=0, le=2**31 - 1)
    return_documents: Bool = True

    def texts(self) -> list[str]:
        """The documents as strings."""
        return [d if isinstance(d, str) else d.text for d in self.documents]
