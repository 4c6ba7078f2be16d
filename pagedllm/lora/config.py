"""``LoRAConfig``: the engine's LoRA settings, resolved from ``EngineArgs`` (vLLM's flag names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAConfig:
    """What the runner and scheduler need to serve adapters.

    Attributes:
        max_loras: distinct adapters one step may hold (the runner's slots).
        max_lora_rank: the highest adapter rank accepted (slot tensors are this wide).
        max_cpu_loras: adapters kept read in host memory (least recently used evicted), >= ``max_loras``.
    Raises:
        ValueError: a value below 1, or ``max_cpu_loras < max_loras``.
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras: must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank: must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
