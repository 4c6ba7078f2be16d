"""GGUF blocks served packed through the Transformers backend (issue 39), side by side in one run.

* gemma-3-270m Q4_K_M (Transformers backend; no native Gemma 3): batch-1 decode and 512-token
  prefill tokens/s with the file's blocks packed (the default, int8 activations) and dequantized to
  float32 (``--quantization none``, what the backend served before), against llama.cpp's own
  ``llama-bench`` tg128 / pp512 on the same file and threads (``peers/build_llama_cpp.sh``);
* the resident memory of a process holding the engine (``LLM``, as the core process does) after a
  short generation, each path in a fresh process, against the issue's bound: 1.5 x (the GGUF file +
  the KV pool + 512 MiB for the Python runtime), with a 256 MiB pool;
* Qwen2.5-Coder-0.5B Q4_K_M packed through the Transformers backend against the native path
  (decode and prefill ratios: the issue asks at least 0.9x).

Decode and prefill are ``cpu_isa.measure``'s (a 32-token prompt and 128 greedy tokens, best of
``--repeats``; one 512-token prompt). Results: ``results/packed_transformers-<date>.json`` with the
CPU's model and flags.

Usage: ``python benchmarks/packed_transformers.py [--threads 1 2] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_isa import gguf_file, idle, llama_bench, measure, write_result  # noqa: E402

from pagedllm.bench.metrics import machine_facts  # noqa: E402
from pagedllm.kernels import cpu  # noqa: E402

GEMMA, QWEN = "gemma-3-270m", "qwen2.5-coder-0.5b-instruct"
KV_POOL_MIB = 256
RUNTIME_MIB = 512

_RSS_CHILD = """
import sys
from pagedllm import LLM, SamplingParams
llm = LLM(sys.argv[1], quantization=sys.argv[2], kv_cache_memory="{pool}MiB", model_impl="transformers")
llm.generate(["The capital of France is"], SamplingParams(max_tokens=32, ignore_eos=True), use_tqdm=False)
llm.generate([{{"prompt_token_ids": list(range(1000, 1512))}}], SamplingParams(max_tokens=1), use_tqdm=False)
status = open("/proc/self/status").read()
print("RSS", int(status.split("VmRSS:")[1].split()[0]) / 1024, int(status.split("VmHWM:")[1].split()[0]) / 1024)
"""


def resident_mib(model: str, quantization: str) -> dict:
    """Resident and peak memory (MiB) of a fresh process that loads ``model`` and generates a little."""
    out = subprocess.run([sys.executable, "-c", _RSS_CHILD.format(pool=KV_POOL_MIB), model, quantization],
                         capture_output=True, text=True, check=True, timeout=1200).stdout
    rss, peak = next(line for line in out.splitlines() if line.startswith("RSS ")).split()[1:]
    return {"rss_mib": round(float(rss), 1), "peak_mib": round(float(peak), 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--llama-cpp-bin", default="/work/peers/llamacpp-bin")
    args = ap.parse_args()
    cpu.available()
    res: dict = {"machine": machine_facts(), "start": idle(), "isa": cpu.isa(), "args": vars(args), "runs": {}}
    gemma_file = gguf_file(GEMMA)
    file_mib = gemma_file.stat().st_size / 2**20
    res["memory"] = {p: resident_mib(GEMMA, p) for p in ("auto", "none")}
    res["memory"]["bound_mib"] = round(1.5 * (file_mib + KV_POOL_MIB + RUNTIME_MIB), 1)
    res["memory"]["gguf_file_mib"] = round(file_mib, 1)
    print(f"gemma-3-270m resident memory: {res['memory']}")
    bench = Path(args.llama_cpp_bin) / "llama-bench"
    for nt in args.threads:
        row = {"gemma packed": measure(GEMMA, "int8", nt, args.repeats, False, "transformers"),
               "gemma none": measure(GEMMA, "none", nt, args.repeats, False, "transformers"),
               "qwen native": measure(QWEN, "int8", nt, args.repeats, False, "native"),
               "qwen transformers": measure(QWEN, "int8", nt, args.repeats, False, "transformers")}
        if bench.exists():
            row["llama.cpp gemma"] = llama_bench(bench.parent, gemma_file, nt)
        res["runs"][f"t{nt}"] = row
        for name, r in row.items():
            if "decode_tok_s" in r:
                print(f"t{nt} {name:18s} decode {r['decode_tok_s']:7.1f} prefill {r['prefill_tok_s']:7.1f}")
        lc, gp, qn, qt = row.get("llama.cpp gemma"), row["gemma packed"], row["qwen native"], row["qwen transformers"]
        if lc:
            print(f"t{nt} llama.cpp gemma tg128 {lc['tg128']:.1f} pp512 {lc['pp512']:.1f}: packed "
                  f"{gp['decode_tok_s'] / lc['tg128']:.2f}x / {gp['prefill_tok_s'] / lc['pp512']:.2f}x")
        print(f"t{nt} qwen transformers / native: decode {qt['decode_tok_s'] / qn['decode_tok_s']:.2f}x, "
              f"prefill {qt['prefill_tok_s'] / qn['prefill_tok_s']:.2f}x")
    write_result("packed_transformers", res, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
