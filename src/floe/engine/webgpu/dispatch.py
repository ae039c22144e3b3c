"""`floe bench dispatch --device webgpu`: what one compute dispatch costs, measured as the WebGPU
dispatch-overhead study measures it (arXiv 2604.02344), on a tiny kernel (tick.wgsl):

(a) record one dispatch, submit, wait for it — n times (the sync dominates);
(b) n dispatches in one encoder and compute pass, one submit, one wait;
(c) a reused command buffer: WebGPU command buffers are single-use (a second submit is a validation
    error; wgpu-native aborts the process), so it is probed in a child process and reported;
A wait is what a decode step's is: 4 bytes of the kernel's output copied into a mapped buffer in the
same submit, and the map awaited (wgpu-py 0.32's on_submitted_work_done_sync is broken). Apart: the
API cost on the host (the three wgpu calls per dispatch, objects made beforehand), the
device's own time per dispatch (timestamp queries around (b)'s pass, where the adapter has them), and
floe's framework cost (its decode step's recording of its planned dispatches, per dispatch)."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import numpy as np

from floe.engine.webgpu.device import gpu

REUSE_PROBE = """
from floe.engine.webgpu.device import gpu
g = gpu()
p = g.pipeline("tick", {"SIZE": 1})
buf = g.buffer(16)
group = g.bind("tick", [buf])
e = g.device.create_command_encoder(); c = e.begin_compute_pass()
c.set_pipeline(p); c.set_bind_group(0, group); c.dispatch_workgroups(1); c.end()
cb = e.finish()
g.queue.submit([cb]); g.queue.submit([cb])
print("resubmitted")
"""


def _median(fn, repeats: int = 5, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _row(size: int, n: int) -> dict:
    g = gpu()
    pipeline = g.pipeline("tick", {"SIZE": size})
    x = g.buffer(4 * size, label="tick")
    group = g.bind("tick", [x])
    groups = -(-size // 64)
    runs = 0
    u = g.wgpu.BufferUsage
    mapped = g.device.create_buffer(size=16, usage=u.MAP_READ | u.COPY_DST, label="sync")

    def submit_and_wait(encoder) -> None:
        encoder.copy_buffer_to_buffer(x, 0, mapped, 0, 4)
        g.queue.submit([encoder.finish()])
        mapped.map_sync(g.wgpu.MapMode.READ)
        mapped.unmap()

    def record(compute, count: int) -> None:
        for _ in range(count):
            compute.set_pipeline(pipeline)
            compute.set_bind_group(0, group)
            compute.dispatch_workgroups(groups)

    def each_synced() -> None:
        for _ in range(n):
            encoder = g.device.create_command_encoder()
            compute = encoder.begin_compute_pass()
            record(compute, 1)
            compute.end()
            submit_and_wait(encoder)

    def batched(timestamps=None) -> None:
        encoder = g.device.create_command_encoder()
        compute = encoder.begin_compute_pass(timestamp_writes=timestamps)
        record(compute, n)
        compute.end()
        submit_and_wait(encoder)

    def api_only() -> None:
        encoder = g.device.create_command_encoder()
        compute = encoder.begin_compute_pass()
        t = time.perf_counter()
        record(compute, n)
        api.append(time.perf_counter() - t)
        compute.end()
        submit_and_wait(encoder)

    api: list[float] = []
    row = {"a_dispatch_sync_us": _median(each_synced, repeats=3, warmup=1) / n * 1e6,
           "b_dispatch_batch_us": _median(batched) / n * 1e6}
    runs += (3 + 1) + (5 + 2)
    _median(api_only)
    runs += 7
    row["api_us"] = statistics.median(api) / n * 1e6
    row["device_us"] = _device_time(g, batched, n)
    runs += 1 if row["device_us"] is not None else 0
    row["ratio_a_over_b"] = row["a_dispatch_sync_us"] / row["b_dispatch_batch_us"]
    row["checked"] = bool(np.all(_read(g, x, size) == float(runs * n)))
    return row


def _device_time(g, batched, n: int) -> float | None:
    """Device microseconds per dispatch of one batched pass, from timestamps at its start and end."""
    if not g.timestamps:
        return None
    w = g.wgpu
    queries = g.device.create_query_set(type=w.QueryType.timestamp, count=2)
    batched({"query_set": queries, "beginning_of_pass_write_index": 0, "end_of_pass_write_index": 1})
    resolved = g.buffer(16, usage=w.BufferUsage.QUERY_RESOLVE)
    encoder = g.device.create_command_encoder()
    encoder.resolve_query_set(queries, 0, 2, resolved, 0)
    g.queue.submit([encoder.finish()])
    start, end = np.frombuffer(g.queue.read_buffer(resolved), dtype=np.uint64)[:2]
    return float(end - start) / n / 1e3  # timestamps count nanoseconds


def _read(g, buffer, size: int) -> np.ndarray:
    return np.frombuffer(g.queue.read_buffer(buffer), dtype=np.float32)[:size]


def reuse_probe() -> dict:
    """Submit one command buffer twice, in a child process: what WebGPU does with a reused one."""
    proc = subprocess.run([sys.executable, "-c", REUSE_PROBE], capture_output=True, text=True, timeout=120)
    lines = proc.stderr.splitlines()
    said = next((line.strip() for line in lines if "submitted" in line), proc.stderr[-200:])
    return {"allowed": proc.returncode == 0 and "resubmitted" in proc.stdout, "exit_status": proc.returncode,
            "error": said.strip()}


def framework_cost(decoder, steps: int = 7, repeat: int = 10) -> dict:
    """floe's own cost per dispatch: its decode step's recording and submit of every planned dispatch
    (no wait; the plan `repeat` times over, so the per-submit costs are spread as in a deep model),
    next to the three API calls alone on the same objects, in turns; and the dispatches per token."""
    plan = decoder.decode_plan
    ops = (plan.embed + plan.layers + plan.head) * repeat
    g = decoder.gpu

    def floe_step() -> None:
        decoder._submit(ops, [1], [0], [0], 0, 1)

    def api_step() -> None:
        encoder = g.device.create_command_encoder()
        compute = encoder.begin_compute_pass()
        for op in ops:
            compute.set_pipeline(op.pipelines[1])
            compute.set_bind_group(0, op.group)
            compute.dispatch_workgroups(op.x, 1)
        compute.end()
        g.queue.submit([encoder.finish()])

    def timed(fn) -> float:
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
            decoder._read(1, None)  # waits for the step (its head wrote the logits)
        return statistics.median(times)

    floe_s, api_s = timed(floe_step), timed(api_step)
    floe_s, api_s = min(floe_s, timed(floe_step)), min(api_s, timed(api_step))
    return {"dispatches_recorded": len(ops), "floe_record_submit_us": floe_s / len(ops) * 1e6,
            "api_record_submit_us": api_s / len(ops) * 1e6}


def dispatch(n: int = 2000, sizes: tuple[int, ...] = (1, 4096)) -> dict:
    """Everything `floe bench dispatch --device webgpu` reports."""
    g = gpu()
    return {"device": "webgpu", "adapter": g.description, "n": n,
            "kernels": {f"tick {size} float32": _row(size, n) for size in sizes},
            "reused_command_buffer": reuse_probe()}


def framework_on_shape(shape: str = "smollm2-135m", layers: int = 2) -> dict:
    """framework_cost on seeded random weights at `shape` cut to `layers` layers (each layer's
    dispatches are the same, so its per-dispatch costs are the whole model's), and the dispatches a
    whole model's decode token takes at `shape` and at llama-3.2-1b, fused and not (planned_dispatches)."""
    import dataclasses

    import torch

    from floe.engine.webgpu.decoder import WebGPUDecoder, planned_dispatches
    from floe.engine.webgpu.kvcache import WebGPUKVCache
    from floe.engine.weights import load_model
    from floe.model.config import KNOWN_SHAPES
    from floe.model.synthetic import random_checkpoint

    g = gpu()
    config = dataclasses.replace(KNOWN_SHAPES[shape], n_layers=layers)
    checkpoint = random_checkpoint(config, None, dtype=torch.float32)
    model = load_model(checkpoint, 256, torch.device("cpu"), torch.float32).model
    decoder = WebGPUDecoder(model, WebGPUKVCache(g, config, 256, 1))
    decoder.step([1], [0], [0])  # compiles the pipelines
    cost = framework_cost(decoder)
    cost["measured_on"] = f"{shape}, {layers} layers, random weights"
    limits = {"layout": g.gemv_layout, "storage_buffers": g.max_storage_buffers,  # (this adapter's plan)
              "workgroup_bytes": g.device.limits["max-compute-workgroup-storage-size"],
              "max_workgroups": g.max_workgroups}
    cost["dispatches_per_decode_token"] = {
        name: {"fused": planned_dispatches(KNOWN_SHAPES[name], g.max_binding, True, **limits),
               "unfused": planned_dispatches(KNOWN_SHAPES[name], g.max_binding, False, **limits)}
        for name in dict.fromkeys((shape, "llama-3.2-1b"))}
    return cost


def copy_bandwidth(nbytes: int = 64 << 20, copies: int = 4) -> float:
    """Bytes/s a buffer-to-buffer copy moves on the adapter (read + write: `floe profile`'s decode
    ceiling): `copies` copies of nbytes in one submit, waited for as a decode step is (a mapped 16 bytes
    copied after them); the median of 5 after 2."""
    g = gpu()
    u = g.wgpu.BufferUsage
    src, dst = g.buffer(nbytes, label="copy source"), g.buffer(nbytes, label="copy target")
    mapped = g.device.create_buffer(size=16, usage=u.MAP_READ | u.COPY_DST, label="sync")

    def run() -> None:
        encoder = g.device.create_command_encoder()
        for _ in range(copies):
            encoder.copy_buffer_to_buffer(src, 0, dst, 0, nbytes)
        encoder.copy_buffer_to_buffer(dst, 0, mapped, 0, 16)
        g.queue.submit([encoder.finish()])
        mapped.map_sync(g.wgpu.MapMode.READ)
        mapped.unmap()

    return 2 * nbytes * copies / _median(run)

