# CPU decode on the device's idle Xeon, two cores: floe trees (old, new, pf) beside llama.cpp, interleaved.
set -x
D=${D:-$(cd "$(dirname "$0")" && pwd)}
cat /tmp/m.part1 "$D/part2" > /tmp/model.gguf && ls -la /tmp/model.gguf
mkdir -p /tmp/site && tar xJf "$D/llama_cpp.tar.xz" -C /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site "$D"/gguf-*.whl
cp "$D/libgomp.so.1" /tmp/site/
export LD_LIBRARY_PATH=/tmp/site:$LD_LIBRARY_PATH
TREES=${TREES:-old new pf}
for t in $TREES; do mkdir -p /tmp/$t && tar xf "$D/$t.tar" -C /tmp/$t; done
for t in $TREES; do (cd /tmp/$t && PYTHONPATH=/tmp/$t/src:/tmp/site python3 -c "from floe.engine import qgemv; [qgemv.load(v) for v in ('vnni', 'avx2')]") 2>&1 | tail -2; done
grep -m1 "model name" /proc/cpuinfo; grep -m1 flags /proc/cpuinfo > $OUT/flags.txt; cat /proc/loadavg; nproc
PYTHONPATH=/tmp/site python3 -c "import llama_cpp; print(llama_cpp.llama_print_system_info())"
for round in $(seq 1 ${ROUNDS:-2}); do for t in $TREES; do
  (cd /tmp/$t && PYTHONPATH=/tmp/$t/src:/tmp/site taskset -c 0,1 python3 bench/cpu_decode.py --model /tmp/model.gguf \
    --repeats ${REPEATS:-5} --kernels ${KERNELS:-vnni,avx2} --no-dense --out $OUT/dec_${t}_$round.json) 2>&1 | grep -E "floe native|llama.cpp \(|copy bandwidth|Error|error" ; cat /proc/loadavg
done; done
# A Llama-3.2-1B-shape Q4_0 file (tests/test_memory_bounds.py's writer, SmolLM2's tokenizer), one process.
if [ -n "$ONE_B" ]; then
  (cd /tmp/$ONE_B && PYTHONPATH=/tmp/$ONE_B/src:/tmp/$ONE_B/tests:/tmp/site python3 -c "
from pathlib import Path
import models
models.default_model_path = lambda: Path('/tmp/model.gguf')
from test_memory_bounds import write_q4_0_gguf, SHAPE_1B
write_q4_0_gguf(Path('/tmp/llama-1b-q4_0.gguf'), **{**SHAPE_1B, 'vocab': 49152})" && ls -la /tmp/llama-1b-q4_0.gguf
  cd /tmp/$ONE_B && PYTHONPATH=/tmp/$ONE_B/src:/tmp/site timeout ${ONE_B_S:-260} taskset -c 0,1 python3 bench/cpu_decode.py \
    --model /tmp/llama-1b-q4_0.gguf --repeats 3 --prompt-tokens 128 --decode-tokens 64 --kernels vnni --no-dense \
    --out $OUT/dec_1b_${ONE_B}.json) 2>&1 | grep -E "floe native|llama.cpp \(|copy bandwidth|Error|error"
fi
