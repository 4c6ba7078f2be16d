"""The front end's check of a request's adapter, before it reaches the engine core."""

from __future__ import annotations

import threading

from pagedllm.lora.config import LoRAConfig
from pagedllm.lora.gguf_adapter import load_adapter
from pagedllm.lora.peft_reader import check_shapes
from pagedllm.lora.request import LoRARequest


def text_model_shapes(text_config) -> tuple[dict[str, tuple[int, int]], int]:
    """``(projection -> (out, in), num_layers)`` of a Llama-family ``transformers`` text config; a
    mixture-of-experts config (``num_local_experts`` / ``num_experts``) has the attention projections
    only (its MLPs are experts, which adapters are not served on)."""
    hidden, heads = text_config.hidden_size, text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or hidden // heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    q, kv = heads * head_dim, kv_heads * head_dim
    shapes = {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q)}
    if not (getattr(text_config, "num_local_experts", None) or getattr(text_config, "num_experts", None)):
        inter = text_config.intermediate_size
        shapes |= {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    return shapes, text_config.num_hidden_layers


class AdapterChecker:
    """Checks each ``LoRARequest`` once (the directory read, its shapes against the base model).

    Args:
        config: the engine's ``LoRAConfig``, or ``None`` when adapters are off.
        text_config: the base model's ``transformers`` text config.
    """

    def __init__(self, config: LoRAConfig | None, text_config) -> None:
        self.config = config
        self.text_config = text_config
        self._seen: dict[int, tuple[str, str]] = {}  # lora_int_id -> (name, path) checked
        self._lock = threading.Lock()

    def check(self, lora: LoRARequest | None) -> None:
        """Accept ``lora`` or raise.

        Raises:
            ValueError: adapters are off (no ``enable_lora``), not a ``LoRARequest``, an id already
                used by another adapter, or an adapter its reader refuses (a PEFT directory or a llama.cpp
                GGUF file, ``gguf_adapter.load_adapter``); the message names why.
        """
        if lora is None:
            return
        if self.config is None:
            raise ValueError("lora_request: LoRA adapters need an engine built with enable_lora=True")
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request: expected a LoRARequest, got {type(lora).__name__}")
        key = (lora.lora_name, lora.lora_path)
        with self._lock:
            seen = self._seen.get(lora.lora_int_id)
        if seen == key:
            return
        if seen is not None:
            raise ValueError(f"lora_int_id {lora.lora_int_id} is already adapter {seen[0]!r} ({seen[1]}); "
                             f"give {lora.lora_name!r} another id")
        adapter = load_adapter(lora.lora_path, self.config.max_lora_rank, self.text_config)
        shapes, layers = text_model_shapes(self.text_config)
        check_shapes(adapter, shapes, layers)
        with self._lock:
            self._seen[lora.lora_int_id] = key
