"""Which encoder-only models pagedllm serves for pooling, and through which implementation.

An encoder-only model (bidirectional attention, no LM head) serves pooling requests only:
embeddings, and, when its architecture is a ``*ForSequenceClassification``, cross-encoder
scores (a classification head over the joined pair, as sentence-transformers' ``CrossEncoder``
and vLLM's score API for such models). BERT (``BertModel``, ``BertForSequenceClassification``)
runs natively on the flattened batch (``models/bert.py``); every other family of
``ENCODER_MODEL_TYPES`` runs through ``transformers``' own modules on a padded batch
(``models/transformers_encoder.py``).
"""

from __future__ import annotations

# transformers ``model_type`` values of encoder-only families with built-in (no remote code) models
ENCODER_MODEL_TYPES = frozenset({
    "albert", "bert", "camembert", "data2vec-text", "deberta", "deberta-v2", "distilbert", "electra",
    "ernie", "megatron-bert", "mobilebert", "modernbert", "mpnet", "rembert", "roberta", "roformer",
    "xlm-roberta", "xlm-roberta-xl",
})
NATIVE_ENCODER_ARCHITECTURES = ("BertModel", "BertForSequenceClassification")


def _architectures(config) -> list[str]:
    return list(getattr(config, "architectures", None) or [])


def is_encoder_only(config) -> bool:
    """True when ``config`` is an encoder-only model served for pooling: a family of
    ``ENCODER_MODEL_TYPES`` not configured as a decoder and not a causal-LM architecture."""
    archs = _architectures(config)
    if getattr(config, "is_decoder", False) or any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return False
    return getattr(config, "model_type", None) in ENCODER_MODEL_TYPES or any(
        a in NATIVE_ENCODER_ARCHITECTURES for a in archs)


def is_cross_encoder(config) -> bool:
    """True when ``config`` is an encoder with a sequence-classification head (a cross-encoder)."""
    return is_encoder_only(config) and any(a.endswith("ForSequenceClassification") for a in _architectures(config))


def num_labels(config) -> int:
    """The classification head's outputs (``config.num_labels``; 0 for an embedding model)."""
    return int(getattr(config, "num_labels", 1) or 1) if is_cross_encoder(config) else 0


# families whose positions count from ``pad_token_id + 1`` (fairseq's rule, kept by transformers)
_OFFSET_POSITIONS = frozenset({"camembert", "data2vec-text", "roberta", "xlm-roberta", "xlm-roberta-xl"})


def max_input_len(config) -> int | None:
    """The longest input the position table holds (``None``: the config says nothing).

    RoBERTa-like models start positions at ``pad_token_id + 1``, so ``max_position_embeddings``
    514 holds 512 tokens.
    """
    n = getattr(config, "max_position_embeddings", None)
    if not n:
        return None
    if getattr(config, "model_type", None) in _OFFSET_POSITIONS:
        return int(n) - int(getattr(config, "pad_token_id", None) or 0) - 1
    return int(n)


def encoder_impl(config, model_impl: str) -> str:
    """``"encoder"`` (native BERT) or ``"transformers-encoder"`` for an encoder-only ``config``.

    ``auto`` takes the native BERT where the architecture is one of ``NATIVE_ENCODER_ARCHITECTURES``.

    Raises:
        ValueError: ``model_impl="native"`` for an encoder with no native implementation.
    """
    native = any(a in NATIVE_ENCODER_ARCHITECTURES for a in _architectures(config))
    if model_impl == "native" and not native:
        raise ValueError(f"encoder {_architectures(config)} has no native implementation (native: "
                         f"{', '.join(NATIVE_ENCODER_ARCHITECTURES)}); use model_impl='auto' or 'transformers'")
    return "encoder" if native and model_impl != "transformers" else "transformers-encoder"


def classifier_activation(config) -> str:
    """The activation a cross-encoder's scores take (``"sigmoid"``, ``"softmax"`` or ``"none"``).

    sentence-transformers records it in ``config.json`` (``sentence_transformers.activation_fn``);
    without it, as ``CrossEncoder`` and vLLM: sigmoid for one label, softmax over several.
    """
    st = getattr(config, "sentence_transformers", None)
    fn = str(st.get("activation_fn", "")) if isinstance(st, dict) else ""
    for name, act in (("Sigmoid", "sigmoid"), ("Softmax", "softmax"), ("Identity", "none")):
        if fn.endswith(name):
            return act
    return "sigmoid" if num_labels(config) == 1 else "softmax"
