"""Mixture-of-experts experts on our kernels (issue 40, first part): the Transformers backend's expert
modules run ``kernels.cpu.moe_experts``, plugged in through ``transformers``' experts-implementation
hook (``ExpertsInterface``: ``experts_implementation="pagedllm"``).

The family's own router (softmax or sigmoid, top-k, renormalized or not, grouped or bias-corrected)
and shared experts stay its code; what this replaces is the experts step: given each token's top-k
expert ids and weights, the weighted sum of those experts' gated MLPs. The (token, expert) pairs are
grouped by expert in C and each active expert's weights are read once per 16 of its tokens, whether
they are the module's float32 ``[E, 2I, H]`` / ``[E, H, I]`` tensors or a GGUF's packed expert blocks
(``ExpertWeights``, filled by ``packed_transformers``; a decoded token then reads only its k
experts' bytes, never a float32 copy of the rest).

An experts module qualifies when it has transformers' default layout (concatenated gate|up, not
transposed, no post-expert norm, the default gating) and an activation checked numerically (SiLU or
tanh-GELU), or gpt-oss's (transposed ``[E, H, 2I]`` with gate and up interleaved, biases, the clamped
SwiGLU checked numerically: its float32 weights are rearranged once into ours); biases are taken.
Others keep their original forward.

Source: transformers 5's ``integrations/moe.py`` (the hook and the experts' tensor layout).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels import cpu as cpu_kernels
from pagedllm.models.decode_stack import activation_of, matmul_entry

EXPERTS_NAME = "pagedllm"


class ExpertWeights:
    """An experts module's weights as ``kernels.cpu.moe_experts`` reads them.

    Args:
        gate_up: per expert, a linear module of its fused gate|up ``[2I, H]`` weight (packed
            ``GGUFLinear`` or float32), or ``(weight, bias)`` float32 tensors.
        down: per expert, its ``[H, I]`` down weight, the same way.
        intermediate: ``I``; activation: ``"silu"`` or ``"gelu_tanh"``.
        kind: what the weights are, for ``/stats`` and logs (``"Q4_K"``, ``"float32"``).
    Raises:
        ValueError: a weight the kernels cannot read (``decode_stack.matmul_entry`` has no entry).
    """

    def __init__(self, gate_up: list, down: list, intermediate: int, activation: str, kind: str) -> None:
        self.gate_up, self.down = gate_up, down  # kept alive: the table holds their addresses
        self.intermediate, self.activation, self.kind = intermediate, activation, kind
        rows = []
        for gu, dn in zip(gate_up, down):
            pair = [_entry(gu), _entry(dn)]
            if None in pair:
                raise ValueError(f"an expert weight the MoE kernel cannot read: {type(gu).__name__}")
            rows.append([[int(c[0])] + [0 if t is None else t.data_ptr() for t in c[1:]] for c in pair])
        self.table = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), 2, 5)
        self.chosen = torch.zeros(len(rows), dtype=torch.int64)  # (token, expert) pairs per expert so far

    def count(self, top_k_index: torch.Tensor) -> None:
        """Add a step's choices to ``chosen`` (ids outside ``0..E-1``, another rank's, are not counted)."""
        ids = top_k_index.reshape(-1)
        ids = ids[(ids >= 0) & (ids < self.chosen.shape[0])]
        self.chosen += torch.bincount(ids, minlength=self.chosen.shape[0])

    def tensors(self):
        """Every tensor the experts' weights hold (``memory.weight_bytes`` counts them)."""
        for m in self.gate_up + self.down:
            if isinstance(m, tuple):
                yield from (t for t in m if t is not None)
            else:
                yield from (t for t in vars(m).values() if isinstance(t, torch.Tensor))
                for sub in m.modules():
                    yield from (t for t in vars(sub).values() if isinstance(t, torch.Tensor))

    @property
    def nbytes(self) -> int:
        """Bytes of the experts' weights."""
        return sum(getattr(m, "nbytes", 0) or sum(t.numel() * t.element_size() for t in m if t is not None)
                   for m in self.gate_up + self.down)


def _entry(w) -> tuple | None:
    if isinstance(w, tuple):  # float32 (weight, bias) slices of the module's 3-D tensors
        weight, bias = w
        return cpu_kernels.MATMUL_FLOAT32, weight, None, None, bias
    return matmul_entry(w)


def expert_activation(module: nn.Module) -> str | None:
    act = getattr(module, "act_fn", None)
    return activation_of(act) if isinstance(act, nn.Module) else None


def default_layout(module: nn.Module) -> bool:
    """Whether an experts module has the layout and gating ``moe_experts`` computes (module docstring)."""
    from transformers.integrations.moe import _default_apply_gate
    return (getattr(module, "has_gate", False) and getattr(module, "is_concatenated", False)
            and not getattr(module, "is_transposed", True) and not getattr(module, "has_post_expert_norm", True)
            and getattr(type(module), "_apply_gate", None) is _default_apply_gate and expert_activation(module) is not None)


