"""Packed weights through the Transformers backend (issue 39): a GGUF's blocks or int8 weights serve the
``transformers`` module's linear layers, embedding and LM head, and the answers stay those of the same
backend on the dequantized (float32) weights.

A tiny Llama-architecture GGUF written with ``gguf``'s writer holds Q8_0 and Q4_0 tensors, with the
q/k rows permuted as llama.cpp's converter writes them, so the packed layers must find the row order
``transformers`` expects; and ``gguf_index`` must read the same tensors as ``gguf.GGUFReader``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.kernels import cpu

HID, N_HEAD, N_KV, HD, FF, LAYERS = 64, 4, 2, 16, 128, 2
TOKENS = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)] + \
    [str(d) for d in range(9)] + ["ab", "<|endoftext|>", "<|im_end|>"]
VOCAB = len(TOKENS)  # 64


def _permuted(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's ``LlamaModel.permute`` stores for q/k rows in Hugging Face order."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write(path: Path, rng) -> None:
    """A 2-layer Llama GGUF: attention in Q8_0, MLP and the output head in Q4_0, embedding Q8_0."""
    import gguf
    from gguf import GGMLQuantizationType as T
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS), w.add_context_length(128), w.add_embedding_length(HID)
    w.add_feed_forward_length(FF), w.add_head_count(N_HEAD), w.add_head_count_kv(N_KV)
    w.add_rope_freq_base(1e4), w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("default"), w.add_token_list(TOKENS)
    w.add_token_types([1] * (VOCAB - 2) + [3, 3]), w.add_token_merges(["a b"])
    w.add_bos_token_id(VOCAB - 2), w.add_eos_token_id(VOCAB - 1)

    def put(name, rows, cols, kind=None, heads=None):
        x = (0.3 * rng.standard_normal((rows, cols))).astype(np.float32) if cols else \
            (1 + 0.1 * rng.standard_normal(rows)).astype(np.float32)
        if heads:
            x = np.ascontiguousarray(_permuted(x, heads))
        if kind is None:
            w.add_tensor(name, x)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, kind), raw_dtype=kind)

    put("token_embd.weight", VOCAB, HID, T.Q8_0)
    put("output_norm.weight", HID, 0)
    put("output.weight", VOCAB, HID, T.Q4_0)
    for i in range(LAYERS):
        b = f"blk.{i}."
        put(b + "attn_q.weight", N_HEAD * HD, HID, T.Q8_0, heads=N_HEAD)
        put(b + "attn_k.weight", N_KV * HD, HID, T.Q8_0, heads=N_KV)
        put(b + "attn_v.weight", N_KV * HD, HID, T.Q8_0)
        put(b + "attn_output.weight", HID, N_HEAD * HD, T.Q8_0)
        put(b + "ffn_gate.weight", FF, HID, T.Q4_0)
        put(b + "ffn_up.weight", FF, HID, T.Q4_0)
        put(b + "ffn_down.weight", HID, FF, T.Q4_0)
        put(b + "attn_norm.weight", HID, 0)
        put(b + "ffn_norm.weight", HID, 0)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("packed-tf") / "tiny-llama-q.gguf"
    _write(path, np.random.default_rng(3))
    return path


def test_tensor_index_reads_what_gguf_reads(tiny_gguf, tmp_path):
    """``gguf_index`` (no metadata parse) gives the architecture and every tensor's type, shape and
    bytes exactly as ``gguf.GGUFReader``; a truncated file is a ValueError naming it."""
    from gguf import GGUFReader

    from pagedllm.models.gguf_index import read_tensor_index
    arch, index = read_tensor_index(tiny_gguf)
    reader = GGUFReader(str(tiny_gguf))
    assert arch == reader.fields["general.architecture"].contents() == "llama"
    assert sorted(index) == sorted(t.name for t in reader.tensors)
    for t in reader.tensors:
        got = index[t.name]
        assert got.tensor_type == t.tensor_type and got.shape == tuple(int(s) for s in t.shape)
        assert np.array_equal(got.data, np.asarray(t.data).view(np.uint8).reshape(-1))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[:-100])
    with pytest.raises(ValueError, match="cut.gguf.*truncated"):
        read_tensor_index(cut)


def _tokens(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [[next(iter(d.values())).logprob for d in o.outputs[0].logprobs]
                                                    for o in outs]


def test_gguf_blocks_serve_the_transformers_module(tiny_gguf, assert_no_leaks):
    """``model_impl="transformers"`` on a GGUF keeps its blocks packed by default (every layer, the
    embedding and the head; q/k rows found in ``transformers``' order) and gives the tokens of the
    same backend on the dequantized weights, logprobs within float32 rounding."""
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, VOCAB - 2, size=n).tolist() for n in (3, 9, 17)]
    ref = LLM(str(tiny_gguf), model_impl="transformers", quantization="none", num_kv_blocks=32, block_size=4)
    want, want_lp = _tokens(ref, prompts)
    assert ref.llm_engine.get_stats().weight_formats == {}
    del ref
    llm = LLM(str(tiny_gguf), model_impl="transformers", num_kv_blocks=32, block_size=4)
    # 2 layers x (q, k, v, o) in Q8_0 and (gate, up, down) in Q4_0, the embedding Q8_0, the head Q4_0
    assert llm.llm_engine.get_stats().weight_formats == {"Q8_0": 9, "Q4_0": 7}
    got, got_lp = _tokens(llm, prompts)
    assert got == want
    assert max(abs(a - b) for x, y in zip(got_lp, want_lp) for a, b in zip(x, y)) < 1e-4
    assert_no_leaks(llm.engine)


def test_int8_weights_through_the_transformers_backend(tiny_gguf):
    """``quantization="int8"`` packs every linear of the ``transformers`` module per output channel
    (the head included) exactly as the native path packs its own: the two score a prompt alike (the
    same int8 weights; attention and norms differ only in float32 rounding)."""
    prompt = {"prompt_token_ids": np.random.default_rng(6).integers(0, VOCAB - 2, size=24).tolist()}
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)

    def scored(llm) -> np.ndarray:
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        return np.array([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])
    native = LLM(str(tiny_gguf), model_impl="native", quantization="int8", num_kv_blocks=16, block_size=4)
    want = scored(native)
    del native
    llm = LLM(str(tiny_gguf), model_impl="transformers", quantization="int8", num_kv_blocks=16, block_size=4)
    assert llm.llm_engine.get_stats().weight_formats == {"int8": 15}  # 2 x 7 linears and the head
    assert np.abs(scored(llm) - want).max() < 1e-4


def test_packed_layers_refuse_a_row_order_they_cannot_match():
    """A GGUF tensor whose rows are not the float tensor's in any known order is not packed (the layer
    stays float32): checked on ``_packed_like`` with a weight whose rows are shuffled."""
    import gguf
    from gguf import GGMLQuantizationType as T

    from pagedllm.models.gguf_index import GGUFTensor
    from pagedllm.models.packed_transformers import _packed_like
    if not cpu.available():
        pytest.skip("needs the C CPU kernels")
    rng = np.random.default_rng(5)
    w = rng.standard_normal((64, 64)).astype(np.float32)
    raw = gguf.quants.quantize(w, T.Q8_0)
    t = GGUFTensor("x.weight", T.Q8_0, (64, 64), raw.reshape(-1))
    deq = torch.from_numpy(gguf.quants.dequantize(raw, T.Q8_0))
    ids = torch.arange(64)
    assert _packed_like(t, (64, 64), (ids, deq), None, (4,)) is not None
    assert _packed_like(t, (64, 64), (ids, deq[torch.randperm(64)]), None, (4,)) is None
    held = _permuted(raw.reshape(64, -1), 4).reshape(-1)  # a Llama file's q rows (Q8_0 rows are independent)
    lin = _packed_like(GGUFTensor("q.weight", T.Q8_0, (64, 64), held), (64, 64), (ids, deq), None, (4,))
    assert lin is not None and torch.equal(lin.dequantize(), deq)


def test_rms_norms_move_to_the_kernel_only_where_they_match():
    """Llama's and Gemma's (``1 + w``) RMSNorms run on the C kernel with the modules' own outputs
    (any leading shape: Gemma's q/k norms see ``[1, T, heads, head_dim]``); a norm with another
    formula, or one that takes a gate, keeps its own code."""
    from torch import nn
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from pagedllm.models.transformers_norms import KernelRMSNorm, install_kernel_norms
    if not cpu.available():
        pytest.skip("needs the C CPU kernels")

    class OddRMSNorm(nn.Module):  # no normalization at all
        def __init__(self, h):
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.randn(h)), 1e-6

        def forward(self, x):
            return x * self.weight

    class GatedRMSNorm(LlamaRMSNorm):
        def forward(self, x, gate=None):
            return super().forward(x if gate is None else x * gate)

    mods = nn.ModuleDict({"llama": LlamaRMSNorm(16, 1e-5), "gemma": Gemma3RMSNorm(16, 1e-6),
                          "odd": OddRMSNorm(16), "gated": GatedRMSNorm(16, 1e-5)})
    with torch.no_grad():
        for m in mods.values():
            m.weight.copy_(torch.randn(16))
    x = torch.randn(1, 5, 2, 16)
    want = {k: m(x) for k, m in mods.items()}
    assert install_kernel_norms(mods) == (2, 2)
    assert isinstance(mods["llama"], KernelRMSNorm) and isinstance(mods["gemma"], KernelRMSNorm)
    assert type(mods["odd"]) is OddRMSNorm and type(mods["gated"]) is GatedRMSNorm
    for k in ("llama", "gemma"):
        torch.testing.assert_close(mods[k](x), want[k], rtol=0, atol=1e-5)


# mistral: the small formats (Q2_K needs rows of 256) and 16-bit tensors kept 16-bit
_MISTRAL_KINDS = {"attn_q": "Q2_K", "attn_k": "Q2_K", "attn_v": "F16", "attn_output": "BF16", "ffn_": "Q2_K"}


def _write_family(path: Path, arch: str, rng) -> None:
    """A 2-layer GGUF of ``arch`` (``qwen3``: q/k norms, MXFP4 MLP weights; ``phi3``: fused qkv and
    gate_up tensors; ``mistral``: 256 wide, Q2_K, F16 and BF16 layers) with Q8_0 weights otherwise,
    a Q8_0 embedding and an untied Q8_0 head, read by ``transformers``' GGUF loader.
    Qwen3 heads are 128 wide: ``transformers`` 5.23 does not read ``key_length`` and assumes
    Qwen3's 128 (what its real checkpoints have)."""
    import gguf
    from gguf import GGMLQuantizationType as T
    hd = {"qwen3": 128, "mistral": 64}.get(arch, HD)
    hid, ff = (256, 256) if arch == "mistral" else (HID, FF)
    w = gguf.GGUFWriter(str(path), "llama" if arch == "mistral" else arch)  # llama.cpp writes Mistral as llama
    w.add_block_count(LAYERS), w.add_context_length(128), w.add_embedding_length(hid)
    w.add_feed_forward_length(ff), w.add_head_count(N_HEAD), w.add_head_count_kv(N_KV)
    w.add_rope_freq_base(1e4), w.add_layer_norm_rms_eps(1e-5)
    if arch == "qwen3":
        w.add_key_length(hd), w.add_value_length(hd)
    else:
        w.add_rope_dimension_count(hd)
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("default"), w.add_token_list(TOKENS)
    w.add_token_types([1] * (VOCAB - 2) + [3, 3]), w.add_token_merges(["a b"])
    w.add_bos_token_id(VOCAB - 2), w.add_eos_token_id(VOCAB - 1)
    w.add_pad_token_id(VOCAB - 1)  # Phi-3's default, 32000, is past this vocabulary

    def put(name, rows, cols=0):
        if not cols:
            w.add_tensor(name, (1 + 0.1 * rng.standard_normal(rows)).astype(np.float32))
            return
        x = (0.3 * rng.standard_normal((rows, cols))).astype(np.float32)
        kind = T.MXFP4 if arch == "qwen3" and ".ffn_" in name else T.Q8_0  # gpt-oss's expert format
        if arch == "mistral":
            kind = next((T[k] for part, k in _MISTRAL_KINDS.items() if "." + part in name), kind)
        if kind == T.Q2_K:  # gguf-py has no Q2_K quantizer: random blocks with small scales
            q = rng.integers(0, 256, (rows * cols // 256, 84), dtype=np.uint8)
            q[:, 80:84] = rng.uniform(0.001, 0.02, (q.shape[0], 2)).astype(np.float16).view(np.uint8)
            w.add_tensor(name, q.reshape(rows, -1), raw_dtype=kind)
            return
        w.add_tensor(name, gguf.quants.quantize(x, kind), raw_dtype=kind)

    put("token_embd.weight", VOCAB, hid), put("output_norm.weight", hid), put("output.weight", VOCAB, hid)
    for i in range(LAYERS):
        b = f"blk.{i}."
        if arch == "phi3":
            put(b + "attn_qkv.weight", (N_HEAD + 2 * N_KV) * hd, hid), put(b + "ffn_up.weight", 2 * ff, hid)
        else:
            put(b + "attn_q.weight", N_HEAD * hd, hid), put(b + "attn_k.weight", N_KV * hd, hid)
            put(b + "attn_v.weight", N_KV * hd, hid), put(b + "ffn_gate.weight", ff, hid)
            put(b + "ffn_up.weight", ff, hid)
        if arch == "qwen3":
            put(b + "attn_q_norm.weight", hd), put(b + "attn_k_norm.weight", hd)
        put(b + "attn_output.weight", hid, N_HEAD * hd), put(b + "ffn_down.weight", hid, ff)
        put(b + "attn_norm.weight", hid), put(b + "ffn_norm.weight", hid)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


@pytest.mark.parametrize("arch,formats", [("qwen3", {"Q8_0": 10, "MXFP4": 6}), ("phi3", {"Q8_0": 10}),
                                          ("mistral", {"Q8_0": 2, "Q2_K": 10, "F16": 2, "BF16": 2})])
def test_other_families_load_packed(tmp_path, arch, formats):
    """Families only ``transformers`` reads from GGUF (Qwen3, here with MXFP4 MLPs; Phi-3, whose q/k/v
    and gate/up are one tensor each in the file and in the module; Mistral with Q2_K, F16 and BF16
    layers) load with every linear, the
    embedding and the head packed, and answer as the same backend on the dequantized weights."""
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_family(path, arch, np.random.default_rng(7))
    prompts = [np.random.default_rng(8).integers(0, VOCAB - 2, size=n).tolist() for n in (4, 11)]
    ref = LLM(str(path), model_impl="transformers", quantization="none", num_kv_blocks=32, block_size=4)
    want, want_lp = _tokens(ref, prompts)
    del ref
    llm = LLM(str(path), model_impl="transformers", num_kv_blocks=32, block_size=4)
    stats = llm.llm_engine.get_stats()
    assert stats.weight_formats == formats
    assert 512 < stats.expected_rss_mib < 2 * int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024
    got, got_lp = _tokens(llm, prompts)
    assert got == want
    assert max(abs(a - b) for x, y in zip(got_lp, want_lp) for a, b in zip(x, y)) < 1e-4


def test_native_path_serves_the_small_formats_packed(tmp_path):
    """The native Llama path packs Q2_K (``MinsLinear``) and 16-bit (``HalfLinear``) layers too (its
    fused q|k|v mixes Q2_K and F16 rows, so stays float32) and answers as on the dequantized
    weights; such layers keep the per-layer decode path (the C stack reads tiles or float32)."""
    path = tmp_path / "tiny-mistral.gguf"
    _write_family(path, "mistral", np.random.default_rng(7))
    prompts = [np.random.default_rng(8).integers(0, VOCAB - 2, size=n).tolist() for n in (4, 11)]
    ref = LLM(str(path), model_impl="native", quantization="none", num_kv_blocks=32, block_size=4)
    want, want_lp = _tokens(ref, prompts)
    del ref
    llm = LLM(str(path), model_impl="native", num_kv_blocks=32, block_size=4)
    assert llm.llm_engine.get_stats().weight_formats == {"float32": 2, "Q2_K": 4, "BF16": 2, "Q8_0": 1}
    got, got_lp = _tokens(llm, prompts)
    assert got == want
    assert max(abs(a - b) for x, y in zip(got_lp, want_lp) for a, b in zip(x, y)) < 1e-4


def test_expected_resident_memory_counts_packed_blocks_once():
    """``/stats`` ``expected_rss_mib``: the weights (a packed table shared by the embedding and the
    head counted once, with its scales) + the pool + the runtime."""
    from torch import nn

    from pagedllm.memory import RUNTIME_BYTES, expected_resident_mib, weight_bytes
    from pagedllm.models.gguf_blocks import quantize_int8
    from pagedllm.models.quant_linear import GGUFLinear, PackedEmbedding
    lin = GGUFLinear("S8", quantize_int8(torch.randn(32, 64)), 32, 64)
    model = nn.ModuleDict({"head": lin, "embed": PackedEmbedding(lin), "norm": nn.LayerNorm(64)})
    assert weight_bytes(model) == lin.nbytes + 2 * 64 * 4 == 32 * 64 + 32 * 2 * 4 + 512
    assert expected_resident_mib(model, 1 << 20) == (weight_bytes(model) + (1 << 20) + RUNTIME_BYTES) / 2**20
