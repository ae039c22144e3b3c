#!/usr/bin/env bash
# session 13 call 3: request CPU alone vs 64 at once (core only); serve 64 A/B HEAD vs 1184399; arrival profile
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/dev29.log") 2>&1
start=$(date +%s); left() { echo $((${BUDGET_S:-540} - ($(date +%s) - start))); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
NEW=/tmp/site:$PWD/src BASE=/tmp/site:$PWD/.dev/base/src
lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core"
for a in 1 64 1 64; do
    PYTHONPATH=$NEW timeout 90 python3 bench/probes/request_cpu.py --tokenizer .tok --requests 128 --batches 3 --at-once $a 2>&1 | tail -1
done
for r in 1 2; do
    for v in new base; do
        [ "$(left)" -gt 150 ] || break 2
        src=$NEW; [ $v = base ] && src=$BASE
        echo "== serve 64 $v $r $(left)"
        PYTHONPATH=$src timeout 120 python3 bench/sessions.py --device cuda --shape llama-3.2-1b --tokenizer .tok \
            --sessions 64 --ways serve --name ab_${v}_$r 2>&1 | tail -2
        cp bench/results/sessions_cuda_ab_${v}_$r.json "$OUT"/ 2>/dev/null
    done
done
if [ "$(left)" -gt 100 ]; then
    echo "== arrival anonymous profile $(left)"
    PYTHONPATH=$NEW timeout $(( $(left) - 10 )) python3 bench/probes/arrival_timeline.py --device cuda --shape llama-3.2-1b \
        --tokenizer .tok --sessions 64 --rounds 2 --max-tokens 32 --fronts 4 --anonymous --profile 45 --cpu-profile \
        > "$OUT/arrival_profile.txt" 2>&1
    grep -v "^ *[0-9.]* *[0-9.]* |" "$OUT/arrival_profile.txt" | tail -75
fi
echo "done in $(( $(date +%s) - start )) s"
