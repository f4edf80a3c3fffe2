#!/usr/bin/env bash
# llama.cpp's `llama-server`, `llama-bench` and `llama-quantize`, built from the llama.cpp
# source vendored in the PyPI `llama-cpp-python` sdist, for benchmarks/throughput.py
# --systems llamacpp, benchmarks/single_request.py and make_gguf_files.sh.
# Not part of CI's test run. The build downloads nothing (no curl, no web UI) and tunes
# for this CPU (-DGGML_NATIVE=ON). On 2 cores it takes about 20 minutes; it runs at the
# lowest priority with 2 jobs so that it does not starve other work.
#
#   bash benchmarks/peers/setup_llamacpp.sh [BUILD_DIR]  # default: benchmarks/peers/.llamacpp
#
# The binaries end up in BUILD_DIR/bin.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="${1:-$here/.llamacpp}"
python="${PYTHON:-python3}"
spec="${LLAMA_CPP_PYTHON_SPEC:-llama-cpp-python}"
jobs="${JOBS:-2}"

for tool in cmake make c++; do
    command -v "$tool" >/dev/null || { echo "error: $tool is needed to build llama.cpp" >&2; exit 1; }
done

mkdir -p "$root/src"
if [ ! -f "$root/src/.unpacked" ]; then
    "$python" -m pip download --quiet --no-deps --no-binary llama-cpp-python --dest "$root/sdist" "$spec"
    archive="$(ls "$root"/sdist/llama_cpp_python-*.tar.gz | sort -V | tail -n 1)"
    tar -xzf "$archive" -C "$root/src" --strip-components=1
    touch "$root/src/.unpacked"
fi
vendored="$root/src/vendor/llama.cpp"
[ -f "$vendored/CMakeLists.txt" ] || { echo "error: no vendored llama.cpp in $root/src" >&2; exit 1; }

nice -n 19 cmake -S "$vendored" -B "$root/build" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
nice -n 19 cmake --build "$root/build" --config Release -j "$jobs" \
    --target llama-server llama-bench llama-quantize

mkdir -p "$root/bin"
cp "$root/build/bin/llama-server" "$root/build/bin/llama-bench" "$root/build/bin/llama-quantize" \
    "$root/bin/"
version="$(basename "$(ls "$root"/sdist/llama_cpp_python-*.tar.gz | sort -V | tail -n 1)" .tar.gz)"
echo "${version#llama_cpp_python-}" >"$root/bin/VERSION"
"$root/bin/llama-server" --version 2>&1 | head -n 3 || true
echo "llama.cpp ready in $root/bin ($(cat "$root/bin/VERSION") sdist)"
