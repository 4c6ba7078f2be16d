"""Prefix caching benchmark: shared-prefix requests with the cache on and off, in one run.

Workload (issue 3): 32 requests that share a ~512-token prefix (a system
prompt / few-shot block) followed by distinct ~32-token suffixes, 16 output
tokens each, greedy, EOS ignored, on the embedded SmolLM2-135M-Instruct.
All requests arrive together through ``LLM.generate``.

Reported per configuration: mean and median time to first token (TTFT,
seconds from arrival to the first generated token), total wall time, and the
prefix cache hit rate (hit tokens / looked-up tokens). Configurations:

* ``off``        -- ``enable_prefix_caching=False``;
* ``on (cold)``  -- caching on, empty cache: the first request's blocks are
  reused by the others as soon as they are scheduled;
* ``on (warm)``  -- caching on, the prefix already cached by an earlier batch.

Usage: ``python benchmarks/prefix_caching.py [--num-requests 32 --prefix-len 512 --suffix-len 32]``
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from datetime import datetime
from pathlib import Path

from pagedllm import LLM, SamplingParams


def make_prompts(tokenizer, n: int, prefix_len: int, suffix_len: int, seed: int) -> list[list[int]]:
    """``n`` token-id prompts: one shared random prefix plus a distinct random suffix each."""
    rng = random.Random(seed)
    lo = max(tokenizer.all_special_ids + list(getattr(tokenizer, "added_tokens_decoder", {}) or [0])) + 1
    hi = tokenizer.vocab_size - 1
    prefix = [rng.randint(lo, hi) for _ in range(prefix_len)]
    return [prefix + [rng.randint(lo, hi) for _ in range(suffix_len)] for _ in range(n)]


def run(llm: LLM, prompts, params) -> dict:
    """Generate and summarize TTFT (s), wall time (s) and this batch's prefix-cache hit rate."""
    s0 = llm.engine.get_stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    s1 = llm.engine.get_stats()
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    queries = s1["prefix_cache_queries"] - s0["prefix_cache_queries"]
    hits = s1["prefix_cache_hits"] - s0["prefix_cache_hits"]
    return {"mean_ttft_s": statistics.mean(ttft), "median_ttft_s": statistics.median(ttft), "wall_s": wall,
            "hit_rate": hits / queries if queries else 0.0, "hit_tokens": hits,
            "tokens": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    results = {}
    for name, caching in (("off", False), ("on", True)):
        llm = LLM(enable_prefix_caching=caching, max_num_seqs=args.num_requests, kv_cache_memory="2GiB")
        tok = llm.get_tokenizer()
        prompts = make_prompts(tok, args.num_requests, args.prefix_len, args.suffix_len, args.seed)
        llm.generate([[tok.vocab_size - 5] * 4], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        results[name if not caching else "on (cold)"] = run(llm, prompts, params)
        if caching:
            warm = make_prompts(tok, args.num_requests, args.prefix_len, args.suffix_len, args.seed + 1)
            warm = [prompts[0][:args.prefix_len] + p[args.prefix_len:] for p in warm]
            results["on (warm)"] = run(llm, warm, params)
        del llm
    same = results["off"]["tokens"] == results["on (cold)"]["tokens"]
    base = results["off"]
    print(f"workload: {args.num_requests} requests, {args.prefix_len}-token shared prefix + "
          f"{args.suffix_len}-token suffixes, {args.output_len} output tokens, greedy")
    print(f"{'config':<11} {'mean TTFT s':>11} {'median TTFT s':>13} {'wall s':>8} {'hit rate':>9} "
          f"{'TTFT speed-up':>13}")
    for name, r in results.items():
        print(f"{name:<11} {r['mean_ttft_s']:>11.3f} {r['median_ttft_s']:>13.3f} {r['wall_s']:>8.2f} "
              f"{r['hit_rate']:>9.1%} {base['mean_ttft_s'] / r['mean_ttft_s']:>12.2f}x")
    print(f"greedy tokens identical with caching on and off: {same}")
    out = Path(args.json_out or Path(__file__).parent / "results" /
               f"prefix-caching-{datetime.now():%Y-%m-%d}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    for r in results.values():
        r.pop("tokens")
    out.write_text(json.dumps({"date": datetime.now().isoformat(timespec="seconds"), "args": vars(args),
                               "results": results, "identical_tokens": same}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
