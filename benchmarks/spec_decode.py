"""Speculative decoding against the same engine without it, side by side in one run (issue 20).

On the embedded SmolLM2-135M-Instruct, in process, greedy, EOS ignored, for each of
``--quantization gguf`` (the default: Q4_1 blocks, compute-bound on a small CPU) and ``none``
(float32, memory-bound), and for no speculation, ``ngram`` and ``suffix`` (``num_speculative_tokens``
5, dynamic depth):

* repetitive, batch 1: a ~300-token code passage, then the prompt asks for it again and starts it;
  256 output tokens; decode tokens/s (after the first token), best of ``--repeats``;
* edit and quote, batch 1, through the chat template (the issue's repetitive workloads as a user
  sends them): "rewrite this code with these small edits" over the same passage, and "summarize this
  text, quoting it" over a ~300-token passage of this repository's docs; 256 output tokens each;
* W1, batch 1: a 32-token random prompt, 128 output tokens; decode tokens/s. SmolLM2's greedy
  continuation of it repeats itself, so this is not the no-repetition case; W1 sampled is: the
  same prompt at temperature 0.8 (seeded, so each configuration draws from the same distribution,
  not the same tokens), where drafts are mostly refused and the depth rule must turn itself down;
* concurrency 16: 64 random 128-token prompts, 16 in flight (``max_num_seqs`` 16: a finished
  request's slot goes to the next, as under 16 clients), 128 output tokens each; output tokens/s;
* concurrency 16, closed batch: 16 prompts at once, output tokens/s over the slowest one's
  finish. Reported, not the criterion: requests whose text repeats finish early under
  speculation and leave the rest decoding at batch 1-2 (a 15 ms step for 1-2 tokens against
  30 ms for 16 on float32), so this number measures the tail, not the step;
* ``suffix`` runs without its cross-request cache (``suffix_decoding_max_cached_requests`` 0):
  the repeats run the same prompts, which that cache would replay;
* the draft tokens, accepted tokens and acceptance by position, per workload, the depth rule's
  measured step times (``t(T)``, ms) and the drafts per step over time (``k_trace``: per step,
  seconds since the workload started, requests in the step, draft tokens in it) for the repetitive
  run and the concurrency-16 run.

Greedy tokens with speculation are compared with those without (they must be equal up to a
near-tie; the engine tests check that against transformers). The configurations are measured in
``--rounds`` interleaved passes, each round starting with another configuration; each keeps its
best and the median over the rounds (the VM's speed drifts, at times by 2x between passes). At concurrency 16 the run also records the steps
taken and the milliseconds per step of each phase: where the depth rule plans no drafts the
steps are the same with and without speculation, and what speculation costs is the planning
time it adds to ``schedule``. Results:
``results/spec_decode-<date>.json`` with the machine's CPU model and flags.

Usage: ``python benchmarks/spec_decode.py [--repeats 2] [--rounds 2] [--quantizations gguf none]``
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

from pagedllm import LLM, SamplingParams
from pagedllm.bench.metrics import machine_facts

METHODS = (None, "ngram", "suffix")
C16_REQUESTS = 64  # the sustained concurrency-16 load: 64 requests, 16 in flight (max_num_seqs)


def _passage(rel: str, start: str, chars: int) -> str:
    src = (Path(__file__).resolve().parents[1] / rel).read_text()
    return src[src.index(start):][:chars]


def repetitive_prompt(tokenizer) -> list[int]:
    """A code passage (~300 tokens of this repository), then a request to repeat it, begun."""
    code = _passage("pagedllm/spec_decode/proposers.py", "class NgramProposer", 1300)
    text = ("Here is a Python class:\n\n" + code + "\n\nHere is the same class with the docstrings kept and the "
            "method names unchanged:\n\n" + code[:40])
    return tokenizer.encode(text)


def chat_prompt(tokenizer, content: str) -> list[int]:
    """``content`` as one user message through the model's chat template."""
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def edit_prompt(tokenizer) -> list[int]:
    """Rewrite a ~300-token code passage with small edits (a rename and one changed default)."""
    code = _passage("pagedllm/spec_decode/proposers.py", "class NgramProposer", 1300)
    return chat_prompt(tokenizer, "Rewrite this Python code with two small edits: rename `propose_one` to "
                                  "`propose_for`, and keep everything else exactly as it is.\n\n" + code)


def quote_prompt(tokenizer) -> list[int]:
    """Summarize a ~300-token passage of prose, quoting it."""
    text = _passage("docs/speculative-decoding.md", "#", 1500)
    return chat_prompt(tokenizer, "Summarize the following text in a few sentences, quoting its key "
                                  "sentences word for word:\n\n" + text)


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(100, 49000) for _ in range(length)] for _ in range(n)]


