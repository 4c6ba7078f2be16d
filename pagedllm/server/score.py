"""``POST /score`` and ``POST /rerank`` (vLLM's score and rerank APIs; ``/rerank`` answers in the
Jina / Cohere shape) with a bi-encoder: a pair's score is the cosine similarity of the two texts'
embeddings (``pooling_params.cosine``). Cross-encoders (a classification head over the joined
pair) are not served yet.
"""

from __future__ import annotations

from pagedllm.pooling_params import cosine, pair_texts
from pagedllm.server.base import ServingContext
from pagedllm.server.embeddings import check_pooling_model, embed_inputs, usage
from pagedllm.server.errors import APIError
from pagedllm.server.protocol import now, random_id
from pagedllm.server.protocol_pooling import RerankRequest, ScoreRequest


class ServingScores:
    """``/score`` and ``/rerank`` (``ctx``: a ``ServingContext``)."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def _embed_unique(self, rid: str, texts: list[str], params, param: str) -> tuple[dict, dict]:
        """Embed each distinct text once; ``(text -> vector, usage)``."""
        unique = list(dict.fromkeys(texts))
        outs = await embed_inputs(self.ctx, rid, unique, params, param)
        return {t: o.outputs.data for t, o in zip(unique, outs)}, usage(outs)

    async def score(self, body: ScoreRequest) -> dict:
        """``{"object": "list", "data": [{"object": "score", "index", "score"}], "usage"}``, one entry per pair.

        Raises:
            APIError: 400 for a generation model, an empty side, lists of different lengths,
                or an input the model cannot take; 404, 429.
        """
        self.ctx.check_model(body.model)
        check_pooling_model(self.ctx, "scores")
        try:
            left, right = pair_texts(body.text_1, body.text_2)
        except ValueError as e:
            raise APIError(400, str(e), "text_2", code="invalid_value") from None
        vecs, used = await self._embed_unique(random_id("score"), left + right, body.pooling_params(), "text_1")
        data = [{"object": "score", "index": i, "score": cosine(vecs[a], vecs[b])}
                for i, (a, b) in enumerate(zip(left, right))]
        return {"id": random_id("score"), "object": "list", "created": now(), "model": self.ctx.model_name,
                "data": data, "usage": used}

    async def rerank(self, body: RerankRequest) -> dict:
        """``{"id", "model", "usage", "results": [{"index", "document": {"text"}, "relevance_score"}]}``,
        best first, the first ``top_n``.

        Raises:
            APIError: 400 for a generation model, no documents, or an input the model cannot take; 404, 429.
        """
        self.ctx.check_model(body.model)
        check_pooling_model(self.ctx, "rerank")
        docs = body.texts()
        if not docs:
            raise APIError(400, "documents: must not be empty", "documents", code="invalid_value")
        vecs, u = await self._embed_unique(random_id("rerank"), [body.query, *docs], body.pooling_params(), "documents")
        q = vecs[body.query]
        ranked = sorted(((cosine(q, vecs[d]), i) for i, d in enumerate(docs)), key=lambda x: (-x[0], x[1]))
        if body.top_n:
            ranked = ranked[:body.top_n]
        results = [{"index": i, "relevance_score": s, **({"document": {"text": docs[i]}} if body.return_documents
                                                          else {})} for s, i in ranked]
        return {"id": random_id("rerank"), "model": self.ctx.model_name, "usage": {"total_tokens": u["total_tokens"]},
                "results": results}
