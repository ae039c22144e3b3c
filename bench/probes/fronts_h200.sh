#!/usr/bin/env bash
# Issue 40 item 2 on the H200: `floe serve --fronts N` (HTTP fronts sharing the port) against one front,
# 1B shape, 64-token prompts, 128 out, greedy; the engine alone once for the ratio; rounds alternate.
#   run(command="bash bench/probes/fronts_h200.sh", carry=[".whl", ".tok"])   (FRONTS=3 ROUNDS=2 SIZES="16 64")
set -x
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/fronts_h200.log") 2>&1
cd "$(dirname "$0")/../.."
start=$(date +%s)
budget=${BUDGET_S:-560}
left() { echo $((budget - ($(date +%s) - start))); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv
lscpu | grep -E "Model name|^CPU\(s\)"
sessions() {  # sessions NAME ARGS...
    local name=$1; shift
    timeout "$(left)" python3 bench/sessions.py --device cuda --shape llama-3.2-1b --tokenizer .tok \
        --name "$name" "$@"
    cp bench/results/sessions_cuda_"$name".json "$OUT"/ 2>/dev/null
}
sessions engine --sessions ${SIZES:-16 64} --ways engine
for r in $(seq 1 "${ROUNDS:-2}"); do
    for f in 1 "${FRONTS:-3}"; do
        [ "$(left)" -gt 90 ] || break 2
        sessions "serve_fronts${f}_$r" --sessions ${SIZES:-16 64} --ways serve --fronts "$f"
    done
done
echo "done in $(( $(date +%s) - start )) s"
