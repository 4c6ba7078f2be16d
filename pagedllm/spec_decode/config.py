"""``--speculative-config`` / ``LLM(speculative_config=...)``: vLLM's names, validated once.

Source: vLLM's ``SpeculativeConfig`` (``method``, ``model``, ``quantization``,
``num_speculative_tokens``, ``prompt_lookup_min``, ``prompt_lookup_max``, ``suffix_decoding_*``).
Unknown keys are refused, never ignored; so are vLLM keys this engine does not serve
(``NOT_SERVED``), by name. ``TargetInfo`` is what a proposer that runs a model (``draft_model``)
is told about the target engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Callable

METHODS = ("ngram", "suffix", "draft_model")
# vLLM speculative_config keys that would change behaviour here and are not implemented
NOT_SERVED = ("draft_tensor_parallel_size", "disable_by_batch_size", "max_model_len", "revision",
              "code_revision", "speculative_token_tree", "draft_sample_method")


@dataclass(frozen=True)
class TargetInfo:
    """What the engine core tells a model-running proposer about the target (``draft_model``).

    Attributes:
        model_dir: the target's resolved model directory (its ``config.json``).
        tokenizer_dir: where the target's tokenizer files are (``None``: none to compare).
        vocab_size: the target's logits width (``config.vocab_size``).
        dtype, device: the target's compute dtype and device (the draft uses the same).
        block_size: tokens per KV block (the draft's pool uses the same).
        num_blocks: blocks in the target's KV pool (the draft pool's default size).
        max_model_len: longest sequence, tokens.
        max_num_batched_tokens: the step's token budget (bounds one draft catch-up forward).
        run: calls a zero-argument function on the core's execution thread and returns its
            result (every torch op of the core runs on that one thread: see ``worker/model_runner.py``).
        seed: the engine's seed (the draft's shared generator for unseeded sampled requests).
    """

    model_dir: str
    tokenizer_dir: str | None
    vocab_size: int
    dtype: Any
    device: Any
    block_size: int
    num_blocks: int
    max_model_len: int
    max_num_batched_tokens: int
    run: Callable[[Callable[[], Any]], Any]
    seed: int = 0


@dataclass(frozen=True)
class SpeculativeConfig:
    """How drafts are proposed and how many.

    Attributes:
        method: ``ngram`` (prompt lookup: the tokens that followed an earlier occurrence of the
            sequence's last n tokens), ``suffix`` (the most frequent continuation of the longest
            matching suffix, over the request's own tokens and earlier requests' outputs) or
            ``draft_model`` (a smaller model with the target's vocabulary, run through its own
            paged KV pool: ``worker/draft_model.py``; greedy or sampled drafts). Without ``method``, a
            given ``model`` means ``draft_model``, as in vLLM.
        num_speculative_tokens: most draft tokens per request per step (``k``), >= 1.
        prompt_lookup_min, prompt_lookup_max: n-gram lengths tried, longest first (``ngram``).
            When only one is given the other takes its value, as in vLLM; neither: 2 and 5.
        suffix_decoding_max_tree_depth: longest suffix matched plus continuation (``suffix``).
        suffix_decoding_max_cached_requests: finished requests whose outputs stay indexed (0: none).
        suffix_decoding_min_token_prob: a continuation token is proposed only while its share of
            the matched suffix's continuations is at least this.
        dynamic: choose each request's depth per step from its measured acceptance and the step's
            measured cost (``depth.py``); ``False`` always proposes up to ``num_speculative_tokens``.
        model: the draft model (``draft_model`` only, required there): a directory with
            ``config.json``, a ``.gguf`` file or a named model, as the engine's ``model``.
        quantization: how the draft's weights are served (``draft_model`` only; the engine's
            ``quantization`` values: ``auto``, ``gguf``, ``int8``, ``none``).
        draft_num_kv_blocks: KV blocks of the draft's own pool (``draft_model`` only; pagedllm's
            key, not vLLM's); ``None``: as many as the target's pool.
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
    quantization: str = "auto"
    draft_num_kv_blocks: int | None = None

    @classmethod
    def parse(cls, value: "str | dict[str, Any] | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """Build from a JSON string or a dict (``None`` stays ``None``).

        Raises:
            ValueError: not JSON / not an object, an unknown key or a vLLM key not served here
                (``NOT_SERVED``), an unknown method, a value out of range, ``draft_model`` without
                ``model``, or a draft-only key with another method; the message names the key.
                (Whether the draft's vocabulary matches the target's is checked when the engine
                loads it: ``DraftModelProposer``.)
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
        refused = sorted(set(value) & set(NOT_SERVED))
        if refused:
            raise ValueError(f"speculative_config: key(s) {refused} are not served by pagedllm")
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
        if method == "draft_model" and not cfg.get("model"):
            raise ValueError("speculative_config.model is required for method 'draft_model' "
                             "(a model directory, a .gguf file or a named model)")
        draft_keys = sorted(k for k in ("model", "quantization", "draft_num_kv_blocks") if k in cfg)
        if method != "draft_model" and draft_keys:
            raise ValueError(f"speculative_config: {draft_keys} apply to method 'draft_model' only, "
                             f"not {method!r}")
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
        if not isinstance(self.model, (str, type(None))):
            raise ValueError(f"speculative_config.model must be a string, got {self.model!r}")
        if self.quantization not in ("auto", "gguf", "int8", "none"):
            raise ValueError("speculative_config.quantization must be one of auto, gguf, int8, none, "
                             f"got {self.quantization!r}")
        n = self.draft_num_kv_blocks
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"speculative_config.draft_num_kv_blocks must be an integer >= 1, got {n!r}")
        if not isinstance(self.dynamic, bool):
            raise ValueError(f"speculative_config.dynamic must be true or false, got {self.dynamic!r}")
