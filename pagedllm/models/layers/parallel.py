"""Tensor-parallel layers (Megatron-LM: Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion
Parameter Language Models Using Model Parallelism", section 3; shaped as vLLM's
``vllm/model_executor/layers/linear.py`` and ``vocab_parallel_embedding.py``).

A transformer block needs two all-reduces: the attention's Q/K/V projection is split by output
(column-parallel: each rank computes its own heads, no communication), the output projection by
input (row-parallel: each rank's partial product is summed over the ranks), and the same for the
MLP's gate/up (column) and down (row) projections. The embedding table is split by vocabulary rows
(each rank looks up the ids it holds, zeros for the others, then one all-reduce), and the LM head
by vocabulary too (each rank computes its rows' logits; rank 0 gathers them).

Heads are never cut: ``head_shard`` gives each rank whole KV groups (a KV head with all the query
heads that read it). With fewer KV heads than ranks each KV head is replicated on ``tp / kvh``
ranks, which split its query heads. Splits need not be even (SmolLM2's 3 KV groups of 3 heads
over 2 ranks: 6 and 3 query heads): earlier ranks take the larger share (``balanced_split``).

Weights load sharded: each layer's ``load`` takes a lazy safetensors slice (``safe_open(...).get_slice``,
or any tensor) and reads only this rank's rows or columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_reduce, tp_gather_last_dim


def balanced_split(n: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, count)`` of part ``index`` when ``n`` items are split into ``parts`` contiguous parts
    whose sizes differ by at most one (the first ``n % parts`` parts take one more)."""
    base, extra = divmod(n, parts)
    return index * base + min(index, extra), base + (index < extra)


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank holds (global head indices, contiguous ranges)."""

    q_start: int
    q_heads: int
    kv_start: int
    kv_heads: int


def head_shard(num_heads: int, num_kv_heads: int, tp_size: int, rank: int) -> HeadShard:
    """Whole KV groups per rank, or (fewer KV heads than ranks) one replicated KV head per rank.

    Raises:
        ValueError: the heads cannot be split into whole heads on ``tp_size`` ranks (the message
            names ``--tensor-parallel-size``).
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp_size:
        kv_start, kv_heads = balanced_split(num_kv_heads, tp_size, rank)
        return HeadShard(kv_start * group, kv_heads * group, kv_start, kv_heads)
    reps = tp_size // num_kv_heads
    if tp_size % num_kv_heads or group < reps:
        raise ValueError(f"--tensor-parallel-size {tp_size} cannot split {num_heads} attention heads and "
                         f"{num_kv_heads} KV heads into whole heads (with fewer KV heads than ranks the ranks "
                         "must be a multiple of the KV heads, and each must get a query head)")
    kv = rank // reps
    q_start, q_heads = balanced_split(group, reps, rank % reps)
    return HeadShard(kv * group + q_start, q_heads, kv, 1)


class ColumnParallelLinear(nn.Module):
    """``y = x A_r^T`` for this rank's output rows of one or more source matrices (no communication).

    Each *piece* is a contiguous row range of a checkpoint matrix (``q_proj``, ``gate_proj``, ...);
    the local output is the pieces concatenated in order, so a merged QKV layer outputs
    ``[q_local, k_local, v_local]`` and a merged gate/up layer ``[gate_local, up_local]``.

    Args:
        in_features: input width (every rank sees the whole input).
        pieces: ``{piece name: (first source row, rows)}`` in output order.
        bias: whether the source matrices have a bias.
    Shapes:
        ``x`` ``[T, in_features]`` -> ``[T, sum(rows)]``, the model's float dtype.
    """

    def __init__(self, in_features: int, pieces: dict[str, tuple[int, int]], bias: bool) -> None:
        super().__init__()
        self.pieces = dict(pieces)
        self.offsets, off = {}, 0
        for name, (_, rows) in self.pieces.items():
            self.offsets[name], off = off, off + rows
        self.weight = nn.Parameter(torch.empty(off, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(off), requires_grad=False) if bias else None
        self.loaded: set[tuple[str, str]] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, in]`` -> ``[T, out_local]``."""
        return F.linear(x, self.weight, self.bias)

    def load(self, param: str, source, piece: str) -> None:
        """Copy this rank's rows of checkpoint tensor ``source`` (``[rows_total, in]`` weight or
        ``[rows_total]`` bias; a safetensors slice reads only those rows) into ``piece``.

        Raises:
            KeyError: an unknown piece or parameter name.
        """
        start, rows = self.pieces[piece]
        dst = getattr(self, param)
        if dst is None:
            raise KeyError(f"unexpected {param} for {piece}")
        off = self.offsets[piece]
        dst.data[off:off + rows].copy_(source[start:start + rows])
        self.loaded.add((param, piece))

    def missing(self) -> list[str]:
        """``param#piece`` names not loaded yet."""
        params = ["weight"] + (["bias"] if self.bias is not None else [])
        return [f"{p}#{k}" for p in params for k in self.pieces if (p, k) not in self.loaded]


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_r A_r^T) + b``: this rank holds input columns ``[start, start + cols)``.

    Args:
        in_range: ``(first input column, columns)`` of this rank (the split of the column-parallel
            layer before it).
        out_features: output width.
        bias: whether the source matrix has a bias (added once, after the all-reduce).
    Shapes:
        ``x`` ``[T, cols]`` -> ``[T, out_features]``, summed over the ranks (one all-reduce of
        ``T * out_features`` elements).
    """

    def __init__(self, in_range: tuple[int, int], out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_start, cols = in_range
        self.weight = nn.Parameter(torch.empty(out_features, cols), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.loaded: set[str] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, cols]`` -> ``[T, out]`` (all-reduced)."""
        y = tp_all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    def load(self, param: str, source, piece: str | None = None) -> None:
        """Copy this rank's columns of the checkpoint weight (the whole bias) from ``source``."""
        if param == "bias":
            self.bias.data.copy_(source[:])
        else:
            cols = self.weight.shape[1]
            self.weight.data.copy_(source[:, self.in_start:self.in_start + cols])
        self.loaded.add(param)

    def missing(self) -> list[str]:
        """Parameters not loaded yet."""
        return [p for p in ("weight", "bias") if getattr(self, p) is not None and p not in self.loaded]


