"""The device path on a real NVIDIA GPU: compiled Triton kernels against the torch reference.

Every test is marked ``gpu``: skipped without CUDA or with ``TRITON_INTERPRET`` set
(tests/conftest.py). ``benchmarks/gpu_check.sh`` runs them. The same checks run
through the interpreter on the CPU in tests/attention/triton and tests/worker/triton;
here they cover float16 and bfloat16 and the compiled code.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

D = 64


def _step(seed: int, bs: int, num_blocks: int = 256):
    """A ragged step: decodes over long contexts, a fresh prefill, a chunk behind a cached prefix."""
    from pagedllm.attention.metadata import AttentionBatch
    rng = np.random.default_rng(seed)
    reqs = [(int(rng.integers(1, 40 * bs)), 1) for _ in range(5)] + [(37, 37), (3 * bs + 5 + 21, 21)]
    perm = rng.permutation(num_blocks).tolist()
    table = np.zeros((len(reqs), 64), dtype=np.int64)
    qsl, slots, prefix = [0], [], []
    for i, (seq, n) in enumerate(reqs):
        blocks = [perm.pop() for _ in range(-(-seq // bs))]
        table[i, :len(blocks)] = blocks
        pos = [blocks[p // bs] * bs + p % bs for p in range(seq)]
        prefix.append(pos[:seq - n])
        slots += pos[seq - n:]
        qsl.append(qsl[-1] + n)
    lens = np.array([s for s, _ in reqs], dtype=np.int64)
    batch = AttentionBatch(query_start_loc=np.array(qsl, dtype=np.int64),
                           num_computed=lens - np.array([n for _, n in reqs], dtype=np.int64), seq_lens=lens,
                           slot_mapping=np.array(slots, dtype=np.int64), block_table=table,
                           rows=np.arange(len(reqs), dtype=np.int64), block_size=bs)
    return batch, prefix, num_blocks


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bs,kvh,ratio,window,softcap", [(16, 2, 1, None, None), (32, 1, 8, 100, None),
                                                         (16, 2, 3, None, 30.0)])
def test_triton_backend_equals_torch_reference_on_cuda(dtype, bs, kvh, ratio, window, softcap):
    from pagedllm.attention.selector import select_attention_backend
    batch, prefix, nb = _step(7, bs)
    g = torch.Generator(device="cuda").manual_seed(0)
    t = int(batch.query_start_loc[-1])
    outs = {}
    base = [torch.randn(kvh, nb, bs, D, generator=g, device="cuda") for _ in range(2)]
    q = torch.randn(t, kvh * ratio, D, generator=g, device="cuda")
    k, v = (torch.randn(t, kvh, D, generator=g, device="cuda") for _ in range(2))
    for name in ("torch", "triton"):
        backend = select_attention_backend("cuda", dtype, name)
        if name == "triton":
            backend.split_tokens = 64
        cache = tuple(c.to(dtype).clone() for c in base)
        meta = backend.build_metadata(batch)
        outs[name] = backend.forward(q.to(dtype), k.to(dtype), v.to(dtype), cache, meta, D ** -0.5, window, softcap)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs["triton"].float(), outs["torch"].float(), rtol=tol, atol=tol)


def test_default_backend_on_cuda_is_triton():
    from pagedllm.attention.selector import select_attention_backend
    assert select_attention_backend("cuda", torch.float16).name == "triton"


def test_seeded_sampling_is_batch_invariant_on_cuda():
    from pagedllm.sampling_params import SamplingParams
    from pagedllm.worker.device import device_sampler as ds
    vocab = 32000
    logits = torch.randn(8, vocab, device="cuda")
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=42)
    alone = ds.sample(logits[3:4].clone(), ds.DeviceSamplingTensors.from_params([p], [5], vocab, torch.device("cuda")))
    params = [SamplingParams(temperature=1.0, top_k=50)] * 3 + [p] + [SamplingParams(temperature=0.0)] * 4
    batch = ds.sample(logits, ds.DeviceSamplingTensors.from_params(params, [5] * 8, vocab, torch.device("cuda")))
    assert int(batch[3]) == int(alone[0])
    assert int(batch[4]) == int(logits[4].argmax())


PROMPTS = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 40, 77)]


def _tiny_llama(path) -> str:
    """Save a tiny random Llama (2 layers, 4 heads, 2 KV heads) at ``path``; returns the directory."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=512,
                         initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return str(path)


