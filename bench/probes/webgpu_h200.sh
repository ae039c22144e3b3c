#!/usr/bin/env bash
# Issue 21 on the H200 through NVIDIA's Vulkan driver, in one device call of at most 8 minutes:
#   1. the Vulkan loader (.gl/*.deb) and the carried wheels (.whl/*.whl, wgpu among them);
#   2. the adapter: NVIDIA's Vulkan ICD where the loader finds none by itself;
#   3. `floe bench dispatch --device webgpu --json` (the dispatch-cost table);
#   4. planned dispatches per decode token at each known shape on this adapter's limits;
#   5. decode tok/s at the Llama-3.2-1B shape (seeded random weights), CUDA's step and WebGPU's
#      variants in one process (bench/probes/webgpu_decode.py).
# Each part has its own time limit and a failing part does not stop the next. Everything lands in
# $OUT: webgpu_h200.log, adapter.txt, dispatch_webgpu_h200.json, dispatches_webgpu_h200.json,
# decode_webgpu_h200.json.
#
# .gl/ holds the Debian packages libvulkan1 libglvnd0 libegl1 libgl1 libglx0 libopengl0 libgles2
# (NVIDIA's Vulkan ICD library needs GLVND: libvulkan1 alone finds no adapter); see the device README.
# From the session (carry the ignored folders: wheels, loader, tokenizer):
#   run(command="bash bench/probes/webgpu_h200.sh", carry=[".whl", ".gl", ".tok"], timeout_s=540)
set -x
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/webgpu_h200.log") 2>&1
cd "$(dirname "$0")/../.."
start=$(date +%s)

for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
ldconfig -p | grep -i libvulkan
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv

adapter() {  # prints the adapter wgpu picks; fails unless it is a Vulkan one
    timeout 60 python3 - <<'EOF'
import wgpu
for a in wgpu.gpu.enumerate_adapters_sync():
    print("seen:", a.info["device"], a.info["backend_type"], a.info["adapter_type"])
from floe.engine.webgpu import adapter_description
from floe.engine.webgpu.device import gpu
g = gpu()
print("adapter:", adapter_description(), "| layout", g.gemv_layout, "| max binding", g.max_binding,
      "| max buffer", g.max_buffer, "| storage buffers", g.max_storage_buffers,
      "| workgroup memory", g.device.limits["max-compute-workgroup-storage-size"],
      "| mappable storage", g.mappable_storage, "| timestamps", g.timestamps)
assert "Vulkan" in adapter_description(), "not a Vulkan adapter"
EOF
}
if ! adapter > "$OUT/adapter.txt" 2>&1; then
    cat "$OUT/adapter.txt"
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json \
        __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
    ls -l "$VK_DRIVER_FILES" || find / -name 'nvidia_icd*.json' -not -path '/proc/*' 2>/dev/null | head
    adapter > "$OUT/adapter.txt" 2>&1
fi
cat "$OUT/adapter.txt"

# 3. dispatch cost, the study's way (with floe's framework cost and the counts at two shapes)
timeout 150 python3 -m floe.cli bench dispatch --device webgpu --json > "$OUT/dispatch_webgpu_h200.json"
echo "dispatch: exit $?"; head -c 3000 "$OUT/dispatch_webgpu_h200.json"; echo

# 4. planned dispatches per decode token on this adapter's limits, f32 and f16, fused and not
timeout 60 python3 - > "$OUT/dispatches_webgpu_h200.json" <<'EOF'
import json
from floe.engine.webgpu.decoder import deep_fused, planned_dispatches
from floe.engine.webgpu.device import gpu
from floe.model.config import KNOWN_SHAPES
g = gpu()
limits = {"layout": g.gemv_layout, "storage_buffers": g.max_storage_buffers,
          "workgroup_bytes": g.device.limits["max-compute-workgroup-storage-size"]}
rows = {}
for name, c in KNOWN_SHAPES.items():
    rows[name] = {f"{w} {'fused' if f else 'unfused'}": planned_dispatches(c, g.max_binding, f, w, **limits)
                  for w in ("f32", "f16") for f in (True, False)}
    rows[name]["deep (three a layer), f16"] = deep_fused(c, g.max_binding, "f16", **limits)
print(json.dumps({"adapter": g.description, "max_binding": g.max_binding, **limits, "shapes": rows}, indent=1))
EOF
echo "dispatches: exit $?"; cat "$OUT/dispatches_webgpu_h200.json"

# 5. decode at the 1B shape: CUDA then WebGPU's variants (its JSON is rewritten after each row)
left=$(( 470 - ($(date +%s) - start) ))
timeout $(( left > 60 ? left : 60 )) python3 bench/probes/webgpu_decode.py --shape llama-3.2-1b --tokenizer .tok \
    --steps 40 --out "$OUT/decode_webgpu_h200.json"
echo "decode: exit $?"
cat "$OUT/decode_webgpu_h200.json"
echo "total $(( $(date +%s) - start )) s"
