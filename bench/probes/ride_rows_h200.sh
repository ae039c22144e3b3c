#!/usr/bin/env bash
# How many prompt rows a CUDA decode step should take along (floe.actor.loop.RIDE_ROWS, the graphs'
# MIXED_ROWS): a 64- and 128-session burst through actors and `floe serve`, VARIANTS taking turns
# (ROUNDS rounds), then where a 64-burst's first token goes at each (bench/probes/arrival_timeline.py).
#   run(command="VARIANTS='256 1024' ROUNDS=2 bash bench/probes/ride_rows_h200.sh", carry=[".whl", ".tok"])
set -x
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/ride_rows_h200.log") 2>&1
cd "$(dirname "$0")/../.."
start=$(date +%s)
left() { echo $((${BUDGET_S:-540} - ($(date +%s) - start))); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/${NEW_SRC:-src}
for r in $(seq 1 "${ROUNDS:-2}"); do
    for v in ${VARIANTS:-256 1024}; do
        [ "$(left)" -gt 120 ] || break 2
        timeout "$(left)" python3 bench/sessions.py --device cuda --shape llama-3.2-1b --tokenizer .tok \
            --sessions ${SIZES:-64 128} --ways actors serve --ride-rows "$v" --name "ride${v}_$r" | tail -6
        cp bench/results/sessions_cuda_ride${v}_$r.json "$OUT"/ 2>/dev/null
    done
done
for v in ${VARIANTS:-256 1024}; do
    [ "$(left)" -gt 90 ] || break
    timeout "$(left)" python3 bench/probes/arrival_timeline.py --device cuda --shape llama-3.2-1b --tokenizer .tok \
        --sessions 64 --rounds 1 --max-tokens 128 --ride-rows "$v" > "$OUT/arrival_ride$v.txt" 2>&1
    tail -12 "$OUT/arrival_ride$v.txt"
done
echo "done in $(( $(date +%s) - start )) s"