def _spec_counts(eng) -> tuple[int, int, int]:
    s = eng.get_stats()
    return s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens


def decode_rate(llm, prompt: list[int], max_tokens: int, trace: list | None = None,
                params: SamplingParams | None = None) -> tuple[float, list[int]]:
    """Batch-1 decode tokens/s after the first token, and the output tokens; ``trace`` gets
    ``(seconds since the first token, tokens so far, draft tokens so far)`` per step."""
    eng = llm.llm_engine
    rid = f"r{time.perf_counter_ns()}"
    eng.add_request(rid, prompt, params or SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    first, tokens = None, []
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens = out.outputs[0].token_ids
            if first is None and tokens:
                first, n_first = time.perf_counter(), len(tokens)
            elif trace is not None and first is not None:
                trace.append((round(time.perf_counter() - first, 4), len(tokens), _spec_counts(eng)[1]))
    return (len(tokens) - n_first) / (time.perf_counter() - first), list(tokens)


def load_rate(llm, prompts: list[list[int]], params: SamplingParams, trace: list | None = None):
    """All ``prompts`` through the engine's step loop (``max_num_seqs`` bounds the requests in
    flight); output tokens/s and the tokens in prompt order. ``trace`` gets, every 8 steps,
    ``(seconds, running requests, draft tokens per step over those 8 steps)``."""
    eng = llm.llm_engine
    ids = [f"c{i}-{time.perf_counter_ns()}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, p, params)
    done: dict[str, list[int]] = {}
    t0, steps, last = time.perf_counter(), 0, _spec_counts(eng)[1]
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if trace is not None and steps % 8 == 0:
            drafts = _spec_counts(eng)[1]
            running = eng.get_stats().num_running
            trace.append((round(time.perf_counter() - t0, 3), running, round((drafts - last) / 8, 2)))
            last = drafts
    elapsed = time.perf_counter() - t0
    toks = [done[r] for r in ids]
    return sum(map(len, toks)) / elapsed, toks


def _delta(after: tuple, before: tuple) -> dict:
    steps, drafts, kept = (a - b for a, b in zip(after, before))
    return {"verified_steps": steps, "draft_tokens": drafts, "accepted_tokens": kept,
            "acceptance": round(kept / drafts, 3) if drafts else None}


def measure(quantization: str, method: str | None, repeats: int) -> dict:
    spec = None if method is None else {"method": method, "num_speculative_tokens": 5}
    if method == "suffix":
        # every repeat runs the same prompt: the cross-request cache would replay the previous
        # repeat's output and measure a replay, so suffix drafts from each request's own tokens here
        spec["suffix_decoding_max_cached_requests"] = 0
    llm = LLM(quantization=quantization, speculative_config=spec, max_num_seqs=16, kv_cache_memory="512MiB")
    tok = llm.get_tokenizer()
    llm.generate(random_prompts(1, 8, 99), SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    eng = llm.llm_engine
    out = {"method": method or "off", "per_workload": {}}
    batch1 = {"repetitive": (repetitive_prompt(tok), 256), "edit": (edit_prompt(tok), 256),
              "quote": (quote_prompt(tok), 256), "w1": (random_prompts(1, 32, 1)[0], 128)}
    for name, (prompt, n) in batch1.items():
        before = _spec_counts(eng)
        best, toks, trace = 0.0, None, []
        for _ in range(repeats):
            t: list = []
            rate, toks = decode_rate(llm, prompt, n, t)
            if rate > best:
                best, trace = rate, t
        out[f"{name}_decode_tok_s"], out[f"{name}_tokens"] = best, toks
        out["per_workload"][name] = _delta(_spec_counts(eng), before)
        if name == "repetitive":
            out["repetitive_trace"] = trace
    before = _spec_counts(eng)
    sampled = [decode_rate(llm, batch1["w1"][0], 128, params=SamplingParams(
        temperature=0.8, seed=s, max_tokens=128, ignore_eos=True))[0] for s in range(repeats)]
    out["w1_sampled_decode_tok_s"] = max(sampled)
    out["per_workload"]["w1_sampled"] = _delta(_spec_counts(eng), before)
    greedy = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    before = _spec_counts(eng)
    rate, out["c16_closed_tokens"] = load_rate(llm, random_prompts(16, 128, 7), greedy)
    out["c16_closed_output_tok_s"] = rate
    out["per_workload"]["c16_closed"] = _delta(_spec_counts(eng), before)
    before, trace, t0 = _spec_counts(eng), [], eng.get_stats().step_timings
    rate, out["c16_tokens"] = load_rate(llm, random_prompts(C16_REQUESTS, 128, 8), greedy, trace)
    out["c16_output_tok_s"], out["c16_k_trace"] = rate, trace
    out["per_workload"]["c16"] = _delta(_spec_counts(eng), before)
    t1 = eng.get_stats().step_timings  # the same steps with and without speculation when no drafts are planned:
    steps = t1.steps - t0.steps        # then what speculation adds is the scheduler's planning time
    out["c16_steps"] = steps
    out["c16_ms_per_step"] = {k: round((getattr(t1, f"{k}_s") - getattr(t0, f"{k}_s")) / steps * 1e3, 3)
                              for k in ("schedule", "prepare", "execute", "sample", "update")}
    s = eng.get_stats()
    out.update(draft_tokens=s.spec_num_draft_tokens, accepted_tokens=s.spec_num_accepted_tokens,
               verified_steps=s.spec_num_drafts, accepted_per_position=s.spec_accepted_per_position)
    core = getattr(llm.llm_engine.client, "core", None)
    sd = core.scheduler.spec if core is not None else None
    if sd is not None:
        out["step_ms_by_tokens"] = {t: round(v[0] * 1e3, 2) for t, v in sorted(sd.depth._times.items())}
    del llm
    gc.collect()
    return out


RATES = ("repetitive_decode_tok_s", "edit_decode_tok_s", "quote_decode_tok_s", "w1_decode_tok_s",
         "w1_sampled_decode_tok_s", "c16_output_tok_s", "c16_closed_output_tok_s")
GREEDY = ("repetitive", "edit", "quote", "w1", "c16", "c16_closed")  # workloads whose tokens must match


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="passes over the three configurations (best kept)")
    ap.add_argument("--quantizations", nargs="+", default=["gguf", "none"])
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    results = {"machine": machine_facts(), "runs": {}}
    for q in a.quantizations:
        runs = [measure(q, m, a.repeats) for m in METHODS]
        for i in range(1, a.rounds):  # the VM's speed drifts: interleave rounds, keep each one's best
            # each round starts with another configuration: in a fixed order the first engine of a
            # round ran 5-10% faster at concurrency 16 whichever it was (the order, not speculation)
            order = [(i + j) % len(METHODS) for j in range(len(METHODS))]
            for r, m in ((runs[j], METHODS[j]) for j in order):
                again = measure(q, m, a.repeats)
                r.setdefault("rounds", [{k: r[k] for k in RATES}]).append({k: again[k] for k in RATES})
                for key in RATES:
                    if again[key] > r[key]:
                        r[key] = again[key]
                        if key == "repetitive_decode_tok_s":
                            r["repetitive_trace"] = again["repetitive_trace"]
                        if key == "c16_output_tok_s":
                            r["c16_k_trace"] = again["c16_k_trace"]
        base = runs[0]
        for r in runs:  # the median over the rounds beside the best: this VM's speed swings by 2x at times
            r["median_of_rounds"] = {k: statistics.median(x[k] for x in r.get("rounds", [r])) for k in RATES}
        for r in runs:
            r["median_ratio_to_off"] = {k: round(r["median_of_rounds"][k] / base["median_of_rounds"][k], 3)
                                        for k in RATES}
            r["greedy_equal_to_off"] = {k: r[f"{k}_tokens"] == base[f"{k}_tokens"] for k in GREEDY}
            r["ratio_to_off"] = {k: round(r[k] / base[k], 3) for k in RATES}
        print(f"\nquantization={q}")
        names = [k.replace("_decode_tok_s", "").replace("_output_tok_s", "") for k in RATES]
        print(f"{'method':8} " + " ".join(f"{n:>16}" for n in names))
        for r in runs:
            print(f"{r['method']:8} " + " ".join(f"{r[k]:9.1f} ({r['ratio_to_off'][k]:4.2f})" for k in RATES))
            print(f"         median of rounds (ratio): " + " ".join(
                f"{r['median_of_rounds'][k]:.1f} ({r['median_ratio_to_off'][k]:.2f})" for k in RATES))
            print(f"         c16: {r['c16_steps']} steps, ms per step {r['c16_ms_per_step']}")
            print(f"         accepted/drafts {r['accepted_tokens']}/{r['draft_tokens']} by position "
                  f"{r['accepted_per_position']}; greedy equal: {r['greedy_equal_to_off']}")
            for w, d in r["per_workload"].items():
                if d["draft_tokens"]:
                    print(f"         {w}: {d['accepted_tokens']}/{d['draft_tokens']} kept over {d['verified_steps']} steps")
            if "step_ms_by_tokens" in r:
                print(f"         step ms by tokens per step: {r['step_ms_by_tokens']}")
        for r in runs:
            for k in GREEDY:
                r.pop(f"{k}_tokens")
        results["runs"][q] = runs
    path = Path(a.json_out or Path(__file__).parent / "results" / f"spec_decode-{time.strftime('%Y-%m-%d')}.json")
    path.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
