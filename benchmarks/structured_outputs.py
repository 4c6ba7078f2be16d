"""Structured-output overhead: 64 concurrent JSON-schema requests against the same 64 unconstrained,
side by side in one run, plus grammar compile times cold and cached.

Workload (issue 16): 64 chat requests on the embedded SmolLM2-135M-Instruct, all arriving
together through ``LLM.generate``, greedy, 128 output tokens each. The constrained runs follow
a schema whose answers are longer than 128 tokens (an array of at least 20 person records), so
every request, constrained or not, produces exactly 128 tokens (the unconstrained run ignores
EOS): the two runs do the same model work, and the throughput ratio is the cost of the
grammar (compile wait, mask fill, mask apply). Configurations, alternated ``--repeats`` times so
that drift on the machine hits both alike (the median is reported):

* ``free``                 -- no constraint;
* ``json (one schema)``    -- all 64 follow one schema (compiled once, then copied);
* ``json (64 schemas)``    -- each follows its own schema (64 cold compiles, all but the
  first off the critical path while earlier requests run).

Compile times are measured on the backend directly: building llguidance's view of the
tokenizer (once per engine), a cold compile, a cached one (a matcher copy), and the front
end's validation.

Usage: ``python benchmarks/structured_outputs.py [--num-requests 64 --output-len 128 --repeats 3]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from pagedllm import LLM, SamplingParams
from pagedllm.bench.metrics import machine_facts
from pagedllm.structured_output import StructuredOutputsParams


def person_list_schema(variant: int) -> dict:
    """An array of at least 20 records; ``variant`` renames one property (a distinct grammar)."""
    person = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24}, f"tag_{variant}": {"enum": ["a", "b", "c"]}},
        "required": ["name", "age", "city"], "additionalProperties": False}
    return {"type": "array", "items": person, "minItems": 20}


def run(llm: LLM, prompts: list[list[dict]], params: list[SamplingParams]) -> dict:
    """Generate; output throughput (tokens/s), wall time (s) and the step loop's timings."""
    s0 = llm.engine.get_stats().step_timings
    t0 = time.perf_counter()
    outs = llm.chat(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    s1 = llm.engine.get_stats().step_timings
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = s1.steps - s0.steps
    return {"wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall,
            "finish_reasons": sorted({o.outputs[0].finish_reason for o in outs}),
            "mean_sample_s": (s1.sample_s - s0.sample_s) / steps, "mean_execute_s": (s1.execute_s - s0.execute_s) / steps,
            "idle_s": s1.idle_s - s0.idle_s, "steps": steps}


def compile_times(llm: LLM) -> dict:
    """Seconds: tokenizer view, validation, cold compile, cached compile (medians of a few)."""
    from pagedllm.structured_output.backend import GuidanceBackend
    tok = llm.get_tokenizer()
    t0 = time.perf_counter()
    backend = GuidanceBackend(tok, llm.engine.hf_config.vocab_size, {tok.eos_token_id})
    init = time.perf_counter() - t0
    cold, cached, validate = [], [], []
    for i in range(5):
        so = StructuredOutputsParams(json=person_list_schema(1000 + i))
        spec = so.grammar_spec()
        t0 = time.perf_counter()
        backend.validate(spec)
        validate.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        backend.compile(so.grammar_key(), spec)
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        backend.compile(so.grammar_key(), spec)
        cached.append(time.perf_counter() - t0)
    return {"tokenizer_init_s": init, "validate_s": statistics.median(validate),
            "compile_cold_s": statistics.median(cold), "compile_cached_s": statistics.median(cached)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    n, out_len = args.num_requests, args.output_len
    llm = LLM(max_num_seqs=n, kv_cache_memory="2GiB")
    prompts = [[{"role": "user", "content": f"List twenty people (request {i}) as JSON records with name, age "
                                            "and city."}] for i in range(n)]

    def constrained(variant_of) -> list[SamplingParams]:
        return [SamplingParams(temperature=0, max_tokens=out_len, structured_outputs=StructuredOutputsParams(
            json=person_list_schema(variant_of(i)))) for i in range(n)]

    configs = {"free": [SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)] * n,
               "json (one schema)": constrained(lambda i: 0),
               "json (64 schemas)": None}
    llm.chat(prompts[:2], configs["json (one schema)"][:2], use_tqdm=False)  # warm-up, and the tokenizer view
    runs: dict[str, list[dict]] = {k: [] for k in configs}
    for rep in range(args.repeats):
        for name, params in configs.items():
            if params is None:  # fresh schemas every repeat: every compile is cold
                params = constrained(lambda i, rep=rep: 1 + rep * n + i)
            runs[name].append(run(llm, prompts, params))
    results = {}
    for name, rs in runs.items():
        med = statistics.median(r["output_tok_s"] for r in rs)
        results[name] = {"median_output_tok_s": med, "runs": rs}
    free = results["free"]["median_output_tok_s"]
    for name, r in results.items():
        r["ratio_to_free"] = r["median_output_tok_s"] / free
    compile = compile_times(llm)
    print(f"workload: {n} concurrent chat requests, {out_len} output tokens each, greedy, SmolLM2-135M")
    print(f"{'config':<20} {'output tok/s':>12} {'ratio':>7} {'mean sample ms':>15} {'mean execute ms':>16}")
    for name, r in results.items():
        last = r["runs"][-1]
        print(f"{name:<20} {r['median_output_tok_s']:>12.1f} {r['ratio_to_free']:>7.3f} "
              f"{last['mean_sample_s'] * 1e3:>15.2f} {last['mean_execute_s'] * 1e3:>16.2f}")
    print("compile: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in compile.items()))
    out = Path(args.json_out or Path(__file__).resolve().parent / "results" /
               f"structured_outputs-{time.strftime('%Y-%m-%d')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_facts(), "args": vars(args), "results": results,
                               "compile": compile}, indent=2))
    print(f"wrote {out}")
    ok = all(r["ratio_to_free"] >= 0.9 for r in results.values())
    print(f"constrained throughput >= 90% of free: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
