"""LoRA adapters applied batched around a model's linears (Punica's SGMV / BGMV ideas, in torch).

``install_lora`` wraps each decoder layer's projections (a native model's fused ``qkv_proj`` /
``gate_up_proj`` included; the Transformers backend's unfused ``q_proj`` ... ``down_proj``:
``lora_layer_specs``) in a ``LoRALinear``. Each holds ``max_loras`` slots: ``A`` of every piece
stacked along the rank (``[slots, pieces * r, in]``) and ``B`` block-diagonal over the pieces with the
scale folded in (``[slots, out, pieces * r]``), so one adapter's delta on a fused linear is two
matmuls whatever its pieces. The wrapper computes the base output (whatever module the base is: ``nn.Linear``,
oneDNN-packed, GGUF blocks; the delta is added to its output) and then the step's adapter rows'
``(x @ A[slot]^T) @ B[slot]^T``, in one of two ways chosen per step by ``LoRAStep``:

* grouped (SGMV-like): per slot present in the step, gather its rows, two matmuls, scatter-add;
* padded (BGMV-like, few rows per adapter, i.e. decode): the adapter rows scattered into a
  ``[slots, g, in]`` buffer (``g``: the most rows one adapter has), two batched matmuls over all
  slots at once, gather and scatter-add back: a fixed number of operations however many adapters.

Never a forward per adapter. Rows of the base model get nothing. Ranks below the slot width are
zero-padded, which adds exact zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class LoRAStep:
    """One step's rows per adapter slot (``worker/lora_slots.py`` builds it).

    Attributes:
        groups: grouped mode: ``[(slot, rows)]``, ``rows`` ``[n]`` int64 indices into the flattened
            batch, or ``None`` when the slot holds every row of the step.
        padded: padded mode (then ``groups`` is ignored): ``(rows [N] int64, dest [N] int64, g)``:
            the adapter rows, each one's place ``slot * g + i`` in the ``[slots * g]`` buffer.
    """

    groups: list[tuple[int, torch.Tensor | None]]
    padded: tuple[torch.Tensor, torch.Tensor, int] | None = None


class LoRAContext:
    """The step every ``LoRALinear`` of a model reads (set by the model's forward; ``None``: base only)."""

    def __init__(self) -> None:
        self.step: LoRAStep | None = None


class LoRALinear(nn.Module):
    """A base linear plus batched LoRA deltas on pieces of its output.

    Args:
        base_layer: the linear module (``[T, in] -> [T, out]``).
        pieces: ``[(projection name, output start, output size)]`` tiling the output: a fused
            ``qkv_proj`` has three.
        in_features: the input width.
        max_loras: adapter slots.
        max_rank: per-piece slot width (the highest rank).
        ctx: the model's shared ``LoRAContext``.
    """

    def __init__(self, base_layer: nn.Module, pieces: list[tuple[str, int, int]], in_features: int,
                 max_loras: int, max_rank: int, ctx: LoRAContext) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.pieces = pieces
        self.max_rank = max_rank
        self.ctx = ctx
        w = next((p for p in base_layer.parameters() if p.dtype.is_floating_point), None)
        dtype = torch.float32 if w is None or w.dtype not in (torch.float32, torch.bfloat16, torch.float16) else w.dtype
        device = torch.device("cpu") if w is None else w.device
        out = sum(size for _, _, size in pieces)
        width = len(pieces) * max_rank
        self.register_buffer("lora_a", torch.zeros(max_loras, width, in_features, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, out, width, dtype=dtype, device=device),
                             persistent=False)
        # the padded mode's batched products read both transposed: contiguous copies, so that bmm never
        # copies a strided operand on each call (measured: it dominated a 4-adapter decode step)
        self.register_buffer("lora_at", torch.zeros(max_loras, in_features, width, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("lora_bt", torch.zeros(max_loras, width, out, dtype=dtype, device=device),
                             persistent=False)

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float) -> None:
        """Write an adapter into ``slot`` (pieces it lacks stay zero).

        Args:
            weights: projection name -> ``(A [r, in], B [out, r])`` float32, ``r <= max_rank``.
            scaling: multiplies ``B`` (folded in here).
        """
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        r0 = self.max_rank
        for p, (name, start, size) in enumerate(self.pieces):
            if name in weights:
                a, b = weights[name]
                r = a.shape[0]
                self.lora_a[slot, p * r0:p * r0 + r].copy_(a)
                self.lora_b[slot, start:start + size, p * r0:p * r0 + r].copy_(b * scaling)
        self.lora_at[slot].copy_(self.lora_a[slot].t())
        self.lora_bt[slot].copy_(self.lora_b[slot].t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., T, in]`` -> ``[..., T, out]`` (the Transformers backend's ``[1, T, in]``
        included): the base output plus each adapter row's delta, rows indexing the flattened batch."""
        y = self.base_layer(x)
        step = self.ctx.step
        if step is None:
            return y
        if x.dim() != 2:
            return self._add_delta(x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1]), step).view(y.shape)
        return self._add_delta(x, y, step)

    def _add_delta(self, x: torch.Tensor, y: torch.Tensor, step: LoRAStep) -> torch.Tensor:
        """``y`` ``[T, out]`` plus the deltas of ``step``'s adapter rows of ``x`` ``[T, in]`` (in place)."""
        xl = x.to(self.lora_a.dtype)
        if step.padded is not None:
            rows, dest, g = step.padded
            slots = self.lora_a.shape[0]
            buf = xl.new_zeros(slots * g, xl.shape[1]).index_copy_(0, dest, xl.index_select(0, rows))
            xa = torch.bmm(buf.view(slots, g, -1), self.lora_at)   # [slots, g, pieces * r]
            d = torch.bmm(xa, self.lora_bt).view(slots * g, -1)      # [slots * g, out]
            return y.index_add_(0, rows, d.index_select(0, dest).to(y.dtype))
        for slot, rows in step.groups:
            if rows is None and y.dtype == xl.dtype:  # every row: y += (x A^T) B^T in one fused product
                y.addmm_(xl @ self.lora_a[slot].t(), self.lora_b[slot].t())
                continue
            xs = xl if rows is None else xl.index_select(0, rows)
            d = ((xs @ self.lora_a[slot].t()) @ self.lora_b[slot].t()).to(y.dtype)  # [n, out]
            if rows is None:
                y += d
            else:
                y.index_add_(0, rows, d)
        return y


