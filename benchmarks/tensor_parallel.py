"""Tensor and pipeline parallelism's communication per step on SmolLM2-135M (float32, gloo on one
machine; issue 21).

For TP=1, TP=2 and PP=2 (one thread per rank), in process, greedy, EOS ignored: a batch of ``--batch``
prompts of 32 random tokens, ``--max-tokens`` output tokens each (no prefix caching: every prompt token is computed). Reported from rank 0's
counters (``parallel_state.COMM_STATS``) over the whole generation: all-reduces per step, bytes per all-reduce and per token, the logits gather,
the token broadcast, the stage-to-stage sends (PP), and the seconds each took (waiting for the peer included) against
the step's execute time. Greedy tokens of TP=2 and PP=2 are compared with TP=1's. Results: ``results/tensor_parallel-<date>.json``.

Usage: ``python benchmarks/tensor_parallel.py [--batch 1 8] [--max-tokens 64]``
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from pagedllm import LLM, SamplingParams
from pagedllm.bench.metrics import machine_facts
from pagedllm.distributed.parallel_state import COMM_STATS


def run(tp: int, batch: int, max_tokens: int, pp: int = 1) -> dict:
    """One engine of ``tp`` x ``pp`` ranks: prefill, then decode ``max_tokens - 1`` steps of ``batch`` rows."""
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(32)] for _ in range(batch)]
    llm = LLM(None, quantization="none", tensor_parallel_size=tp, pipeline_parallel_size=pp, num_threads=1,
              num_kv_blocks=256,
              enable_prefix_caching=False)
    try:
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
        core = llm.engine.core
        COMM_STATS.reset()
        steps0, exec0 = core.num_steps, core.timer.totals.execute + core.timer.totals.sample
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                            use_tqdm=False)
        wall = time.perf_counter() - t0
        steps = core.num_steps - steps0
        busy = core.timer.totals.execute + core.timer.totals.sample - exec0
        c = COMM_STATS
        tokens = batch * (32 + max_tokens - 1)  # every token the forward computed (the last one is only sampled)
        return {
            "tp": tp, "pp": pp, "batch": batch, "max_tokens": max_tokens, "steps": steps, "wall_s": wall,
            "output_tokens_per_s": batch * max_tokens / wall, "execute_s": busy,
            "all_reduce_per_step": c.all_reduce_calls / steps if steps else 0,
            "all_reduce_bytes_per_token": c.all_reduce_bytes / tokens,
            "all_reduce_s_per_step": c.all_reduce_s / steps if steps else 0,
            "gather_per_step": c.gather_calls / steps if steps else 0,
            "gather_bytes_per_sampled_token": c.gather_bytes / (batch * max_tokens),
            "gather_s_per_step": c.gather_s / steps if steps else 0,
            "broadcast_s_per_step": c.broadcast_s / steps if steps else 0,
            "p2p_per_step": c.p2p_calls / steps if steps else 0,
            "p2p_bytes_per_token": c.p2p_bytes / tokens,
            "p2p_s_per_step": c.p2p_s / steps if steps else 0,
            "comm_fraction_of_execute": (c.all_reduce_s + c.gather_s + c.broadcast_s + c.p2p_s) / busy if busy else 0,
            "token_ids": [o.outputs[0].token_ids for o in outs],
        }
    finally:
        llm.engine.shutdown()


def main() -> None:
    """Run TP=1, TP=2 and PP=2 for each batch size, print a table, write the JSON results."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args()
    rows = []
    for batch in a.batch:
        one, two, pp2 = run(1, batch, a.max_tokens), run(2, batch, a.max_tokens), run(1, batch, a.max_tokens, pp=2)
        for r in (two, pp2):
            r["same_greedy_as_tp1"] = one["token_ids"] == r["token_ids"]
        rows += [one, two, pp2]
        for r in (one, two, pp2):
            print(f"TP={r['tp']} PP={r['pp']} batch={batch}: {r['output_tokens_per_s']:.1f} tok/s, "
                  f"{r['all_reduce_per_step']:.1f} all-reduces/step, {r['all_reduce_bytes_per_token']:.0f} B/token, "
                  f"all-reduce {1e3 * r['all_reduce_s_per_step']:.2f} ms/step, gather "
                  f"{1e3 * r['gather_s_per_step']:.2f} ms/step, broadcast {1e3 * r['broadcast_s_per_step']:.2f} "
                  f"ms/step, p2p {r['p2p_per_step']:.1f}/step {r['p2p_bytes_per_token']:.0f} B/token "
                  f"{1e3 * r['p2p_s_per_step']:.2f} ms/step, comm {100 * r['comm_fraction_of_execute']:.0f}% of execute"
                  + (f", same greedy as TP=1: {r['same_greedy_as_tp1']}" if "same_greedy_as_tp1" in r else ""))
    for r in rows:
        r.pop("token_ids")
    out = Path(__file__).parent / "results" / f"tensor_parallel-{time.strftime('%Y-%m-%d')}.json"
    out.write_text(json.dumps({"machine": machine_facts(), "runs": rows}, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
