"""The Triton paged attention backend: the GPU path (and, under Triton's interpreter, the CPU).

Per step the host builds one small int64 buffer (the slot mapping, query start
locations, context lengths, the step's block-table rows, the decode list and
the prefill tile map) and copies it to the device in one transfer
(``non_blocking`` from pinned memory on CUDA); every layer then runs three
launches at most: the K/V write, the split-K decode with its reduction, and
the prefill / mixed kernel (``attention/triton_kernels.py``). Nothing in
``forward`` reads a device value on the host.

Chosen with ``--attention-backend triton`` / ``LLM(attention_backend="triton")``,
and by default on CUDA devices. On a CPU device it runs only under Triton's
interpreter (``TRITON_INTERPRET=1`` set before the first use, i.e. before
``triton`` compiles anything): slow, meant for tests. The C kernels' fused
batch-1 decode stack is not used with this backend, so its model runs torch
ops around the Triton attention, as on the GPU.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

import pagedllm.envs as envs
from pagedllm.attention.backend import AttentionBackend, KVCache
from pagedllm.attention.metadata import AttentionBatch

# tokens per decode split (flash-decoding): one split per ~SPLIT_TOKENS of the longest context,
# at most MAX_SPLITS (vLLM's paged attention v2 uses partitions of 512)
SPLIT_TOKENS = 512
MAX_SPLITS = 16
# a KV block is one tile of the kernels' products, and tl.dot wants tiles of 16 or more on the GPU
MIN_CUDA_BLOCK_SIZE = 16


def triton_available() -> bool:
    """True when the ``triton`` package can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreter_on() -> bool:
    """True when Triton's interpreter is requested (``TRITON_INTERPRET=1``): kernels run on CPU tensors."""
    return envs.TRITON_INTERPRET


