"""LoRA pieces without a model: the PEFT reader's checks, the batched wrapper, the scheduler's
per-step adapter bound, block hashes, flags (issue 43)."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from pagedllm.config import EngineArgs
from pagedllm.core.hashing import ROOT_HASH, extend_block_hashes
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.lora.config import LoRAConfig
from pagedllm.lora.peft_reader import load_peft_adapter
from pagedllm.lora.request import LoRARequest
from pagedllm.models.lora_linear import LoRAContext, LoRALinear, LoRAStep
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams

HIDDEN, R = 8, 4


def _adapter_dir(root, name="ok", r=R, targets=("q_proj", "down_proj"), **config):
    """A hand-written PEFT directory: ``r``, ``lora_alpha=8``, random A/B of layer 0's targets."""
    d = root / name
    d.mkdir()
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 8, "target_modules": list(targets), "bias": "none"} | config
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    tensors = {}
    for t in targets:
        part = "mlp" if t in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        key = f"base_model.model.model.layers.0.{part}.{t}"
        tensors[f"{key}.lora_A.weight"] = torch.randn(r, HIDDEN)
        tensors[f"{key}.lora_B.weight"] = torch.randn(HIDDEN, r)
    save_file(tensors, str(d / "adapter_model.safetensors"))
    return d


def test_reader_scaling(tmp_path):
    """``lora_alpha / r``, and ``lora_alpha / sqrt(r)`` with rsLoRA."""
    a = load_peft_adapter(_adapter_dir(tmp_path, "plain"), 16)
    assert a.rank == R and a.scaling == pytest.approx(8 / R)
    assert set(a.weights) == {(0, "q_proj"), (0, "down_proj")}
    rs = load_peft_adapter(_adapter_dir(tmp_path, "rs", use_rslora=True), 16)
    assert rs.scaling == pytest.approx(8 / math.sqrt(R))


