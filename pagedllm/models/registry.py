"""The architecture table: which implementation serves which ``transformers`` architecture name.

Only the lookup lives here; the load pipeline is ``models/load.py`` and the decisions it follows
are ``models/load_plan.py``'s.
"""

from __future__ import annotations

NATIVE_ARCHITECTURES = {
    "LlamaForCausalLM": "pagedllm.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "pagedllm.models.llama:LlamaForCausalLM",
}


def resolve_architecture(config) -> type:
    """Return the native model class for ``config.architectures``.

    Raises:
        ValueError: no architecture of the config has a native implementation
            (the message lists the supported ones).
    """
    import importlib
    for arch in getattr(config, "architectures", None) or []:
        if arch in NATIVE_ARCHITECTURES:
            mod, cls = NATIVE_ARCHITECTURES[arch].split(":")
            return getattr(importlib.import_module(mod), cls)
    raise ValueError(f"architecture {getattr(config, 'architectures', None)} has no native implementation; "
                     f"supported: {sorted(NATIVE_ARCHITECTURES)}")


MODEL_IMPLS = ("auto", "native", "transformers")


def select_impl(config, model_impl: str = "auto") -> str:
    """Which implementation serves ``config``: ``"native"``, ``"transformers"``, ``"encoder"``,
    ``"transformers-encoder"`` or ``"whisper"`` (the encoder-decoder, ``models/whisper.py``).

    ``auto`` takes the native one when it exists, else the Transformers backend. An encoder-only
    model (for pooling) is ``"encoder"`` (native BERT, ``models/bert.py``) or
    ``"transformers-encoder"`` (any other encoder family, ``models/transformers_encoder.py``).

    Raises:
        ValueError: an unknown ``model_impl``, or an architecture the chosen
            implementation(s) cannot serve (the message says what is missing).
    """
    from pagedllm.models.encoder_only import encoder_impl, is_encoder_only
    from pagedllm.models.transformers_backend import check_supported
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {model_impl!r}")
    if is_encoder_only(config):
        return encoder_impl(config, model_impl)
    from pagedllm.multimodal_whisper import is_whisper
    if is_whisper(config):
        if model_impl == "native":
            raise ValueError("Whisper has no native implementation; use --model-impl transformers or auto")
        return "whisper"
    archs = getattr(config, "architectures", None) or []
    native = any(a in NATIVE_ARCHITECTURES for a in archs)
    if model_impl == "native" or (model_impl == "auto" and native):
        if not native:
            raise ValueError(f"architecture {archs} has no native implementation (native: "
                             f"{sorted(NATIVE_ARCHITECTURES)}); use --model-impl transformers or auto")
        return "native"
    try:
        check_supported(config)
    except ValueError as e:
        hint = "" if model_impl == "transformers" else f" and no native implementation exists for {archs}"
        raise ValueError(f"cannot serve this model: {e}{hint}") from None
    return "transformers"
