"""Benchmark workloads: random token prompts, prompts sharing a prefix, and prompts from a JSON file."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass
class SampleRequest:
    """One benchmark request.

    Attributes:
        prompt: token ids (random and prefix datasets: exact lengths, no re-tokenization) or text.
        prompt_len: prompt length in tokens.
        output_len: tokens to generate (sent as ``max_tokens`` with ``ignore_eos``).
    """

    prompt: list[int] | str
    prompt_len: int
    output_len: int


def _ordinary_ids(tokenizer) -> list[int]:
    """Token ids that are neither special nor added tokens (safe to put anywhere in a prompt)."""
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return [i for i in range(len(tokenizer)) if i not in special]


def random_requests(tokenizer, num_prompts: int, input_len: int, output_len: int, seed: int = 0,
                    range_ratio: float = 0.0) -> list[SampleRequest]:
    """Prompts of random ordinary token ids (as vLLM's ``random`` dataset).

    Args:
        tokenizer: the model's tokenizer (its vocabulary is sampled).
        num_prompts: requests to make.
        input_len, output_len: lengths in tokens; with ``range_ratio`` r each is drawn
            uniformly from ``[len * (1 - r), len * (1 + r)]``.
        seed: random seed, so every engine gets the same prompts.
    Raises:
        ValueError: a non-positive length or a ratio outside [0, 1).
    """
    if input_len < 1 or output_len < 1 or not 0 <= range_ratio < 1:
        raise ValueError("input_len and output_len must be >= 1 and range_ratio in [0, 1)")
    rng = random.Random(seed)
    vocab = _ordinary_ids(tokenizer)

    def draw(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - range_ratio)), int(n * (1 + range_ratio))))

    out = []
    for _ in range(num_prompts):
        n = draw(input_len)
        out.append(SampleRequest([rng.choice(vocab) for _ in range(n)], n, draw(output_len)))
    return out


def prefix_requests(tokenizer, num_prompts: int, prefix_len: int, suffix_len: int, output_len: int,
                    num_prefixes: int = 1, seed: int = 0) -> list[SampleRequest]:
    """Prompts made of one of ``num_prefixes`` shared random prefixes plus a random suffix
    (as vLLM's ``prefix_repetition`` dataset); prefix caching can skip the prefix.

    Raises:
        ValueError: a non-positive length or prefix count.
    """
    if prefix_len < 1 or suffix_len < 0 or output_len < 1 or num_prefixes < 1:
        raise ValueError("prefix_len, output_len and num_prefixes must be >= 1, suffix_len >= 0")
    rng = random.Random(seed)
    vocab = _ordinary_ids(tokenizer)
    prefixes = [[rng.choice(vocab) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    out = []
    for i in range(num_prompts):
        ids = prefixes[i % num_prefixes] + [rng.choice(vocab) for _ in range(suffix_len)]
        out.append(SampleRequest(ids, len(ids), output_len))
    return out


def json_requests(path: str | Path, tokenizer, num_prompts: int | None, output_len: int) -> list[SampleRequest]:
    """Prompts from a JSON file: a list of strings, or of objects ``{"prompt": str, "output_len": int}``
    or ``{"prompt_token_ids": [int], "output_len": int}`` (``output_len`` optional, default
    ``output_len``). A ``.jsonl`` file holds one such item per line; a ``{"prompts": [...],
    "output_len": int}`` object (the side-by-side workload files) is read as its list.

    Raises:
        ValueError: the file holds something else.
    """
    text = Path(path).read_text()
    items = ([json.loads(ln) for ln in text.splitlines() if ln.strip()] if str(path).endswith(".jsonl")
             else json.loads(text))
    if isinstance(items, dict) and isinstance(items.get("prompts"), list):
        output_len = int(items.get("output_len", output_len))
        items = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in items["prompts"]]
    if not isinstance(items, list):
        raise ValueError(f"{path}: expected a JSON list of prompts")
    out = []
    for i, item in enumerate(items[:num_prompts] if num_prompts else items):
        if isinstance(item, str):
            prompt, n = item, output_len
        elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
            prompt, n = item["prompt"], int(item.get("output_len", output_len))
        elif isinstance(item, dict) and isinstance(item.get("prompt_token_ids"), list):
            ids = [int(t) for t in item["prompt_token_ids"]]
            out.append(SampleRequest(ids, len(ids), int(item.get("output_len", output_len))))
            continue
        else:
            raise ValueError(f"{path}: item {i} is neither a string, {{\"prompt\": str}} nor "
                             f"{{\"prompt_token_ids\": [int]}}")
        out.append(SampleRequest(prompt, len(tokenizer.encode(prompt, add_special_tokens=False)), n))
    return out


def add_dataset_args(p, with_seed: bool = True) -> None:
    """The dataset flags of ``pagedllm bench throughput`` and ``serve`` (vLLM's names).

    ``with_seed=False`` when the parser already has ``--seed`` (the engine's), which then
    seeds the dataset too.
    """
    p.add_argument("--dataset-name", choices=["random", "prefix", "json"], default="random")
    p.add_argument("--dataset-path", default=None, help="JSON / JSONL file of prompts (--dataset-name json)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--random-input-len", "--input-len", dest="input_len", type=int, default=128)
    p.add_argument("--random-output-len", "--output-len", dest="output_len", type=int, default=128)
    p.add_argument("--random-range-ratio", dest="range_ratio", type=float, default=0.0)
    p.add_argument("--prefix-len", type=int, default=256, help="shared prefix tokens (--dataset-name prefix)")
    p.add_argument("--suffix-len", type=int, default=32, help="distinct tokens after it (--dataset-name prefix)")
    p.add_argument("--num-prefixes", type=int, default=1)
    if with_seed:
        p.add_argument("--seed", type=int, default=0, help="dataset (and arrival-time) seed")


def load_requests(args, tokenizer) -> list[SampleRequest]:
    """Build the workload the dataset flags describe.

    Raises:
        ValueError: ``json`` without ``--dataset-path``, or a bad length.
    """
    if args.dataset_name == "random":
        return random_requests(tokenizer, args.num_prompts, args.input_len, args.output_len, args.seed,
                               args.range_ratio)
    if args.dataset_name == "prefix":
        return prefix_requests(tokenizer, args.num_prompts, args.prefix_len, args.suffix_len, args.output_len,
                               args.num_prefixes, args.seed)
    if not args.dataset_path:
        raise ValueError("--dataset-name json needs --dataset-path")
    return json_requests(args.dataset_path, tokenizer, args.num_prompts, args.output_len)
