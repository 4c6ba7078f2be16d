"""Does ``torch.compile`` of the pieces between attention calls pay? (``models/layers/compiled.py``)

Times, per piece (RMSNorm with its residual add, SwiGLU's activation, rotary) at SmolLM2-135M's
and Qwen2.5-0.5B's widths and several token counts: the eager torch ops, the inductor-compiled
function and, on the CPU, the C kernel the CPU path runs. Reports microseconds per call and the
compiled/eager and compiled/C ratios; the first compiled call (compile time) is reported apart.
One result file with the machine's CPU model and flags.

usage: python benchmarks/compile_ops.py [--device cpu|cuda] [--dtype float32|bfloat16] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embeddings import machine  # noqa: E402

SHAPES = {"smollm2-135m": (576, 1536, 9, 3, 64), "qwen2.5-0.5b": (896, 4864, 14, 2, 64)}  # H, I, heads, kv, D
TOKENS = (1, 16, 256)


def timed(fn, args, device, reps: int) -> float:
    """Median microseconds per call of ``fn(*args)`` over ``reps`` calls (after 3 warm-ups)."""
    import torch
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn(*args)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2] * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch
    from pagedllm.kernels import cpu as kernels
    from pagedllm.models.layers import compiled as c
    torch.set_num_threads(torch.get_num_threads())
    dev, dt = a.device, getattr(torch, a.dtype)
    use_c = dev == "cpu" and dt == torch.float32 and kernels.available()
    rows, compile_s = [], {}
    for name, (h, inter, heads, kvh, d) in SHAPES.items():
        w = torch.randn(h, device=dev, dtype=dt)
        for t in TOKENS:
            x, res = torch.randn(t, h, device=dev, dtype=dt), torch.randn(t, h, device=dev, dtype=dt)
            gu = torch.randn(t, 2 * inter, device=dev, dtype=dt)
            qkv = torch.randn(t, (heads + 2 * kvh) * d, device=dev, dtype=dt)
            qk = qkv[:, :(heads + kvh) * d].view(t, heads + kvh, d)
            cos, sin = torch.randn(t, 1, d, device=dev, dtype=dt), torch.randn(t, 1, d, device=dev, dtype=dt)
            pos = torch.arange(t, device=dev)
            table_c, table_s = torch.randn(4096, d, device=dev), torch.randn(4096, d, device=dev)
            pieces = {
                "add_rms_norm": (c.add_rms_norm, (x, res, w, 1e-5),
                                 (lambda: kernels.rms_norm(x, w, 1e-5, res.clone())) if use_c else None),
                "silu_and_mul": (c.silu_and_mul, (gu,), (lambda: kernels.silu_mul(gu)) if use_c else None),
                "rope": (c.rope, (qk, cos, sin),
                         (lambda: kernels.rope_(qkv, heads + kvh, d, pos, table_c, table_s)) if use_c else None),
            }
            for piece, (fn, args, ckern) in pieces.items():
                if piece not in compile_s:
                    t0 = time.perf_counter()
                    c.compiled(fn)(*args)
                    compile_s[piece] = round(time.perf_counter() - t0, 2)
                eager = timed(fn, args, dev, a.reps)
                comp = timed(c.compiled(fn), args, dev, a.reps)
                row = {"shape": name, "tokens": t, "piece": piece, "eager_us": round(eager, 2),
                       "compiled_us": round(comp, 2), "compiled_speedup_vs_eager": round(eager / comp, 3)}
                if ckern is not None:
                    ck = timed(lambda _=None: ckern(), (), dev, a.reps)
                    row.update(c_kernel_us=round(ck, 2), compiled_speedup_vs_c=round(ck / comp, 3))
                rows.append(row)
                print(json.dumps(row), flush=True)
    out = Path(a.out or f"benchmarks/results/compile_ops-{datetime.date.today()}-{dev}.json")
    out.write_text(json.dumps({"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(),
                               "device": dev, "dtype": a.dtype, "threads": torch.get_num_threads(),
                               "first_call_compile_s": compile_s, "rows": rows}, indent=1) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main()
