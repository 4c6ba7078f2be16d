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

With ``--enable-expert-parallel`` (``transformers_tp``) a rank holds a contiguous range of whole
experts (``shard_experts``); ``experts_forward`` then runs the pairs routed into that range (ids
shifted to local ones, the others given the module's "no expert" id, ``num_experts``, that its eager
forward skips) and sums the ranks' outputs with one all-reduce.

Off the CPU (a CUDA model) the experts run ``moe_triton``'s kernels over the module's own tensors
(``DeviceExperts``, read through strides in either layout).

Source: transformers 5's ``integrations/moe.py`` (the hook and the experts' tensor layout); expert
parallelism as GShard (Lepikhin et al. 2020) places experts, without its token capacity limit.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    if not (isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.dtype == torch.float32
            and gu.device.type == "cpu"):
        return None  # off the CPU the Triton kernels read the module's tensors (_device_forward)
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


@dataclass(frozen=True)
class DeviceExperts:
    """An experts module's own tensors as the GPU kernels (``moe_triton.experts``) read them, in place.

    Attributes:
        gate_up, down: ``[E, 2I, H]`` / ``[E, H, I]`` weights, or ``[E, H, 2I]`` / ``[E, I, H]`` when
            ``transposed`` (gpt-oss); any float dtype.
        gate_up_bias, down_bias: ``[E, 2I]`` / ``[E, H]`` or ``None``.
        transposed: the weights are stored ``[E, in, out]``.
        interleaved: gate and up columns alternate (gpt-oss) instead of all gate then all up.
        activation: ``"silu"``, ``"gelu_tanh"`` or ``"swiglu_oai"`` (gpt-oss's clamped SwiGLU).
    """

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    transposed: bool
    interleaved: bool
    activation: str

    @property
    def intermediate(self) -> int:
        """``I``, the expert width."""
        return self.down.shape[1 if self.transposed else 2]


def device_experts(module: nn.Module) -> DeviceExperts | None:
    """``DeviceExperts`` over an experts module's tensors when its layout and gating are one the
    GPU kernels compute (``default_layout`` or ``interleaved_layout``), else ``None``."""
    gu, dn = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.dtype.is_floating_point):
        return None
    biases = getattr(module, "gate_up_proj_bias", None), getattr(module, "down_proj_bias", None)
    if interleaved_layout(module):
        return DeviceExperts(gu, dn, *biases, transposed=True, interleaved=True, activation="swiglu_oai")
    if default_layout(module):
        return DeviceExperts(gu, dn, *biases, transposed=False, interleaved=False,
                             activation=expert_activation(module))
    return None


def _device_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """``experts_forward`` for tensors off the CPU: the Triton kernels over the module's tensors, or
    the module's own forward when its layout does not qualify."""
    spec = getattr(module, "pagedllm_device_experts", None)
    if spec is None:
        spec = module.pagedllm_device_experts = device_experts(module) or False
    if spec is False:
        return type(module).forward.__wrapped__(module, hidden_states, top_k_index, top_k_weights)
    from pagedllm.models import moe_triton
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    out = moe_triton.experts(spec, x, top_k_index.reshape(x.shape[0], -1), top_k_weights.reshape(x.shape[0], -1))
    return out.view(hidden_states.shape)


def shard_experts(module: nn.Module, ranks: int, rank: int) -> tuple[int, int]:
    """Keep this rank's experts of an experts module in place (``--enable-expert-parallel``).

    Every parameter whose first dimension is the expert count (``gate_up_proj`` ``[E, 2I, H]``,
    ``down_proj``, their biases) is cut to experts ``start .. start + count - 1`` (on the meta device
    it only changes shape: ``transformers_tp_load`` then reads those experts only); ``num_experts``
    becomes ``count`` and ``pagedllm_ep`` records ``(start, count, E)``.

    Returns:
        ``(start, count)``.
    Raises:
        ValueError: the module has no ``num_experts`` or fewer experts than ranks.
    """
    from pagedllm.models.layers.parallel import balanced_split
    total = getattr(module, "num_experts", None)
    if not isinstance(total, int) or total < ranks:
        raise ValueError(f"--enable-expert-parallel: {type(module).__name__} has {total} experts for {ranks} ranks")
    start, count = balanced_split(total, ranks, rank)
    for name, p in list(module.named_parameters(recurse=False)):
        if p.dim() >= 1 and p.shape[0] == total:
            module._parameters[name] = nn.Parameter(p.data.narrow(0, start, count).clone(), requires_grad=False)
    module.num_experts = count
    module.pagedllm_ep = (start, count, total)
    return start, count


def _expert_parallel_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
    """This rank's share of the experts (``pagedllm_ep``) through the module's own eager forward, then
    the all-reduce over the tensor-parallel group: ``[T, H]`` like ``experts_forward``."""
    from pagedllm.distributed.parallel_state import tp_all_reduce
    start, count, _ = module.pagedllm_ep
    local = top_k_index - start
    local = torch.where((local >= 0) & (local < count), local, torch.full_like(local, count))
    out = type(module).forward.__wrapped__(module, hidden_states, local, top_k_weights)
    return tp_all_reduce(out.contiguous())


def experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts function ``"pagedllm"``: ``[T, H]`` hidden states, ``[T, k]`` expert ids
    and routing weights -> ``[T, H]`` (the module's ``pagedllm_experts``, else its float32 tensors;
    a module that does not qualify runs its original forward; an expert-parallel rank's module its
    share and an all-reduce; tensors on a GPU the Triton kernels, ``_device_forward``)."""
    if getattr(module, "pagedllm_ep", None) is not None:
        return _expert_parallel_forward(module, hidden_states, top_k_index, top_k_weights)
    if hidden_states.device.type != "cpu":
        return _device_forward(module, hidden_states, top_k_index, top_k_weights)
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


def install_expert_parallel(hf: nn.Module) -> int:
    """Route a split model's experts modules (``shard_experts``) through ``experts_forward``; returns
    how many there are.

    Raises:
        ValueError: experts were split but the model class has no experts-implementation hook.
    """
    split = [m for m in hf.modules() if getattr(m, "pagedllm_ep", None) is not None]
    if split:
        if not getattr(type(hf), "_can_set_experts_implementation", lambda: False)():
            raise ValueError(f"--enable-expert-parallel: {type(hf).__name__} has no experts-implementation hook")
        register()
        hf.set_experts_implementation(EXPERTS_NAME)
    return len(split)


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
