"""Model layers whose implementation (torch ops or the C CPU kernels) is chosen once, at construction."""

from pagedllm.models.layers.activation import CpuSiluAndMul, SiluAndMul, build_silu_and_mul
from pagedllm.models.layers.norm import CpuRMSNorm, RMSNorm, build_rms_norm
from pagedllm.models.layers.rotary import CpuRotaryEmbedding, RotaryEmbedding, RotaryStep, build_rotary

__all__ = ["CpuRMSNorm", "CpuRotaryEmbedding", "CpuSiluAndMul", "RMSNorm", "RotaryEmbedding", "RotaryStep",
           "SiluAndMul", "build_rms_norm", "build_rotary", "build_silu_and_mul"]
