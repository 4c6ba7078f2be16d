"""Do the hybrid mixers' C kernels pay? (``kernels/state_kernels.c`` against the torch mixers)

1. Per mixer call, at real models' widths: LFM2-350M's gated short convolution (hidden 1024, 3
   taps) and Granite-4.0-H-Tiny's Mamba-2 (hidden 1536, 48 heads x 64, state 128, 4 taps): the
   input convolution and the SSM for 1 and 16 decodes and for one 256-token prefill chunk, with and
   without prefix caching's checkpoints (one per 16-token block): the torch side is transformers'
   recurrent update and chunked scan, the C side ``ssd_scan``, token by token.
2. Whole models: prefill tokens/s (8 new prompts of 512 tokens, prefix caching on) and decode
   tokens/s (batch 1 and 16, 64 tokens) of random-weight LFM2 and Granite 4 hybrid models of those
   widths (8 layers, attention at 2 of them) through ``LLM.generate``, with the mixers on
   the C kernels and on torch ops (``PAGEDLLM_NATIVE_MIXERS``, read per call: one engine, the two
   settings alternated per round, best of the rounds), greedy tokens compared.

Writes ``results/hybrid_mixers-<date>.json`` with the CPU model and flags.

    python benchmarks/hybrid_mixers.py [--rounds 3] [--skip-models]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embeddings import machine  # noqa: E402

LFM2 = dict(hidden_size=1024, intermediate_size=4608, num_attention_heads=16, num_key_value_heads=8, conv_L_cache=3,
            block_multiple_of=256, norm_eps=1e-5, vocab_size=65536, tie_word_embeddings=True)
GRANITE = dict(hidden_size=1536, intermediate_size=512, shared_intermediate_size=4096, num_attention_heads=12,
               num_key_value_heads=4, mamba_n_heads=48, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1,
               mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256, num_local_experts=0,
               position_embedding_type="rope", vocab_size=49160, tie_word_embeddings=True)


def _timed(fn, reps: int) -> float:
    """Median microseconds of ``fn()`` over ``reps`` calls after 3 warm-ups."""
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2] * 1e6


def _native(on: bool) -> None:
    os.environ["PAGEDLLM_NATIVE_MIXERS"] = "1" if on else "0"


def mixer_calls(reps: int) -> list[dict]:
    """Part 1: microseconds per call, torch vs C."""
    import torch
    from pagedllm.attention.state import StateBatch
    from pagedllm.models.mamba2 import ssd_step
    from pagedllm.models.short_conv import causal_conv_step
    from transformers import GraniteMoeHybridConfig
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMambaLayer
    rows = []
    g = GRANITE
    layer = GraniteMoeHybridMambaLayer(GraniteMoeHybridConfig(**g, num_hidden_layers=1,
                                                              layer_types=["linear_attention"]), layer_idx=0).eval()
    nh, hd, ns = g["mamba_n_heads"], g["mamba_d_head"], g["mamba_d_state"]
    conv_dim = g["mamba_expand"] * g["hidden_size"] + 2 * ns
    cases = [("lfm2 short conv", LFM2["hidden_size"], LFM2["conv_L_cache"] - 1, False),
             ("mamba2 input conv", conv_dim, g["mamba_d_conv"] - 1, True)]
    for batch_shape in ([1], [1] * 16, [256], [1024]):
        n = len(batch_shape)
        qsl = torch.tensor([0] + torch.tensor(batch_shape).cumsum(0).tolist())
        t = int(qsl[-1])
        sb = StateBatch(torch.arange(n), torch.ones(n, dtype=torch.bool), qsl, {})
        label = f"{n} decodes" if batch_shape[0] == 1 else f"prefill {t}"
        for name, chans, width, silu in cases:
            x, cache = torch.randn(t, chans), torch.randn(n, chans, width)
            w, b = torch.randn(chans, width + 1), torch.randn(chans)
            res = {}
            for on in (False, True):
                _native(on)
                sb._conv_index.clear()
                res[on] = _timed(lambda: causal_conv_step(x, cache, w, b, sb, silu=silu), reps)
            rows.append({"mixer": name, "step": label, "torch_us": round(res[False], 1), "c_us": round(res[True], 1),
                         "speedup": round(res[False] / res[True], 2)})
            print(json.dumps(rows[-1]), flush=True)
        xs, dt = torch.randn(t, nh * hd), torch.randn(t, nh)
        bm, cm = torch.randn(t, ns), torch.randn(t, ns)
        # a prefill chunk also with prefix caching's checkpoints (one per 16-token block)
        for cks in ([[]] if batch_shape[0] == 1 else [[], [(0, k, 1 + k // 16) for k in range(16, t + 1, 16)]]):
            ssm = torch.randn(n + t // 16 + 1, nh, hd, ns)
            sbc = StateBatch(torch.arange(n), torch.ones(n, dtype=torch.bool), qsl, {}, checkpoints=cks)
            res = {}
            with torch.no_grad():
                for on in (False, True):
                    _native(on)
                    res[on] = _timed(lambda: ssd_step(layer, xs, bm, cm, dt, ssm, sbc), max(3, reps // 10))
            rows.append({"mixer": "mamba2 ssm", "step": label + (f", {len(cks)} checkpoints" if cks else ""),
                         "torch_us": round(res[False], 1), "c_us": round(res[True], 1),
                         "speedup": round(res[False] / res[True], 2)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _build(kind: str, root: Path) -> str:
    import torch
    import transformers
    torch.manual_seed(0)
    if kind == "lfm2":
        cfg = transformers.Lfm2Config(**LFM2, num_hidden_layers=8, full_attn_idxs=[2, 5])
    else:
        cfg = transformers.GraniteMoeHybridConfig(**GRANITE, num_hidden_layers=8, layer_types=[
            "full_attention" if i in (2, 5) else "linear_attention" for i in range(8)])
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    path = root / kind
    model.save_pretrained(path)
    return str(path)


def whole_models(rounds: int) -> list[dict]:
    """Part 2: decode tokens/s, C kernels vs torch mixers, same engine."""
    from pagedllm import LLM, SamplingParams
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("lfm2", "granite_hybrid"):
            # prefix caching on (the default): prefill chunks also write the state checkpoints
            llm = LLM(_build(kind, Path(tmp)), skip_tokenizer_init=True, kv_cache_memory="1GiB", max_num_seqs=16)
            run = 0
            best = {False: 0.0, True: 0.0}
            for r in range(rounds):  # prefill: 8 prompts of 512 tokens, new ones every run (no cache hits)
                for on in ((False, True) if r % 2 == 0 else (True, False)):
                    _native(on)
                    run += 1
                    prompts = [{"prompt_token_ids": [(run * 131 + 7 * i + j) % 4000 + 5 for j in range(512)]}
                               for i in range(8)]
                    t = time.perf_counter()
                    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
                    best[on] = max(best[on], 8 * 512 / (time.perf_counter() - t))
            rows.append({"model": kind, "workload": "prefill 8 x 512", "torch_mixers_tok_s": round(best[False], 1),
                         "c_mixers_tok_s": round(best[True], 1), "speedup": round(best[True] / best[False], 3)})
            print(json.dumps(rows[-1]), flush=True)
            for bs in (1, 16):
                prompts = [{"prompt_token_ids": [(7 * i + j) % 1000 + 5 for j in range(32)]} for i in range(bs)]
                sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
                best, tokens = {False: 0.0, True: 0.0}, {}
                for r in range(rounds):
                    for on in ((False, True) if r % 2 == 0 else (True, False)):
                        _native(on)
                        t = time.perf_counter()
                        outs = llm.generate(prompts, sp, use_tqdm=False)
                        el = time.perf_counter() - t
                        best[on] = max(best[on], bs * 64 / el)
                        tokens[on] = [o.outputs[0].token_ids for o in outs]
                rows.append({"model": kind, "workload": f"decode batch {bs}", "torch_mixers_tok_s": round(best[False], 1),
                             "c_mixers_tok_s": round(best[True], 1), "speedup": round(best[True] / best[False], 3),
                             "greedy_tokens_equal": tokens[True] == tokens[False]})
                print(json.dumps(rows[-1]), flush=True)
            del llm
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--skip-models", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch
    res = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(),
           "threads": torch.get_num_threads(), "mixer_calls": mixer_calls(a.reps)}
    if not a.skip_models:
        res["whole_models"] = whole_models(a.rounds)
    out = Path(a.out or f"benchmarks/results/hybrid_mixers-{datetime.date.today()}.json")
    out.write_text(json.dumps(res, indent=1) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main()
