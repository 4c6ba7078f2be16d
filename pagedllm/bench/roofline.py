"""This machine's float32 ceilings and the throughput they allow a model.

Two measured rates bound a dense decoder on a CPU:

* the float32 matrix-product rate (FLOP/s, best of several 2048^3 products), which
  bounds batched work: every token costs about 2 FLOPs per weight it passes through;
* the memory read bandwidth (bytes/s, the best streaming read of a 512 MiB buffer),
  which bounds batch-1 decode: every step reads all weights once. The rate torch's
  BLAS reaches in a matrix-vector product is reported beside it.

The roofline model (Williams, Waterman and Patterson, CACM 2009) takes the slower of
the two per step; this module applies each where it binds.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch


def matmul_flops(n: int = 2048, repeats: int = 5) -> float:
    """Best float32 ``n x n @ n x n`` rate on this thread's intra-op threads, in FLOP/s."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def read_bandwidth(mib: int = 512, repeats: int = 7) -> float:
    """Best bytes/s of summing a float32 buffer of ``mib`` MiB (each byte read once, nothing written).

    A plain streaming read, not a matrix-vector product: BLAS ``sgemv`` on this
    machine's shapes reaches only about half of it, which is a property of the
    kernel, not of the memory (llama.cpp's own float32 kernels go well past sgemv).
    """
    x = torch.randn(mib * 2 ** 20 // 4)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def matvec_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Best bytes/s of a float32 matrix-vector product over a ``mib`` MiB matrix of 576 columns
    (SmolLM2's hidden size): what torch's BLAS makes of batch-1 decode."""
    cols = 576
    w = torch.randn(mib * 2 ** 20 // 4 // cols, cols)
    x = torch.randn(cols)
    torch.mv(w, x)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mv(w, x)
        best = min(best, time.perf_counter() - t0)
    return w.numel() * 4 / best


def model_costs(model_dir: str | Path) -> dict:
    """Weights, bytes and FLOPs per token of a Llama-style decoder from its ``config.json``.

    Returns:
        ``params`` (all weights, tied embeddings once), ``lm_head_params``,
        ``decode_bytes`` (float32 bytes read per batch-1 step: every weight but the
        embedding table's gathered rows, the LM head included), ``flops_prefill_token``
        (2 x the non-embedding weights: prompt tokens skip the LM head),
        ``flops_decode_token`` (the same plus the LM head), and ``attn_flops_per_ctx_token``
        (4 x layers x heads x head_dim: QK^T and AV for one query against one cached token).
    """
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    h, layers, inter = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    kvh = cfg.get("num_key_value_heads", heads)
    d = cfg.get("head_dim") or h // heads
    vocab = cfg["vocab_size"]
    per_layer = h * heads * d + 2 * h * kvh * d + heads * d * h + 3 * h * inter + 2 * h
    body = layers * per_layer + h
    emb = vocab * h
    tied = cfg.get("tie_word_embeddings", False)
    return {"params": body + emb * (1 if tied else 2), "lm_head_params": emb,
            "decode_bytes": 4 * (body + emb), "flops_prefill_token": 2 * body,
            "flops_decode_token": 2 * (body + emb), "attn_flops_per_ctx_token": 4 * layers * heads * d}


def rooflines(model_dir: str | Path, flops: float, bandwidth: float, w1=(32, 128), w2=(64, 128, 128)) -> dict:
    """Ceilings for the benchmark workloads.

    Args:
        model_dir: the model's Hugging Face directory.
        flops: measured FLOP/s; bandwidth: measured bytes/s.
        w1: ``(prompt, output)`` tokens of the batch-1 workload.
        w2: ``(prompts, prompt tokens, output tokens)`` of the offline workload.
    Returns:
        ``w1_decode_tok_s``: batch-1 decode tokens/s if each step only reads the weights
        at ``bandwidth``; ``w2_output_tok_s``: output tokens/s if all of W2's FLOPs
        (prefill, decode, attention) ran at ``flops``; and the costs used.
    """
    c = model_costs(model_dir)
    n, p, o = w2
    mean_ctx_decode = p + o / 2
    total = n * (p * (c["flops_prefill_token"] + c["attn_flops_per_ctx_token"] * p / 2)
                 + o * (c["flops_decode_token"] + c["attn_flops_per_ctx_token"] * mean_ctx_decode))
    return {**c, "w1_decode_tok_s": bandwidth / c["decode_bytes"], "w2_flops": total,
            "w2_output_tok_s": n * o / (total / flops)}


def measure(model_dir: str | Path) -> dict:
    """Measure both rates now and apply them to the model (seconds of work: a few)."""
    flops, bw = matmul_flops(), read_bandwidth()
    return {"matmul_gflops": flops / 1e9, "read_bandwidth_gbs": bw / 1e9,
            "matvec_bandwidth_gbs": matvec_bandwidth() / 1e9, **rooflines(model_dir, flops, bw)}
