#!/usr/bin/env bash
# The side-by-side run with the peers, one throughput.py run per workload, model and
# dtype, each with pagedinfer and the peers in turn (so that every ratio comes from one
# run). Set the peers up first (setup_vllm.sh, setup_llamacpp.sh); a peer not set up
# is skipped with the reason in its JSON.
#
#   bash benchmarks/peers/run_peers.sh [TAG] [throughput.py options...]
#
# writes benchmarks/results/throughput_peers_TAG_{WORKLOAD}_{MODEL}_{DTYPE}.json (and a
# .png beside each) for WORKLOAD in chat, mixed and, per workload:
#   embedded fp32: paged, paged_spec, vllm, llamacpp  (the GGUF file's Q4_1 weights)
#   noisy fp32:    paged, vllm                        (an ordinary checkpoint, on no grid)
#   noisy bf16:    paged, vllm                        (only where the CPU has native bf16)
#   noisy-bf16:    paged in fp32, vllm in bf16        (a checkpoint published in bf16, each
#                                                      engine's default dtype for it there)
# Extra options go to every run (e.g. --repeats 2, --threads 2). About 40 minutes on
# 2 cores; run it on an otherwise idle machine.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
tag=run
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
    tag="$1"
    shift
fi
python="${PYTHON:-.venv/bin/python}"
results=benchmarks/results

bf16=""
if grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo; then
    bf16=yes
fi

run() {  # workload model dtype systems
    local name="throughput_peers_${tag}_$1_$2_$3"
    echo "== $name: $4" >&2
    "$python" benchmarks/throughput.py --json --workload "$1" --model "$2" --dtype "$3" \
        --systems "$4" --no-gemm-limits --no-step-profile --prefix-requests 0 \
        --plot "$results/$name.png" "${@:5}" >"$results/$name.json.tmp"
    mv "$results/$name.json.tmp" "$results/$name.json"
}

for workload in chat mixed; do
    run "$workload" embedded float32 paged,paged_spec,vllm,llamacpp "$@"
    run "$workload" noisy float32 paged,vllm "$@"
    if [ -n "$bf16" ]; then
        run "$workload" noisy bfloat16 paged,vllm "$@"
        run "$workload" noisy-bf16 float32 paged,vllm --peer-dtype bfloat16 "$@"
    fi
done
echo "results in $results/throughput_peers_${tag}_*.json" >&2
