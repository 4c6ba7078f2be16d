"""Images per second and time to first token of an image-text model: pagedllm against ``transformers``'
``generate`` on the same model, side by side in one run (issue 41).

The model: a random LLaVA with a SigLIP-base-sized vision tower (hidden 768, 12 layers, 12 heads, MLP
3072, 224 px in patches of 16: 196 placeholder tokens per image) in front of SmolLM2-135M's shapes
(hidden 576, 30 layers, 9 query / 3 KV heads, MLP 1536; SmolLM2's tokenizer plus ``<image>``), float32,
built with ``transformers`` in a temporary directory (random weights: speed only).

Workloads (``PROMPT``: the image, then a question of about 30 tokens; greedy, EOS ignored):

- throughput: ``--requests`` requests, each with its own image, ``--max-tokens`` new tokens each, all at
  once (pagedllm: one ``generate`` call, concurrency = requests; ``transformers``: one batched
  ``generate``): images per second (requests over wall time).
- TTFT at concurrency 1: one request with one new token (the encoder step and the prefill), median
  of ``--repeats`` with a new image each time; pagedllm again with an image it has just served (a
  prefix-cache hit: no encoder step, only the last block's tokens computed).

Results: ``results/images-<date>.json`` with the CPU model, flags and load.

Usage: ``python benchmarks/images.py [--threads 2] [--requests 16] [--max-tokens 16] [--repeats 5]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

# text after the image: a prefix-cache hit then covers the image's placeholders in whole blocks (a hit
# that ends inside them runs the encoder step again, as vLLM's does)
PROMPT = ("USER: <image>\nDescribe the picture: the objects in it, their colours, where they are, and what "
          "the scene as a whole is likely to show. ASSISTANT:")


def build_model(out: Path):
    """Save the random SigLIP-LLaVA with its processor in ``out``; returns (model, processor)."""
    from transformers import (AutoTokenizer, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor,
                              SiglipImageProcessor, SiglipVisionConfig)

    from pagedllm.models.resolve import resolve_model
    tok = AutoTokenizer.from_pretrained(resolve_model(None))
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    vision = SiglipVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                                image_size=224, patch_size=16)
    text = LlamaConfig(vocab_size=len(tok), hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                       bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_id=tok.convert_tokens_to_ids("<image>"),
                      vision_feature_layer=-1, vision_feature_select_strategy="full")
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(cfg).eval()
    model.save_pretrained(out)
    proc = LlavaProcessor(image_processor=SiglipImageProcessor(size={"height": 224, "width": 224}), tokenizer=tok,
                          patch_size=16, vision_feature_select_strategy="full", image_token="<image>",
                          num_additional_image_tokens=0)
    proc.save_pretrained(out)
    return model, proc


def images(n: int, seed: int) -> list:
    from PIL import Image
    rng = np.random.default_rng(seed)
    return [Image.fromarray((rng.random((240, 320, 3)) * 255).astype("uint8")) for _ in range(n)]


def bench_pagedllm(path: Path, args) -> dict:
    from pagedllm import LLM, SamplingParams
    llm = LLM(str(path), max_num_seqs=args.requests, kv_cache_memory="1GiB", max_num_batched_tokens=4096)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    req = [{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in images(args.requests, 1)]
    llm.generate(req[:1], one, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    llm.generate(req, SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True), use_tqdm=False)
    wall = time.perf_counter() - t0
    cold, hit = [], []
    for im in images(args.repeats, 2):
        r = {"prompt": PROMPT, "multi_modal_data": {"image": im}}
        t0 = time.perf_counter()
        llm.generate([r], one, use_tqdm=False)
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        llm.generate([r], one, use_tqdm=False)
        hit.append(time.perf_counter() - t0)
    return {"images_per_s": args.requests / wall, "ttft_ms": 1e3 * statistics.median(cold),
            "ttft_prefix_hit_ms": 1e3 * statistics.median(hit),
            "encoder_steps": llm.engine.core.scheduler.encoder.num_encoded}


def bench_transformers(model, proc, args) -> dict:
    def run(ims, max_new):
        inp = proc(text=[PROMPT] * len(ims), images=ims, return_tensors="pt", padding=True)
        with torch.inference_mode():
            model.generate(**inp, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                           pad_token_id=2)
    run(images(1, 9), 1)  # warm-up
    t0 = time.perf_counter()
    run(images(args.requests, 1), args.max_tokens)
    wall = time.perf_counter() - t0
    ttft = []
    for im in images(args.repeats, 2):
        t0 = time.perf_counter()
        run([im], 1)
        ttft.append(time.perf_counter() - t0)
    return {"images_per_s": args.requests / wall, "ttft_ms": 1e3 * statistics.median(ttft)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from pagedllm.bench.metrics import machine_facts
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "siglip-llava"
        model, proc = build_model(path)
        facts = machine_facts()
        ours = bench_pagedllm(path, args)
        peer = bench_transformers(model, proc, args)
    result = {"machine": facts, "threads": args.threads, "requests": args.requests, "max_tokens": args.max_tokens,
              "pagedllm": ours, "transformers": peer,
              "ratios": {"images_per_s": ours["images_per_s"] / peer["images_per_s"],
                         "ttft": peer["ttft_ms"] / ours["ttft_ms"],
                         "ttft_prefix_hit": peer["ttft_ms"] / ours["ttft_prefix_hit_ms"]}}
    out = args.out or Path(__file__).parent / "results" / f"images-{time.strftime('%Y-%m-%d')}.json"
    out.write_text(json.dumps(result, indent=1))
    json.dump(result, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
