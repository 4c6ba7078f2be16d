"""``--speculative-config`` / ``LLM(speculative_config=...)``: vLLM's names, validated once.

Source: vLLM's ``SpeculativeConfig`` (``method``, ``num_speculative_tokens``, ``prompt_lookup_min``,
``prompt_lookup_max``, ``suffix_decoding_*``). Unknown keys are refused, never ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "suffix", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How drafts are proposed and how many.

    Attributes:
        method: ``ngram`` (prompt lookup: the tokens that followed an earlier occurrence of the
            sequence's last n tokens), ``suffix`` (the most frequent continuation of the longest
            matching suffix, over the request's own tokens and earlier requests' outputs) or
            ``draft_model`` (refused for now: not served yet).
        num_speculative_tokens: most draft tokens per request per step (``k``), >= 1.
        prompt_lookup_min, prompt_lookup_max: n-gram lengths tried, longest first (``ngram``).
            When only one is given the other takes its value, as in vLLM; neither: 2 and 5.
        suffix_decoding_max_tree_depth: longest suffix matched plus continuation (``suffix``).
        suffix_decoding_max_cached_requests: finished requests whose outputs stay indexed (0: none).
        suffix_decoding_min_token_prob: a continuation token is proposed only while its share of
            the matched suffix's continuations is at least this.
        dynamic: choose each request's depth per step from its measured acceptance and the step's
            measured cost (``depth.py``); ``False`` always proposes up to ``num_speculative_tokens``.
        model: the draft model (``draft_model`` only).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_min_token_prob: float = 0.1
    dynamic: bool = True
    model: str | None = None

    @classmethod
    def parse(cls, value: "str | dict[str, Any] | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """Build from a JSON string or a dict (``None`` stays ``None``).

        Raises:
            ValueError: not JSON / not an object, an unknown key, an unknown method, a value out
                of range, or ``draft_model`` (not served yet); the message names the key.
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object such as "
                             '{"method": "ngram", "num_speculative_tokens": 4}')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        cfg = dict(value)
        method = cfg.get("method")
        if method is None and cfg.get("model"):
            method = cfg["method"] = "draft_model"
        if method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, got {method!r}")
        if method == "draft_model":
            raise ValueError("speculative_config.method 'draft_model' is not served yet; use 'ngram' or 'suffix'")
        if "num_speculative_tokens" not in cfg:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        lo, hi = cfg.get("prompt_lookup_min"), cfg.get("prompt_lookup_max")
        if lo is None and hi is not None:
            cfg["prompt_lookup_min"] = hi
        elif hi is None and lo is not None:
            cfg["prompt_lookup_max"] = lo
        out = cls(**cfg)
        out._check()
        return out

    def _check(self) -> None:
        ints = {"num_speculative_tokens": (1, 64), "prompt_lookup_min": (1, 1 << 16), "prompt_lookup_max": (1, 1 << 16),
                "suffix_decoding_max_tree_depth": (2, 1024), "suffix_decoding_max_cached_requests": (0, 1 << 24)}
        for name, (lo, hi) in ints.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"speculative_config.{name} must be an integer in [{lo}, {hi}], got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        p = self.suffix_decoding_min_token_prob
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ValueError(f"speculative_config.suffix_decoding_min_token_prob must be in [0, 1], got {p!r}")
        if not isinstance(self.dynamic, bool):
            raise ValueError(f"speculative_config.dynamic must be true or false, got {self.dynamic!r}")
