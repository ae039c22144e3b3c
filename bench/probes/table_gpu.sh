#!/usr/bin/env bash
# Issue 40's table on a lent GPU in one call: bench/sessions.py at the 1B shape (1, 16, 64, 128 sessions; the
# engine alone, actors, floe serve), then the engine loop's host time a row-token at the 1B shape
# (bench/probes/loop_host_cost.py), then (PART=8b) the 8B shape at 16 and 64; stops past BUDGET_S seconds.
#   run(command="bash bench/probes/table_gpu.sh", carry=[".whl", ".tok"])          # 1B and the loop
#   run(command="PART=8b bash bench/probes/table_gpu.sh", carry=[".whl", ".tok"])  # 8B
BUDGET_S=${BUDGET_S:-560}
LOG=table_gpu.log . "$(dirname "$0")/lend.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
lscpu | grep -E "Model name|^CPU\(s\)"
git log --oneline -1 2>/dev/null
tag=${TAG:-$(date +%Y-%m-%d)}
if [ "${PART:-1b}" = 1b ]; then
    echo "=== 1B: sessions 1 16 64 128 ($(left) s left)"
    timeout $(( $(left) - 80 )) python3 bench/sessions.py --device cuda --shape llama-3.2-1b --tokenizer .tok \
        --sessions 1 16 64 128 --ways engine actors serve --name "1b_$tag" | tail -16
    cp "bench/results/sessions_cuda_1b_$tag.json" "$OUT"/ 2>/dev/null
    for streams in "" --ids; do  # (the replies' text made at their ends; streamed as ids, as floe serve's)
        echo "=== the loop's host time a row-token, 1B ${streams:-text at the end} ($(left) s left)"
        log="$OUT/loop_host_cost${streams:-_text}.txt"
        [ "$(left)" -gt 40 ] && timeout $(( $(left) - 10 )) python3 bench/probes/loop_host_cost.py \
            --device cuda --shape llama-3.2-1b --tokens 128 --tokenizer .tok $streams > "$log" 2>&1
        grep -E "asking|actors:|host time|calls a row" "$log"
    done
else
    echo "=== 8B: sessions 16 64 ($(left) s left)"
    timeout $(( $(left) - 10 )) python3 bench/sessions.py --device cuda --shape llama-3-8b --tokenizer .tok \
        --sessions 16 64 --ways engine actors serve --name "8b_$tag" | tail -10
    cp "bench/results/sessions_cuda_8b_$tag.json" "$OUT"/ 2>/dev/null
fi
echo "done in $(( $(date +%s) - start )) s"
