#!/usr/bin/env bash
# A 64-burst's TTFT (bench/probes/burst_ttft.py, a light client) against this checkout's `floe serve` and an
# earlier one's, on the H200 in one device call; then (unless SKIP_SERVE) the standard serve benchmark
# (`bench/sessions.py --ways serve`, 16 and 64 sessions) for both. ROUNDS bursts (4), PAUSE seconds
# between them (0: back to back; 2: the server idle between bursts, as it would be between users').
# The earlier source's src/ in .base/src, this one's in .new/src (ignored; carried). Results in $OUT.
#   run(command="PAUSE=2 SKIP_SERVE=1 bash bench/probes/burst_ab_h200.sh", carry=[".whl", ".tok", ".base", ".new"])
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
for v in new base; do
  PYTHONPATH=/tmp/site:$PWD/.$v/src python3 bench/serve_load.py --device cuda --shape llama-3.2-1b --tokenizer .tok --sessions 64 --serve-on 8123 > $OUT/serve_$v.log 2>&1 &
  pid=$!
  for i in $(seq 1 150); do python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8123/health', timeout=2)" 2>/dev/null && break; sleep 1; done
  echo "$v up after $i s"
  timeout 120 python3 bench/probes/burst_ttft.py --port 8123 --sessions 64 --max-tokens 128 --rounds ${ROUNDS:-4} --pause ${PAUSE:-0} > $OUT/burst_$v.txt 2>&1
  cat $OUT/burst_$v.txt
  kill $pid; wait $pid 2>/dev/null; sleep 2
done
[ -n "$SKIP_SERVE" ] || for v in new base; do PYTHONPATH=/tmp/site:$PWD/.$v/src timeout 120 python3 bench/sessions.py --device cuda --shape llama-3.2-1b --tokenizer .tok --name serve_$v --sessions 16 64 --ways serve 2>&1 | grep -E "^ +(16|64) +serve"; cp bench/results/sessions_cuda_serve_$v.json $OUT/; done
