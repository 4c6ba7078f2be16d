"""Packed GGUF weights against the float32 path, side by side in one run (issue 18, first part).

On the embedded SmolLM2-135M-Instruct (Q4_1 linears, Q8_0 tied embedding / LM head), in process,
greedy, EOS ignored, for ``quantization="none"`` (every weight dequantized to float32) and
``"gguf"`` (the file's blocks kept packed, C kernels, float32 activations):

* batch-1 decode: one 32-token prompt, 128 output tokens, decode tokens/s (the tokens after the
  first over the time after the first), best of ``--repeats``;
* prefill: one 512-token prompt, 1 output token, prompt tokens/s (best of ``--repeats``);
* batch 16: 16 prompts x 128 in / 128 out at once, output tokens/s;
* the process's resident memory after each configuration's runs (``/proc/self/status`` VmRSS; the
  float32 configuration runs first, so the second's figure includes what the allocator kept).

Also checks that both configurations give the same greedy tokens on the batch-16 prompts.
Results: ``results/quantized-<date>.json`` with the machine's CPU model and flags.

Usage: ``python benchmarks/quantized.py [--repeats 3]``
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

from pagedllm import LLM, SamplingParams
from pagedllm.bench.metrics import machine_facts


def rss_mb() -> float:
    """Resident set size of this process in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` random token-id prompts of ``length`` tokens (ids past the special tokens)."""
    rng = random.Random(seed)
    return [[rng.randint(100, 49000) for _ in range(length)] for _ in range(n)]


def measure(quantization: str, repeats: int) -> dict:
    """One configuration's numbers (see the module docstring)."""
    llm = LLM(quantization=quantization, max_num_seqs=16, kv_cache_memory="512MiB")
    eng = llm.llm_engine
    llm.generate(prompts(1, 8, 99), SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    decode, prefill = [], []
    for r in range(repeats):
        eng.add_request(f"d{r}", prompts(1, 32, r)[0], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
        first = None
        while eng.has_unfinished_requests():
            for out in eng.step():
                if first is None and out.outputs[0].token_ids:
                    first = time.perf_counter()
        decode.append(127 / (time.perf_counter() - first))
        t0 = time.perf_counter()
        llm.generate(prompts(1, 512, 100 + r), SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        prefill.append(512 / (time.perf_counter() - t0))
    batch = prompts(16, 128, 7)
    t0 = time.perf_counter()
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), use_tqdm=False)
    wall = time.perf_counter() - t0
    result = {"decode_tok_s": max(decode), "prefill_tok_s": max(prefill), "batch16_output_tok_s": 16 * 128 / wall,
              "rss_mib": rss_mb(), "layers": getattr(eng.runner.model, "quantization", None),
              "tokens": [o.outputs[0].token_ids for o in outs]}
    del llm, eng, outs
    gc.collect()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    results = {q: measure(q, args.repeats) for q in ("none", "gguf")}
    same = results["none"].pop("tokens") == results["gguf"].pop("tokens")
    base = results["none"]
    print(f"{'config':<6} {'decode tok/s':>12} {'prefill tok/s':>13} {'batch16 tok/s':>13} {'RSS MiB':>8}")
    for name, r in results.items():
        print(f"{name:<6} {r['decode_tok_s']:>12.1f} {r['prefill_tok_s']:>13.1f} {r['batch16_output_tok_s']:>13.1f} "
              f"{r['rss_mib']:>8.0f}")
    ratios = {k: results["gguf"][k] / base[k] for k in ("decode_tok_s", "prefill_tok_s", "batch16_output_tok_s")}
    print("gguf / none: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    print(f"greedy tokens identical: {same}")
    out = Path(args.json_out or Path(__file__).resolve().parent / "results" /
               f"quantized-{time.strftime('%Y-%m-%d')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_facts(), "args": vars(args), "results": results,
                               "ratios_gguf_to_none": ratios, "identical_tokens": same}, indent=2))
    print(f"wrote {out}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
