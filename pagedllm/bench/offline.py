"""``pagedllm bench throughput`` and ``pagedllm bench latency``: the offline ``LLM`` API, timed."""

from __future__ import annotations

import statistics
import time

from pagedllm.bench.datasets import SampleRequest, load_requests
from pagedllm.bench.metrics import percentile


def _params(req: SampleRequest):
    from pagedllm import SamplingParams
    return SamplingParams(temperature=0, max_tokens=req.output_len, ignore_eos=True)


def run_throughput(llm, requests: list[SampleRequest]) -> dict:
    """Generate every request in one ``LLM.generate`` call (greedy, EOS ignored) and time it.

    Args:
        llm: a ``pagedllm.LLM``.
        requests: the workload; token-id prompts are passed as ids.
    Returns:
        ``elapsed_s``, ``num_requests``, token totals, and ``requests_per_s``,
        ``output_throughput`` and ``total_token_throughput`` (tokens/s) over the wall time.
    """
    llm.generate([[1, 2, 3]], _params(SampleRequest([1], 1, 2)), use_tqdm=False)  # warm-up
    prompts = [r.prompt for r in requests]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, [_params(r) for r in requests], use_tqdm=False)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    return {"elapsed_s": elapsed, "num_requests": len(requests), "total_input_tokens": n_in,
            "total_output_tokens": n_out, "requests_per_s": len(requests) / elapsed,
            "output_throughput": n_out / elapsed, "total_token_throughput": (n_in + n_out) / elapsed}


def run_latency(llm, batch: list[SampleRequest], num_iters: int, num_iters_warmup: int) -> dict:
    """Time one batch end to end, ``num_iters`` times after ``num_iters_warmup`` untimed runs.

    Prefix caching would make every repeat after the first cheaper, so the cache is
    reset before each run.

    Returns:
        ``avg_latency_s``, ``percentiles_s`` (10, 25, 50, 75, 90, 99), ``latencies_s``,
        and ``output_throughput``: output tokens of the batch over the mean latency (prefill
        included, so not a decode-only rate).
    """
    params = [_params(r) for r in batch]
    prompts = [r.prompt for r in batch]

    def once() -> float:
        if llm.engine.core is not None:  # in process: the cache can be dropped directly
            llm.engine.reset_prefix_cache()
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0

    for _ in range(num_iters_warmup):
        once()
    lat = [once() for _ in range(num_iters)]
    avg = statistics.fmean(lat)
    return {"batch_size": len(batch), "input_len": batch[0].prompt_len, "output_len": batch[0].output_len,
            "avg_latency_s": avg, "latencies_s": lat,
            "percentiles_s": {str(p): percentile(lat, p) for p in (10, 25, 50, 75, 90, 99)},
            "output_throughput": sum(r.output_len for r in batch) / avg}


def make_llm(args):
    """An ``LLM`` from the engine flags of ``pagedllm bench throughput|latency``."""
    from pagedllm import LLM
    from pagedllm.cli_args import engine_args_from_cli
    ea = engine_args_from_cli(args)
    return LLM(**{k: v for k, v in vars(ea).items() if k != "extra"})


def throughput_main(args) -> dict:
    """``pagedllm bench throughput``: build the engine and the dataset, run, report."""
    llm = make_llm(args)
    try:
        requests = load_requests(args, llm.get_tokenizer())
        res = run_throughput(llm, requests)
        res["cpu_kernels"] = llm.engine.get_stats().cpu_kernels
    finally:
        llm.engine.shutdown()
    print(f"Throughput: {res['requests_per_s']:.2f} requests/s, {res['total_token_throughput']:.2f} total tokens/s, "
          f"{res['output_throughput']:.2f} output tokens/s")
    return res


def latency_main(args) -> dict:
    """``pagedllm bench latency``: one batch of ``--batch-size`` random prompts, repeated."""
    from pagedllm.bench.datasets import random_requests
    llm = make_llm(args)
    try:
        batch = random_requests(llm.get_tokenizer(), args.batch_size, args.input_len, args.output_len, args.seed)
        res = run_latency(llm, batch, args.num_iters, args.num_iters_warmup)
        res["cpu_kernels"] = llm.engine.get_stats().cpu_kernels
    finally:
        llm.engine.shutdown()
    print(f"Avg latency: {res['avg_latency_s']:.4f} seconds")
    for p, v in res["percentiles_s"].items():
        print(f"{p}% percentile latency: {v:.4f} seconds")
    print(f"Output tokens/s over the whole latency (prefill included): {res['output_throughput']:.2f}")
    return res