@pytest.mark.parametrize("change, message", [
    (dict(r=32), "rank r=32 is above max_lora_rank=16"),
    (dict(targets=("q_proj", "lm_head")), "unknown target modules \\['lm_head'\\]"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(use_dora=True), "DoRA"),
    (dict(bias="lora_only"), "bias 'lora_only'"),
    (dict(rank_pattern={"q_proj": 2}), "rank_pattern"),
])
def test_reader_refuses_by_name(tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        load_peft_adapter(_adapter_dir(tmp_path, **change), 16)


@pytest.mark.parametrize("missing", ["adapter_config.json", "adapter_model.safetensors"])
def test_reader_missing_file(tmp_path, missing):
    d = _adapter_dir(tmp_path)
    (d / missing).unlink()
    with pytest.raises(ValueError, match=f"missing file {missing}"):
        load_peft_adapter(d, 16)
    with pytest.raises(ValueError, match="no such directory"):
        load_peft_adapter(tmp_path / "absent", 16)


def _packed(weight: torch.Tensor) -> nn.Module:
    from pagedllm.models.cpu_linear import PackedLinear
    return PackedLinear(weight, None)


@pytest.mark.parametrize("base_kind", ["linear", "packed"])
def test_wrapper_groups_rows_by_slot(base_kind):
    """Rows of slots 0 and 1 and base rows in one call equal each row's own ``W x + s B A x``,
    grouped or padded, whatever module the base is (plain or oneDNN-packed)."""
    torch.manual_seed(1)
    out, pieces = 12, [("q_proj", 0, 8), ("k_proj", 8, 4)]
    base = nn.Linear(HIDDEN, out, bias=True)
    if base_kind == "packed":
        base = _packed(base.weight.detach().clone())
    ctx = LoRAContext()
    lin = LoRALinear(base, pieces, HIDDEN, max_loras=2, max_rank=8, ctx=ctx)
    ad = {s: {"q_proj": (torch.randn(R, HIDDEN), torch.randn(8, R)), "k_proj": (torch.randn(8, HIDDEN), torch.randn(4, 8))}
          for s in (0, 1)}
    for s in (0, 1):
        lin.set_slot(s, ad[s], scaling=0.5)
    x = torch.randn(6, HIDDEN)
    slot_of_row = [0, -1, 1, 1, 0, -1]
    ctx.step = LoRAStep([(0, torch.tensor([0, 4])), (1, torch.tensor([2, 3]))])
    with torch.inference_mode():
        got = lin(x)
    with torch.no_grad():
        want = base(x).clone()
    for i, s in enumerate(slot_of_row):
        if s >= 0:
            for name, start, size in pieces:
                a, b = ad[s][name]
                want[i, start:start + size] += 0.5 * (b @ (a @ x[i]))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the padded mode (slot * g + i places in a [slots, g] buffer, g = 2): the same sums
    ctx.step = LoRAStep([], (torch.tensor([0, 4, 2, 3]), torch.tensor([0, 1, 2, 3]), 2))
    with torch.inference_mode():
        padded = lin(x)
    torch.testing.assert_close(padded, want, rtol=1e-5, atol=1e-5)
    ctx.step = LoRAStep([(1, None)])  # one slot holding every row
    with torch.inference_mode():
        all1 = lin(x)
    a, b = ad[1]["q_proj"]
    with torch.no_grad():
        torch.testing.assert_close(all1[:, :8], base(x)[:, :8] + 0.5 * x @ a.t() @ b.t(), rtol=1e-5, atol=1e-5)


def _lora_req(rid: str, lora: LoRARequest | None) -> Request:
    sp = SamplingParams(temperature=0, max_tokens=4)
    return Request(rid, list(range(10, 18)), sp, {2}, 4, arrival_time=0.0, lora_request=lora)


def test_scheduler_holds_at_most_max_loras_adapters_per_step():
    """Three adapters and the base, max_loras=2: the first step takes two adapters (and the base);
    the third adapter's request waits, keeping its place, and runs in a later step."""
    sched = Scheduler(KVCacheManager(64, 4, enable_prefix_caching=False), 16, 256, 1024, True, max_loras=2)
    loras = [LoRARequest(f"a{i}", i, f"/x/{i}") for i in (1, 2, 3)]
    for i, lr in enumerate([loras[0], None, loras[1], loras[2], loras[0]]):
        sched.add_request(_lora_req(str(i), lr))
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"0", "1", "2", "4"}
    ids = {nr.lora_request.lora_int_id for nr in out.new_reqs if nr.lora_request is not None}
    assert ids == {1, 2}
    assert [r.request_id for r in sched.waiting] == ["3"]


def test_block_hashes_carry_the_adapter():
    """Equal tokens: equal hashes with the same adapter, different across adapters and the base."""
    tokens = list(range(32))
    a, a2, b = (LoRARequest("a", 1, "/a"), LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b"))

    def hashes(lr):
        out: list[bytes] = []
        extend_block_hashes(out, tokens, 16, None, (), None if lr is None else lr.cache_key())
        return out
    assert hashes(a) == hashes(a2)
    assert hashes(a)[1] != hashes(b)[1] and hashes(a)[0] != hashes(None)[0]
    assert hashes(None)[0] != ROOT_HASH


def test_flags_and_settings():
    """vLLM's flag names reach EngineArgs; bad settings are refused by name."""
    from pagedllm.cli_args import add_engine_flags, engine_args_from_cli
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    a = p.parse_args(["m", "--enable-lora", "--max-loras", "3", "--max-lora-rank", "32", "--max-cpu-loras", "5",
                      "--lora-modules", "sql=/a/sql", "chat=/b"])
    assert a.lora_modules == [("sql", "/a/sql"), ("chat", "/b")]
    args = engine_args_from_cli(a)
    assert args.lora_config() == LoRAConfig(3, 32, 5)
    assert EngineArgs(enable_lora=True, max_loras=2).lora_config() == LoRAConfig(2, 16, 2)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineArgs(enable_lora=True, max_loras=4, max_cpu_loras=2)
    assert EngineArgs(enable_lora=True, model_impl="transformers").lora_config() == LoRAConfig(1, 16, 1)
    with pytest.raises(ValueError, match="enable-lora.*tensor or pipeline"):
        EngineArgs(enable_lora=True, model_impl="transformers", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/p")
