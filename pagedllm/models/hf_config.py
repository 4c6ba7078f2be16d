"""A model directory's ``config.json`` and ``generation_config.json``, and facts read from a
``transformers`` config that more than one model file needs.

One owner for each reading, so the loaders, the Transformers backend and its tensor-parallel
sharding agree on what a config says (and do not import each other for it).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path


def num_kv_heads(cfg) -> int:
    """KV heads of a ``transformers`` config: ``num_key_value_heads`` only where the config class
    declares it, else ``num_attention_heads`` (no grouped-query attention).

    A config class without grouped-query attention (GPT-NeoX, OPT, ...) keeps unknown
    keyword arguments as plain attributes, so a stray ``num_key_value_heads`` there
    does not describe the model.
    """
    declared = "num_key_value_heads" in getattr(type(cfg), "attribute_map", {})
    try:
        declared = declared or "num_key_value_heads" in inspect.signature(type(cfg).__init__).parameters
    except (TypeError, ValueError):
        pass
    return (getattr(cfg, "num_key_value_heads", None) if declared else None) or cfg.num_attention_heads


def read_hf_config(model_dir: str | Path):
    """``AutoConfig`` of ``model_dir``, with a one-line error naming ``config.json`` when it is broken.

    Raises:
        ModelLoadError: ``config.json`` is missing, not JSON, or not a config ``transformers`` knows.
    """
    from transformers import AutoConfig
    from pagedllm.models.loader import ModelLoadError, one_line
    path = Path(model_dir) / "config.json"
    try:
        json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelLoadError(path, f"not a readable JSON file ({one_line(e)})") from None
    try:
        return AutoConfig.from_pretrained(model_dir)
    except Exception as e:  # transformers raises ValueError, KeyError, OSError on a config it cannot map
        raise ModelLoadError(path, f"not a model config transformers can read ({one_line(e)})") from None


def read_generation_config(model_dir: str | Path) -> dict:
    """The model directory's ``generation_config.json`` as a dict ({} when absent).

    Raises:
        ModelLoadError: the file exists but is not a JSON object.
    """
    from pagedllm.models.loader import ModelLoadError, one_line
    p = Path(model_dir) / "generation_config.json"
    if not p.exists():
        return {}
    try:
        out = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelLoadError(p, f"not a readable JSON file ({one_line(e)})") from None
    if not isinstance(out, dict):
        raise ModelLoadError(p, "not a JSON object")
    return out
