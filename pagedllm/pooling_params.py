"""Pooling parameters: how a request's hidden states become one vector (vLLM's ``PoolingParams``).

A pooling request is an engine request that needs the model's final hidden states, not
tokens: it finishes when its prompt is computed. Names follow vLLM's pooling API
(``pooling_type``, ``normalize``, ``dimensions``, ``truncate_prompt_tokens``) and OpenAI's
embeddings API reference (``dimensions``).

Pooling types:
    ``CLS``: the first token's hidden state (BERT's [CLS]).
    ``MEAN``: the mean over the prompt's tokens (Reimers & Gurevych 2019, Sentence-BERT).
    ``LAST``: the last token's hidden state (causal LMs: the only position that saw every token).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pagedllm.sampling_params import SamplingParamError

POOLING_TYPES = ("CLS", "MEAN", "LAST")


@dataclass
class PoolingParams:
    """How to pool one request's hidden states.

    Attributes:
        pooling_type: ``CLS``, ``MEAN`` or ``LAST``; ``None``: the model's default (the
            sentence-transformers ``1_Pooling/config.json`` of an encoder, ``LAST`` for a causal LM).
        normalize: divide by the L2 norm (float32); ``None``: the model's default (True when the
            sentence-transformers modules include ``Normalize``, and for causal LMs as vLLM).
        dimensions: keep the first ``dimensions`` entries (Matryoshka embeddings), then normalize
            again when ``normalize``; ``None``: all of them.
        truncate_prompt_tokens: keep only this many prompt tokens (the tokenizer's truncation side,
            right for BERT); ``-1``: the model's limit; ``None``: an over-long prompt is refused.
        task: ``embed`` (the vector), ``score`` (a pair's similarity: the vector of a bi-encoder, the
            classifier's output of a cross-encoder) or ``classify`` (a cross-encoder's outputs for one text).
        use_activation: a cross-encoder's outputs go through its activation (sigmoid for one label,
            softmax over several, or what its sentence-transformers config names; vLLM's
            ``use_activation``); ``False``: the raw logits. ``None``: True.
        activation: set by ``resolved``: ``"sigmoid"``, ``"softmax"`` or ``"none"``.
        token_type_start: set by the processor for a cross-encoder pair: the first token of the second
            text (token type 1 from there, as the tokenizer's ``token_type_ids``); ``None``: one text.
    Raises:
        SamplingParamError: from ``validate`` with ``param`` naming the field.
    """

    pooling_type: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    task: str = "embed"
    use_activation: bool | None = None
    activation: str = "none"
    token_type_start: int | None = None

    def validate(self) -> "PoolingParams":
        """Check ranges; returns ``self``.

        Raises:
            SamplingParamError: an unknown ``pooling_type``, ``dimensions`` < 1 or
                ``truncate_prompt_tokens`` < -1 or 0.
        """
        if self.pooling_type is not None and self.pooling_type.upper() not in POOLING_TYPES:
            raise SamplingParamError("pooling_type", f"pooling_type: must be one of {', '.join(POOLING_TYPES)}, "
                                     f"got {self.pooling_type!r}")
        if self.dimensions is not None and self.dimensions < 1:
            raise SamplingParamError("dimensions", f"dimensions: must be >= 1, got {self.dimensions}")
        t = self.truncate_prompt_tokens
        if t is not None and (t < -1 or t == 0):
            raise SamplingParamError("truncate_prompt_tokens", f"truncate_prompt_tokens: must be -1 or >= 1, got {t}")
        return self

    def resolved(self, defaults: "PoolerConfig") -> "PoolingParams":
        """A copy with the model's defaults filled in for ``pooling_type`` and ``normalize``.

        Raises:
            SamplingParamError: ``dimensions`` above the model's hidden size, or a pooling type the
                model cannot do (a causal LM pools ``LAST`` only: its prompt may be chunked over steps
                and served from the prefix cache, so earlier rows are not at hand).
        """
        ptype = (self.pooling_type or defaults.pooling_type).upper()
        if ptype not in defaults.supported:
            raise SamplingParamError("pooling_type", f"pooling_type: this model pools {', '.join(defaults.supported)}, "
                                     f"not {ptype}")
        if defaults.num_labels:
            return self._resolved_classifier(defaults, ptype)
        if self.dimensions is not None and self.dimensions > defaults.hidden_size:
            raise SamplingParamError("dimensions", f"dimensions: must be <= {defaults.hidden_size} (the model's "
                                     f"embedding size), got {self.dimensions}")
        norm = defaults.normalize if self.normalize is None else self.normalize
        return replace(self, pooling_type=ptype, normalize=norm)

    def _resolved_classifier(self, defaults: "PoolerConfig", ptype: str) -> "PoolingParams":
        """``resolved`` for a cross-encoder: its outputs are the classifier's, activated or not.

        Raises:
            SamplingParamError: ``dimensions`` or ``normalize=True`` (they shape embeddings, which
                a cross-encoder does not make).
        """
        for name, value in (("dimensions", self.dimensions), ("normalize", self.normalize or None)):
            if value is not None:
                raise SamplingParamError(name, f"{name}: this model is a cross-encoder (a classification head, "
                                         f"{defaults.num_labels} output(s)); {name} applies to embedding models")
        act = defaults.activation if self.use_activation is not False else "none"
        return replace(self, pooling_type=ptype, normalize=False, activation=act)


@dataclass(frozen=True)
class PoolerConfig:
    """A model's pooling defaults (vLLM's ``PoolerConfig``).

    Attributes:
        pooling_type: the default pooling type.
        normalize: the default for ``normalize``.
        hidden_size: length of the pooled vector (``dimensions`` may not exceed it).
        supported: the pooling types the model can do.
        num_labels: a cross-encoder's classifier outputs (``hidden_size`` is then this); 0: an
            embedding model.
        activation: a cross-encoder's default activation (``encoder_only.classifier_activation``).
        labels: a cross-encoder's label names by index (``config.id2label``).
    """

    pooling_type: str
    normalize: bool
    hidden_size: int
    supported: tuple[str, ...] = POOLING_TYPES
    num_labels: int = 0
    activation: str = "none"
    labels: tuple[str, ...] = ()

    @property
    def is_cross_encoder(self) -> bool:
        """True for a classification model (scores pairs as one input)."""
        return self.num_labels > 0


def pair_texts(text_1, text_2) -> tuple[list, list]:
    """The pairs of vLLM's score API as two equal lists: 1 -> 1, 1 -> N (``text_1`` repeated) or N -> N.

    Raises:
        ValueError: an empty side, or lists of different lengths (N -> M).
    """
    left = [text_1] if isinstance(text_1, str) else list(text_1)
    right = [text_2] if isinstance(text_2, str) else list(text_2)
    if not left or not right:
        raise ValueError("text_1, text_2: must not be empty")
    if len(left) == 1 and len(right) > 1:
        left = left * len(right)
    if len(left) != len(right):
        raise ValueError(f"text_1 has {len(left)} texts and text_2 {len(right)}: give one text_1 or as many as text_2")
    return left, right


def cosine(a: list[float], b: list[float]) -> float:
    """Cosine similarity of two vectors (float64 arithmetic; 0.0 when either is zero)."""
    import math
    dot = sum(x * y for x, y in zip(a, b))
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(y * y for y in b))
    return dot / (na * nb) if na and nb else 0.0