def unwrap(module: nn.Module) -> nn.Module:
    """The base module under a ``LoRALinear`` (``module`` itself otherwise)."""
    return module.base_layer if isinstance(module, LoRALinear) else module


# one wrapped linear: (owning module, attribute, pieces [(projection, output start, size)], in_features)
LayerSpec = tuple[nn.Module, str, list[tuple[str, int, int]], int]


def lora_layer_specs(model: nn.Module) -> list[list[LayerSpec]]:
    """Per decoder layer, the linears ``install_lora`` wraps: the model's own ``lora_layer_specs()``
    where it has one (the Transformers backend: ``models/transformers_lora.py``), else those of a native
    Llama-family model (fused ``qkv_proj`` / ``gate_up_proj`` as several pieces).

    Raises:
        ValueError: a model without Llama-style ``layers[i].self_attn`` / ``mlp`` fused projections.
    """
    own = getattr(model, "lora_layer_specs", None)
    if own is not None:
        return own()
    layers = getattr(model, "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") and hasattr(layer.self_attn, "qkv_proj")
                                 for layer in layers):
        raise ValueError(f"enable_lora: {type(model).__name__} has no native Llama-family decoder layers")
    specs = []
    for layer in layers:
        a, m = layer.self_attn, layer.mlp
        q, kv, hidden = a.q_size, a.kv_size, model.config.hidden_size
        specs.append([(a, "qkv_proj", [("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)], hidden),
                      (a, "o_proj", [("o_proj", 0, hidden)], q),
                      (m, "gate_up_proj", [("gate_proj", 0, m.inter), ("up_proj", m.inter, m.inter)], hidden),
                      (m, "down_proj", [("down_proj", 0, hidden)], m.inter)])
    return specs


def install_lora(model: nn.Module, specs: list[list[LayerSpec]], max_loras: int,
                 max_rank: int) -> dict[str, list[LoRALinear]]:
    """Wrap the linears of ``specs`` (``lora_layer_specs(model)``) in ``LoRALinear`` (in place).

    Sets ``model.lora_context`` (a ``LoRAContext``), which the model's forward sets per step from its
    ``lora`` keyword.

    Returns:
        projection name (``q_proj`` ... ``down_proj``) -> the wrapper holding it, one per layer in
        layer order (fused modules appear under each of their projections).
    """
    ctx = LoRAContext()
    model.lora_context = ctx
    table: dict[str, list[LoRALinear]] = {}
    for layer in specs:
        for owner, attr, pieces, inp in layer:
            wrapper = LoRALinear(getattr(owner, attr), pieces, inp, max_loras, max_rank, ctx)
            setattr(owner, attr, wrapper)
            for name, _, _ in pieces:
                table.setdefault(name, []).append(wrapper)
    return table


def projection_shapes(specs: list[list[LayerSpec]]) -> dict[str, tuple[int, int]]:
    """Projection name -> ``(out_features, in_features)`` of the first decoder layer of ``specs``."""
    return {name: (size, inp) for _, _, pieces, inp in specs[0] for name, _, size in pieces}
