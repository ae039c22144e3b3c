#!/usr/bin/env bash
# One lend's checks and the fronts' A/B (issues 40, 19): PART=tests runs tests/test_cuda.py and the thaw table
# (bench/store.py: pinned and disk tiers, 128 / 1,024 / 4,096 tokens); PART=fronts runs bench/sessions.py at
# the 1B shape, 16 and 64 sessions, engine and serve, with `--fronts 1` and `--fronts ${FRONTS:-4}` taking
# turns (ROUNDS pairs, default 2) until BUDGET_S; PART=gate runs a 64-burst through 4 fronts
# (bench/probes/arrival_timeline.py, 2 rounds) with at most GATE (1) chats admitting at once against no gate,
# taking turns (ROUNDS pairs).
#   run(command="PART=tests bash bench/probes/fronts_gpu.sh", carry=[".whl", ".tok"])
#   run(command="PART=fronts bash bench/probes/fronts_gpu.sh", carry=[".whl", ".tok"])
#   run(command="PART=gate bash bench/probes/fronts_gpu.sh", carry=[".whl", ".tok"])
BUDGET_S=${BUDGET_S:-560}
LOG=fronts_gpu_${PART:-fronts}.log . "$(dirname "$0")/lend.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
lscpu | grep -E "Model name|^CPU\(s\)"
tag=${TAG:-$(date +%Y-%m-%d)}
if [ "${PART:-fronts}" = tests ]; then
    echo "=== tests/test_cuda.py ($(left) s left)"
    FLOE_TEST_TOKENIZER=$PWD/.tok timeout $(( $(left) - 200 )) python3 -m pytest -q -p no:cacheprovider \
        tests/test_cuda.py 2>&1 | tail -15
    echo "=== the thaw table ($(left) s left)"
    timeout $(( $(left) - 10 )) python3 bench/store.py --device cuda --shape llama-3.2-1b --tokenizer .tok \
        --tiers pinned disk --lengths 128 1024 4096 --out "$OUT/store_cuda_$tag.json" 2>&1 | tail -20
elif [ "$PART" = gate ]; then
    for round in $(seq 1 "${ROUNDS:-2}"); do
        for gate in 0 "${GATE:-1}"; do
            [ "$(left)" -gt 100 ] || break 2
            echo "=== round $round, gate $gate ($(left) s left)"
            timeout $(( $(left) - 10 )) python3 bench/probes/arrival_timeline.py --device cuda \
                --shape llama-3.2-1b --tokenizer .tok --sessions 64 --rounds 2 --max-tokens 32 --fronts 4 \
                --gate "$gate" > "$OUT/arrival_gate${gate}_r$round.txt" 2>&1
            grep -E "received|front gets|client's first token|chat threads' CPU" \
                "$OUT/arrival_gate${gate}_r$round.txt" | tail -8
        done
    done
else
    for round in $(seq 1 "${ROUNDS:-2}"); do
        for fronts in 1 "${FRONTS:-4}"; do
            [ "$(left)" -gt 120 ] || break 2
            echo "=== round $round, $fronts front(s): sessions 16 64 ($(left) s left)"
            timeout $(( $(left) - 10 )) python3 bench/sessions.py --device cuda --shape llama-3.2-1b \
                --tokenizer .tok --sessions 16 64 --ways engine serve --fronts "$fronts" \
                --name "fronts${fronts}_r${round}_$tag" | tail -6
            cp "bench/results/sessions_cuda_fronts${fronts}_r${round}_$tag.json" "$OUT"/ 2>/dev/null
        done
    done
fi
echo "done in $(( $(date +%s) - start )) s"
