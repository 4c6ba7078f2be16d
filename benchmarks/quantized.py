"""Quantized weights against the float32 path and against llama.cpp, side by side in one run (issue 18).

On the embedded SmolLM2-135M-Instruct (Q4_1 linears, Q8_0 tied embedding / LM head), in process,
greedy, EOS ignored, for ``quantization="none"`` (every weight dequantized to float32), ``"gguf"``
(the file's blocks kept packed in tiles, C kernels; what ``auto`` picks: int8 activations with
VNNI byte dot products where the CPU has AVX-512 VNNI, float32 activations elsewhere),
``"gguf"`` with float32 activations forced (``PAGEDLLM_INT8_ACTIVATIONS=0``) and ``"int8"``
(the float32 weights quantized per output channel, same kernels):

* batch-1 decode: one 32-token prompt, 128 output tokens, decode tokens/s (the tokens after the
  first over the time after the first), best of ``--repeats``, and the share of that time spent
  outside the model's forward and sampling (scheduling, preparing, outputs: the per-step overhead);
* prefill: one 512-token prompt, 1 output token, prompt tokens/s (best of ``--repeats``);
* batch 16: 16 prompts x 128 in / 128 out at once, output tokens/s;
* greedy tokens of ``gguf-f32act`` against ``none`` on the batch-16 prompts (they must be equal),
  and how many of the 16 sequences ``gguf`` (int8 activations) keeps identical.

Then, when llama.cpp's own binaries exist (``peers/build_llama_cpp.sh`` builds ``llama-bench`` and
``llama-server`` from the sources vendored in the llama-cpp-python sdist): ``llama-bench`` pp512 and
tg128 on the same GGUF file and thread count, and both servers (``pagedllm serve`` with its
defaults, and again with float32 activations; ``llama-server --parallel 16``) driven by ``pagedllm bench serve``'s client at
concurrency 1 and 16 on the same token-id prompts (128 in / 128 out): output tok/s, median TTFT
and TPOT, and each server's resident memory against the GGUF file plus its KV pool.
Results: ``results/quantized-<date>.json`` with the machine's CPU model and flags.

Usage: ``python benchmarks/quantized.py [--repeats 3] [--llama-cpp-bin /work/peers/llamacpp-bin]``
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import subprocess
import sys
import time
from pathlib import Path

from pagedllm import LLM, SamplingParams
from pagedllm.bench.metrics import machine_facts


def rss_mb() -> float:
    """Resident set size of this process in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` random token-id prompts of ``length`` tokens (ids past the special tokens)."""
    rng = random.Random(seed)
    return [[rng.randint(100, 49000) for _ in range(length)] for _ in range(n)]


def measure(quantization: str, repeats: int, int8_activations: bool = True) -> dict:
    """One configuration's numbers (see the module docstring); ``int8_activations`` as the default
    (on where VNNI exists) or forced off."""
    from pagedllm.kernels import cpu
    cpu.available()
    cpu.set_int8_activations(int8_activations)
    llm = LLM(quantization=quantization, max_num_seqs=16, kv_cache_memory="512MiB")
    eng = llm.llm_engine
    llm.generate(prompts(1, 8, 99), SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    decode, prefill, overhead = [], [], []
    for r in range(repeats):
        eng.add_request(f"d{r}", prompts(1, 32, r)[0], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
        first = None
        while eng.has_unfinished_requests():
            for out in eng.step():
                if first is None and out.outputs[0].token_ids:
                    first = time.perf_counter()
                    before = eng.get_stats().step_timings
        wall = time.perf_counter() - first
        decode.append(127 / wall)
        after = eng.get_stats().step_timings
        # per-step work outside the model's forward and sampling (schedule, prepare, update, outputs)
        device = (after.execute_s - before.execute_s) + (after.sample_s - before.sample_s)
        overhead.append(1 - device / wall)
        t0 = time.perf_counter()
        llm.generate(prompts(1, 512, 100 + r), SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        prefill.append(512 / (time.perf_counter() - t0))
    batch = prompts(16, 128, 7)
    t0 = time.perf_counter()
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), use_tqdm=False)
    wall = time.perf_counter() - t0
    result = {"decode_tok_s": max(decode), "decode_overhead_fraction": min(overhead), "prefill_tok_s": max(prefill),
              "batch16_output_tok_s": 16 * 128 / wall,
              "rss_mib": rss_mb(), "layers": getattr(eng.runner.model, "quantization", None),
              "tokens": [o.outputs[0].token_ids for o in outs]}
    del llm, eng, outs
    gc.collect()
    return result


def llama_bench(bin_dir: Path, gguf: Path, threads: int) -> dict:
    """llama.cpp's own pp512 and tg128 (tokens/s, mean of 3 repetitions) on the GGUF file."""
    out = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", "512", "-n", "128",
                          "-r", "3", "-o", "json"], capture_output=True, text=True, check=True, timeout=900).stdout
    rows = json.loads(out)
    return {("pp512" if r["n_prompt"] else "tg128"): r["avg_ts"] for r in rows}


def against_llama_cpp(bin_dir: Path, offline: dict[str, dict], requests: int) -> dict:
    """The llama.cpp half of the run (module docstring); prints a table of pagedllm / llama.cpp ratios."""
    import tempfile

    import torch
    from side_by_side import make_workloads, run_online
    from transformers import AutoTokenizer

    from pagedllm.models import loader
    from pagedllm.models.resolve import resolve_model
    gguf = Path(loader.default_model_path())
    threads = torch.get_num_threads()
    bench = llama_bench(bin_dir, gguf, threads)
    tok = AutoTokenizer.from_pretrained(resolve_model(None))
    py = sys.executable
    servers = {
        "pagedllm": {"serve": lambda port: ["env", "-u", "PAGEDLLM_INT8_ACTIVATIONS", py, "-m", "pagedllm.cli",
                                            "serve", "--port", str(port), "--log-level", "warning"],
                     "kv_pool_mib": 1024.0},
        "pagedllm-f32act": {"serve": lambda port: ["env", "PAGEDLLM_INT8_ACTIVATIONS=0", py, "-m", "pagedllm.cli",
                                                   "serve", "--port", str(port), "--log-level", "warning"],
                            "kv_pool_mib": 1024.0},
        "llama.cpp": {"serve": lambda port: [str(bin_dir / "llama-server"), "-m", str(gguf), "--port", str(port),
                                             "-t", str(threads), "--parallel", "16", "-c", "8192", "--no-webui"],
                      # f16 K and V: 30 layers x 2 x 3 KV heads x 64 x 2 bytes per token, 8192 tokens
                      "kv_pool_mib": 8192 * 30 * 2 * 3 * 64 * 2 / 2**20},
    }
    serve = {}
    with tempfile.TemporaryDirectory() as tmp:
        w3 = make_workloads(tok, Path(tmp), requests)["w3"]  # a warm-up prompt, then fresh prompts per level
        for name, eng in servers.items():
            stats: dict = {}
            runs = run_online(name, eng, w3, [1, 16], tok, Path(tmp), 600, stats=stats)
            serve[name] = {"c1": runs[0] if runs else None, "c16": runs[1] if runs else None,
                           "rss_mib": stats.get("rss_mib"), "kv_pool_mib": eng["kv_pool_mib"]}
    gguf_mib = gguf.stat().st_size / 2**20
    # columns: pagedllm's default (int8 activations where VNNI exists), with float32 activations, llama.cpp
    cols = [("pagedllm", offline["gguf"], serve["pagedllm"]), ("pagedllm-f32act", offline["gguf-f32act"],
                                                                 serve["pagedllm-f32act"])]
    llama = {"tg128": bench.get("tg128"), "pp512": bench.get("pp512"), **{c: serve["llama.cpp"][c] or {} for c in ("c1", "c16")}}
    metrics = [("batch-1 decode tok/s (32 in / 128 out; tg128)", lambda o, s: o["decode_tok_s"], llama["tg128"], True),
               ("prefill tok/s (512 in; pp512)", lambda o, s: o["prefill_tok_s"], llama["pp512"], True)]
    for c in ("c1", "c16"):
        for key, label, higher in (("output_throughput", "output tok/s", True), ("median_ttft_ms", "median TTFT ms", False),
                                   ("median_tpot_ms", "median TPOT ms", False)):
            metrics.append((f"serve {c}: {label}", lambda o, s, c=c, key=key: (s[c] or {}).get(key),
                            llama[c].get(key), higher))
    print(f"{'metric':<50} " + " ".join(f"{n:>15}" for n, _, _ in cols) + f" {'llama.cpp':>9}")
    table = []
    for label, get, ref, higher in metrics:
        row = {"metric": label, "llama_cpp": ref}
        cells = []
        for name, off, srv in cols:
            v = get(off, srv)
            ratio = (v / ref if higher else ref / v) if v and ref else None
            row[name], row[name + "_advantage"] = v, ratio
            cells.append(f"{v or float('nan'):>8.1f} {ratio or float('nan'):>5.2f}x")
        table.append(row)
        print(f"{label:<50} " + " ".join(f"{c:>15}" for c in cells) + f" {ref or float('nan'):>9.1f}")
    memory = {}
    for name, s in serve.items():  # the engine process: the largest (pagedllm's core is a child of its front end)
        procs = s["rss_mib"] or {0: 0.0}
        core = max(procs.values())
        memory[name] = {"processes_mib": list(procs.values()), "engine_rss_mib": core, "total_rss_mib": sum(procs.values()),
                        "gguf_plus_kv_mib": gguf_mib + s["kv_pool_mib"], "ratio": core / (gguf_mib + s["kv_pool_mib"])}
        print(f"{name}: engine process RSS {core:.0f} MiB = {memory[name]['ratio']:.2f}x GGUF + KV pool "
              f"({gguf_mib + s['kv_pool_mib']:.0f} MiB); all its processes {sum(procs.values()):.0f} MiB")
    print("ratios: pagedllm's advantage over llama.cpp (>1 better; for latencies llama.cpp / pagedllm); "
          "pagedllm: the defaults; pagedllm-f32act: PAGEDLLM_INT8_ACTIVATIONS=0")
    return {"llama_bench": bench, "serve": serve, "table": table, "memory": memory,
            "build_flags": (bin_dir / "build-flags.txt").read_text().split() if (bin_dir / "build-flags.txt").exists() else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--llama-cpp-bin", default="/work/peers/llamacpp-bin",
                    help="folder with llama-bench and llama-server (skipped when missing)")
    ap.add_argument("--serve-requests", type=int, default=32, help="requests per concurrency level")
    args = ap.parse_args()
    from pagedllm.kernels import cpu
    results = {q: measure(q, args.repeats) for q in ("none", "gguf", "int8")}
    results["gguf-f32act"] = measure("gguf", args.repeats, int8_activations=False)
    ref = results["none"].pop("tokens")
    same = ref == results["gguf-f32act"].pop("tokens")
    i8_tokens = results["gguf"].pop("tokens")
    results["int8"].pop("tokens")
    i8_same = sum(a == b for a, b in zip(i8_tokens, ref))
    cpu.set_int8_activations(True)
    print(f"int8 activations in the default: {cpu.int8_activations()}")
    base = results["none"]
    print(f"{'config':<10} {'decode tok/s':>12} {'overhead':>8} {'prefill tok/s':>13} {'batch16 tok/s':>13} {'RSS MiB':>8}")
    for name, r in results.items():
        print(f"{name:<10} {r['decode_tok_s']:>12.1f} {r['decode_overhead_fraction']:>8.1%} {r['prefill_tok_s']:>13.1f} {r['batch16_output_tok_s']:>13.1f} "
              f"{r['rss_mib']:>8.0f}")
    ratios = {k: results["gguf"][k] / base[k] for k in ("decode_tok_s", "prefill_tok_s", "batch16_output_tok_s")}
    print("gguf / none: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    print(f"greedy tokens of gguf-f32act identical to none: {same}; gguf (default) keeps {i8_same} of 16 "
          "sequences identical")
    peers = against_llama_cpp(Path(args.llama_cpp_bin), results, args.serve_requests) if Path(args.llama_cpp_bin).is_dir() else None
    out = Path(args.json_out or Path(__file__).resolve().parent / "results" /
               f"quantized-{time.strftime('%Y-%m-%d')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_facts(), "args": vars(args), "results": results,
                               "ratios_gguf_to_none": ratios, "identical_tokens_f32act": same,
                               "default_int8_activations": cpu.int8_activations(),
                               "identical_sequences_default_of_16": i8_same, "llama_cpp": peers},
                              indent=2))
    print(f"wrote {out}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
