#!/usr/bin/env bash
# Build llama.cpp's own llama-bench, llama-server and llama-quantize from the sources vendored in the
# llama-cpp-python sdist (the peer a llama.cpp user runs), into $DEST (default /work/peers/llamacpp-bin).
#
# Instruction sets come from /proc/cpuinfo with GGML_NATIVE=OFF, AMX left off: on a Sapphire
# Rapids VM whose flags list AMX, a -march=native build died with an illegal instruction on a
# Q4_1 file (its AMX path, without the OS tile permission). About 10 minutes on 2 cores.
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
DEST=${DEST:-/work/peers/llamacpp-bin}
WORK=${WORK:-/work/peers/llamacpp-src}
PIP=${PIP:-pip}
mkdir -p "$WORK" "$DEST"
cd "$WORK"
[ -f "llama_cpp_python-$VERSION.tar.gz" ] || "$PIP" download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d .
[ -d "llama_cpp_python-$VERSION" ] || tar xzf "llama_cpp_python-$VERSION.tar.gz"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
has() { grep -q -w "$1" /proc/cpuinfo && echo ON || echo OFF; }
FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma)
       -DGGML_F16C=$(has f16c) -DGGML_BMI2=$(has bmi2) -DGGML_AVX512=$(has avx512f)
       -DGGML_AVX512_VBMI=$(has avx512vbmi) -DGGML_AVX512_VNNI=$(has avx512_vnni)
       -DGGML_AVX512_BF16=$(has avx512_bf16) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
echo "llama.cpp flags: ${FLAGS[*]}"
cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF "${FLAGS[@]}"
cmake --build "$WORK/build" --target llama-bench llama-server llama-quantize -j "$(nproc)"
cp "$WORK/build/bin/llama-bench" "$WORK/build/bin/llama-server" "$WORK/build/bin/llama-quantize" "$DEST/"
printf '%s\n' "${FLAGS[@]}" > "$DEST/build-flags.txt"
echo "built: $DEST/llama-bench $DEST/llama-server"
