"""Batch-1 decode through a whole decoder stack in one C call (``kernels.cpu.decode_stack``), shared by
the native Llama-family model and the Transformers backend (``transformers_stack``).

A decode step of a small model is dominated by per-operation dispatch when each layer runs as
Python modules: 7 linear calls, norms, rotary, attention and residual adds, a few microseconds
each, 24 layers deep. The C stack runs the same math with no return to Python; this module builds
its per-layer table from the modules that hold the weights (packed ``GGUFLinear`` or float32) and
decides when a step qualifies (the last <= 16 tokens of one sequence).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.models.lora_linear import unwrap
from pagedllm.models.quant_linear import GGUFLinear

MAX_STACK_TOKENS = 16  # pl_decode_stack's bound (QGEMM_MAX_ROWS)


def one_sequence(num_tokens: int, meta: AttentionMetadata, block_size: int) -> tuple[torch.Tensor, int] | None:
    """``(block table, context length)`` when the step is the last ``num_tokens`` <= 16 tokens of
    one sequence (a decode, or a decode with its draft tokens), else ``None``. Read from the fields
    every backend's metadata has (``AttentionMetadata``); ``block_size`` in tokens."""
    if num_tokens == 1 and meta.decode_token_idx.numel() == 1:
        return meta.decode_block_tables[0], int(meta.decode_seq_lens[0])
    if 1 < num_tokens <= MAX_STACK_TOKENS and meta.decode_token_idx.numel() == 0 and len(meta.prefills) == 1:
        seq = meta.prefills[0]
        slots = seq.gather_slots
        if seq.q_end - seq.q_start == num_tokens:
            return (slots[::block_size] // block_size).contiguous(), int(slots.shape[0])
    return None


def matmul_entry(module) -> tuple | None:
    """The ``(fmt, weight, d, m, bias)`` entry of ``kernels.cpu.stack_table`` for a linear module:
    a ``GGUFLinear``'s packed arrays, or a module's float32 ``[N, K]`` ``weight`` (``nn.Linear``,
    ``cpu_linear.PackedLinear``); ``None`` for a module that has neither (the stack cannot run it)."""
    module = unwrap(module)  # a LoRA wrapper's base (steps with adapter rows never take the stack)
    bias = getattr(module, "bias", None)
    bias = None if bias is None else bias.detach()
    if isinstance(module, GGUFLinear):
        return module.fmt, module.qs, module.d, module.m, bias
    w = getattr(module, "weight", None)
    if isinstance(w, torch.Tensor) and w.dtype == torch.float32 and w.dim() == 2 and w.is_contiguous():
        return cpu_kernels.MATMUL_FLOAT32, w.detach(), None, None, bias
    return None


def activation_of(module) -> str | None:
    """``"silu"`` or ``"gelu_tanh"`` when the activation module computes it on a range of inputs,
    else ``None`` (the C stack and experts kernels have those two)."""
    x = torch.linspace(-6, 6, 97)
    with torch.no_grad():
        try:
            y = module(x)
        except Exception:  # an activation with other arguments: not one the stack has
            return None
    gelu = 0.5 * x * (1 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))
    for name, want in (("silu", x * torch.sigmoid(x)), ("gelu_tanh", gelu)):
        if torch.allclose(y, want, rtol=0, atol=1e-5):
            return name
    return None


class DecodeStack:
    """A model's ``stack_table``, rebuilt only when the KV cache or the weights are replaced.

    Args:
        layer_rows: ``kv_caches -> [per-layer dict]`` as ``kernels.cpu.stack_table`` takes them.
        key: ``kv_caches -> hashable`` that changes when any address in the table would.
        dims: ``(num_heads, num_kv_heads, head_dim, intermediate, eps, scale, activation, softcap)``.
    """

    def __init__(self, layer_rows: Callable[[list], list[dict]], key: Callable[[list], object], dims: tuple) -> None:
        self.layer_rows, self.key, self.dims = layer_rows, key, dims
        self._table, self._key, self._rows = None, None, None

    def run(self, x: torch.Tensor, kv_caches: list, cos: torch.Tensor, sin: torch.Tensor,
            block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
        """``x`` ``[T, hidden]`` float32 through every layer (it becomes the last layer's MLP output);
        returns the residual stream ``[T, hidden]`` (the final hidden state is ``residual + x``).
        ``cos``/``sin``: ``[R, T, head_dim]`` rotary rows per rotary kind at the tokens' positions.

        Raises:
            MemoryError, ValueError: as ``kernels.cpu.decode_stack``.
        """
        key = self.key(kv_caches)
        if self._key != key:
            self._rows = self.layer_rows(kv_caches)  # kept alive: the table holds their addresses
            self._table, self._key = cpu_kernels.stack_table(self._rows), key
        nh, kvh, hd, inter, eps, scale, act, softcap = self.dims
        kc = kv_caches[0][0]
        return cpu_kernels.decode_stack(self._table, x.contiguous(), nh, kvh, hd, inter, eps, cos.contiguous(),
                                        sin.contiguous(), kc.shape[2], kc.shape[1] * kc.shape[2], block_table,
                                        seq_len, scale, act, softcap)
