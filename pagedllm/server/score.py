"""``POST /score``, ``POST /rerank`` (vLLM's score and rerank APIs; ``/rerank`` answers in the
Jina / Cohere shape) and ``POST /classify`` (vLLM's classification API).

A cross-encoder (a sequence-classification model) scores a pair as one input, the two texts
joined by its tokenizer (``Processor.process_pair``): the score is its classifier's first output
after the model's activation (sigmoid for one label), as sentence-transformers' ``CrossEncoder``
and vLLM. A bi-encoder's score is the cosine similarity of the two texts' embeddings
(``pooling_params.cosine``). ``/classify`` needs a cross-encoder.
"""

from __future__ import annotations

from pagedllm.pooling_params import cosine, pair_texts
from pagedllm.server.base import ServingContext
from pagedllm.server.embeddings import check_pooling_model, embed_inputs, run_pooling, usage
from pagedllm.server.errors import APIError
from pagedllm.server.protocol import now, random_id
from pagedllm.server.protocol_pooling import ClassificationRequest, RerankRequest, ScoreRequest


class ServingScores:
    """``/score`` and ``/rerank`` (``ctx``: a ``ServingContext``)."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def _embed_unique(self, rid: str, texts: list[str], params, param: str) -> tuple[dict, dict]:
        """Embed each distinct text once; ``(text -> vector, usage)``."""
        unique = list(dict.fromkeys(texts))
        outs = await embed_inputs(self.ctx, rid, unique, params, param)
        return {t: o.outputs.data for t, o in zip(unique, outs)}, usage(outs)

    async def _pair_scores(self, rid: str, left: list[str], right: list[str], params, param: str,
                           fields: dict) -> tuple[list[float], dict]:
        """A cross-encoder's score of each pair, run as one input each; ``(scores, usage)``
        (``fields``: ``run_pooling``'s names of the two texts in the body)."""
        from dataclasses import replace
        params = replace(params, task="score")
        for t in left + right:
            self.ctx.check_prompt_chars(t, param)
        outs = await run_pooling(self.ctx, [(lambda a=a, b=b, i=i: self.ctx.llm.make_pair_request(f"{rid}-{i}", a, b,
                                                                                                 params), None)
                                            for i, (a, b) in enumerate(zip(left, right))], param, fields)
        return [o.outputs.data[0] for o in outs], usage(outs)

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
        if self.ctx.llm.is_cross_encoder:
            many = len(left) > 1
            fields = {t: (lambda i, t=t: f"{t}[{i}]" if many and not (t == "text_1" and isinstance(body.text_1, str))
                          else t) for t in ("text_1", "text_2")}
            scores, used = await self._pair_scores(random_id("score"), left, right, body.pooling_params(), "text_1",
                                                   fields)
        else:
            vecs, used = await self._embed_unique(random_id("score"), left + right, body.pooling_params(), "text_1")
            scores = [cosine(vecs[a], vecs[b]) for a, b in zip(left, right)]
        data = [{"object": "score", "index": i, "score": x} for i, x in enumerate(scores)]
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
        if self.ctx.llm.is_cross_encoder:
            scores, u = await self._pair_scores(random_id("rerank"), [body.query] * len(docs), docs,
                                                body.pooling_params(), "documents",
                                                {"text_1": lambda i: "query", "text_2": lambda i: f"documents[{i}]"})
        else:
            vecs, u = await self._embed_unique(random_id("rerank"), [body.query, *docs], body.pooling_params(),
                                               "documents")
            scores = [cosine(vecs[body.query], vecs[d]) for d in docs]
        ranked = sorted(((x, i) for i, x in enumerate(scores)), key=lambda x: (-x[0], x[1]))
        if body.top_n:
            ranked = ranked[:body.top_n]
        results = [{"index": i, "relevance_score": s, **({"document": {"text": docs[i]}} if body.return_documents
                                                          else {})} for s, i in ranked]
        return {"id": random_id("rerank"), "model": self.ctx.model_name, "usage": {"total_tokens": u["total_tokens"]},
                "results": results}

    async def classify(self, body: ClassificationRequest) -> dict:
        """vLLM's classification response: ``data`` of ``{"index", "label", "probs", "num_classes"}``.

        Raises:
            APIError: 400 for a model without a classification head, an empty or over-long input; 404, 429.
        """
        from dataclasses import replace
        self.ctx.check_model(body.model)
        check_pooling_model(self.ctx, "classification")
        labels = self.ctx.llm.pooler_config.labels
        outs = await embed_inputs(self.ctx, random_id("classify"), body.inputs(),
                                  replace(body.pooling_params(), task="classify"))
        data = []
        for i, o in enumerate(outs):
            probs = o.outputs.data
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append({"index": i, "label": labels[best] if best < len(labels) else str(best), "probs": probs,
                         "num_classes": len(probs)})
        return {"id": random_id("classify"), "object": "list", "created": now(), "model": self.ctx.model_name,
                "data": data, "usage": usage(outs)}
