#!/usr/bin/env bash
# The GGUF files people download, made from the embedded model's own file (Q4_1 with a
# Q8_0 embedding) with llama.cpp's llama-quantize (setup_llamacpp.sh), for
# benchmarks/single_request.py: Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0, and F32 and BF16 copies.
#
#   bash benchmarks/peers/make_gguf_files.sh [OUT_DIR]  # default: benchmarks/peers/.gguf
#
# They are requantised from 4-bit weights (--allow-requantize), so their quality is that
# of the Q4_1 file at best; they serve to measure speed. SmolLM2's rows are 576 wide, not
# a multiple of the K-quants' 256-wide super-blocks, so for most tensors of the Q4_K_M,
# Q5_K_M and Q6_K files llama.cpp falls back to 32-wide types (Q5_0, Q5_1, Q8_0); only the
# 1536-wide rows of the MLP's down projection get K-quants. Files already there are kept.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${1:-$here/.gguf}"
quantize="${LLAMACPP_DIR:-$here/.llamacpp}/bin/llama-quantize"
python="${PYTHON:-$here/../../.venv/bin/python}"
threads="${THREADS:-2}"

[ -x "$quantize" ] || { echo "error: no $quantize (bash benchmarks/peers/setup_llamacpp.sh)" >&2; exit 1; }
source_file="$("$python" -c 'from pagedinfer.service.loader import default_gguf_path; print(default_gguf_path())')"
stem="$(basename "$source_file" .gguf)"
stem="${stem%.*}"  # SmolLM2-135M-Instruct.Q4_1 -> SmolLM2-135M-Instruct

mkdir -p "$out"
for type in Q4_K_M Q5_K_M Q6_K Q8_0 Q4_0 F32 BF16; do
    target="$out/$stem.$type.gguf"
    if [ -f "$target" ]; then
        echo "$(basename "$target") is there" >&2
        continue
    fi
    nice -n 19 "$quantize" --allow-requantize "$source_file" "$target.tmp" "$type" "$threads" \
        >"$target.log" 2>&1 || { tail -n 20 "$target.log" >&2; exit 1; }
    mv "$target.tmp" "$target"
    rm -f "$target.log"
    echo "made $(basename "$target") ($(du -h "$target" | cut -f1))" >&2
done
