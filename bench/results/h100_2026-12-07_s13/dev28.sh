#!/usr/bin/env bash
# session 13 diagnosis call: mixed steps (kernel trace), lease create, 64-burst arrivals with 4 fronts, serve 64/128
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/dev28.log") 2>&1
start=$(date +%s); left() { echo $((${BUDGET_S:-540} - ($(date +%s) - start))); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src RAY_USAGE_STATS_ENABLED=0
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv; nproc; python3 -c "import torch; print(torch.__version__)"
if [ -z "$SKIP_MIXED" ]; then
echo "== mixed_step $(left)"
timeout 200 python3 bench/probes/mixed_step.py --device cuda --shape llama-3.2-1b --tokenizer .tok --decoding 64 \
    --prompt-tokens 70 --riding 1 3 6 --repeats 20 --trace 30 > "$OUT/mixed_step.txt" 2>&1; tail -60 "$OUT/mixed_step.txt"
echo "== mixed_step decoding 0 $(left)"
timeout 100 python3 bench/probes/mixed_step.py --device cuda --shape llama-3.2-1b --tokenizer .tok --decoding 1 \
    --prompt-tokens 70 --riding 1 6 --repeats 10 > "$OUT/mixed_step_d1.txt" 2>&1; tail -8 "$OUT/mixed_step_d1.txt"
echo "== lease_create $(left)"
timeout 40 python3 bench/probes/lease_create.py --folder /tmp/leases 2>&1 | tail -5
timeout 40 python3 bench/probes/lease_create.py --folder /dev/shm/leases 2>&1 | tail -5
fi
for v in "" "--anonymous"; do
    [ "$(left)" -gt 150 ] || break
    echo "== arrival fronts 4 $v $(left)"
    timeout 150 python3 bench/probes/arrival_timeline.py --device cuda --shape llama-3.2-1b --tokenizer .tok \
        --sessions 64 --rounds 2 --max-tokens 32 --fronts 4 --steps $v > "$OUT/arrival_f4${v}.txt" 2>&1
    tail -40 "$OUT/arrival_f4${v}.txt"
done
if [ "$(left)" -gt 130 ]; then
    echo "== serve 64 128 $(left)"
    timeout $(( $(left) - 10 )) python3 bench/sessions.py --device cuda --shape llama-3.2-1b --tokenizer .tok \
        --sessions 64 128 --ways engine serve --name s13 | tail -8
    cp bench/results/sessions_cuda_s13.json "$OUT"/ 2>/dev/null
fi
echo "done in $(( $(date +%s) - start )) s"
