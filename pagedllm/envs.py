"""Every environment variable pagedllm reads, in one module (the idea of vLLM's ``envs.py``).

Import it as ``import pagedllm.envs as envs`` (``from pagedllm import envs`` would import the
package's ``__init__``, the top floor) and read a variable as an attribute,
``envs.PAGEDLLM_CPU_ISA``: each read looks at ``os.environ`` again
(nothing is cached here), so a test that sets a variable, or a process that inherits one, sees it.
``VARIABLES`` maps each name to its reader and its meaning; ``set_var`` is the one writer (a
setting a child process must inherit). No other module of pagedllm touches ``os.environ``
(``tests/test_layering.py`` checks it). This module imports nothing of pagedllm: floor one.
"""

from __future__ import annotations

import os
from typing import Any, Callable


def _on_unless_zero(name: str) -> Callable[[], bool]:
    return lambda: os.environ.get(name, "1") != "0"


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "on", "yes")


def _text(name: str, default: str | None = None) -> Callable[[], str | None]:
    # an empty value counts as unset (``PAGEDLLM_API_KEY= pagedllm serve`` stays open)
    return lambda: os.environ.get(name) or default


VARIABLES: dict[str, tuple[Callable[[], Any], str]] = {
    "PAGEDLLM_CACHE": (_text("PAGEDLLM_CACHE"),
                       "cache directory (converted GGUF models, built kernels); default ~/.cache/pagedllm"),
    "PAGEDLLM_API_KEY": (_text("PAGEDLLM_API_KEY"),
                         "API key the server requires when --api-key is not given; empty: none"),
    "PAGEDLLM_ENABLE_MULTIPROCESSING": (lambda: os.environ.get("PAGEDLLM_ENABLE_MULTIPROCESSING", "0") == "1",
                                        "1: the offline LLM runs its engine core in a process of its own"),
    "PAGEDLLM_ASYNC_SCHEDULING": (lambda: os.environ.get("PAGEDLLM_ASYNC_SCHEDULING", "1") == "1",
                                  "default of async_scheduling (plan step N+1 while step N runs); 0: off"),
    "PAGEDLLM_PIPELINE_OVERLAP": (_on_unless_zero("PAGEDLLM_PIPELINE_OVERLAP"),
                                  "0: a pipeline-parallel engine drains the pipeline at every step (a baseline)"),
    "PAGEDLLM_CPU_KERNELS": (_on_unless_zero("PAGEDLLM_CPU_KERNELS"),
                             "0: torch ops instead of the C CPU kernels (the reference path)"),
    "PAGEDLLM_CPU_PREPACK": (lambda: os.environ.get("PAGEDLLM_CPU_PREPACK", "1") == "1",
                             "0: float linears without oneDNN prepacked weights"),
    "PAGEDLLM_CPU_ISA": (lambda: os.environ.get("PAGEDLLM_CPU_ISA", "").strip().lower(),
                         "force a lower kernel build: generic, avx2, avxvnni or avx512vnni"),
    "PAGEDLLM_INT8_ACTIVATIONS": (_on_unless_zero("PAGEDLLM_INT8_ACTIVATIONS"),
                                  "0: packed weights multiply float32 activations (no int8 quantization)"),
    "PAGEDLLM_INT8_ONE_LEVEL": (_on_unless_zero("PAGEDLLM_INT8_ONE_LEVEL"),
                                "0: prefill-sized packed products on AVX2 / AVX-VNNI keep two activation "
                                "levels (or the dequantized product) instead of one"),
    "PAGEDLLM_PREFILL_BF16": (lambda: os.environ.get("PAGEDLLM_PREFILL_BF16"),
                              "1 / 0: force bfloat16 / float32 for large dequantized products (default: AMX)"),
    "PAGEDLLM_API_SERVER_NICE": (lambda: int(os.environ.get("PAGEDLLM_API_SERVER_NICE", "7")),
                                 "niceness the API server adds to itself once its engine core process runs "
                                 "(default 7; 0: none)"),
    "PAGEDLLM_NATIVE_MIXERS": (_on_unless_zero("PAGEDLLM_NATIVE_MIXERS"),
                               "0: hybrid models' state mixers in torch instead of the C kernels"),
    "PAGEDLLM_DEVICE_INPUTS": (_on_unless_zero("PAGEDLLM_DEVICE_INPUTS"),
                               "0: the Triton path builds step inputs on the host instead of the device"),
    "PAGEDLLM_RAY_CPUS_PER_WORKER": (lambda: float(os.environ.get("PAGEDLLM_RAY_CPUS_PER_WORKER", "1")),
                                     "CPUs a Ray worker rank reserves (default 1)"),
    "PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING": (lambda: _truthy("PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING")
                                             or _truthy("VLLM_ALLOW_RUNTIME_LORA_UPDATING"),
                                             "1 / true (or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING): the server's "
                                             "/v1/load_lora_adapter and /v1/unload_lora_adapter change its adapters"),
    "TRITON_INTERPRET": (lambda: os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"),
                         "Triton's own switch: run Triton kernels on the CPU through its interpreter"),
    "RAY_ADDRESS": (_text("RAY_ADDRESS"), "Ray's own: the cluster to join (default: start a local one)"),
    "PYTHONPATH": (lambda: os.environ.get("PYTHONPATH", ""), "passed on to Ray workers"),
    "CC": (lambda: os.environ.get("CC", "cc"), "the C compiler for the kernels (default cc, else gcc)"),
}


def __getattr__(name: str) -> Any:
    """``envs.NAME``: the variable's current value, parsed (see ``VARIABLES``).

    Raises:
        AttributeError: ``name`` is not a variable pagedllm reads.
    """
    if name in VARIABLES:
        return VARIABLES[name][0]()
    raise AttributeError(f"pagedllm.envs has no variable {name!r}")


def set_var(name: str, value: str) -> None:
    """Set ``name`` for this process and the processes it starts later (tests; a switch a child
    process must inherit).

    Raises:
        KeyError: ``name`` is not in ``VARIABLES``.
    """
    if name not in VARIABLES:
        raise KeyError(f"pagedllm.envs has no variable {name!r}")
    os.environ[name] = value
