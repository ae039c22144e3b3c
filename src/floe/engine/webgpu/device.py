"""The WebGPU device floe's WGSL kernels run on (wgpu-native through wgpu-py): one adapter, one
device and queue per process, buffers, and shader pipelines compiled with the model's shape as
constants. Set-up only: nothing here runs per token."""

from __future__ import annotations

import functools
import os
import re
import tempfile
from importlib import resources

import numpy as np

from floe.errors import FloeError


class WebGPUUnavailable(FloeError):
    """No WebGPU adapter: wgpu is not installed, or no Vulkan, Metal or D3D12 driver answers."""


# How a projection's weights are stored, as the shaders read them: bytes per weight, and WGSL that
# names the stored element (W4: four weights) and turns it into four f32s. f16 pairs are packed in
# u32s and opened with unpack2x16float, core WGSL: no shader-f16 feature needed, every adapter runs it.
WEIGHT_FORMATS = {
    "f32": (4, "alias W4 = vec4<f32>;\nfn w4(v: W4) -> vec4<f32> { return v; }"),
    "f16": (2, "alias W4 = vec2<u32>;\nfn w4(v: W4) -> vec4<f32> {\n"
               "    return vec4<f32>(unpack2x16float(v.x), unpack2x16float(v.y));\n}"),
}
# The lanes GEMV's load (gemv_lanes.wgsl): WL, WE weights of a row read at once, wl(v, h) their four at
# 4h. A W4 (WIDE 0), or with f16 weights eight in one 16-byte load (WIDE 1: a W4 of f16 is 8 bytes,
# half what a GPU's lane loads at once; f32's W4 is 16 already).
LANE_LOADS = {
    0: "alias WL = W4;\nconst WE: u32 = 4u;\nfn wl(v: WL, h: u32) -> vec4<f32> { return w4(v); }",
    1: "alias WL = vec4<u32>;\nconst WE: u32 = 8u;\nfn wl(v: WL, h: u32) -> vec4<f32> {\n"
       "    if (h == 0u) {\n        return vec4<f32>(unpack2x16float(v.x), unpack2x16float(v.y));\n    }\n"
       "    return vec4<f32>(unpack2x16float(v.z), unpack2x16float(v.w));\n}",
}
# GEMV layouts: "threads", a thread per output row streaming its row (a CPU adapter such as lavapipe,
# where lanes run one after another); "lanes", a workgroup's lanes splitting each row's inputs
# (coalesced loads, a reduction in workgroup memory: a GPU). FLOE_WEBGPU_GEMV=threads|lanes overrides.
GEMV_LAYOUTS = ("threads", "lanes")


def _wgpu():
    try:
        import wgpu
    except ImportError as e:
        raise WebGPUUnavailable("device 'webgpu' needs wgpu: pip install 'floe[webgpu]'") from e
    return wgpu


@functools.cache
def adapter():
    """The process's WebGPU adapter (high-performance preference); raises WebGPUUnavailable."""
    wgpu = _wgpu()
    # Mesa's Wayland WSI prints "XDG_RUNTIME_DIR is invalid" twice when the instance is made without
    # one; floe draws nothing, so it gets one for that moment only.
    unset = "XDG_RUNTIME_DIR" not in os.environ
    if unset:
        os.environ["XDG_RUNTIME_DIR"] = tempfile.gettempdir()
    try:
        found, cause = wgpu.gpu.request_adapter_sync(power_preference="high-performance"), None
    except Exception as e:  # noqa: BLE001 - wgpu-native raises its own types for "no adapter"
        found, cause = None, e
    finally:
        if unset:
            del os.environ["XDG_RUNTIME_DIR"]
    if found is None:
        raise WebGPUUnavailable("device 'webgpu': no WebGPU adapter on this machine (Linux: install a "
                                "Vulkan driver, e.g. apt-get install mesa-vulkan-drivers for lavapipe)"
                                + (f": {cause}" if cause else ""))
    return found


def adapter_description() -> str:
    """One line naming the adapter: device, driver, backend (e.g. 'llvmpipe … (Vulkan, CPU)')."""
    info = adapter().info
    return f"{info['device']}, {info['description']} ({info['backend_type']}, {info['adapter_type']})"