def test_tiny_llama_triton_equals_torch_on_cuda(tmp_path):
    from pagedllm import LLM, SamplingParams
    _tiny_llama(tmp_path)
    prompts = PROMPTS
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    got = {}
    for name in ("torch", "triton"):
        llm = LLM(str(tmp_path), device="cuda", dtype="float32", attention_backend=name, skip_tokenizer_init=True,
                  num_kv_blocks=64, max_num_batched_tokens=32)
        got[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        del llm
    assert got["triton"] == got["torch"]


def test_decode_steps_replay_cuda_graphs_and_enforce_eager_captures_none(tmp_path):
    """Decode steps of the Triton backend replay the graphs captured at start-up (padded to a
    bucket); ``enforce_eager`` captures none; both give the same greedy tokens."""
    from pagedllm import LLM, SamplingParams
    path = _tiny_llama(tmp_path)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    got, counts = {}, {}
    for eager in (False, True):
        # compiling off for both (enforce_eager turns it off): only the graphs differ
        llm = LLM(path, device="cuda", dtype="bfloat16", attention_backend="triton", skip_tokenizer_init=True,
                  num_kv_blocks=64, enforce_eager=eager, compilation_config=0)
        runner = llm.engine.core.runner
        assert (runner.decode_graphs is None) == eager
        got[eager] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
        counts[eager] = dict(runner.step_counts)
        del llm
    assert counts[False]["graph"] >= 10 and counts[True]["graph"] == 0
    assert got[False] == got[True]


def test_sampled_ids_reach_the_host_through_a_pinned_copy():
    from pagedllm.worker.device.host_tokens import HostTokens
    tokens = torch.randint(0, 50000, (37,), device="cuda")
    host = HostTokens(tokens)
    assert host._host.is_pinned() and host.get() == tokens.tolist() and host.ready()


def test_compiled_pieces_on_cuda_give_the_eager_tokens(tmp_path):
    """On CUDA the norms, activations and rotary are compiled by default; ``-O0`` gives the same
    greedy tokens (float32, where the fused kernels round alike)."""
    from pagedllm import LLM, SamplingParams
    path = _tiny_llama(tmp_path)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    got = {}
    for level in (None, 0):
        llm = LLM(path, device="cuda", dtype="float32", attention_backend="triton", skip_tokenizer_init=True,
                  num_kv_blocks=64, compilation_config=level)
        assert (llm.engine.core.runner.compiled_modules > 0) == (level is None)
        got[level] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
        del llm
    assert got[None] == got[0]


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_experts_on_cuda_run_the_triton_kernels(kind, dtype):
    """``moe.experts_forward`` on CUDA tensors takes the Triton kernels (``_device_forward``) and
    equals the module's own per-expert forward in float32."""
    from transformers import GptOssConfig, Qwen3MoeConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from pagedllm.models import moe
    torch.manual_seed(0)
    m = (Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=512, moe_intermediate_size=384, num_experts=16))
         if kind == "qwen3_moe" else GptOssExperts(GptOssConfig(hidden_size=512, intermediate_size=384,
                                                                num_local_experts=16)))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(0.05 * torch.randn_like(p))
    x, w = torch.randn(70, 512), torch.rand(70, 4)
    ids = torch.stack([torch.randperm(16)[:4] for _ in range(70)])
    with torch.no_grad():
        want = type(m).forward.__wrapped__(m, x, ids, w)
        mc = m.to("cuda", dtype)
        got = moe.experts_forward(mc, x.to("cuda", dtype), ids.cuda(), w.to("cuda", dtype))
    assert mc.pagedllm_device_experts
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float().cpu(), want, rtol=tol, atol=tol)
