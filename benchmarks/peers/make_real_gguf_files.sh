#!/usr/bin/env bash
# GGUF files at the sizes users download, made as a user makes them: a shaped checkpoint
# (shaped_checkpoint.py, default Llama-3.2-1B's shapes in bf16) converted by llama.cpp's own
# convert_hf_to_gguf.py to BF16, then quantised by llama-quantize (setup_llamacpp.sh),
# for benchmarks/single_request.py and throughput.py.
#
#   bash benchmarks/peers/make_real_gguf_files.sh [OUT_DIR]  # default: benchmarks/peers/.gguf
#   FAMILY=qwen3 TYPES="Q4_K_M Q4_K_S Q5_K_M Q6_K Q8_0 Q4_0 IQ4_XS" bash ...make_real_gguf_files.sh
#
# The converter runs in its own environment beside llama.cpp's build: the project's
# packages (torch, transformers) plus sentencepiece, which it imports for every Llama
# checkpoint; it uses the gguf-py that comes with its source. Files already there are kept.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${1:-$here/.gguf}"
llamacpp="${LLAMACPP_DIR:-$here/.llamacpp}"
quantize="$llamacpp/bin/llama-quantize"
converter="$llamacpp/src/vendor/llama.cpp/convert_hf_to_gguf.py"
python="${PYTHON:-$here/../../.venv/bin/python}"
family="${FAMILY:-llama3-1b}"
dtype="${DTYPE:-bfloat16}"
types="${TYPES:-Q4_K_M Q8_0 Q4_0}"
threads="${THREADS:-2}"

[ -x "$quantize" ] || { echo "error: no $quantize (bash benchmarks/peers/setup_llamacpp.sh)" >&2; exit 1; }
[ -f "$converter" ] || { echo "error: no $converter (bash benchmarks/peers/setup_llamacpp.sh)" >&2; exit 1; }

# The converter's environment: a venv whose .pth adds the project's site-packages.
convert_env="$llamacpp/convert-venv"
if [ ! -x "$convert_env/bin/python" ]; then
    base="$("$python" -c 'import sys; print(sys._base_executable)')"
    "$base" -m venv "$convert_env"
    "$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
        >"$("$convert_env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/project.pth"
    "$convert_env/bin/python" -m pip install --quiet "sentencepiece>=0.1.98,<0.3"
fi

checkpoint="$("$python" "$here/shaped_checkpoint.py" "$family" "$dtype" | tail -n 1)"
stem="$(basename "$checkpoint")"
stem="${stem%-*}"  # llama-3.2-1b-shaped-bfloat16-a8e9b598929c -> llama-3.2-1b-shaped-bfloat16

mkdir -p "$out"
source_file="$out/$stem.BF16.gguf"
if [ ! -f "$source_file" ]; then
    nice -n 19 "$convert_env/bin/python" "$converter" "$checkpoint" --outtype bf16 \
        --outfile "$source_file.tmp" >"$source_file.log" 2>&1 \
        || { tail -n 20 "$source_file.log" >&2; exit 1; }
    mv "$source_file.tmp" "$source_file"
    rm -f "$source_file.log"
    echo "made $(basename "$source_file") ($(du -h "$source_file" | cut -f1))" >&2
fi

for type in $types; do
    target="$out/$stem.$type.gguf"
    if [ -f "$target" ]; then
        echo "$(basename "$target") is there" >&2
        continue
    fi
    nice -n 19 "$quantize" "$source_file" "$target.tmp" "$type" "$threads" \
        >"$target.log" 2>&1 || { tail -n 20 "$target.log" >&2; exit 1; }
    mv "$target.tmp" "$target"
    rm -f "$target.log"
    echo "made $(basename "$target") ($(du -h "$target" | cut -f1))" >&2
done
