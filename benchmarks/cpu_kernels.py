"""A/B of pagedllm's CPU code paths on SmolLM2, in one run: torch ops only, oneDNN-packed
linears, and packed linears plus our C kernels (the default).

Each variant runs in its own process (the switches are read once per process):

- ``torch``: ``PAGEDLLM_CPU_KERNELS=0 PAGEDLLM_CPU_PREPACK=0`` (MKL linears, torch attention);
- ``packed``: ``PAGEDLLM_CPU_KERNELS=0`` (oneDNN-packed linears, torch ops elsewhere);
- ``kernels``: the defaults (packed linears, C kernels, batch-1 decode in one C call).

Workloads, offline through ``LLM`` with prefix caching off, greedy with ``ignore_eos``:
W1 decode tok/s (one 32-token prompt, 128 output tokens: 127 / (time for 128 - time for 1)),
prefill ms (one 128-token prompt, one output token, median of 5) and W2 output tok/s
(64 prompts x 128 in / 128 out). Ratios are against ``torch``.

    python benchmarks/cpu_kernels.py                  # all three variants
    python benchmarks/cpu_kernels.py --variants torch kernels --w2-prompts 16
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {
    "torch": {"PAGEDLLM_CPU_KERNELS": "0", "PAGEDLLM_CPU_PREPACK": "0"},
    "packed": {"PAGEDLLM_CPU_KERNELS": "0", "PAGEDLLM_CPU_PREPACK": "1"},
    "kernels": {"PAGEDLLM_CPU_KERNELS": "1", "PAGEDLLM_CPU_PREPACK": "1"},
}


def _child(w2_prompts: int) -> dict:
    """Run the workloads in this process; returns the measured values."""
    import random

    from pagedllm import LLM, SamplingParams
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(n)]

    llm = LLM(enable_prefix_caching=False, max_num_seqs=max(64, w2_prompts), num_kv_blocks=2048)

    def timed(prompts, max_tokens: int) -> float:
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t0

    timed([prompt(32)], 8)  # warm-up
    w1 = prompt(32)
    t1, t128 = min(timed([w1], 1) for _ in range(3)), min(timed([w1], 128) for _ in range(2))
    prefill = statistics.median(timed([prompt(128)], 1) for _ in range(5))
    w2 = timed([prompt(128) for _ in range(w2_prompts)], 128)
    return {"w1_decode_tok_s": 127 / (t128 - t1), "prefill_128_ms": prefill * 1e3,
            "w2_output_tok_s": w2_prompts * 128 / w2}


def main() -> None:
    """Run each variant in a subprocess, print the table of values and ratios, save JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--w2-prompts", type=int, default=64)
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args.w2_prompts)))
        return
    results = {}
    for name in args.variants:
        env = {**os.environ, **VARIANTS[name]}
        proc = subprocess.run([sys.executable, __file__, "--child", "--w2-prompts", str(args.w2_prompts)],
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"variant {name} failed:\n{proc.stderr[-3000:]}")
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(name, results[name], flush=True)
    base = results.get("torch")
    metrics = [("W1 decode tok/s", "w1_decode_tok_s"), ("prefill 128 tokens ms", "prefill_128_ms"),
               ("W2 output tok/s", "w2_output_tok_s")]
    print("\n| metric | " + " | ".join(args.variants) + (" | " + " | ".join(f"{v} / torch" for v in args.variants
                                                                    if v != "torch") if base else "") + " |")
    print("|---" * (1 + len(args.variants) + (len(args.variants) - 1 if base else 0)) + "|")
    for label, key in metrics:
        row = [f"{results[v][key]:.1f}" for v in args.variants]
        if base:
            row += [f"{results[v][key] / base[key]:.2f}x" for v in args.variants if v != "torch"]
        print(f"| {label} | " + " | ".join(row) + " |")
    from pagedllm.bench.metrics import machine_facts
    out = Path(args.out_dir) / f"cpu_kernels-{datetime.date.today().isoformat()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_facts(), "w2_prompts": args.w2_prompts, "results": results},
                              indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