def interleaved_layout(module: nn.Module) -> bool:
    """Whether an experts module is gpt-oss's: transposed, gate and up interleaved, biased, and its
    gating the clamped SwiGLU the kernel computes (checked on random inputs)."""
    if not (getattr(module, "is_transposed", False) and not getattr(module, "is_concatenated", True)
            and getattr(module, "has_gate", False) and getattr(module, "has_bias", False)
            and not getattr(module, "has_post_expert_norm", True) and hasattr(type(module), "_apply_gate")):
        return False
    x = torch.linspace(-12, 12, 2 * 97).reshape(97, 2)[torch.randperm(97, generator=torch.Generator().manual_seed(0))]
    x = x.reshape(1, -1)
    g, u = x[..., ::2], x[..., 1::2]
    gc = g.clamp(max=7.0)
    want = (u.clamp(-7.0, 7.0) + 1) * gc * torch.sigmoid(1.702 * gc)
    with torch.no_grad():
        try:
            got = module._apply_gate(x)
        except Exception:  # a gate with other needs: keep the module's code
            return False
    return got.shape == want.shape and torch.allclose(got, want, rtol=0, atol=1e-5)


def float_experts(module: nn.Module) -> ExpertWeights | None:
    """``ExpertWeights`` over an experts module's own float32 ``gate_up_proj`` / ``down_proj`` (and
    biases; gpt-oss's rearranged into our layout once, its own tensors then dropped), or ``None``
    when it does not qualify."""
    gu, dn = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.dtype == torch.float32):
        return None
    if interleaved_layout(module):
        gb, db = module.gate_up_proj_bias.detach(), module.down_proj_bias.detach()
        gate_up = [(torch.cat([gu[e, :, 0::2], gu[e, :, 1::2]], 1).t().contiguous().detach(),
                    torch.cat([gb[e, 0::2], gb[e, 1::2]]).contiguous()) for e in range(gu.shape[0])]
        down = [(dn[e].t().contiguous().detach(), db[e].contiguous()) for e in range(gu.shape[0])]
        for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
            module._parameters[name] = None  # rearranged above; the kernel reads those copies only
        return ExpertWeights(gate_up, down, gu.shape[2] // 2, "swiglu_oai", "float32")
    if not default_layout(module):
        return None
    if gu.dtype != torch.float32 or dn.dtype != torch.float32 or gu.device.type != "cpu" or not gu.is_contiguous():
        return None
    gb, db = (getattr(module, "gate_up_proj_bias", None), getattr(module, "down_proj_bias", None))
    n = gu.shape[0]
    return ExpertWeights([(gu[e].detach(), None if gb is None else gb[e].detach()) for e in range(n)],
                         [(dn[e].detach(), None if db is None else db[e].detach()) for e in range(n)],
                         gu.shape[1] // 2, expert_activation(module), "float32")


def experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts function ``"pagedllm"``: ``[T, H]`` hidden states, ``[T, k]`` expert ids
    and routing weights -> ``[T, H]`` (the module's ``pagedllm_experts``, else its float32 tensors;
    a module that does not qualify runs its original forward)."""
    weights = getattr(module, "pagedllm_experts", None)
    if weights is None:
        weights = module.pagedllm_experts = float_experts(module) or False
    if weights is False:
        return type(module).forward.__wrapped__(module, hidden_states, top_k_index, top_k_weights)
    x = hidden_states.reshape(-1, hidden_states.shape[-1]).float().contiguous()
    weights.count(top_k_index)
    out = cpu_kernels.moe_experts(x, top_k_index.reshape(x.shape[0], -1), top_k_weights.reshape(x.shape[0], -1),
                                  weights.table, weights.intermediate, weights.activation)
    return out.view(hidden_states.shape).to(hidden_states.dtype)


def expert_weights(model: nn.Module) -> list[ExpertWeights]:
    """The ``ExpertWeights`` of every experts module of ``model`` on the kernel, in layer order."""
    return [w for m in model.modules() if (w := getattr(m, "pagedllm_experts", None))]


def register() -> None:
    """Register ``experts_forward`` as ``experts_implementation="pagedllm"`` (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_NAME, experts_forward)


def install(hf: nn.Module) -> int:
    """Point a loaded ``transformers`` model's expert modules at ``experts_forward``; returns how many
    expert modules will run our kernel (0 for a dense model, or one whose class has no hook)."""
    experts = [m for m in hf.modules() if hasattr(m, "is_concatenated") and hasattr(m, "has_gate")]
    if not experts or not getattr(type(hf), "_can_set_experts_implementation", lambda: False)():
        return 0
    register()
    hf.set_experts_implementation(EXPERTS_NAME)
    for m in experts:
        if getattr(m, "pagedllm_experts", None) is None:  # packed_transformers may have set packed ones
            m.pagedllm_experts = float_experts(m) or False
    return sum(bool(m.pagedllm_experts) for m in experts)
