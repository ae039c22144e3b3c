# The set-up every device script of bench/probes sources first (`LOG=name.log . "$(dirname "$0")/lend.sh"`):
# its output also to $OUT/$LOG, the repository's root as the working folder, left() the seconds of BUDGET_S
# (default 540) that remain, the carried wheels (.whl) installed to /tmp/site and floe's sources (SRC, default
# src) on the path.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/${LOG:?a device script names its log}") 2>&1
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
start=$(date +%s)
left() { echo $((${BUDGET_S:-540} - ($(date +%s) - start))); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 PYTHONPATH=/tmp/site:$PWD/${SRC:-src}
