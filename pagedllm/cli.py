"""Command line: ``pagedllm serve [MODEL]``, ``generate``, ``chat`` and ``bench throughput|latency|serve``.

Flag names follow vLLM's (``--max-num-seqs``, ``--max-num-batched-tokens``,
``--block-size``, ``--served-model-name``, ...). The engine flags shared by
the subcommands are in ``cli_args.py``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

import pagedllm.envs as envs
from pagedllm.cli_args import add_engine_flags, engine_args_from_cli
from pagedllm.server import defaults as server_defaults


def _json_str_list(text: str) -> list[str]:
    """Parse a ``--allowed-*`` value: a JSON list of strings such as ``'["http://a.example"]'``.

    Raises:
        argparse.ArgumentTypeError: not JSON, or not a list of strings.
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def _serve(a: argparse.Namespace) -> int:
    if a.enable_auto_tool_choice and not a.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser (as in vLLM)")
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.server.app import build_app
    from pagedllm.server.lifecycle import run_server, yield_cpu_to_engine_core
    if a.max_waiting_requests is not None and a.max_waiting_requests < 0:
        raise ValueError(f"--max-waiting-requests must be >= 0, got {a.max_waiting_requests}")
    if a.max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes must be >= 1, got {a.max_request_body_bytes}")
    if not 0 <= a.shutdown_timeout < float("inf"):  # also refuses nan
        raise ValueError(f"--shutdown-timeout must be a finite number of seconds >= 0, got {a.shutdown_timeout}")
    engine = LLMEngine(engine_args_from_cli(a))
    template = None
    if a.chat_template:
        from pathlib import Path
        p = Path(a.chat_template)
        template = p.read_text() if p.exists() else a.chat_template
    llm = AsyncLLM(engine)
    if engine.multiprocess:  # the core already runs at the priority the server was started with
        yield_cpu_to_engine_core(envs.PAGEDLLM_API_SERVER_NICE)
    # an empty PAGEDLLM_API_KEY counts as unset, so `PAGEDLLM_API_KEY= pagedllm serve` stays open
    env_key = envs.PAGEDLLM_API_KEY
    app = build_app(llm, engine.served_model_name, template, api_key=a.api_key or ([env_key] if env_key else None),
                    allowed_origins=a.allowed_origins, allowed_methods=a.allowed_methods,
                    allowed_headers=a.allowed_headers, allow_credentials=a.allow_credentials,
                    reasoning_parser=a.reasoning_parser, tool_call_parser=a.tool_call_parser,
                    enable_auto_tool_choice=a.enable_auto_tool_choice,
                    max_request_body_bytes=a.max_request_body_bytes, max_waiting_requests=a.max_waiting_requests,
                    lora_modules=getattr(a, "lora_modules", None) or ())
    logging.getLogger(__name__).info("serving %s on http://%s:%d", engine.served_model_name, a.host, a.port)
    # a SIGTERM outside the server's own handling (while stopping) must still let the finally
    # below stop the core process and remove its ipc sockets
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        code = run_server(app, llm, a.host, a.port, a.log_level, a.shutdown_timeout)
    finally:
        llm.shutdown()
    # the core is reaped and its sockets removed: skip the interpreter's teardown of torch and
    # friends (about a second), so that a stopped server is gone within its deadline
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _generate(a: argparse.Namespace) -> int:
    from pagedllm import LLM, SamplingParams
    llm = LLM(**vars(engine_args_from_cli(a)))
    try:
        sp = SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens, seed=a.sampling_seed)
        if a.command == "chat":
            out = llm.chat([{"role": "user", "content": a.prompt}], sp, use_tqdm=False)
        else:
            out = llm.generate([a.prompt], sp, use_tqdm=False)
        print(out[0].outputs[0].text)
    finally:
        llm.llm_engine.shutdown()  # core process, tensor-parallel workers: stopped in order
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pagedllm`` console script; returns the exit status."""
    parser = argparse.ArgumentParser(prog="pagedllm", description="Paged-KV-cache LLM inference and serving")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="start the OpenAI-compatible server")
    add_engine_flags(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None, help="model name the API reports and accepts")
    s.add_argument("--chat-template", default=None, help="Jinja chat template (file path or inline text)")
    # repeatable rather than nargs="+", which would swallow a model named after it
    s.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' on every path but /health, /version, /metrics, /stats "
                        "and the OpenAPI pages; repeat it for several keys, each of which sees only the stored "
                        "responses made with it (default: $PAGEDLLM_API_KEY, else none)")
    s.add_argument("--allowed-origins", type=_json_str_list, default=["*"],
                   help='CORS allowed origins, a JSON list (default: ["*"])')
    s.add_argument("--allowed-methods", type=_json_str_list, default=["*"],
                   help='CORS allowed methods, a JSON list (default: ["*"])')
    s.add_argument("--allowed-headers", type=_json_str_list, default=["*"],
                   help='CORS allowed headers, a JSON list (default: ["*"])')
    s.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    s.add_argument("--max-waiting-requests", type=int, default=server_defaults.MAX_WAITING_REQUESTS,
                   help="requests that may wait beyond the --max-num-seqs running ones; past that a request "
                        f"gets 429 with Retry-After (default {server_defaults.MAX_WAITING_REQUESTS}; each choice of n counts)")
    s.add_argument("--max-request-body-bytes", type=int, default=server_defaults.MAX_REQUEST_BODY_BYTES,
                   help=f"larger request bodies get 413 (default {server_defaults.MAX_REQUEST_BODY_BYTES}, 4 MiB)")
    s.add_argument("--shutdown-timeout", type=float, default=server_defaults.SHUTDOWN_TIMEOUT_S,
                   help="seconds running requests may take to finish after SIGTERM before they are aborted "
                        f"(default {server_defaults.SHUTDOWN_TIMEOUT_S:.0f}; a second SIGTERM stops at once)")
    s.add_argument("--enable-multiprocessing", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine core in its own process (--no-enable-multiprocessing: in process, "
                        "for debugging)")
    from pagedllm.parsers import REASONING_PARSERS, TOOL_PARSERS
    s.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                   help="split <think> reasoning into reasoning_content")
    s.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                   help="the model's tool-call format (needs --enable-auto-tool-choice)")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='parse tool calls for requests with tools and tool_choice "auto"')
    for name in ("generate", "chat"):
        g = sub.add_parser(name, help=f"{name} once from the command line and print the text")
        add_engine_flags(g)
        g.add_argument("--prompt", required=True)
        g.add_argument("--temperature", type=float, default=0.0)
        g.add_argument("--max-tokens", type=int, default=64)
        g.add_argument("--sampling-seed", type=int, default=None)
    _bench_flags(sub)
    a = parser.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pagedllm.engine.messages import EngineDeadError
    try:
        if a.command == "bench":
            return _bench(a)
        return _serve(a) if a.command == "serve" else _generate(a)
    except (FileNotFoundError, ValueError) as e:  # ModelLoadError among them: one line naming the file
        print(f"pagedllm: error: {e}", file=sys.stderr)
        return 2
    except EngineDeadError as e:  # the core process could not start
        print(f"pagedllm: error: {e}", file=sys.stderr)
        return 1


def _bench_flags(sub) -> None:
    from pagedllm.bench.datasets import add_dataset_args
    b = sub.add_parser("bench", help="benchmark: throughput (offline), latency (one batch), serve (any "
                                     "OpenAI-compatible server)")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    t = bsub.add_parser("throughput", help="offline LLM.generate over a dataset")
    add_engine_flags(t)
    add_dataset_args(t, with_seed=False)
    t.add_argument("--output-json", default=None, help="write the result here")
    lat = bsub.add_parser("latency", help="one batch end to end, repeated")
    add_engine_flags(lat)
    lat.add_argument("--batch-size", type=int, default=1)
    lat.add_argument("--input-len", type=int, default=32)
    lat.add_argument("--output-len", type=int, default=128)
    lat.add_argument("--num-iters", type=int, default=5)
    lat.add_argument("--num-iters-warmup", type=int, default=1)
    lat.add_argument("--output-json", default=None, help="write the result here")
    s = bsub.add_parser("serve", help="drive a running OpenAI-compatible server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000")
    s.add_argument("--model", default=None, help="model name to send (default: the first in /v1/models)")
    s.add_argument("--tokenizer", default=None, help="tokenizer for the prompts: a directory or a GGUF file (default: the embedded SmolLM2)")
    s.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    s.add_argument("--max-concurrency", type=int, nargs="+", default=None,
                   help="requests in flight; several values run one after another (and are plotted)")
    s.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    s.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the one-request warm-up")
    add_dataset_args(s)
    s.add_argument("--result-file", default=None, help="write every run's metrics here (JSON)")
    s.add_argument("--plot", default=None, help="PNG of throughput and latency against concurrency "
                                                "(default with several --max-concurrency: next to --result-file)")
    s.add_argument("--log-level", default="warning")


def _bench(a: argparse.Namespace) -> int:
    from pagedllm.bench.report import plot_runs, write_result
    if a.bench_command == "throughput":
        from pagedllm.bench.offline import throughput_main
        res = throughput_main(a)
    elif a.bench_command == "latency":
        from pagedllm.bench.offline import latency_main
        res = latency_main(a)
    else:
        from pagedllm.bench.serve import serve_main
        res = serve_main(a)
        plot = a.plot or (str(a.result_file).rsplit(".", 1)[0] + ".png" if a.result_file and len(res) > 1 else None)
        if plot:
            print(f"plot: {plot_runs(res, plot)}")
    out = getattr(a, "output_json", None) or getattr(a, "result_file", None)
    if out:
        print(f"result: {write_result(out, a.bench_command, a, res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
