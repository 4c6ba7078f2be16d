"""The ``attention_backend`` option (EngineArgs, ``--attention-backend``) and ``--enforce-eager``.

Runs without the interpreter: these check names and errors only, never a kernel.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from pagedllm.attention import triton_paged
from pagedllm.attention.selector import select_attention_backend
from pagedllm.cli_args import add_engine_flags, engine_args_from_cli
from pagedllm.config import EngineArgs


def test_unknown_backend_is_a_value_error_naming_the_option():
    with pytest.raises(ValueError, match="attention_backend.*choose from torch, cpu, cpu_kernels, triton"):
        EngineArgs(attention_backend="flash")


def test_triton_without_triton_installed(monkeypatch):
    monkeypatch.setattr(triton_paged, "triton_available", lambda: False)
    with pytest.raises(ValueError, match=r"'triton' \(option attention_backend\).*pip install triton"):
        EngineArgs(attention_backend="triton")


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(triton_paged, "triton_available", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        EngineArgs(device="cpu", attention_backend="triton")


def test_default_choice_never_picks_triton_on_cpu(monkeypatch):
    """Even with the interpreter on (as in tests/attention/triton), the CPU default stays as before."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_attention_backend("cpu", torch.float32).name in ("cpu_kernels", "torch")
    assert select_attention_backend("cpu", torch.bfloat16).name == "torch"


def test_cli_flags_reach_engine_args():
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    args = engine_args_from_cli(p.parse_args(["--attention-backend", "torch", "--enforce-eager"]))
    assert args.attention_backend == "torch" and args.enforce_eager is True
    if select_attention_backend("cpu", torch.float32).name == "cpu_kernels":  # the C kernels are built here
        args = engine_args_from_cli(p.parse_args(["--attention-backend", "cpu"]))
        assert args.attention_backend == "cpu_kernels"  # "cpu" is the C kernels' short name
    defaults = engine_args_from_cli(p.parse_args([]))
    assert defaults.attention_backend is None and defaults.enforce_eager is False
    assert EngineArgs(attention_backend="torch").attention_backend == "torch"


def test_small_blocks_on_cuda_are_refused_for_triton(monkeypatch):
    monkeypatch.setattr(triton_paged, "triton_available", lambda: True)
    with pytest.raises(ValueError, match="block_size must be >= 16"):
        EngineArgs(device="cuda", block_size=8)
    assert EngineArgs(device="cuda", block_size=8, attention_backend="torch").block_size == 8
