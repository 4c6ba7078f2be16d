"""The one-time choice of an attention backend at model load, and the check of a requested name.

Kept apart from ``backend.py`` (the base class every backend imports) so that no backend module
and the base class import each other. The order of preference follows vLLM's platform-driven
selection: a GPU backend where it can run, our C kernels on the CPU, the torch reference anywhere.
"""

from __future__ import annotations

import torch

from pagedllm.attention.backend import AttentionBackend


def _registry() -> dict[str, type[AttentionBackend]]:
    # imported when first asked: the Triton backend's module is only needed where it is chosen
    from pagedllm.attention.cpu_kernels import CpuKernelBackend
    from pagedllm.attention.torch_paged import TorchPagedBackend
    from pagedllm.attention.triton_paged import TritonPagedBackend
    return {CpuKernelBackend.name: CpuKernelBackend, TorchPagedBackend.name: TorchPagedBackend,
            TritonPagedBackend.name: TritonPagedBackend}


# preference order of ``select_attention_backend``: the first that supports the device and dtype
# (and lists the device type in its ``auto_devices``) wins
PRIORITY = ("triton", "cpu_kernels", "torch")

# the names ``--attention-backend`` / ``EngineArgs.attention_backend`` accept ("cpu" is "cpu_kernels")
ALIASES = {"cpu": "cpu_kernels"}
BACKEND_NAMES = ("torch", "cpu", "cpu_kernels", "triton")


def check_attention_backend(name: str | None, device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Validate a requested backend name without building it; returns the registry name (``None``: by device).

    Raises:
        ValueError: ``name`` is unknown, or the backend cannot run ``dtype`` on ``device`` (the
            message names the ``attention_backend`` option and what the backend needs).
    """
    if name is None:
        return None
    canonical = ALIASES.get(name, name)
    backends = _registry()
    if canonical not in backends:
        raise ValueError(f"unknown attention backend {name!r} (option attention_backend / --attention-backend); choose from {', '.join(BACKEND_NAMES)}")
    cls = backends[canonical]
    if not cls.supports(torch.device(device), dtype):
        need = f"; it needs {cls.requirement}" if cls.requirement else ""
        raise ValueError(f"attention backend {name!r} (option attention_backend) cannot run {dtype} on {device}{need}")
    return canonical


def select_attention_backend(device: torch.device | str, dtype: torch.dtype,
                             name: str | None = None) -> AttentionBackend:
    """Choose the attention backend for a model of ``dtype`` on ``device`` (call once, at load).

    Without ``name`` the first backend of ``PRIORITY`` that supports the pair on its
    ``auto_devices``: Triton on CUDA (when triton is installed), the C CPU kernels for
    float32 on the CPU when they are built and not turned off (``PAGEDLLM_CPU_KERNELS=0``),
    else the torch reference, which runs anywhere. Triton on the CPU (its interpreter)
    is used only when asked by name.

    Raises:
        ValueError: ``name`` is not a backend name (``BACKEND_NAMES``), or it does not support
            ``device``/``dtype`` (see ``check_attention_backend``).
    """
    device = torch.device(device)
    backends = _registry()
    if name is not None:
        return backends[check_attention_backend(name, device, dtype)](device)
    return next(backends[n](device) for n in PRIORITY
                if (backends[n].auto_devices is None or device.type in backends[n].auto_devices)
                and backends[n].supports(device, dtype))
