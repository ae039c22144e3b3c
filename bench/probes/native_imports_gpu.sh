#!/usr/bin/env bash
# The host imports answered in C (floe.actor.native_imports) on a lent GPU host, against all of them in
# Python (FLOE_NATIVE_IMPORTS=0), taking turns: a request's CPU in the core's chat thread (request_cpu.py
# --native-imports alternate, in one process), a 64-burst through 4 fronts (arrival_timeline.py) AR
# rounds, then serve at 64 sessions (bench/sessions.py) SR rounds; stops past BUDGET_S seconds.
#   run(command="bash bench/probes/native_imports_gpu.sh", carry=[".whl", ".tok"])
LOG=native_imports_gpu.log . "$(dirname "$0")/lend.sh"
echo "=== a request's CPU ($(left) s left)"
timeout 120 python3 bench/probes/request_cpu.py --tokenizer .tok --requests 32 --batches 40 \
    --native-imports alternate --json "$OUT/request_cpu.json" | tail -4
for r in $(seq 1 "${AR:-2}"); do
    for n in 0 1; do
        [ "$(left)" -gt 70 ] || break 2
        echo "=== arrival, native imports $n, round $r ($(left) s left)"
        FLOE_NATIVE_IMPORTS=$n timeout 80 python3 bench/probes/arrival_timeline.py --device cuda \
            --shape llama-3.2-1b --tokenizer .tok --sessions 64 --rounds 2 --max-tokens 32 --fronts 4 \
            --stuck-s 70 > "$OUT/arrival_native${n}_$r.txt" 2>&1
        grep -E "TTFT p50|first token id sent|CPU ms" "$OUT/arrival_native${n}_$r.txt"
    done
done
for r in $(seq 1 "${SR:-2}"); do
    for n in 0 1; do
        [ "$(left)" -gt 45 ] || break 2
        echo "=== serve 64, native imports $n, round $r ($(left) s left)"
        FLOE_NATIVE_IMPORTS=$n timeout $(( $(left) - 5 )) python3 bench/sessions.py --device cuda \
            --shape llama-3.2-1b --tokenizer .tok --sessions 64 --ways serve --name native${n}_$r | tail -3
        cp "bench/results/sessions_cuda_native${n}_$r.json" "$OUT"/ 2>/dev/null
    done
done
echo "done in $(( $(date +%s) - start )) s"
