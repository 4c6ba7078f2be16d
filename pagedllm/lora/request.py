"""``LoRARequest``: which adapter a request runs with (vLLM's ``vllm.lora.request.LoRARequest`` fields).

A msgspec struct, so it travels inside ``EngineCoreRequest`` to a core process unchanged.
"""

from __future__ import annotations

import hashlib

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """A request for a LoRA adapter, as vLLM names its fields.

    Attributes:
        lora_name: the adapter's name (what a server's ``model`` field would say).
        lora_int_id: a positive id, unique per adapter for the engine's life (slots and the
            scheduler's per-step count key on it).
        lora_path: the PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``), or a
            llama.cpp LoRA adapter file ending in ``.gguf``.
        base_model_name: the base model it was trained on (informative only).
        long_lora_max_len, tensorizer_config_dict: accepted for vLLM's signature; must stay ``None``.
    Raises:
        ValueError: ``lora_int_id`` below 1, an empty ``lora_path``, or one of the unsupported
            fields set.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    long_lora_max_len: int | None = None
    tensorizer_config_dict: dict | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id: must be an integer > 0, got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"lora_path: adapter {self.lora_name!r} needs a PEFT directory or a .gguf file")
        if self.long_lora_max_len is not None or self.tensorizer_config_dict is not None:
            raise ValueError("long_lora_max_len and tensorizer_config_dict are not supported")

    @property
    def adapter_id(self) -> int:
        """vLLM's alias of ``lora_int_id``."""
        return self.lora_int_id

    @property
    def name(self) -> str:
        """vLLM's alias of ``lora_name``."""
        return self.lora_name

    @property
    def path(self) -> str:
        """vLLM's alias of ``lora_path``."""
        return self.lora_path

    def cache_key(self) -> bytes:
        """The adapter's identity in prefix-cache block hashes: SHA-256 of id, name and path (32 bytes).

        Two requests share KV blocks only when all three are equal (``core/hashing.py``).
        """
        text = f"{self.lora_int_id}\0{self.lora_name}\0{self.lora_path}"
        return hashlib.sha256(text.encode("utf-8")).digest()
