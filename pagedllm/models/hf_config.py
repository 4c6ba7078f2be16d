"""Facts read from a ``transformers`` config that more than one model file needs.

One owner for each reading, so the loaders, the Transformers backend and its tensor-parallel
sharding agree on what a config says (and do not import each other for it).
"""

from __future__ import annotations

import inspect


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
