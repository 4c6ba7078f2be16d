"""CUDA graphs for decode steps of the Triton path, captured at start-up at bucketed batch sizes.

A decode step launches a few kernels per layer; at small batches the launch
overhead, not the work, bounds it. Following vLLM's documented design, the
model forward (embedding to logits) is captured once per batch-size bucket
(1, 2, 4, 8, then multiples of 8 up to ``max_num_seqs``) over static input
buffers sized for the largest bucket, and a decode step of ``R`` requests
copies its inputs into those buffers, pads them to the next bucket and
replays that bucket's graph (PyTorch: ``torch.cuda.CUDAGraph``,
``torch.cuda.graph(..., pool=...)``, warm-up on a side stream before
capture; one memory pool shared by every bucket, captured largest first so
the smaller ones reuse its memory). Sampling stays eager: its sizes vary
per step (the rows with penalties, top-k/top-p, ...).

What has to be static for a replay to be right, and is here:
- every tensor the forward reads from the step is one of the buffers (the metadata
  a graph was captured with holds views of them, nothing is re-derived per step);
- the grid sizes: the decode split-K count is fixed per engine, from
  ``max_model_len`` (``TritonPagedBackend.fixed_splits``), not from the step's
  longest context (empty splits cost a loop that does not run);
- padded rows: slot -1 (the K/V write skips it) and context length 0 (decode
  attention reads no key, its output is 0), token 0 at position 0; rows are
  independent through the model, so they cannot change the real rows.

The capture mechanism is injected (``capture``): ``CudaGraphCapture`` on CUDA;
tests on the CPU pass ``CallCapture``, which replays by calling the same
callable over the same buffers, so what a real graph would freeze is checked
by running it.
"""

from __future__ import annotations

import logging
from typing import Callable, Protocol

import torch

from pagedllm.attention.triton_paged import TritonMetadata, TritonPagedBackend

logger = logging.getLogger(__name__)

Forward = Callable[[], torch.Tensor]


class Captured(Protocol):
    """One captured forward: ``replay()`` reruns it, and its result is in ``output`` (a static tensor)."""

    output: torch.Tensor

    def replay(self) -> None:
        """Rerun the captured work over the current contents of the static buffers."""


class CallCapture:
    """A stand-in for graph capture on the CPU: replay calls the eager callable again.

    The callable closes over the static buffers and the metadata built from them at
    capture time, exactly as a CUDA graph would; so a replay reads only what a real
    graph would read, and with the same grid sizes.

    Attributes:
        captured: the batch sizes captured, in capture order.
        replays: replays per batch size.
    """

    def __init__(self) -> None:
        self.captured: list[int] = []
        self.replays: dict[int, int] = {}

    def __call__(self, fn: Forward, size: int) -> Captured:
        """Capture ``fn`` for batch size ``size`` (calls it once, as capture would)."""
        self.captured.append(size)
        capture = self

        class _Replay:
            output = fn()

            def replay(self) -> None:
                capture.replays[size] = capture.replays.get(size, 0) + 1
                self.output.copy_(fn())

        return _Replay()


class CudaGraphCapture:
    """``torch.cuda.CUDAGraph`` capture with one memory pool shared by every bucket.

    Args:
        warmup: eager runs on a side stream before capture (compiles the Triton kernels and lets
            lazily initialized state settle: PyTorch's CUDA Graphs notes ask for it).
    """

    def __init__(self, warmup: int = 2) -> None:
        self.warmup = warmup
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, fn: Forward, size: int) -> Captured:
        """Capture ``fn`` (batch size ``size``, for logs) into a new graph of the shared pool.

        Raises:
            RuntimeError: from PyTorch when ``fn`` does something capture forbids (a host sync,
                a CPU tensor, ...).
        """
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()

        class _Graph:
            output = out

            def replay(self) -> None:
                graph.replay()

        return _Graph()


def capture_for(device: torch.device):
    """The default capture for ``device``: ``CudaGraphCapture`` on CUDA, else ``None`` (no graphs).
    Tests replace this function to inject ``CallCapture``."""
    return CudaGraphCapture() if torch.device(device).type == "cuda" else None


