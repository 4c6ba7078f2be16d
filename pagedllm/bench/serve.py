"""``pagedllm bench serve``: drive any OpenAI-compatible server and measure TTFT, TPOT, ITL, E2E latency.

Requests stream from ``/v1/completions`` (or ``/v1/chat/completions``) with
``max_tokens`` = the request's output length and ``ignore_eos`` (accepted by
pagedllm, vLLM and llama.cpp's server), at a fixed ``--max-concurrency`` and/or
a Poisson ``--request-rate``. Token-id prompts are sent as token arrays (the
completions API accepts them), so every server sees exactly the same tokens.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

from pagedllm.bench.datasets import SampleRequest
from pagedllm.bench.metrics import RequestRecord, summarize


async def _one(client, url: str, model: str, req: SampleRequest, chat: bool, tokenizer) -> RequestRecord:
    """Send one streamed request; time its chunks."""
    rec = RequestRecord(prompt_len=req.prompt_len)
    body = {"model": model, "max_tokens": req.output_len, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    if chat:
        text = req.prompt if isinstance(req.prompt, str) else tokenizer.decode(req.prompt)
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = req.prompt
    chunks = 0
    rec.start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, timeout=None) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    rec.output_len = chunk["usage"].get("completion_tokens", 0)
                choices = chunk.get("choices") or []
                text = (choices[0].get("delta", {}).get("content") if chat else choices[0].get("text")) \
                    if choices else None
                if text:
                    now = time.perf_counter()
                    if chunks == 0:
                        rec.ttft = now - rec.start
                    else:
                        rec.itl.append(now - last)
                    last = now
                    chunks += 1
        rec.e2el = time.perf_counter() - rec.start
        rec.output_len = rec.output_len or chunks  # servers without usage in streams: one token per chunk
        rec.success = chunks > 0
        if not rec.success:
            rec.error = "no text in the stream"
    except Exception as e:  # a benchmark reports failures, it does not stop on them
        rec.error = f"{type(e).__name__}: {e}"
    return rec


async def run_serve(base_url: str, model: str, requests: list[SampleRequest], max_concurrency: int | None,
                    request_rate: float = float("inf"), chat: bool = False, tokenizer=None, seed: int = 0) -> dict:
    """Send every request and summarize.

    Args:
        base_url: server root, e.g. ``http://127.0.0.1:8000``.
        model: the ``model`` field to send.
        requests: the workload.
        max_concurrency: most requests in flight (``None``: unbounded).
        request_rate: mean arrivals per second (Poisson, seeded); ``inf`` sends all at once.
        chat: use ``/v1/chat/completions`` (token prompts are decoded to text with ``tokenizer``).
    Returns:
        ``summarize``'s metrics plus ``max_concurrency`` and ``request_rate``.
    """
    import httpx
    url = base_url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=(max_concurrency or len(requests)) + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        async def task(req: SampleRequest, delay: float) -> RequestRecord:
            await asyncio.sleep(delay)
            if sem is None:
                return await _one(client, url, model, req, chat, tokenizer)
            async with sem:
                return await _one(client, url, model, req, chat, tokenizer)

        delays, t = [], 0.0
        for _ in requests:
            delays.append(t)
            if request_rate != float("inf"):
                t += rng.expovariate(request_rate)
        t0 = time.perf_counter()
        records = await asyncio.gather(*[task(r, d) for r, d in zip(requests, delays)])
        duration = time.perf_counter() - t0
    res = summarize(list(records), duration)
    res.update({"max_concurrency": max_concurrency, "request_rate": request_rate})
    return res


def served_model(base_url: str) -> str:
    """The first model id ``GET /v1/models`` lists.

    Raises:
        RuntimeError: the server lists none.
    """
    import httpx
    data = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=30).json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return data[0]["id"]


def serve_main(args) -> list[dict]:
    """``pagedllm bench serve``: one run per ``--max-concurrency`` value, a table each, JSON and a plot."""
    from transformers import AutoTokenizer

    from pagedllm.bench.datasets import load_requests
    from pagedllm.bench.metrics import print_table
    from pagedllm.models.resolve import resolve_model
    # a GGUF file holds its tokenizer: resolve_model converts it (cached) to a directory transformers reads
    source = args.tokenizer
    if source is None or str(source).lower().endswith(".gguf"):
        source = resolve_model(source)
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = args.model or served_model(args.base_url)
    requests = load_requests(args, tokenizer)
    if args.warmup:
        asyncio.run(run_serve(args.base_url, model, requests[:1], 1, chat=args.endpoint == "chat",
                              tokenizer=tokenizer))
    runs = []
    for c in args.max_concurrency or [None]:
        res = asyncio.run(run_serve(args.base_url, model, requests, c, args.request_rate,
                                    chat=args.endpoint == "chat", tokenizer=tokenizer, seed=args.seed))
        print_table(f"Serving Benchmark Result (concurrency {c or 'unbounded'})", res)
        runs.append(res)
    return runs
