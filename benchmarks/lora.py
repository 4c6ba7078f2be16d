"""LoRA adapters benchmark (issue 43): output tokens per second with 1, 4 and 8 distinct adapters in one
batch against the base model alone, and batch-1 decode with an adapter against without, in one run.

Workload: the embedded SmolLM2-135M-Instruct; random PEFT adapters of rank 16 on every attention and MLP
projection (written with ``peft``, ``init_lora_weights=False``); 16 prompts of 64 random tokens arriving
together (concurrency 16), 64 output tokens each, greedy, EOS ignored; requests spread round-robin over
the adapters. One engine (``enable_lora=True, max_loras=8``) serves every configuration, so the base
model's numbers are the same engine's with no adapter rows (the cost of LoRA support itself is the
base-only line against a second engine without ``enable_lora``). Each configuration runs once to warm
up, then ``--repeats`` times; the median is reported.

Usage: ``python benchmarks/lora.py [--model qwen2.5-coder-0.5b-instruct] [--repeats 3] [--out ...json]``
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path

from pagedllm import LLM, SamplingParams
from pagedllm.bench.metrics import machine_facts
from pagedllm.lora.request import LoRARequest

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapters(model_dir: str, root: Path, n: int, rank: int) -> list[Path]:
    """``n`` random PEFT adapters of ``model_dir`` under ``root`` (rank ``rank``, every projection)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    for i in range(n):
        torch.manual_seed(i)
        peft = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                               init_lora_weights=False, lora_dropout=0.0))
        d = root / f"adapter-{i}"
        peft.save_pretrained(d)
        base = peft.unload()
        out.append(d)
    return out


def timed(llm: LLM, prompts, params, loras, repeats: int) -> dict:
    """Median wall time and output tokens per second of ``llm.generate(prompts, params, lora_request=loras)``."""
    llm.generate(prompts, params, lora_request=loras, use_tqdm=False)  # warm-up
    walls, tokens = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        walls.append(time.perf_counter() - t0)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    wall = statistics.median(walls)
    return {"wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall, "walls_s": walls}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default=None, help="a model name or directory (default: the embedded SmolLM2)")
    ap.add_argument("--out", default=f"benchmarks/results/lora-{date.today()}.json")
    args = ap.parse_args()
    from pagedllm.models.resolve import resolve_model
    model = str(resolve_model(args.model))
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randint(100, 40000) for _ in range(args.prompt_len)]}
               for _ in range(args.concurrency)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    results: dict = {"machine": machine_facts(), "args": vars(args), "model": model, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = write_adapters(model, Path(tmp), 8, args.rank)
        reqs = [LoRARequest(f"a{i}", i + 1, str(d)) for i, d in enumerate(dirs)]
        plain = LLM(model, max_num_seqs=args.concurrency)
        results["runs"]["base, no --enable-lora"] = timed(plain, prompts, params, None, args.repeats)
        results["runs"]["batch 1, no --enable-lora"] = timed(plain, prompts[:1], params, None, args.repeats)
        del plain
        llm = LLM(model, enable_lora=True, max_loras=8, max_cpu_loras=8, max_lora_rank=args.rank,
                  max_num_seqs=args.concurrency)
        results["runs"]["base"] = timed(llm, prompts, params, None, args.repeats)
        for n in (1, 4, 8):
            loras = [reqs[i % n] for i in range(args.concurrency)]
            results["runs"][f"{n} adapters"] = timed(llm, prompts, params, loras, args.repeats)
        results["runs"]["batch 1, base"] = timed(llm, prompts[:1], params, None, args.repeats)
        results["runs"]["batch 1, adapter"] = timed(llm, prompts[:1], params, [reqs[0]], args.repeats)
    runs = results["runs"]
    base = runs["base"]["tokens_per_s"]
    results["ratios"] = {k: v["tokens_per_s"] / base for k, v in runs.items() if not k.startswith("batch 1")}
    results["ratios"]["batch 1: adapter / base"] = (runs["batch 1, adapter"]["tokens_per_s"]
                                                   / runs["batch 1, base"]["tokens_per_s"])
    results["ratios"]["batch 1: base / no --enable-lora"] = (runs["batch 1, base"]["tokens_per_s"]
                                                            / runs["batch 1, no --enable-lora"]["tokens_per_s"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    for k, v in runs.items():
        print(f"{k:32s} {v['tokens_per_s']:9.1f} tok/s  wall {v['wall_s']:.2f} s")
    for k, v in results["ratios"].items():
        print(f"{k:40s} {v:.3f}x")


if __name__ == "__main__":
    main()
