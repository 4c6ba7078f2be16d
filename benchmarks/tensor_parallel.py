"""Tensor and pipeline parallelism's communication per step on SmolLM2-135M (float32, gloo on one
machine; issue 21).

For TP=1, TP=2 and PP=2 (one thread per rank; PP three ways: the whole step at once and drained,
two micro-batches drained at each step end, and two micro-batches with several steps in flight,
the default), in process, greedy, EOS ignored: a batch of ``--batch``
prompts of 32 random tokens, ``--max-tokens`` output tokens each, then a prompt-heavy run (``--prefill-batch``
prompts of ``--prefill-len`` tokens, 2 output tokens each: where splitting the requests between the steps in flight pays) (no prefix caching: every prompt token is computed). Reported from rank 0's
counters (``parallel_state.COMM_STATS``) over the whole generation: all-reduces per step, bytes per all-reduce and per token, the logits gather,
the token broadcast, the stage-to-stage sends (PP), and the seconds each took (waiting for the peer included) against
the step's execute time. Greedy tokens of TP=2 and PP=2 are compared with TP=1's. Results: ``results/tensor_parallel-<date>.json``.

Usage: ``python benchmarks/tensor_parallel.py [--batch 1 8 16] [--max-tokens 64] [--prefill-len 384]``
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

from pagedllm import LLM, SamplingParams
from pagedllm.bench.metrics import machine_facts
from pagedllm.distributed.parallel_state import COMM_STATS


# (label, LLM keyword arguments, PAGEDLLM_PIPELINE_OVERLAP)
CONFIGS = [
    ("TP=1", dict(), "1"),
    ("TP=2", dict(tensor_parallel_size=2), "1"),
    ("PP=2 whole step, drained", dict(pipeline_parallel_size=2, pipeline_micro_batches=1), "0"),
    ("PP=2 x 2 micro-batches, drained", dict(pipeline_parallel_size=2, pipeline_micro_batches=2), "0"),
    ("PP=2 x 2 micro-batches, steps in flight", dict(pipeline_parallel_size=2, pipeline_micro_batches=2), "1"),
]


def run(label: str, kwargs: dict, overlap: str, batch: int, max_tokens: int, prompt_len: int = 32) -> dict:
    """One engine: prefill ``batch`` prompts of ``prompt_len`` tokens, then decode ``max_tokens - 1``
    tokens for each."""
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(prompt_len)] for _ in range(batch)]
    os.environ["PAGEDLLM_PIPELINE_OVERLAP"] = overlap
    llm = LLM(None, quantization="none", num_threads=1, num_kv_blocks=256, enable_prefix_caching=False, **kwargs)
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
        tokens = batch * (prompt_len + max_tokens - 1)  # every token the forward computed (the last one is only sampled)
        return {
            "config": label, "tp": kwargs.get("tensor_parallel_size", 1), "pp": kwargs.get("pipeline_parallel_size", 1),
            "steps_in_flight": core.scheduler.steps_in_flight, "batch": batch, "prompt_len": prompt_len,
            "computed_tokens_per_s": tokens / wall, "max_tokens": max_tokens, "steps": steps, "wall_s": wall,
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
    """Run every configuration for each batch size, print a line each, write the JSON results."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prefill-batch", type=int, default=16, help="the prompt-heavy run: this many prompts...")
    ap.add_argument("--prefill-len", type=int, default=384, help="... of this many tokens, 2 output tokens (0: skip)")
    a = ap.parse_args()
    rows = []
    work = [(b, a.max_tokens, 32) for b in a.batch] + [(a.prefill_batch, 2, a.prefill_len)] * (a.prefill_len > 0)
    for batch, max_tokens, prompt_len in work:
        runs = [run(label, kw, overlap, batch, max_tokens, prompt_len) for label, kw, overlap in CONFIGS]
        for r in runs[1:]:
            r["same_greedy_as_tp1"] = runs[0]["token_ids"] == r["token_ids"]
            r["throughput_vs_tp1"] = r["computed_tokens_per_s"] / runs[0]["computed_tokens_per_s"]
        rows += runs
        for r in runs:
            print(f"{r['config']} batch={batch} prompt={prompt_len}: {r['output_tokens_per_s']:.1f} output tok/s, "
                  f"{r['computed_tokens_per_s']:.1f} computed tok/s, {r['steps']} steps, "
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