class VocabParallelEmbedding(nn.Module):
    """The embedding table split by vocabulary rows: rank ``r`` holds ids ``[r * s, (r + 1) * s)``
    with ``s = ceil(vocab / tp)`` (rows past ``vocab`` are zero padding).

    Shapes:
        ``ids`` ``[T]`` int64 -> ``[T, hidden]``: local lookup, zeros for ids held elsewhere, one
        all-reduce of ``T * hidden`` elements.
    """

    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.shard = -(-vocab_size // get_tp_size())
        self.start = get_tp_rank() * self.shard
        self.end = min(vocab_size, self.start + self.shard)
        self.weight = nn.Parameter(torch.empty(self.shard, hidden), requires_grad=False)
        self.loaded: set[str] = set()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` int64 -> ``[T, hidden]``."""
        held = (ids >= self.start) & (ids < self.end)
        out = F.embedding(torch.where(held, ids - self.start, 0), self.weight)
        out.masked_fill_(~held.unsqueeze(1), 0)
        return tp_all_reduce(out)

    def load(self, param: str, source, piece: str | None = None) -> None:
        """Copy this rank's vocabulary rows of ``[vocab, hidden]`` ``source``; zero the padding."""
        n = self.end - self.start
        self.weight.data[n:].zero_()
        if n > 0:
            self.weight.data[:n].copy_(source[self.start:self.end])
        self.loaded.add(param)

    def missing(self) -> list[str]:
        """Parameters not loaded yet."""
        return [] if "weight" in self.loaded else ["weight"]


class ParallelLMHead(VocabParallelEmbedding):
    """An untied LM head split by vocabulary rows (same layout and loading as the embedding)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - called through ParallelLogits
        """Not a lookup: use ``ParallelLogits``."""
        raise TypeError("ParallelLMHead computes logits through ParallelLogits")


class ParallelLogits:
    """Logits from a vocabulary-split table (the embedding when tied, else a ``ParallelLMHead``).

    Not a module (holds no parameters of its own). ``__call__(x)`` ``[R, hidden]`` -> ``[R, vocab]``
    on rank 0 (each rank's ``[R, s]`` gathered and the padding cut) and ``[R, 0]`` on the others.
    """

    def __init__(self, table: VocabParallelEmbedding) -> None:
        self.table = table

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``[R, hidden]`` -> ``[R, vocab]`` on rank 0, ``[R, 0]`` elsewhere."""
        full = tp_gather_last_dim(F.linear(x, self.table.weight))
        return x.new_empty(x.shape[0], 0) if full is None else full[:, :self.table.vocab_size]


PARALLEL_TYPES = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


def load_parallel_weights(model: nn.Module, weights, fused: dict[str, tuple[str, str]], skip=()) -> None:
    """Load checkpoint tensors into a model built with the layers above, each rank taking only its part.

    Args:
        weights: ``(name, tensor or safetensors slice)`` pairs with ``transformers`` names.
        fused: checkpoint module name -> ``(fused module name, piece)``, e.g.
            ``{"q_proj": ("qkv_proj", "q")}``.
        skip: checkpoint names to ignore (``lm_head.weight`` of a tied model).
    Raises:
        KeyError: a checkpoint tensor the model does not have, or a parameter left unloaded.
    """
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    for name, source in weights:
        name = name.removeprefix("model.")
        if "rotary_emb" in name or name in skip:
            continue
        parts = name.split(".")
        mod_name, param, piece = ".".join(parts[:-1]), parts[-1], None
        if len(parts) >= 2 and parts[-2] in fused:
            fused_name, piece = fused[parts[-2]]
            mod_name = ".".join(parts[:-2] + [fused_name])
        mod = modules.get(mod_name)
        if isinstance(mod, PARALLEL_TYPES):
            mod.load(param, source, piece)
        elif mod is not None and isinstance(getattr(mod, param, None), torch.Tensor):
            getattr(mod, param).data.copy_(source[:])
            loaded.add(f"{mod_name}.{param}")
        else:
            raise KeyError(f"unexpected weight {name!r} in checkpoint")
    missing = [f"{n}.{m}" for n, mod in modules.items() if isinstance(mod, PARALLEL_TYPES) for m in mod.missing()]
    plain = {n for n, p in model.named_parameters()
             if not isinstance(modules.get(n.rpartition(".")[0]), PARALLEL_TYPES)}
    missing += sorted(plain - loaded)
    if missing:
        raise KeyError(f"checkpoint lacks weights for {missing[:5]}{'...' if len(missing) > 5 else ''}")
