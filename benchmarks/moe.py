"""A mixture-of-experts GGUF served with its experts packed (issue 40), side by side with llama.cpp.

* Builds once (cached under ``~/.cache/pagedllm/bench``) a random-weight Qwen3-MoE at Qwen3-30B-A3B's
  layer shapes: hidden 2048, 128 experts, top-8, expert width 768, 32 query / 4 KV heads of 128,
  ``--layers`` layers, SmolLM2's tokenizer (49,152 tokens) so the file stays small; converted by
  llama.cpp's own ``convert_hf_to_gguf.py`` (f16) and quantized by its ``llama-quantize`` (Q4_K_M),
  both from the sdist ``peers/build_llama_cpp.sh`` builds. ``--family gpt-oss``: a gpt-oss at
  gpt-oss-20b's shapes (hidden 2880, 32 experts, top-4, expert width 2880, 64 query / 8 KV heads of
  64, sliding window 128 on every other layer, attention sinks, biases), bf16 through the converter,
  then ``llama-quantize`` ``MXFP4_MOE`` (experts MXFP4, the rest Q8_0: what gpt-oss GGUFs ship).
* pagedllm (the Transformers backend; experts on the experts kernel over the file's blocks) batch-1
  decode and 512-token prefill (``cpu_isa.measure``) against ``llama-bench`` tg128 / pp512 on the same
  file and threads; the resident memory of a fresh process (256 MiB pool) against the issue's bound,
  1.3 x (file + pool + 512 MiB).
* With ``--serve``: ``pagedllm serve`` and ``llama-server --parallel 16`` on the same file, driven by
  ``pagedllm bench serve``'s client at concurrency 1 and 16 on the same token-id prompts (128 in /
  128 out; ``side_by_side.run_online``): output tok/s, median TTFT and TPOT.

Results: ``results/moe-<date>.json`` with the CPU's model and flags.

``--compare-s8h``: ours again with Q6_K tiled one byte per weight (``S8H``), the layout before the 6-bit
``U6H`` tiles (``quant_kernels.c``), in the same run.

Usage: ``python benchmarks/moe.py [--family qwen3moe|gpt-oss] [--layers 2] [--threads 2] [--repeats 2] [--serve]
[--compare-s8h]``
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_isa import idle, llama_bench, measure, write_result  # noqa: E402
from packed_transformers import resident_mib  # noqa: E402

from pagedllm.bench.metrics import machine_facts  # noqa: E402
from pagedllm.cache import cache_root  # noqa: E402
from pagedllm.kernels import cpu  # noqa: E402

KV_POOL_MIB, RUNTIME_MIB = 256, 512
SHAPES = dict(hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
              intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
              max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False)


GPT_OSS_SHAPES = dict(hidden_size=2880, num_local_experts=32, num_experts_per_tok=4, intermediate_size=2880,
                      num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128,
                      max_position_embeddings=4096, tie_word_embeddings=False)
# family -> (directory name, transformers config class, shapes, llama-quantize type)
FAMILIES = {"qwen3moe": ("qwen3moe-30b-a3b-shapes", "Qwen3MoeConfig", SHAPES, "Q4_K_M"),
            "gpt-oss": ("gpt-oss-20b-shapes", "GptOssConfig", GPT_OSS_SHAPES, "MXFP4_MOE")}


def build_gguf(layers: int, llama_dir: Path, src_dir: Path, family: str = "qwen3moe") -> Path:
    """The quantized file of the random model (built once per family and layer count)."""
    name, config_cls, shapes, qtype = FAMILIES[family]
    out = cache_root() / "bench" / f"{name}-{layers}l"
    q4 = out / f"model-{qtype}.gguf"
    if q4.exists():
        return q4
    import shutil

    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    from pagedllm.models.resolve import resolve_model
    hf_dir = out / "hf"
    tok = Path(resolve_model(None))  # SmolLM2's converted directory: its tokenizer
    config = getattr(transformers, config_cls)(vocab_size=49152, num_hidden_layers=layers, bos_token_id=1,
                                               eos_token_id=2, **shapes)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(hf_dir)
    del model
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tok / name).is_file():
            shutil.copy(tok / name, hf_dir / name)
    f16 = out / "model-f16.gguf"
    subprocess.run([sys.executable, str(src_dir / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(f16),
                    "--outtype", "f16"], check=True)
    subprocess.run([str(llama_dir / "llama-quantize"), str(f16), str(q4), qtype], check=True)
    f16.unlink()
    shutil.rmtree(hf_dir)
    return q4


def serve(gguf: Path, bin_dir: Path, threads: int, requests: int) -> dict:
    """Both servers at concurrency 1 and 16 (module docstring); ``{server: {c1, c16, rss_mib}}`` and the
    ratios (llama.cpp's latency over ours: above 1 is better for us)."""
    import tempfile

    from side_by_side import make_workloads, run_online
    from transformers import AutoTokenizer

    from pagedllm.models.resolve import resolve_model
    tok = AutoTokenizer.from_pretrained(resolve_model(None))  # the model's vocabulary is SmolLM2's
    servers = {"pagedllm": {"serve": lambda port: [sys.executable, "-m", "pagedllm.cli", "serve", str(gguf), "--port",
                                                   str(port), "--log-level", "warning"]},
               "llama.cpp": {"serve": lambda port: [str(bin_dir / "llama-server"), "-m", str(gguf), "--port", str(port),
                                                    "-t", str(threads), "--parallel", "16", "-c", "8192",
                                                    "--no-webui"]}}
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        w3 = make_workloads(tok, Path(tmp), requests)["w3"]
        for name, eng in servers.items():
            stats: dict = {}
            runs = run_online(name, eng, w3, [1, 16], tok, Path(tmp), 900, stats=stats)
            out[name] = {"c1": runs[0] if runs else None, "c16": runs[1] if runs else None,
                         "rss_mib": stats.get("rss_mib")}
    for c in ("c1", "c16"):
        ours, peer = out["pagedllm"][c] or {}, out["llama.cpp"][c] or {}
        for key in ("median_ttft_ms", "median_tpot_ms"):
            if ours.get(key) and peer.get(key):
                out.setdefault("ratios", {})[f"{c} {key}"] = peer[key] / ours[key]
        print(f"serve {c}: pagedllm TTFT {ours.get('median_ttft_ms')} TPOT {ours.get('median_tpot_ms')} ms, "
              f"{ours.get('output_throughput')} tok/s; llama.cpp TTFT {peer.get('median_ttft_ms')} TPOT "
              f"{peer.get('median_tpot_ms')} ms, {peer.get('output_throughput')} tok/s")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", choices=list(FAMILIES), default="qwen3moe")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, nargs="+", default=[2])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--serve", action="store_true", help="also both servers at concurrency 1 and 16")
    ap.add_argument("--serve-only", action="store_true", help="only the servers (no llama-bench, no memory)")
    ap.add_argument("--compare-s8h", action="store_true",
                    help="also ours with Q6_K tiled one byte per weight (S8H), as before the 6-bit tiles")
    ap.add_argument("--serve-requests", type=int, default=32, help="requests per concurrency level")
    ap.add_argument("--llama-cpp-bin", default="/work/peers/llamacpp-bin")
    ap.add_argument("--llama-cpp-src", default="/work/peers/llamacpp-src/llama_cpp_python-0.3.36/vendor/llama.cpp")
    args = ap.parse_args()
    cpu.available()
    gguf = build_gguf(args.layers, Path(args.llama_cpp_bin), Path(args.llama_cpp_src), args.family)
    res: dict = {"machine": machine_facts(), "start": idle(), "isa": cpu.isa(), "args": vars(args),
                 "gguf_file_mib": round(gguf.stat().st_size / 2**20, 1), "runs": {}}
    if not args.serve_only:
        res["memory"] = resident_mib(str(gguf), "auto")
        res["memory"]["bound_mib"] = round(1.3 * (res["gguf_file_mib"] + KV_POOL_MIB + RUNTIME_MIB), 1)
        print(f"file {res['gguf_file_mib']} MiB, resident memory {res['memory']}")
    for nt in [] if args.serve_only else args.threads:
        ours = measure(str(gguf), "int8", nt, args.repeats, False, "transformers")
        peer = llama_bench(Path(args.llama_cpp_bin), gguf, nt)
        res["runs"][f"t{nt}"] = {"pagedllm": ours, "llama.cpp": peer,
                                 "decode_ratio": ours["decode_tok_s"] / peer["tg128"],
                                 "prefill_ratio": ours["prefill_tok_s"] / peer["pp512"]}
        if args.compare_s8h:  # the same build with the 6-bit tiles off (kernels.cpu.six_bit_tiles)
            six_bit, cpu.six_bit_tiles = cpu.six_bit_tiles, lambda: False
            try:
                s8h = measure(str(gguf), "int8", nt, args.repeats, False, "transformers")
            finally:
                cpu.six_bit_tiles = six_bit
            res["runs"][f"t{nt}"]["pagedllm_s8h"] = s8h
            print(f"t{nt} pagedllm with Q6_K as S8H: decode {s8h['decode_tok_s']:.1f} prefill {s8h['prefill_tok_s']:.1f}")
        print(f"t{nt} pagedllm decode {ours['decode_tok_s']:.1f} prefill {ours['prefill_tok_s']:.1f}; llama.cpp "
              f"tg128 {peer['tg128']:.1f} pp512 {peer['pp512']:.1f}: {ours['decode_tok_s'] / peer['tg128']:.2f}x / "
              f"{ours['prefill_tok_s'] / peer['pp512']:.2f}x")
    if args.serve or args.serve_only:
        res["serve"] = serve(gguf, Path(args.llama_cpp_bin), max(args.threads), args.serve_requests)
    write_result("moe" if args.family == "qwen3moe" else f"moe-{args.family}", res, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
