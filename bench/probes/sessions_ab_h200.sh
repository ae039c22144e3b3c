#!/usr/bin/env bash
# Issue 16 on the H200: this checkout's engine loop against an earlier one, in one device call.
#   PART=check  tests/test_cuda.py, then the loop's host cost (bench/probes/loop_host_cost.py, LOOP_ARGS
#               e.g. --ids, LOOP_ROUNDS rounds) for both sources taking turns, then `bench/sessions.py
#               --ways engine actors` (SIZES, default 1 16 64) for this checkout;
#   PART=serve  `bench/sessions.py --ways serve`, the two sources taking turns (ROUNDS rounds) at SIZES
#               sessions (default "16 64"); PROFILE_AFTER=1: then PART=profile's py-spy run;
#   PART=tests  tests/test_cuda.py alone;
#   PART=hints  `bench/sessions.py --ways serve` for this checkout with and without its prompt hints
#               (`--no-prompt-hints`), taking turns (ROUNDS rounds) at SIZES sessions (default "16 64");
#   PART=table  `bench/sessions.py` (every way) at SIZES for this checkout, then the serve way for the
#               earlier source, TABLE_ARGS added to both (e.g. "--shape llama-3-8b");
#   PART=timeline  `bench/sessions.py --ways serve` at SIZES (default "16 64") for this checkout with
#               each core's threads sampled (probes/thread_timeline.py): $OUT/timeline/serve_S/, and its
#               tables (BIN_MS, default 10) in $OUT/timeline_S.txt;
#   PART=profile  py-spy (a wheel in .whl) samples every process of `--ways serve --sessions 64` (this
#               checkout): $OUT/serve64_pyspy.txt, raw stacks with their process (bench/probes/stacks.py
#               reads them); RATE (200 a second), TOKENS (128 out), PYSPY_ARGS (e.g. --gil: only the
#               thread holding the GIL is sampled).
# The earlier source is a copy of its src/ in .base/src (ignored; carried). Everything lands in $OUT.
# From the session (the wheels as the device README says, the tokenizer folder .tok):
#   run(command="PART=check bash bench/probes/sessions_ab_h200.sh", carry=[".whl", ".tok", ".base"])
#   run(command="PART=serve ROUNDS=2 bash bench/probes/sessions_ab_h200.sh", carry=[".whl", ".tok", ".base"])
set -x
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/sessions_ab_h200.log") 2>&1
cd "$(dirname "$0")/../.."
start=$(date +%s)
budget=${BUDGET_S:-540}
left() { echo $((budget - ($(date +%s) - start))); }

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NEW=/tmp/site:$PWD/${NEW_SRC:-src}  # NEW_SRC: e.g. .new/src, a clean copy of a commit (ignored; carried)
BASE=/tmp/site:$PWD/.base/src
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv
lscpu | grep -E "Model name|^CPU\(s\)"

sessions() {  # sessions SOURCE NAME ARGS...
    local src=$1 name=$2; shift 2
    PYTHONPATH=$src timeout "$(left)" python3 bench/sessions.py --device cuda --shape llama-3.2-1b \
        --tokenizer .tok --name "$name" "$@"
    cp bench/results/sessions_cuda_"$name".json "$OUT"/ 2>/dev/null
}

if [ "${PART:-check}" = hints ]; then
    for r in $(seq 1 "${ROUNDS:-1}"); do  # (the order alternates: on, off; off, on; ...)
        order="on off"; [ $((r % 2)) = 0 ] && order="off on"
        for v in $order; do
            [ "$(left)" -gt 150 ] || break
            flag=""; [ $v = off ] && flag=--no-prompt-hints
            sessions "$NEW" hints_${v}_$r --sessions ${SIZES:-16 64} --ways serve $flag
        done
    done
elif [ "${PART:-check}" = timeline ]; then
    sessions "$NEW" timeline --sessions ${SIZES:-16 64} --ways serve --timeline "$OUT/timeline"
    for d in "$OUT"/timeline/serve_*; do
        python3 bench/probes/thread_timeline.py --show "$d/timeline.json" --bin-ms "${BIN_MS:-10}" --top 8 \
            > "$OUT/timeline_${d##*_}.txt" 2>&1
        head -12 "$OUT/timeline_${d##*_}.txt"
        gzip "$d/timeline.json"
    done
elif [ "${PART:-check}" = tests ]; then
    FLOE_TEST_TOKENIZER=$PWD/.tok PYTHONPATH=$NEW timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py
elif [ "${PART:-check}" = profile ]; then
    PYTHONPATH=$NEW timeout "$(left)" /tmp/site/bin/py-spy record --subprocesses --threads --nonblocking --rate "${RATE:-200}" ${PYSPY_ARGS:-} \
        --format raw -o "$OUT/serve64_pyspy.txt" -- python3 bench/sessions.py --device cuda \
        --shape llama-3.2-1b --tokenizer .tok --name serve64_profiled --sessions 64 --ways serve \
        --tokens "${TOKENS:-128}"
    cp bench/results/sessions_cuda_serve64_profiled.json "$OUT"/ 2>/dev/null
elif [ "${PART:-check}" = table ]; then  # the whole table for this checkout, then base's serve column
    sessions "$NEW" table_new --sessions ${SIZES:-1 16 64 128} ${TABLE_ARGS:-}
    [ "$(left)" -gt 150 ] && sessions "$BASE" table_base --sessions ${SIZES:-1 16 64 128} --ways serve ${TABLE_ARGS:-}
elif [ "${PART:-check}" = check ]; then
    FLOE_TEST_TOKENIZER=$PWD/.tok PYTHONPATH=$NEW timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tail -15
    for r in $(seq 1 "${LOOP_ROUNDS:-1}"); do
        for v in new base; do
            src=$NEW; [ $v = base ] && src=$BASE
            PYTHONPATH=$src timeout 60 python3 bench/probes/loop_host_cost.py --sessions 64 --tokens 64 \
                --tokenizer .tok ${LOOP_ARGS:-} > "$OUT/loop_host_cost_${v}_$r.txt" 2>&1
            head -4 "$OUT/loop_host_cost_${v}_$r.txt"
        done
    done
    [ "$(left)" -gt 120 ] && sessions "$NEW" new_engine_actors --sessions ${SIZES:-1 16 64} --ways engine actors
else
    for r in $(seq 1 "${ROUNDS:-2}"); do
        for v in new base; do
            src=$NEW; [ $v = base ] && src=$BASE
            [ "$(left)" -gt 100 ] || break 2
            sessions "$src" "serve_${v}_$r" --sessions ${SIZES:-16 64} --ways serve
        done
    done
    if [ -n "${PROFILE_AFTER:-}" ] && [ "$(left)" -gt 90 ]; then  # then py-spy of this checkout's serve
        PYTHONPATH=$NEW timeout "$(left)" /tmp/site/bin/py-spy record --subprocesses --threads --nonblocking \
            --rate "${RATE:-200}" ${PYSPY_ARGS:-} --format raw -o "$OUT/serve64_pyspy.txt" -- python3 \
            bench/sessions.py --device cuda --shape llama-3.2-1b --tokenizer .tok --name serve64_profiled \
            --sessions 64 --ways serve --tokens "${TOKENS:-128}"
    fi
fi
echo "done in $(( $(date +%s) - start )) s"
