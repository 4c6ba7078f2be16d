"""Time to first token of a video, with efficient video sampling off and at 0.75 (issue 42):
pagedllm against ``transformers``' ``generate`` (no EVS there) on the same model, side by side in one run.

The model: a random Qwen2.5-VL with a small vision tower (hidden 256, 4 blocks, 4 heads, 14 px patches
merged 2 x 2, windowed blocks but the last) in front of SmolLM2-135M's shapes (hidden 576, 30 layers,
9 query / 3 KV heads, MLP 1536; SmolLM2's tokenizer plus Qwen-VL's vision tokens), float32, built with
``transformers`` in a temporary directory (random weights: speed only).

Workload: one request at a time, a question about a video of ``--frames`` frames of 224 x 224 (each
later frame a little changed), one new token, median of ``--repeats`` with a new video each time:
``8 x 16 x 16`` patches, 512 video rows without pruning, 128 at rate 0.75. ``transformers`` runs the
processor-equivalent inputs (our patches: its own video processor needs torchvision) through
``generate``.

Results: ``results/video-<date>.json`` with the CPU model, flags and load.

Usage: ``python benchmarks/video.py [--threads 2] [--frames 16] [--repeats 3]``
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

VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
PROMPT = f"{VIDEO}\nDescribe what happens in the video, step by step, and what changes between the frames."


def build_model(out: Path):
    """Save the random Qwen2.5-VL with its tokenizer and image processor in ``out``; returns the model."""
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    from pagedllm.models.resolve import resolve_model
    tok = AutoTokenizer.from_pretrained(resolve_model(None))
    names = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
    tok.add_special_tokens({"additional_special_tokens": names})
    start, pad, end, video = tok.convert_tokens_to_ids(names)
    vision = dict(depth=4, hidden_size=256, intermediate_size=1024, num_heads=4, out_hidden_size=576, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[3])
    text = dict(vocab_size=len(tok), hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]},
                bos_token_id=1, eos_token_id=2, pad_token_id=2)
    cfg = Qwen2_5_VLConfig(vision_config=vision, text_config=text, image_token_id=pad, video_token_id=video,
                           vision_start_token_id=start, vision_end_token_id=end, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    Qwen2VLImageProcessorPil(min_pixels=224 * 224, max_pixels=224 * 224, patch_size=14, merge_size=2,
                             temporal_patch_size=2).save_pretrained(out)
    return model


def video(seed: int, frames: int) -> np.ndarray:
    """``[frames, 224, 224, 3]`` uint8: a random first frame, each later one changed in a tenth of its pixels."""
    rng = np.random.default_rng(seed)
    x = [rng.random((224, 224, 3))]
    for _ in range(frames - 1):
        x.append(np.where(rng.random((224, 224, 1)) < 0.1, rng.random((224, 224, 3)), x[-1]))
    return (np.stack(x) * 255).astype("uint8")


def bench_pagedllm(path: Path, rate: float, args) -> dict:
    from pagedllm import LLM, SamplingParams
    llm = LLM(str(path), kv_cache_memory="1GiB", video_pruning_rate=rate, enable_prefix_caching=False)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([{"prompt": PROMPT, "multi_modal_data": {"video": video(99, args.frames)}}], one, use_tqdm=False)
    ttft = []
    for i in range(args.repeats):
        req = {"prompt": PROMPT, "multi_modal_data": {"video": video(i, args.frames)}}
        t0 = time.perf_counter()
        out = llm.generate([req], one, use_tqdm=False)[0]
        ttft.append(time.perf_counter() - t0)
    return {"ttft_ms": 1e3 * statistics.median(ttft), "prompt_tokens": len(out.prompt_token_ids),
            "pruned_tokens": llm.llm_engine.get_stats().num_video_tokens_pruned}


def bench_transformers(model, path: Path, args) -> dict:
    from pagedllm.multimodal_patches import PATCH_PROCESSOR_TOKENS, PatchTokenProcessor
    proc = PatchTokenProcessor(path, PATCH_PROCESSOR_TOKENS["qwen2_5_vl"])

    def run(v):
        inp = {k: torch.from_numpy(np.asarray(x)) for k, x in proc(text=PROMPT, videos=((v, 2.0),)).items()}
        inp["mm_token_type_ids"] = 2 * (inp["input_ids"] == model.config.video_token_id).int()
        with torch.inference_mode():
            model.generate(input_ids=inp["input_ids"], pixel_values_videos=inp["pixel_values_videos"],
                           video_grid_thw=inp["video_grid_thw"], second_per_grid_ts=inp["second_per_grid_ts"],
                           mm_token_type_ids=inp["mm_token_type_ids"], max_new_tokens=1, do_sample=False,
                           pad_token_id=2)
    run(video(99, args.frames))
    ttft = []
    for i in range(args.repeats):
        v = video(i, args.frames)
        t0 = time.perf_counter()
        run(v)
        ttft.append(time.perf_counter() - t0)
    return {"ttft_ms": 1e3 * statistics.median(ttft)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--frames", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from pagedllm.bench.metrics import machine_facts
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "qwen2_5_vl"
        model = build_model(path)
        facts = machine_facts()
        off = bench_pagedllm(path, 0.0, args)
        evs = bench_pagedllm(path, 0.75, args)
        peer = bench_transformers(model, path, args)
    result = {"machine": facts, "threads": args.threads, "frames": args.frames, "pagedllm_rate_0": off,
              "pagedllm_rate_0.75": evs, "transformers": peer,
              "ratios": {"ttft_rate_0": peer["ttft_ms"] / off["ttft_ms"],
                         "ttft_rate_0.75": peer["ttft_ms"] / evs["ttft_ms"],
                         "rate_0.75_over_0": off["ttft_ms"] / evs["ttft_ms"]}}
    out = args.out or Path(__file__).parent / "results" / f"video-{time.strftime('%Y-%m-%d')}.json"
    out.write_text(json.dumps(result, indent=1))
    json.dump(result, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
