"""Offline throughput benchmark: pagedllm ``LLM.generate`` vs Hugging Face ``generate``.

What it measures
    Generation throughput on a fixed synthetic workload: ``--num-prompts``
    prompts of ``--input-len`` random token ids (seeded, drawn from the
    tokenizer's ordinary vocabulary, no special/added tokens), each generating
    exactly ``--output-len`` tokens greedily with EOS ignored.

How
    * pagedllm: one ``LLM`` on the embedded default model (SmolLM2-135M-Instruct,
      float32, CPU) with ``max_num_seqs`` and a KV pool large enough for every
      prompt to run at once; a tiny warm-up generate, then one timed
      ``llm.generate(prompts, params, use_tqdm=False)`` end to end (scheduling,
      model, sampling and detokenization all included).
    * Baseline: ``transformers`` ``AutoModelForCausalLM.generate`` on the same
      converted HF directory (``llm.engine.model_dir``), float32, static batches
      of ``--batch-size`` (default: 16 and all prompts at once); all prompts have
      the same length, so no padding. The best batch size is the baseline.
    * output tok/s = generated tokens / wall seconds; total tok/s adds prompt tokens.
    * Sanity: the first 3 prompts' pagedllm token ids are compared with HF's
      ("greedy match: x/3") so that both engines do the same work.

Results are printed as a table and written as JSON to
``benchmarks/results/throughput-<date>.json`` (or ``--json-out``).

Usage: python benchmarks/throughput.py [--num-prompts 64 --input-len 128 --output-len 128
       --batch-size 16 --skip-hf --json-out PATH]. Timings need an idle machine: the
"other CPU" column is the share of all cores that other processes used meanwhile.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

import pagedllm
from pagedllm import LLM, SamplingParams


def machine_facts() -> dict:
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or "unknown"
    import transformers
    return {"cpu_model": cpu, "cpu_count": os.cpu_count(),
            "affinity_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "torch_num_threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "pagedllm": pagedllm.__version__, "pagedllm_git": _git_describe(),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "loadavg_1_5_15_at_start": os.getloadavg()}


def _git_describe() -> str | None:
    """Commit of the pagedllm checkout, with ``-dirty`` when the tree has local changes."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=Path(pagedllm.__file__).parent,
                              capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _cpu_seconds() -> tuple[float, float]:
    """(non-idle CPU seconds of the whole machine, CPU seconds of this process), for contention checks."""
    try:
        v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        busy = (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        busy = float("nan")
    t = os.times()
    return busy, t.user + t.system


def timed(fn):
    """Run ``fn()``; return (result, wall s, share of all cores used by *other* processes meanwhile)."""
    b0, o0 = _cpu_seconds()
    t0 = time.perf_counter()
    res = fn()
    wall, (b1, o1) = time.perf_counter() - t0, _cpu_seconds()
    return res, wall, max(0.0, ((b1 - b0) - (o1 - o0)) / (wall * (os.cpu_count() or 1)))


def make_prompts(tokenizer, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` random ids above every special/added token id."""
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    low = max(special) + 1 if special else 0
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, tokenizer.vocab_size, (n, length), generator=g).tolist()


def run_pagedllm(args, prompts, model_impl: str = "native") -> tuple[dict, list[list[int]], str]:
    blocks_per_seq = -(-(args.input_len + args.output_len) // 16)
    llm = LLM(max_num_seqs=args.num_prompts, block_size=16, num_kv_blocks=args.num_prompts * blocks_per_seq + 16,
              max_num_batched_tokens=max(2048, args.input_len), model_impl=model_impl)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    warm = make_prompts(llm.get_tokenizer(), 2, 16, args.seed + 1)  # not the timed prompts: no prefix-cache hits
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    steps0 = llm.engine.stats["num_steps"]
    outs, wall, other = timed(lambda: llm.generate(prompts, params, use_tqdm=False))
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    assert gen == args.num_prompts * args.output_len, f"pagedllm generated {gen} tokens"
    res = {"engine": "pagedllm", "config": f"{model_impl}, max_num_seqs={args.num_prompts}", "model_impl": model_impl,
           "wall_s": wall,
           "other_cpu_share": other, "output_tokens": gen, "prompt_tokens": sum(map(len, prompts)),
           "engine_steps": llm.engine.stats["num_steps"] - steps0,
           "engine_args": {k: str(v) for k, v in vars(llm.engine.args).items()}}
    model_dir = str(llm.engine.model_dir)
    del llm
    return res, [list(o.outputs[0].token_ids) for o in outs[:3]], model_dir


def run_hf(args, prompts, model_dir: str, batch_sizes: list[int]) -> tuple[list[dict], list[list[int]]]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    kw = dict(do_sample=False, use_cache=True, pad_token_id=model.config.eos_token_id)  # no padding happens

    def gen(batch, n):
        ids = torch.tensor(batch, dtype=torch.long)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             min_new_tokens=n, max_new_tokens=n, **kw)
        return out[:, ids.shape[1]:]

    results, first3 = [], None
    with torch.inference_mode():
        gen(prompts[:2], 4)  # warm-up
        for bs in batch_sizes:
            toks, wall, other = timed(lambda: [t for i in range(0, len(prompts), bs)
                                               for t in gen(prompts[i:i + bs], args.output_len).tolist()])
            gen_n = sum(map(len, toks))
            assert gen_n == len(prompts) * args.output_len, f"HF generated {gen_n} tokens"
            results.append({"engine": "hf-transformers", "config": f"static batch={bs}", "batch_size": bs,
                            "wall_s": wall, "other_cpu_share": other, "output_tokens": gen_n,
                            "prompt_tokens": sum(map(len, prompts))})
            first3 = first3 or toks[:3]
            print(f"  HF batch={bs}: {wall:.1f} s", flush=True)
    return results, first3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=None,
                    help="HF static batch size (default: 16 and all prompts at once)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-hf", action="store_true", help="run pagedllm only")
    ap.add_argument("--model-impl", default="native",
                    help="pagedllm implementation(s), comma-separated: native, transformers or "
                         "native,transformers (side by side; reports transformers / native)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()

    start = time.perf_counter()
    facts = machine_facts()
    print("machine: " + ", ".join(f"{k}={v}" for k, v in facts.items()), flush=True)
    from transformers import AutoTokenizer
    from pagedllm.models.resolve import resolve_model
    prompts = make_prompts(AutoTokenizer.from_pretrained(str(resolve_model(None))),
                           args.num_prompts, args.input_len, args.seed)

    rows, paged_rows, firsts = [], {}, {}
    for impl in args.model_impl.split(","):
        print(f"running pagedllm ({impl}) ...", flush=True)
        row, firsts[impl], model_dir = run_pagedllm(args, prompts, impl)
        print(f"  pagedllm {impl}: {row['wall_s']:.1f} s", flush=True)
        rows.append(row)
        paged_rows[impl] = row
    paged, paged3 = rows[0], firsts[rows[0]["model_impl"]]
    match = None
    if not args.skip_hf:
        print("running HF transformers ...", flush=True)
        sizes = [args.batch_size] if args.batch_size else sorted({min(16, args.num_prompts), args.num_prompts})
        hf_rows, hf3 = run_hf(args, prompts, model_dir, sizes)
        rows += hf_rows
        match = sum(a == b for a, b in zip(paged3, hf3))
    for r in rows:
        r["output_tok_s"] = r["output_tokens"] / r["wall_s"]
        r["total_tok_s"] = (r["output_tokens"] + r["prompt_tokens"]) / r["wall_s"]

    print(f"\nworkload: {args.num_prompts} prompts x {args.input_len} in / {args.output_len} out, "
          f"greedy, ignore_eos, float32, {facts['torch_num_threads']} threads")
    print(f"{'engine':<16} {'config':<22} {'wall s':>8} {'out tok/s':>10} {'total tok/s':>12} {'other CPU':>10}")
    for r in rows:
        print(f"{r['engine']:<16} {r['config']:<22} {r['wall_s']:>8.2f} {r['output_tok_s']:>10.1f} "
              f"{r['total_tok_s']:>12.1f} {r['other_cpu_share']:>10.0%}")
    if any(r["other_cpu_share"] > 0.05 for r in rows):
        print("WARNING: other processes used >5% of the CPUs during a timed run; the numbers are skewed")
    summary = {}
    if len(paged_rows) > 1 and {"native", "transformers"} <= set(paged_rows):
        ratio = paged_rows["transformers"]["output_tok_s"] / paged_rows["native"]["output_tok_s"]
        same = sum(a == b for a, b in zip(firsts["native"], firsts["transformers"]))
        summary.update(ratio_transformers_over_native=ratio, native_transformers_greedy_match=f"{same}/3")
        print(f"ratio Transformers backend / native: {ratio:.2f}x (greedy match {same}/3)")
    if not args.skip_hf:
        best = max((r for r in rows if r["engine"] != "pagedllm"), key=lambda r: r["output_tok_s"])
        summary = {"hf_best_batch_size": best["batch_size"],
                   "ratio_output_tok_s": paged["output_tok_s"] / best["output_tok_s"],
                   "greedy_match": f"{match}/3"}
        print(f"ratio pagedllm / HF-best (batch={best['batch_size']}): {summary['ratio_output_tok_s']:.2f}x")
        print(f"greedy match: {match}/3")
    summary.update(benchmark_wall_s=time.perf_counter() - start, loadavg_1_5_15_at_end=os.getloadavg())
    print(f"benchmark wall time: {summary['benchmark_wall_s']:.1f} s")

    out = Path(args.json_out) if args.json_out else (
        Path(__file__).resolve().parent / "results" / f"throughput-{datetime.date.today().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": facts, "workload": vars(args), "model_dir": model_dir,
                               "results": rows, **summary}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
