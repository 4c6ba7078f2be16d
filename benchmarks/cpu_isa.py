"""Packed-weight kernels per instruction-set build and thread count, against llama.cpp's ``llama-bench``
on the same GGUF files, side by side in one run (issue 37).

For each model (SmolLM2-135M Q4_1, the default; Qwen2.5-Coder-0.5B-Instruct Q4_K_M), each path
(``int8``: the default build with int8 activations; ``f32act``: the same build with
``PAGEDLLM_INT8_ACTIVATIONS=0``; ``none``: every weight dequantized to float32) and each thread
count: batch-1 decode tokens/s (a 32-token prompt, 128 greedy tokens, EOS ignored; the tokens after
the first over the time after the first, best of ``--repeats``) and prefill tokens/s (one 512-token
prompt, 1 output token, best of ``--repeats``); with ``--batch64``, 64 prompts x 128 in / 128 out at
once (output tokens/s) for ``int8`` and ``none``, first model and highest thread count only. Then ``llama-bench`` pp512 and tg128 (mean of 3)
per model and thread count, when its binary exists (``peers/build_llama_cpp.sh``).

Results: ``results/cpu_isa-<date>.json`` with the machine's CPU model, flags, load average and
whether it was idle (load below 0.7 and no pytest running) when the run started.

Usage: ``python benchmarks/cpu_isa.py [--threads 1 2] [--repeats 3] [--batch64]
[--llama-cpp-bin /work/peers/llamacpp-bin]``
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.bench.metrics import machine_facts
from pagedllm.kernels import cpu

MODELS = {"smollm2-q4_1": None, "qwen2.5-coder-0.5b-q4_k_m": "qwen2.5-coder-0.5b-instruct"}


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` random token-id prompts of ``length`` tokens (ids 100 .. 30000: in both vocabularies)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 30000, (n, length), generator=g).tolist()


def measure(model: str | None, path: str, threads: int, repeats: int, batch64: bool, model_impl: str = "auto") -> dict:
    """Decode and prefill tokens/s (and batch 64 output tokens/s) of one model, path and thread count
    (``model_impl`` as ``LLM``'s: ``auto``, ``native`` or ``transformers``)."""
    torch.set_num_threads(threads)
    cpu.set_int8_activations(path == "int8")
    llm = LLM(model, quantization="none" if path == "none" else "auto", max_num_seqs=64,
              kv_cache_memory="1GiB", enable_prefix_caching=False, model_impl=model_impl)
    eng = llm.llm_engine
    llm.generate(prompts(1, 8, 99), SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    decode, prefill = [], []
    for r in range(repeats):
        eng.add_request(f"d{r}", prompts(1, 32, r)[0], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
        first = None
        while eng.has_unfinished_requests():
            for out in eng.step():
                if first is None and out.outputs[0].token_ids:
                    first = time.perf_counter()
        decode.append(127 / (time.perf_counter() - first))
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompts(1, 512, 100 + r)[0]}], SamplingParams(max_tokens=1),
                     use_tqdm=False)
        prefill.append(512 / (time.perf_counter() - t0))
    out = {"decode_tok_s": max(decode), "prefill_tok_s": max(prefill), "decode_all": decode, "prefill_all": prefill,
           "weight_kernels": eng.get_stats().weight_kernels}
    if batch64 and path != "f32act":
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts(64, 128, 7)],
                     SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), use_tqdm=False)
        out["batch64_output_tok_s"] = 64 * 128 / (time.perf_counter() - t0)
    del llm, eng
    gc.collect()
    return out


def llama_bench(bin_dir: Path, gguf: Path, threads: int) -> dict:
    """llama.cpp's own pp512 and tg128 (tokens/s, mean of 3 repetitions) on the GGUF file."""
    res = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", "512", "-n", "128",
                          "-r", "3", "-o", "json"], capture_output=True, text=True, check=True, timeout=1800).stdout
    return {("pp512" if r["n_prompt"] else "tg128"): r["avg_ts"] for r in json.loads(res)}


def gguf_file(alias: str | None) -> Path:
    """The GGUF file a model alias (``None``: the embedded default) was converted from."""
    from pagedllm.models.quant_linear import gguf_source
    from pagedllm.models.resolve import resolve_model
    src = gguf_source(resolve_model(alias))
    if src is None:
        raise FileNotFoundError(f"no GGUF recorded for {alias}")
    return src


def idle() -> dict:
    """The load average and running pytest processes now (the machine counts as idle below 0.7, none)."""
    load = os.getloadavg()[0]
    tests = subprocess.run(["pgrep", "-f", "pytest"], capture_output=True, text=True).stdout.split()
    return {"load_1min": load, "pytest_pids": tests, "idle": load < 0.7 and not tests}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--paths", nargs="+", default=["int8", "f32act", "none"])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--batch64", action="store_true")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--llama-cpp-bin", default="/work/peers/llamacpp-bin")
    args = ap.parse_args()
    cpu.available()
    start = idle()
    results: dict = {"machine": machine_facts(), "start": start, "isa": cpu.isa(), "args": vars(args), "runs": {}}
    print(f"kernels: {cpu.isa()} build; machine idle at start: {start}")
    bin_dir = Path(args.llama_cpp_bin)
    for name in args.models:
        alias = MODELS[name]
        for nt in args.threads:
            b64 = args.batch64 and nt == max(args.threads) and name == args.models[0]
            row = {p: measure(alias, p, nt, args.repeats, b64) for p in args.paths}
            if (bin_dir / "llama-bench").exists():
                row["llama.cpp"] = llama_bench(bin_dir, gguf_file(alias), nt)
            results["runs"][f"{name}/t{nt}"] = row
            lc = row.get("llama.cpp", {})
            for p in args.paths:
                r = row[p]
                ratio = (f" ({r['decode_tok_s'] / lc['tg128']:.2f}x tg128, {r['prefill_tok_s'] / lc['pp512']:.2f}x pp512)"
                         if lc else "")
                b64 = f" batch64 {r['batch64_output_tok_s']:.1f}" if "batch64_output_tok_s" in r else ""
                print(f"{name} t{nt} {p:7s} decode {r['decode_tok_s']:7.1f} prefill {r['prefill_tok_s']:7.1f}{b64}{ratio}")
            if lc:
                print(f"{name} t{nt} llama.cpp tg128 {lc['tg128']:7.1f} pp512 {lc['pp512']:7.1f}")
    write_result("cpu_isa", results, args.json_out)
    return 0


def write_result(name: str, results: dict, json_out: str | None) -> Path:
    """Record the idle state at the end and write ``results`` to ``json_out`` or
    ``results/<name>-<date>.json``; the path written."""
    results["end"] = idle()
    out = Path(json_out or Path(__file__).resolve().parent / "results" / f"{name}-{time.strftime('%Y-%m-%d')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    sys.exit(main())