@dataclass
class TritonMetadata:
    """The step's layout for the Triton kernels, all views of one int64 device buffer.

    ``R`` requests, ``T`` tokens, ``Dn`` decodes, ``N`` prefill tiles.

    Attributes:
        slot_mapping: ``[T]`` cache slot of each token's K/V.
        query_start_loc: ``[R + 1]`` first row of each request.
        num_computed: ``[R]`` tokens cached before this step; seq_lens: ``[R]`` after it.
        block_tables: ``[R, nblk]`` block ids of each request (``nblk``: the longest context's).
        decode_req: ``[Dn]`` requests with one query token.
        tile_req, tile_q0: ``[N]`` request and first local query token of each prefill tile.
        num_splits, split_len: the decode split-K grid (splits per context, tokens per split).
        block_q: query tokens per prefill tile.
        spans: ``[2, T]`` first and end position of the bidirectional span (an image of Gemma 3)
            each token lies in (``0, 0``: none), or ``None`` when the step has none.
    The CPU backends' shared fields (``AttentionMetadata``) are not built: the models read them
    only for the C kernels' fused decode, which never runs with this backend.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    num_computed: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    decode_req: torch.Tensor
    tile_req: torch.Tensor
    tile_q0: torch.Tensor
    num_splits: int
    split_len: int
    block_q: int
    spans: torch.Tensor | None = None


@dataclass
class StepLayout:
    """The part of a step's Triton layout the host decides (``TritonPagedBackend.step_layout``).

    Attributes:
        decode_req: ``[Dn]`` int64 requests with one query token.
        tile_req, tile_q0: ``[N]`` int64 request and first local query token of each prefill tile.
        num_splits, split_len: the decode split-K grid (splits per context, tokens per split).
        nblk: block-table columns the step's kernels read per request (the longest context's blocks).
    """

    decode_req: np.ndarray
    tile_req: np.ndarray
    tile_q0: np.ndarray
    num_splits: int
    split_len: int
    nblk: int


class TritonPagedBackend(AttentionBackend):
    """Paged attention in Triton kernels (vLLM's paged attention, flash-decoding split-K for decodes,
    FlashAttention-2 tiles for prefills). Metadata: ``TritonMetadata``.

    Args:
        device: the model's device (CUDA, or CPU under ``TRITON_INTERPRET=1``).
    Attributes:
        split_tokens, max_splits: the decode split-K policy (tests lower ``split_tokens`` to
            exercise many splits on short contexts).
    """

    name = "triton"
    auto_devices: ClassVar[tuple[str, ...] | None] = ("cuda",)
    requirement = ("the triton package (pip install triton==3.9.0) and a CUDA device, or on the CPU "
                   "Triton's interpreter (TRITON_INTERPRET=1); dtypes float16, bfloat16, float32")

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        from pagedllm.attention import triton_kernels  # imports triton: TRITON_INTERPRET is read now
        self._k = triton_kernels
        self.split_tokens = SPLIT_TOKENS
        self.max_splits = MAX_SPLITS
        self.block_q = triton_kernels.PREFILL_BLOCK_Q
        self._pin = self.device.type == "cuda"

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        """True for float16/bfloat16/float32 on CUDA with triton installed, or on the CPU when
        Triton's interpreter is on."""
        if dtype not in (torch.float16, torch.bfloat16, torch.float32) or not triton_available():
            return False
        device = torch.device(device)
        if device.type == "cuda":
            return True
        return device.type == "cpu" and interpreter_on()

    def step_layout(self, num_sched: np.ndarray, seq_lens: np.ndarray, block_size: int) -> StepLayout:
        """The host-side part of a step's layout: which requests decode, the prefill tiles, the
        split-K grid and the block-table width (host arrays only: the device path builds the rest
        on the device, ``worker/device/device_inputs.py``).

        The decode split count follows the longest decode context: ``ceil(max_len / split_tokens)``
        splits, at most ``max_splits``, each a whole number of blocks.

        Args:
            num_sched: ``[R]`` int64 query tokens per request; seq_lens: ``[R]`` int64 context
                lengths after the step; block_size: tokens per KV block.
        Raises:
            ValueError: a block size under 16 on CUDA (``tl.dot`` needs 16-wide tiles there).
        """
        bs, n = block_size, num_sched
        if bs < MIN_CUDA_BLOCK_SIZE and self.device.type == "cuda":
            raise ValueError(f"attention backend 'triton' needs block_size >= {MIN_CUDA_BLOCK_SIZE} on CUDA, got {bs}")
        nblk = max(1, -(-int(seq_lens.max()) // bs)) if n.size else 1
        dec = np.flatnonzero(n == 1)
        pre = np.flatnonzero(n > 1)
        tiles = -(-n[pre] // self.block_q)
        tile_req = np.repeat(pre, tiles)
        tile_q0 = (np.arange(int(tiles.sum()), dtype=np.int64) - np.repeat(np.cumsum(tiles) - tiles, tiles)) * self.block_q
        max_dec = int(seq_lens[dec].max()) if dec.size else 1
        num_splits, split_len = self.fixed_splits(max_dec, bs)
        return StepLayout(decode_req=dec, tile_req=tile_req, tile_q0=tile_q0, num_splits=num_splits,
                          split_len=split_len, nblk=nblk)

    def fixed_splits(self, max_len: int, block_size: int) -> tuple[int, int]:
        """The decode split-K grid covering contexts up to ``max_len`` tokens: ``(num_splits,
        split_len)``, ``ceil(max_len / split_tokens)`` splits (at most ``max_splits``), each a whole
        number of blocks. A step uses its longest decode context; a CUDA graph, whose grid is
        frozen, uses ``max_model_len`` (``worker/device/cuda_graphs.py``)."""
        max_len = max(1, int(max_len))
        num_splits = int(min(self.max_splits, max(1, -(-max_len // self.split_tokens))))
        split_len = -(-(-(-max_len // num_splits)) // block_size) * block_size
        return num_splits, split_len

    def build_metadata(self, batch: AttentionBatch) -> TritonMetadata:
        """Pack the step's layout (``step_layout``, with the slot mapping, lengths and block-table
        rows gathered on the host) into one int64 buffer and copy it to the device once.

        Raises:
            ValueError: from ``step_layout``.
        """
        qsl = batch.query_start_loc
        r = qsl.shape[0] - 1
        lay = self.step_layout(qsl[1:] - qsl[:-1], batch.seq_lens, batch.block_size)
        nblk = lay.nblk
        tables = batch.block_table[batch.rows, :nblk]
        parts = [batch.slot_mapping, qsl, batch.num_computed, batch.seq_lens, tables.reshape(-1), lay.decode_req,
                 lay.tile_req, lay.tile_q0]
        spans = token_spans(batch)
        if spans is not None:
            parts.append(spans)
        host = np.concatenate([np.asarray(p, dtype=np.int64).reshape(-1) for p in parts])
        buf = torch.from_numpy(host)
        if self._pin:
            buf = buf.pin_memory()
        buf = buf.to(self.device, non_blocking=True)
        views, at = [], 0
        for p in parts:
            views.append(buf[at:at + p.size])
            at += p.size
        return TritonMetadata(slot_mapping=views[0], query_start_loc=views[1], num_computed=views[2],
                              seq_lens=views[3], block_tables=views[4].view(r, nblk), decode_req=views[5],
                              tile_req=views[6], tile_q0=views[7], num_splits=lay.num_splits,
                              split_len=lay.split_len, block_q=self.block_q,
                              spans=None if spans is None else views[8].view(2, -1))

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache, metadata: TritonMetadata) -> None:
        """Scatter the step's K/V ``[T, KVH, D]`` into their slots (one Triton launch)."""
        self._k.write_kv(_last_contig(key), _last_contig(value), kv_cache[0], kv_cache[1], metadata.slot_mapping)

    def attend(self, query: torch.Tensor, kv_cache: KVCache, metadata: TritonMetadata, scale: float,
               sliding_window: int | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Decodes through the split-K kernel and its reduction, multi-token requests through the
        prefill kernel; returns ``[T, H, D]`` in ``query``'s dtype (``sinks``: ``[H]``, any float dtype)."""
        if sinks is not None:
            sinks = sinks.to(device=query.device, dtype=torch.float32).contiguous()
        query = _last_contig(query)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        kc, vc = kv_cache
        m = metadata
        self._k.decode_attention(out, query, kc, vc, m.block_tables, m.seq_lens, m.query_start_loc, m.decode_req,
                                 m.num_splits, m.split_len, scale, sliding_window, softcap, sinks)
        self._k.prefill_attention(out, query, kc, vc, m.block_tables, m.seq_lens, m.num_computed, m.query_start_loc,
                                  m.tile_req, m.tile_q0, m.block_q, scale, sliding_window, softcap, sinks, m.spans)
        return out


def token_spans(batch: AttentionBatch) -> np.ndarray | None:
    """``[2, T]`` int64 first and end position of the ``AttentionBatch.bidirectional`` span each
    token of the step lies in (``0, 0``: none), or ``None`` when no request has one."""
    if not batch.bidirectional or not any(batch.bidirectional):
        return None
    qsl = batch.query_start_loc
    out = np.zeros((2, int(qsl[-1])), dtype=np.int64)
    for i, spans in enumerate(batch.bidirectional):
        pos = np.arange(int(batch.num_computed[i]), int(batch.num_computed[i]) + int(qsl[i + 1] - qsl[i]))
        for lo, hi in spans:
            inside = (pos >= lo) & (pos < hi)
            out[0, qsl[i]:qsl[i + 1]][inside], out[1, qsl[i]:qsl[i + 1]][inside] = lo, hi
    return out


def _last_contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()
