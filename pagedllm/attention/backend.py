"""The attention backend interface and the one-time choice of a backend at model load.

A backend owns one way of computing paged attention: the metadata layout it
wants (``build_metadata``, once per step, shared by every layer), the K/V write
and the attention read (``forward``, once per layer). The runner asks the
backend for the step's metadata and never builds a backend's private layout
itself; the model's attention layers call ``forward``. The backend is chosen
once, when the model is loaded (``selector.select_attention_backend``), so no per-call
code asks which kernels exist.

The KV cache of a layer is a pair ``(key_cache, value_cache)``, each
``[num_kv_heads, num_blocks, block_size, head_dim]`` (head-major). The shape of
the interface follows vLLM's ``AttentionBackend`` / ``AttentionMetadataBuilder``
split (metadata built once per step, an implementation called per layer).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from pagedllm.attention.metadata import AttentionBatch, AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]


class AttentionBackend(ABC):
    """One paged attention implementation (subclasses register in ``BACKENDS``).

    Args:
        device: the device of the model, the KV cache and the metadata tensors.
    Class attributes:
        name: the backend's registry name.
        uses_cpu_kernels: True when the backend runs the C CPU kernels (``pagedllm.kernels.cpu``);
            the engine reports it as ``get_stats()["cpu_kernels"]``.
        auto_devices: device types on which ``select_attention_backend`` may pick the backend
            without being asked by name (``None``: any device it supports).
        requirement: what the backend needs, said in the error when it cannot run.
    """

    name: ClassVar[str]
    uses_cpu_kernels: ClassVar[bool] = False
    auto_devices: ClassVar[tuple[str, ...] | None] = None
    requirement: ClassVar[str] = ""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)

    @classmethod
    @abstractmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        """True when this backend can run a model of ``dtype`` on ``device``."""

    @abstractmethod
    def build_metadata(self, batch: AttentionBatch) -> AttentionMetadata:
        """The step's metadata for this backend, tensors on ``self.device``.

        Called on the scheduling thread while the previous step may still run: the
        result must not alias ``batch.block_table``.
        """

    @abstractmethod
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache,
                 metadata: AttentionMetadata) -> None:
        """Write the step's ``key``/``value`` ``[T, KVH, D]`` into ``kv_cache`` at ``metadata.slot_mapping``."""

    supports_sinks = True  # per-head attention sinks (gpt-oss); a backend without them says False

    @abstractmethod
    def attend(self, query: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata, scale: float,
               sliding_window: int | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of ``query`` ``[T, H, D]`` over the cached contexts (the step's K/V
        already written); returns ``[T, H, D]``, same dtype. Arguments as in ``forward``."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata, scale: float, sliding_window: int | None = None,
                softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Write the step's K/V into the layer's cache, then attend over the paged contexts.

        Args:
            query: ``[T, H, D]`` (last dim contiguous; rows and heads may be strided).
            key, value: ``[T, KVH, D]`` of the step's tokens, same dtype as the cache.
            kv_cache: the layer's ``(key_cache, value_cache)``, each ``[KVH, num_blocks, block_size, D]``.
            metadata: this backend's ``build_metadata`` result for the step.
            scale: softmax scale (usually ``D ** -0.5``).
            sliding_window: a query at position ``i`` sees keys ``j > i - sliding_window`` only
                (Mistral, Gemma local layers; transformers' definition); ``None`` for full context.
            softcap: attention logit soft-capping ``softcap * tanh(s / softcap)`` (Gemma 2), or ``None``.
            sinks: ``[H]`` float32 per-head sink logits (gpt-oss: one more entry in each softmax,
                with no value), or ``None``.
        Returns:
            ``[T, H, D]`` attention output.
        """
        self.write_kv(key, value, kv_cache, metadata)
        return self.attend(query, kv_cache, metadata, scale, sliding_window, softcap, sinks)
