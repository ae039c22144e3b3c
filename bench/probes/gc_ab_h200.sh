#!/usr/bin/env bash
# The serving processes' cyclic collector (floe.server.heap) on a lent GPU host: Python's thresholds
# (FLOE_GC_THRESHOLD=700,10,10) against floe's default, taking turns: a 64-burst through 4 fronts
# (bench/probes/arrival_timeline.py, its per-round report of the core's and the fronts' collectors) AR
# rounds, then serve at 64 sessions (bench/sessions.py) SR rounds; stops past BUDGET_S seconds.
#   run(command="bash bench/probes/gc_ab_h200.sh", carry=[".whl", ".tok"])
LOG=gc_ab_h200.log . "$(dirname "$0")/lend.sh"
default=$(python3 -c "from floe.server.heap import GC_THRESHOLDS as t; print(','.join(map(str, t)))")
for r in $(seq 1 "${AR:-2}"); do
    for g in 700,10,10 "$default"; do
        [ "$(left)" -gt 70 ] || break 2
        echo "=== arrival, collector $g, round $r ($(left) s left)"
        FLOE_GC_THRESHOLD=$g timeout 80 python3 bench/probes/arrival_timeline.py --device cuda --shape llama-3.2-1b \
            --tokenizer .tok --sessions 64 --rounds 2 --max-tokens 32 --fronts 4 --steps --stuck-s 70 \
            > "$OUT/arrival_gc${g%%,*}_$r.txt" 2>&1
        grep -E "collector|TTFT p50|first token id sent|received →|CPU ms|in all" "$OUT/arrival_gc${g%%,*}_$r.txt"
    done
done
for r in $(seq 1 "${SR:-2}"); do
    for g in 700,10,10 "$default"; do
        [ "$(left)" -gt 45 ] || break 2
        echo "=== serve 64, collector $g, round $r ($(left) s left)"
        FLOE_GC_THRESHOLD=$g timeout $(( $(left) - 5 )) python3 bench/sessions.py --device cuda --shape llama-3.2-1b \
            --tokenizer .tok --sessions 64 --ways serve --name gc${g%%,*}_$r | tail -3
        cp "bench/results/sessions_cuda_gc${g%%,*}_$r.json" "$OUT"/ 2>/dev/null
    done
done
echo "done in $(( $(date +%s) - start )) s"
