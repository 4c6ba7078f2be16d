"""The pooling model routes: OpenAI's ``POST /v1/embeddings``; vLLM's ``/pooling``, ``/score``,
``/rerank`` and ``/classify`` (``server/embeddings.py``, ``server/score.py`` do the work).

``/score``, ``/rerank`` and ``/classify`` are served under each path vLLM serves them at (with
and without ``/v1``, and ``/v2/rerank`` for Cohere's clients), one route per path so that each
operation has its own OpenAPI operation id. Errors are OpenAI's error body.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from pagedllm.server.base import ServingContext
from pagedllm.server.embeddings import OpenAIServingEmbedding
from pagedllm.server.protocol_pooling import (ClassificationRequest, EmbeddingRequest, PoolingRequest, RerankRequest,
                                              ScoreRequest)
from pagedllm.server.replies import reply
from pagedllm.server.score import ServingScores


def pooling_router(ctx: ServingContext) -> APIRouter:
    """The embeddings, pooling, score, rerank and classify routes.

    Args:
        ctx: what every handler shares (the engine, the served model's name, admission control).
    """
    router = APIRouter()
    embedding_serving, score_serving = OpenAIServingEmbedding(ctx), ServingScores(ctx)

    @router.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request):
        """OpenAI Embeddings (a pooling model: ``--runner pooling`` or an encoder such as BERT)."""
        return await reply(request, embedding_serving.embeddings(body))

    @router.post("/pooling")
    async def pooling(body: PoolingRequest, request: Request):
        """vLLM's pooling API: the pooled vectors of the inputs."""
        return await reply(request, embedding_serving.pooling(body))

    @router.post("/score")
    @router.post("/v1/score")
    async def score(body: ScoreRequest, request: Request):
        """vLLM's score API: ``text_1`` and ``text_2`` pairs scored by a cross-encoder, or the cosine
        similarity of their embeddings (bi-encoder)."""
        return await reply(request, score_serving.score(body))

    @router.post("/rerank")
    @router.post("/v1/rerank")
    @router.post("/v2/rerank")
    async def rerank(body: RerankRequest, request: Request):
        """vLLM's rerank API (Jina / Cohere shapes): ``documents`` ordered by their score against ``query``."""
        return await reply(request, score_serving.rerank(body))

    @router.post("/classify")
    @router.post("/v1/classify")
    async def classify(body: ClassificationRequest, request: Request):
        """vLLM's classification API: a cross-encoder's label probabilities per input."""
        return await reply(request, score_serving.classify(body))

    return router
