#!/usr/bin/env bash
# A 64- and 128-session burst through `floe serve` (and actors with WAYS="actors serve") by variant of
# bench/sessions.py's arguments, taking turns (ROUNDS rounds): VARIANTS, separated by ';', e.g. how many
# prompt rows a CUDA decode step takes along (--ride-rows: floe.actor.loop.RIDE_ROWS, the graphs'
# MIXED_ROWS) and how many HTTP fronts (--fronts). ARRIVALS=1: then where a 64-burst's first token goes
# at each --ride-rows given in RIDES (bench/probes/arrival_timeline.py).
#   run(command="VARIANTS='--ride-rows 256;--ride-rows 1024;--fronts 4' bash bench/probes/serve_variants_h200.sh",
#       carry=[".whl", ".tok"])
set -x
SRC=${NEW_SRC:-src} LOG=serve_variants_h200.log . "$(dirname "$0")/lend.sh"
IFS=';' read -r -a variants <<< "${VARIANTS:---ride-rows 256;--ride-rows 1024}"
for r in $(seq 1 "${ROUNDS:-1}"); do
    for k in "${!variants[@]}"; do
        [ "$(left)" -gt 100 ] || break 2
        # shellcheck disable=SC2086  # (a variant is several arguments)
        timeout "$(left)" python3 bench/sessions.py --device cuda --shape llama-3.2-1b --tokenizer .tok \
            --sessions ${SIZES:-64 128} --ways ${WAYS:-serve} ${variants[$k]} --name "variant${k}_$r" | tail -4
        cp bench/results/sessions_cuda_variant${k}_$r.json "$OUT"/ 2>/dev/null
    done
done
if [ -n "${ARRIVALS:-}" ]; then
    for v in ${RIDES:-256 1024}; do
        [ "$(left)" -gt 90 ] || break
        timeout "$(left)" python3 bench/probes/arrival_timeline.py --device cuda --shape llama-3.2-1b \
            --tokenizer .tok --sessions 64 --rounds 1 --max-tokens 128 --ride-rows "$v" > "$OUT/arrival_ride$v.txt" 2>&1
        tail -12 "$OUT/arrival_ride$v.txt"
    done
fi
echo "done in $(( $(date +%s) - start )) s"
