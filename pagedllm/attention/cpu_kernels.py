"""The CPU-kernel paged attention backend: float32 on the CPU, through ``pagedllm.kernels.cpu``.

The K/V write and the decode attention run in the C kernels: the decode kernel
reads each context straight through its block table, with no gathered copy and
no mask (it stops at each request's length). Prefills keep the torch reference
path (``torch_paged.prefill_attention``): one SDPA call per request is already
compute-bound there. Chosen at load when the kernels are built and not turned
off (``PAGEDLLM_CPU_KERNELS=0``).
"""

from __future__ import annotations

import torch

from pagedllm.attention.backend import AttentionBackend, KVCache
from pagedllm.attention.metadata import AttentionBatch, AttentionMetadata, paged_fields
from pagedllm.attention.torch_paged import prefill_attention
from pagedllm.kernels import cpu as kernels


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    # the kernels take row and head strides but need each head's D values adjacent
    return t if t.stride(-1) == 1 else t.contiguous()


class CpuKernelBackend(AttentionBackend):
    """Paged attention with the C CPU kernels (metadata: the shared ``AttentionMetadata``).

    Needs contiguous caches (the runner allocates them so) and float32 tensors.
    """

    name = "cpu_kernels"
    uses_cpu_kernels = True

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        """True for float32 on the CPU when the kernels are enabled and built (``kernels.available()``)."""
        return kernels.applies(device, dtype)

    def build_metadata(self, batch: AttentionBatch) -> AttentionMetadata:
        """The shared paged fields only: the decode kernel needs no mask."""
        return AttentionMetadata(**paged_fields(batch, self.device))

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache,
                 metadata: AttentionMetadata) -> None:
        """Copy the step's K/V into their slots in one C call (``kernels.write_kv``)."""
        kernels.write_kv(kv_cache[0], kv_cache[1], _last_dim_contiguous(key), _last_dim_contiguous(value),
                         metadata.slot_mapping)

    def attend(self, query: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata, scale: float,
               sliding_window: int | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Decodes in the C kernel (through the block tables), prefills through torch SDPA."""
        query = _last_dim_contiguous(query)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if metadata.decode_token_idx.numel():
            kernels.decode_attention(out, query, metadata.decode_token_idx, metadata.decode_block_tables,
                                     metadata.decode_seq_lens, kv_cache[0], kv_cache[1], scale, sliding_window,
                                     softcap, None if sinks is None else sinks.float().contiguous())
        prefill_attention(out, query, kv_cache[0], kv_cache[1], metadata, scale, sliding_window, softcap, sinks)
        return out