def default_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's decode buckets: 1, 2, 4, 8, then multiples of 8, all ``<= max_num_seqs``, and
    ``max_num_seqs`` itself when it is not one (so every decode batch has a bucket)."""
    sizes = [s for s in [1, 2, 4] + list(range(8, max_num_seqs + 1, 8)) if s <= max_num_seqs]
    return sizes if sizes[-1] == max_num_seqs else sizes + [max_num_seqs]


class DecodeGraphs:
    """Decode-step forwards captured per batch bucket, over static input buffers.

    Args:
        model: the model, called as ``model(input_ids, positions, kv_caches, meta, logits_rows)``
            returning ``[B, vocab]`` float32 logits.
        kv_caches: the runner's per-layer ``(key_cache, value_cache)`` (fixed tensors).
        backend: the Triton attention backend (its split policy and prefill tile size).
        max_model_len: longest context in tokens (fixes the decode split-K grid).
        block_size: tokens per KV block; max_blocks: block-table columns (``InputBatch``'s).
        sizes: batch buckets, ascending (``default_sizes``); each is captured now.
        capture: ``(fn, size) -> Captured`` (``CudaGraphCapture``, ``CallCapture``).
        device: the model's device.
    Attributes:
        sizes: the buckets captured; graphs: bucket -> ``Captured``.
        input_ids, positions, slot_mapping, seq_lens: ``[Bmax]`` int64 static buffers;
        block_tables: ``[Bmax, max_blocks]`` int64; num_splits, split_len: the fixed decode grid.
    Raises:
        ValueError: ``sizes`` empty or not positive.
    """

    def __init__(self, model, kv_caches, backend: TritonPagedBackend, max_model_len: int, block_size: int,
                 max_blocks: int, sizes: list[int], capture, device: torch.device) -> None:
        sizes = sorted(set(int(s) for s in sizes))
        if not sizes or sizes[0] < 1:
            raise ValueError(f"cuda graph sizes must be positive, got {sizes}")
        self.sizes, big = sizes, sizes[-1]
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(big, **i64)
        self.positions = torch.zeros(big, **i64)
        self.slot_mapping = torch.full((big,), -1, **i64)  # -1: no K/V write (also during capture)
        self.seq_lens = torch.zeros(big, **i64)  # 0: no key read
        self.block_tables = torch.zeros(big, max_blocks, **i64)
        # a decode-only step: request i is row i, so these never change
        self._arange = torch.arange(big + 1, **i64)
        self._num_computed = torch.zeros(big, **i64)
        self._none = torch.zeros(0, **i64)
        self.num_splits, self.split_len = backend.fixed_splits(max_model_len, block_size)
        self._block_q = backend.block_q
        self.graphs: dict[int, Captured] = {}
        for size in reversed(sizes):  # largest first: the smaller graphs reuse its pool memory
            meta = self._meta(size)
            ids, pos, rows = self.input_ids[:size], self.positions[:size], self._arange[:size]
            self.graphs[size] = capture(lambda ids=ids, pos=pos, meta=meta, rows=rows:
                                        model(ids, pos, kv_caches, meta, rows), size)
        logger.info("captured decode graphs for batch sizes %s (%d decode splits)", sizes, self.num_splits)

    def _meta(self, size: int) -> TritonMetadata:
        """The metadata of a ``size``-row decode step, as views of the static buffers."""
        return TritonMetadata(slot_mapping=self.slot_mapping[:size], query_start_loc=self._arange[:size + 1],
                              num_computed=self._num_computed[:size], seq_lens=self.seq_lens[:size],
                              block_tables=self.block_tables[:size], decode_req=self._arange[:size],
                              tile_req=self._none, tile_q0=self._none, num_splits=self.num_splits,
                              split_len=self.split_len, block_q=self._block_q)

    def bucket(self, num_reqs: int) -> int | None:
        """The smallest bucket holding ``num_reqs`` requests, or ``None`` (run eagerly)."""
        for s in self.sizes:
            if s >= num_reqs:
                return s
        return None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: TritonMetadata) -> torch.Tensor:
        """Replay the decode step through its bucket's graph.

        Args:
            input_ids, positions: ``[R]`` int64 on the device, one token per request.
            meta: the step's ``TritonMetadata`` (``R`` decodes, request ``i`` at row ``i``;
                ``block_tables`` ``[R, nblk]`` with ``nblk <= max_blocks``).
        Returns:
            ``[R, vocab]`` float32 logits: a view of the graph's output, valid until the next replay.
        Raises:
            ValueError: ``R`` is above the largest bucket, or a step is not one token per request.
        """
        r = input_ids.shape[0]
        size = self.bucket(r)
        if size is None or meta.slot_mapping.shape[0] != r:
            raise ValueError(f"not a decode step of at most {self.sizes[-1]} requests: {r} requests, "
                             f"{meta.slot_mapping.shape[0]} tokens")
        # device-to-device copies on the step's stream: no host sync
        self.input_ids[:r].copy_(input_ids)
        self.positions[:r].copy_(positions)
        self.slot_mapping[:r].copy_(meta.slot_mapping)
        self.seq_lens[:r].copy_(meta.seq_lens)
        self.block_tables[:r, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        if size > r:  # padding rows; their block-table rows are never read (length 0)
            self.input_ids[r:size].zero_()
            self.positions[r:size].zero_()
            self.slot_mapping[r:size].fill_(-1)
            self.seq_lens[r:size].zero_()
        graph = self.graphs[size]
        graph.replay()
        return graph.output[:r]


def capture_decode_graphs(model, kv_caches, backend: TritonPagedBackend, input_batch, max_model_len: int,
                          sizes: list[int] | None, capture, device: torch.device) -> DecodeGraphs | None:
    """Capture the runner's decode graphs at start-up (Triton backend, a model with no recurrent
    state: the runner checks both).

    Args:
        model, kv_caches, backend: the runner's; input_batch: its persistent batch (block-table
        width, slots); max_model_len: longest sequence in tokens; sizes: the batch buckets (``None``: ``default_sizes``); capture: the
        mechanism (``None``: ``capture_for(device)``, which captures only on CUDA).
    Returns:
        The graphs, or ``None`` when nothing captures here or capture fails (logged: the engine
        still serves, eagerly).
    """
    capture = capture or capture_for(device)
    if capture is None:
        return None
    try:
        return DecodeGraphs(model, kv_caches, backend, max_model_len, input_batch.block_size,
                            input_batch.block_table.shape[1], sizes or default_sizes(input_batch.max_num_reqs),
                            capture, device)
    except RuntimeError as e:
        logger.warning("CUDA graph capture failed, every step runs eagerly: %s", e)
        return None
