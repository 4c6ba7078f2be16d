"""``torch.compile`` of the pieces between attention calls (``models/layers/compiled.py``):
each compiled piece equals its eager ops, a model with them compiled gives the eager model's
greedy tokens, and ``compilation_config`` resolves and refuses as documented."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.models.layers import compiled as c


@pytest.mark.parametrize("tokens", [1, 7])
def test_compiled_pieces_equal_eager(tokens):
    g = torch.Generator().manual_seed(tokens)
    x, res, w = torch.randn(tokens, 64, generator=g), torch.randn(tokens, 64, generator=g), torch.randn(64, generator=g)
    torch.testing.assert_close(c.compiled(c.rms_norm)(x, w, 1e-6), c.rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-6)
    got, want = c.compiled(c.add_rms_norm)(x, res, w, 1e-6), c.add_rms_norm(x, res, w, 1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    gu = torch.randn(tokens, 2 * 48, generator=g)
    torch.testing.assert_close(c.compiled(c.silu_and_mul)(gu), c.silu_and_mul(gu), rtol=1e-5, atol=1e-6)
    qk = torch.randn(tokens, 5, 16, generator=g)
    cos, sin = torch.randn(tokens, 1, 16, generator=g), torch.randn(tokens, 1, 16, generator=g)
    torch.testing.assert_close(c.compiled(c.rope)(qk, cos, sin), c.rope(qk, cos, sin), rtol=1e-5, atol=1e-6)


def test_compiled_model_gives_the_eager_tokens(tiny_model_dir):
    path = str(tiny_model_dir("llama"))
    prompts = [list(range(3, 20)), [7, 8, 9], list(range(40, 44))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = {}
    for level in (0, 3):
        # the torch backend runs the torch-op norms, activations and rotary: the ones compiled
        llm = LLM(path, attention_backend="torch", compilation_config=level, num_kv_blocks=32,
                  max_num_batched_tokens=16, max_num_seqs=4)
        runner = llm.llm_engine.runner
        assert (runner.compiled_modules > 0) == (level > 0)
        outs[level] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if level:  # the swapped modules are the compiled twins
            kinds = {type(m).__name__ for m in runner.model.modules()}
            assert {"CompiledRMSNorm", "CompiledSiluAndMul"} <= kinds and "RMSNorm" not in kinds
    assert outs[3] == outs[0] and all(len(t) == 8 for t in outs[0])


def test_resolve_compilation():
    assert c.resolve_compilation(None, "cpu", False) is False  # the C kernels already fuse each piece
    assert c.resolve_compilation(None, "cuda", False) is True
    assert c.resolve_compilation(None, "cuda:0", True) is False  # enforce_eager
    assert c.resolve_compilation(3, "cpu", False) is True and c.resolve_compilation("0", "cuda", False) is False
    assert c.resolve_compilation('{"level": 3}', "cpu", False) is True
    assert c.resolve_compilation({"mode": 0}, "cuda", False) is False
    with pytest.raises(ValueError, match="cudagraph_mode"):
        c.resolve_compilation({"level": 3, "cudagraph_mode": "FULL"}, "cuda", False)
    for bad in (True, 3.7, {"level": 3, "mode": 0}, -1):
        with pytest.raises(ValueError, match="compilation_config"):
            c.resolve_compilation(bad, "cpu", False)
    with pytest.raises(ValueError, match="compilation_config"):
        EngineArgs(compilation_config=7)
    with pytest.raises(ValueError, match="compilation_config"):
        EngineArgs(compilation_config="{bad json")