class Gpu:
    """A WebGPU device and its queue, with the features floe uses where the adapter has them."""

    def __init__(self) -> None:
        self.wgpu = _wgpu()
        a = adapter()
        # Logits written by the head's shader straight into a buffer the host maps (no staging copy).
        self.mappable_storage = "mappable-primary-buffers" in a.features
        self.timestamps = "timestamp-query" in a.features
        features = [f for f in ("mappable-primary-buffers", "timestamp-query") if f in a.features]
        limits = {name: a.limits[name] for name in ("max-storage-buffer-binding-size", "max-buffer-size",
                                                     "max-compute-workgroup-storage-size",
                                                     "max-storage-buffers-per-shader-stage")}
        self.device = a.request_device_sync(label="floe", required_features=features, required_limits=limits)
        self.queue = self.device.queue
        self.max_binding = self.device.limits["max-storage-buffer-binding-size"]
        self.max_buffer = self.device.limits["max-buffer-size"]
        self.max_storage_buffers = self.device.limits["max-storage-buffers-per-shader-stage"]
        # (a GEMV band of more workgroups is dispatched in pieces: Gemma 3's 262,144-row head is 65,536
        # workgroups of four rows)
        self.max_workgroups = self.device.limits["max-compute-workgroups-per-dimension"]
        self.description = adapter_description()
        self.gemv_layout = gemv_layout(a.info["adapter_type"])

    def buffer(self, nbytes: int, usage: int = 0, data: np.ndarray | None = None, label: str = ""):
        """A storage buffer of nbytes (rounded up to 16), zeroed or holding `data` (copied once)."""
        u = self.wgpu.BufferUsage
        size = max(16, -(-nbytes // 16) * 16)
        buf = self.device.create_buffer(size=size, usage=u.STORAGE | u.COPY_DST | u.COPY_SRC | usage,
                                        label=label)
        if data is not None:
            self.queue.write_buffer(buf, 0, np.ascontiguousarray(data))
        return buf

    def uniform(self, values: list[int | float], label: str = ""):
        """A small uniform buffer of 32-bit words: ints as u32, floats as f32 (16-byte rounded)."""
        words = np.zeros(max(4, -(-len(values) // 4) * 4), dtype=np.uint32)
        for i, v in enumerate(values):
            words[i] = np.float32(v).view(np.uint32) if isinstance(v, float) else np.uint32(v)
        u = self.wgpu.BufferUsage
        buf = self.device.create_buffer(size=words.nbytes, usage=u.UNIFORM | u.COPY_DST, label=label)
        self.queue.write_buffer(buf, 0, words)
        return buf

    def readback(self, nbytes: int, label: str = "readback"):
        """A buffer the host maps to read results: the kernels' own output where the adapter lets
        storage buffers be mapped, else a staging buffer a copy fills (MAP_READ | COPY_DST)."""
        u = self.wgpu.BufferUsage
        size = max(16, -(-nbytes // 16) * 16)
        if self.mappable_storage:
            usage = u.STORAGE | u.MAP_READ | u.COPY_SRC
            return self.device.create_buffer(size=size, usage=usage, label=label)
        return self.device.create_buffer(size=size, usage=u.MAP_READ | u.COPY_DST, label=label)

    def pipeline(self, shader: str, constants: dict[str, int | float], weights: str = "f32",
                 entry: str = "main"):
        """The compute pipeline of shaders/`shader`.wgsl with `constants` prepended as WGSL consts and
        W4/w4 for `weights` (WEIGHT_FORMATS), on the shader's own bind group layout (LAYOUTS), shared by
        all its variants."""
        return _pipeline(self, shader, tuple(sorted(constants.items())), weights, entry)

    def layout(self, shader: str):
        """The bind group layout of `shader` (LAYOUTS): explicit, so a binding a variant leaves unused
        is still bound, and one bind group serves every variant (and every shader of the same layout)."""
        return _layout(self, LAYOUTS[shader])

    def bind(self, shader: str, buffers: list) -> object:
        """A bind group of `buffers` (whole) at bindings 0.. of `shader`'s layout; None, or missing at
        the end: a dummy."""
        entries = []
        kinds = LAYOUTS[shader]
        buffers = list(buffers) + [None] * (len(kinds) - len(buffers))
        for i, b in enumerate(buffers):
            # a read-write dummy of its own per binding: one buffer both read and written in a
            # dispatch is a usage conflict
            b = b if b is not None else (self.dummy if kinds[i] == "r" else self.dummy_written(i))
            entries.append({"binding": i, "resource": {"buffer": b, "offset": 0, "size": b.size}})
        return self.device.create_bind_group(layout=self.layout(shader), entries=entries)

    @functools.cache  # noqa: B019 - one per binding index for the process's one Gpu
    def dummy_written(self, binding: int):
        """A 16-byte buffer for a written binding a variant does not touch."""
        return self.buffer(16, label=f"unused w{binding}")

    @functools.cached_property
    def dummy(self):
        """A 16-byte buffer for bindings a variant does not read."""
        return self.buffer(16, label="unused")


# Each shader's bindings in order: r read-only storage, w read-write storage, u uniform.
# gemv and gemv_lanes share one layout (as gemm does): bindings 7, 8 are the deferred residual's
# (MODE 3: its fixed-point sum read, the whole residual written). rmsnorm's input is written where it
# normalises in place (the q/k norm).
LAYOUTS = {"gemv": "rurrwrrrw", "gemv_lanes": "rurrwrrrw", "gemm": "rurrwrrrw", "attention": "rrwwrrw",
           "rope_kv": "rrwwrrw", "attend_out": "rrwwrrrww", "mlp": "rrrrrrww", "rmsnorm": "rwrw",
           "swiglu": "rrw", "embed": "rurww", "tick": "w", "attention_split": "rrwwrrw",
           "attention_merge": "rrw"}


def gemv_layout(adapter_type: str) -> str:
    """The GEMV layout for an adapter of `adapter_type` (wgpu's: 'CPU', 'DiscreteGPU', …)."""
    forced = os.environ.get("FLOE_WEBGPU_GEMV", "")
    if forced:
        if forced not in GEMV_LAYOUTS:
            raise FloeError(f"FLOE_WEBGPU_GEMV={forced!r}: choose one of {', '.join(GEMV_LAYOUTS)}")
        return forced
    return "threads" if str(adapter_type).upper() == "CPU" else "lanes"


@functools.cache
def _layout(gpu: Gpu, bindings: str):
    w = gpu.wgpu
    kinds = {"r": w.BufferBindingType.read_only_storage, "w": w.BufferBindingType.storage,
             "u": w.BufferBindingType.uniform}
    entries = [{"binding": i, "visibility": w.ShaderStage.COMPUTE, "buffer": {"type": kinds[k]}}
               for i, k in enumerate(bindings)]
    return gpu.device.create_bind_group_layout(entries=entries, label=bindings)


def _included(shader: str) -> str:
    """shaders/`shader`.wgsl with each `// #include NAME` line replaced by shaders/NAME.wgsl (WGSL has no
    includes: the attention shaders' helpers live once, in attention_common.wgsl)."""
    text = resources.files("floe.engine.webgpu").joinpath("shaders", f"{shader}.wgsl").read_text()
    return re.sub(r"^// #include (\w+)$", lambda m: _included(m.group(1)), text, flags=re.M)


def shader_source(shader: str, constants: tuple[tuple[str, int | float], ...], weights: str = "f32") -> str:
    """WGSL of shaders/`shader`.wgsl after `const NAME: T = value;` lines (u32 for ints, f32 for
    floats), the weight format's W4/w4 (WEIGHT_FORMATS) and the lanes GEMV's load (LANE_LOADS[WIDE])."""
    text = _included(shader)
    lines = [f"const {name}: u32 = {value}u;" if isinstance(value, int) else
             f"const {name}: f32 = {float(value)!r};" for name, value in constants]
    lanes = LANE_LOADS[dict(constants).get("WIDE", 0)] if shader == "gemv_lanes" else ""
    return "\n".join(lines) + "\n" + WEIGHT_FORMATS[weights][1] + "\n" + lanes + "\n" + text


@functools.cache
def _pipeline(gpu: Gpu, shader: str, constants: tuple, weights: str, entry: str):
    module = gpu.device.create_shader_module(code=shader_source(shader, constants, weights), label=shader)
    layout = gpu.device.create_pipeline_layout(bind_group_layouts=[gpu.layout(shader)])
    return gpu.device.create_compute_pipeline(layout=layout, compute={"module": module, "entry_point": entry},
                                              label=shader)


@functools.cache
def gpu() -> Gpu:
    """The process's one device (wgpu-native serialises a device's queue: one is enough)."""
    return Gpu()
