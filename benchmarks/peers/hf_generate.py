"""Peer engine: Hugging Face ``transformers`` ``generate`` with static batching (float32, CPU).

What it measures: the workloads of ``benchmarks/side_by_side.py`` run with the
plain ``generate`` loop a user would write: prompts in static batches of equal
length (no padding needed: the benchmark prompts of one workload share a
length), greedy, exactly ``output_len`` new tokens (``min_new_tokens`` =
``max_new_tokens``, so EOS does not stop a row), transformers' dynamic KV cache.
For one prompt, TTFT is timed with a 1-token ``generate`` and decode speed is
``(output_len - 1) / (full time - TTFT)``. There is no server, so no W3.

Runs in the main pagedllm environment (transformers is already a dependency):

    python benchmarks/peers/hf_generate.py run --workload W.json --json-out OUT.json --model-dir DIR
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def run(workload: dict, model_dir: str, batch_size: int | None) -> dict:
    """Generate every prompt of ``workload`` and time it (see the module docstring).

    Args:
        workload: ``{"name", "prompts": [[ids]], "output_len"}``.
        model_dir: Hugging Face directory of the model.
        batch_size: prompts per ``generate`` call (default: all of them).
    Returns:
        The result fields shared by every peer script.
    """
    import transformers
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts, n = workload["prompts"], workload["output_len"]
    bs = batch_size or len(prompts)
    kw = dict(do_sample=False, use_cache=True, pad_token_id=model.config.eos_token_id)

    def gen(batch, k):
        ids = torch.tensor(batch, dtype=torch.long)
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), min_new_tokens=k,
                              max_new_tokens=k, **kw)[:, ids.shape[1]:]

    with torch.inference_mode():
        gen(prompts[:1], 4)  # warm-up
        ttft = None
        if len(prompts) == 1:
            t0 = time.perf_counter()
            gen(prompts, 1)
            ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = [t for i in range(0, len(prompts), bs) for t in gen(prompts[i:i + bs], n).tolist()]
        elapsed = time.perf_counter() - t0
    n_out, n_in = sum(map(len, out)), sum(map(len, prompts))
    res = {"engine": f"transformers {transformers.__version__} generate (static batch {bs})",
           "workload": workload["name"], "num_prompts": len(prompts), "total_input_tokens": n_in,
           "total_output_tokens": n_out, "elapsed_s": elapsed, "output_throughput": n_out / elapsed,
           "total_token_throughput": (n_in + n_out) / elapsed, "first_output_ids": out[0][:16]}
    if ttft is not None:
        res["mean_ttft_ms"] = ttft * 1e3
        res["decode_tok_s"] = (n - 1) / (elapsed - ttft)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="time one workload file")
    r.add_argument("--workload", required=True)
    r.add_argument("--json-out", required=True)
    r.add_argument("--model-dir", required=True)
    r.add_argument("--batch-size", type=int, default=None)
    a = ap.parse_args()
    res = run(json.loads(open(a.workload).read()), a.model_dir, a.batch_size)
    open(a.json_out, "w").write(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "first_output_ids"}))


if __name__ == "__main__":
    main()
