"""A model's pooling defaults, read from its directory (vLLM's ``PoolerConfig`` resolution).

A sentence-transformers directory says how its vectors are made: ``modules.json`` lists the
modules (``Pooling``, ``Normalize``), ``1_Pooling/config.json`` the pooling mode and
``sentence_bert_config.json`` the longest input (``max_seq_length``). Without them an encoder
pools ``CLS`` and a causal LM ``LAST``, both normalized (vLLM's defaults). A cross-encoder's
output is its classifier's (``CLS`` only, not normalized, its activation).
"""

from __future__ import annotations

import json
from pathlib import Path

from pagedllm.pooling_params import PoolerConfig

_ST_MODES = (("pooling_mode_cls_token", "CLS"), ("pooling_mode_mean_tokens", "MEAN"),
             ("pooling_mode_lasttoken", "LAST"))


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def pooler_config(model_dir: str | Path, hf_config, encoder_only: bool) -> PoolerConfig:
    """The pooling defaults of ``model_dir``.

    Args:
        model_dir: the model directory.
        hf_config: its ``transformers`` config (``hidden_size``).
        encoder_only: an encoder (any pooling type; default from sentence-transformers, else ``CLS``)
            rather than a causal LM (``LAST`` only: its prompt may be chunked and prefix-cached).
    Returns:
        A ``PoolerConfig``. Unreadable sentence-transformers files count as absent.
    """
    d = Path(model_dir)
    hidden = int(getattr(hf_config, "hidden_size", 0) or 0)
    if not encoder_only:
        return PoolerConfig("LAST", True, hidden, ("LAST",))
    from pagedllm.models.encoder_only import classifier_activation, num_labels
    labels = num_labels(hf_config)
    if labels:  # a cross-encoder: one output vector per input, the classifier's (its head picks the rows)
        names = getattr(hf_config, "id2label", None) or {}
        return PoolerConfig("CLS", False, labels, ("CLS",), labels, classifier_activation(hf_config),
                            tuple(str(names.get(i, f"LABEL_{i}")) for i in range(labels)))
    modules = _read_json(d / "modules.json") or []
    pooling_dir = next((m.get("path") for m in modules if isinstance(m, dict)
                        and str(m.get("type", "")).endswith(".Pooling")), None)
    ptype = "CLS"
    if pooling_dir is not None:
        cfg = _read_json(d / pooling_dir / "config.json") or {}
        ptype = next((t for key, t in _ST_MODES if cfg.get(key)), "CLS")
    normalize = (any(str(m.get("type", "")).endswith(".Normalize") for m in modules if isinstance(m, dict))
                 if modules else True)
    return PoolerConfig(ptype, normalize, hidden)


def sentence_transformers_max_len(model_dir: str | Path) -> int | None:
    """``max_seq_length`` of ``sentence_bert_config.json`` (the longest input the model was trained
    for, which vLLM takes as ``max_model_len``), or ``None`` when absent."""
    cfg = _read_json(Path(model_dir) / "sentence_bert_config.json")
    n = cfg.get("max_seq_length") if isinstance(cfg, dict) else None
    return int(n) if isinstance(n, int) and n > 0 else None
