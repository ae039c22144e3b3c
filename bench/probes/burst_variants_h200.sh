#!/usr/bin/env bash
# Where a 64-session burst's TTFT goes through `floe serve` on the H200 (1B shape): one fresh server per
# variant (as bench/sessions.py's serve way starts one per size), loaded by bench/serve_load.py --url
# with 64 sessions of 128 tokens: named vs anonymous requests, 64-token vs short prompts, 8 client
# processes vs one. Results under $OUT (one JSON a variant) and the log's summary lines.
#   run(command="bash bench/probes/burst_variants_h200.sh", carry=[".whl", ".tok", ".new"])
set -x
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/burst_variants.log") 2>&1
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/${NEW_SRC:-src}
port=18300
variant() {  # variant NAME serve_load ARGS...
    local name=$1; shift
    port=$((port + 1))
    timeout 120 python3 bench/serve_load.py --serve-on $port --device cuda --shape llama-3.2-1b --tokenizer .tok \
        --sessions 64 > "$OUT/server_$name.log" 2>&1 &
    local server=$!
    for _ in $(seq 1 90); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
    timeout 90 python3 bench/serve_load.py --url "http://127.0.0.1:$port" --device cuda --sessions 64 --turns 1 \
        --max-tokens 128 --out "$OUT/$name.json" "$@" 2>&1 | grep -E "TTFT|errors"
    kill $server; wait $server 2>/dev/null
}
variant named_p64_c8 --prompt-tokens 64 --client-processes 8
variant anon_p64_c8 --prompt-tokens 64 --client-processes 8 --anonymous
variant named_p0_c8 --client-processes 8
variant named_p64_c1 --prompt-tokens 64 --client-processes 1
variant named_p64_c8_again --prompt-tokens 64 --client-processes 8
