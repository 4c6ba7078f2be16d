"""pagedllm on the side-by-side workloads, with the same interface as the peer scripts.

W1 (one prompt) runs through ``LLMEngine`` step by step, so TTFT (the step that
returns the first token) and decode speed (``(output_len - 1)`` tokens over the
time after it) are exact; W2 runs as one ``LLM.generate`` call, all prompts at
once. Greedy, EOS ignored, float32, in process, async scheduling on.

    python benchmarks/peers/pagedllm_run.py run --workload W.json --json-out OUT.json [--model-impl native]
"""

from __future__ import annotations

import argparse
import json
import time


def run(workload: dict, model: str | None, engine_args: dict) -> dict:
    """Time one workload (see the module docstring); returns the peers' result fields."""
    import pagedllm
    from pagedllm import LLM, SamplingParams
    prompts, n = workload["prompts"], workload["output_len"]
    llm = LLM(model, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    llm.generate([prompts[0][:8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    eng = llm.engine
    res = {"engine": f"pagedllm {pagedllm.__version__}", "workload": workload["name"], "num_prompts": len(prompts)}
    if len(prompts) == 1:
        t0 = time.perf_counter()
        eng.add_request("w1", prompts[0], params)
        ttft, out = None, None
        while eng.has_unfinished_requests():
            for o in eng.step():
                if ttft is None and o.outputs[0].token_ids:
                    ttft = time.perf_counter() - t0
                if o.finished:
                    out = o
        elapsed = time.perf_counter() - t0
        outs = [out]
        res.update(mean_ttft_ms=ttft * 1e3, decode_tok_s=(n - 1) / (elapsed - ttft))
    else:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(map(len, prompts))
    res.update(total_input_tokens=n_in, total_output_tokens=n_out, elapsed_s=elapsed,
               output_throughput=n_out / elapsed, total_token_throughput=(n_in + n_out) / elapsed,
               first_output_ids=list(outs[0].outputs[0].token_ids[:16]))
    eng.shutdown()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="time one workload file")
    r.add_argument("--workload", required=True)
    r.add_argument("--json-out", required=True)
    r.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    r.add_argument("--model-impl", default="auto")
    r.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false")
    a = ap.parse_args()
    w = json.loads(open(a.workload).read())
    res = run(w, a.model, {"model_impl": a.model_impl, "async_scheduling": a.async_scheduling,
                           "max_num_seqs": max(128, len(w["prompts"])), "num_kv_blocks": 4096})
    open(a.json_out, "w").write(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "first_output_ids"}))


if __name__ == "__main__":
    main()
