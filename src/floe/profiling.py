"""`floe profile`: one actor turn, measured at every boundary, dispatch and ceiling.

What it runs, in order, on one engine: the device's copy bandwidth and matmul rate; one message
through the actor (its ledger records every guest↔host↔engine crossing; TTFT and decode rate are
medians over `repeats` fresh actors after a warm-up one); a freeze and a thaw of that actor
(snapshot I/O, and the host→device KV load on CUDA); the dispatch count of one prefill and one
decode step; for the roofline, a timed prefill of the same prompt and 32 timed decode steps after
it (host-driven, so the guest's share is not in them). With `fusion="both"` the
decode and TTFT numbers are taken again with the engine's fused decode off, on the same weights.
On WebGPU (device "webgpu") the ceilings are the adapter's: a buffer-to-buffer copy's bandwidth and the
prompt's GEMM shader's FLOP/s; the dispatches are the shaders a step records (WebGPUDecoder).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from floe import snapshot
from floe.actor import Actor
from floe.bench import copy_bandwidth, decode_bytes, matmul_rate, timed
from floe.engine import Engine
from floe.engine.int4 import gemm_dtype
from floe.model.checkpoint import Checkpoint
from floe.profile import Ledger, count_dispatches, linear_params, prefill_flops, roofline


def _turn(engine: Engine, prompt: str, max_tokens: int, repeats: int) -> tuple[object, dict]:
    """The reply of the first of `repeats` fresh actors, and median TTFT / decode rate over all."""
    replies = []
    for _ in range(repeats):
        with Actor(engine) as actor:
            replies.append(actor.send(prompt, max_tokens=max_tokens))
    stats = [r.stats for r in replies]
    return replies[0], {
        "prompt_tokens": stats[0].prompt_tokens,
        "generated_tokens": stats[0].generated_tokens,
        "ttft_ms": 1e3 * statistics.median(s.ttft_s for s in stats),
        "decode_tok_s": statistics.median(s.decode_tokens_per_s for s in stats),
    }


def _snapshot_io(engine: Engine, prompt: str, ledger: Ledger) -> None:
    """Freeze an actor after one short message and thaw it into a fresh one; record both."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "profile.safetensors"
        with Actor(engine) as actor:
            actor.send(prompt, max_tokens=2)
            t = time.perf_counter()
            snapshot.freeze(actor, path)
            seconds = time.perf_counter() - t
        ledger.copy("snapshot write (actor → file)", path.stat().st_size, seconds=seconds)
        t = time.perf_counter()
        with snapshot.thaw(engine, path) as thawed:
            seconds = time.perf_counter() - t
            kv = [b for b in thawed.ledger.boundaries.values() if b.name.startswith("KV ")]
        size = path.stat().st_size
        kv_bytes = max((b.bytes_copied // b.copies for b in kv if b.copies), default=0)
        ledger.copy(f"snapshot read (file → actor, all but the KV; KV to {engine.backend} below)",
                    size - kv_bytes, seconds=seconds)
        for b in kv:
            ledger.copy(f"snapshot read: {b.name}", b.bytes_copied // max(b.copies, 1), copies=b.copies)


def _dispatches(engine: Engine, ids: list[int]) -> dict:
    slot = engine.claim_slot()
    if engine.backend == "webgpu":  # the shaders each submit records (a prompt: one submit per chunk)
        decoder = engine._batch_decoder()
        try:
            engine.kv_truncate(0, slot)
            engine.prefill(ids, slot)
            prefill = decoder.last_dispatches
            engine.decode_step(ids[-1], slot)
            decode = decoder.last_dispatches
        finally:
            engine.release_slot(slot)
        return {"prefill": prefill, "decode_per_token": decode, "counted": "webgpu_dispatches"}
    try:
        prefill = count_dispatches(lambda: (engine.kv_truncate(0, slot), engine.prefill(ids, slot)),
                                   engine.device, steps=3)
        n = engine.kv_len(slot)
        decode = count_dispatches(lambda: (engine.kv_truncate(n, slot), engine.decode_step(ids[-1], slot)),
                                  engine.device, steps=5)
    finally:
        engine.release_slot(slot)
    key = "device_kernels" if engine.device.type == "cuda" else "framework_ops"
    return {"prefill": prefill[key], "decode_per_token": decode[key], "counted": key,
            "prefill_detail": prefill, "decode_detail": decode}


def _timed_engine(engine: Engine, ids: list[int], steps: int = 32) -> tuple[float, float]:
    """(prefill seconds of ids, seconds per decode step after them): medians, host-driven."""
    slot = engine.claim_slot()
    try:
        def prefill():
            engine.kv_truncate(0, slot)
            engine.prefill(ids, slot)

        def decode():
            engine.kv_truncate(len(ids), slot)
            for _ in range(steps):
                engine.decode_step(ids[-1], slot)

        return timed(prefill, 5), timed(decode, 5) / steps
    finally:
        engine.release_slot(slot)


def profile_turn(checkpoint: Checkpoint, prompt: str, *, device: str = "cpu", dtype: str = "float32",
                 weights: str = "dense", max_tokens: int = 64, fusion: str = "on", repeats: int = 3,
                 context: int | None = None, progress=lambda text: None) -> dict:
    """Everything `floe profile` reports, as one JSON-ready dict."""
    if fusion not in ("on", "off", "both"):
        raise ValueError(f"fusion must be on, off or both, not {fusion!r}")
    webgpu = device == "webgpu"
    dev = device if webgpu else torch.device(device)
    n_ctx = context or min(checkpoint.config.context_length, 4096)

    def make(fused: bool) -> Engine:
        return Engine(checkpoint, device=dev, dtype=dtype, max_seq_len=n_ctx, n_slots=2, weights=weights,
                      fused_kernels=fused)

    engine = make(fusion != "off")
    progress("measuring the device's bandwidth and matmul rate")
    if webgpu:  # (the shaders compute in float32, whatever the weights are stored as)
        from floe.engine.webgpu.dispatch import copy_bandwidth as webgpu_copy_bandwidth

        bandwidth, matmul_dtype = webgpu_copy_bandwidth(), torch.float32
        rate = engine._batch_decoder().gemm_rate()
    else:
        bandwidth = copy_bandwidth(dev)
        # The dtype the prompt's matmuls run in: a native engine's bands in gemm_dtype (float32 where
        # this CPU has no native bf16 product), a dense engine's weights as they are.
        matmul_dtype = (torch.bfloat16 if dev.type == "cuda" else gemm_dtype() if weights == "native"
                        else engine.dtype)
        rate = matmul_rate(dev, matmul_dtype)
    progress("one actor turn (ledger on)")
    _turn(engine, prompt, max_tokens, 1)  # warm-up: compiled guest, decode graphs, TorchScript
    reply, run = _turn(engine, prompt, max_tokens, repeats)
    ledger = reply.ledger
    progress("snapshot freeze and thaw")
    _snapshot_io(engine, prompt, ledger)
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    progress("counting dispatches")
    dispatches = _dispatches(engine, ids)
    prefill_s, step_s = _timed_engine(engine, ids)
    if webgpu:  # what its buffers hold: every weight as stored (the tied head once), read each step
        from floe.engine.webgpu.decoder import decode_bytes as webgpu_decode_bytes

        step_bytes = webgpu_decode_bytes(engine._batch_decoder(), 0)
    else:
        step_bytes = decode_bytes(engine)
    roof = roofline(step_bytes, step_s, bandwidth, len(ids), prefill_s,
                    prefill_flops(engine.config, len(ids)), rate)
    layers, head = linear_params(engine.config)
    roof["decode_flops_per_token"] = 2 * (layers + head)  # two per weight read; attention is small
    # Prefill reads each layer weight once, in the dtype its matmuls run (dequantized bands when native).
    roof["prefill_weight_bytes"] = layers * matmul_dtype.itemsize
    records = sum(b.calls for b in ledger.boundaries.values())
    per_record = ledger.overhead_per_record_s()
    result = {
        "model": {"name": checkpoint.name, "fingerprint": checkpoint.fingerprint,
                  "file_type": checkpoint.file_type},
        "device": str(dev), "dtype": dtype,
        "weights": {"kind": weights, "kernel": engine.native_kernel, "quantized": engine.packed},
        "prompt": prompt, "run": run, "boundaries": ledger.rows(), "dispatches": dispatches,
        "roofline": roof, "matmul_dtype": str(matmul_dtype).removeprefix("torch."),
        "ledger_overhead": {"records": records, "per_record_us": per_record * 1e6,
                            "total_us": records * per_record * 1e6,
                            "pct_of_turn": 100 * records * per_record
                            / (run["ttft_ms"] / 1e3 + run["generated_tokens"] / run["decode_tok_s"])},
    }
    if fusion == "both":
        progress("fusion off: the same turn and counts without the fused decode")
        off = make(False)
        _turn(off, prompt, max_tokens, 1)
        _, off_run = _turn(off, prompt, max_tokens, repeats)
        off_prefill_s, off_step_s = _timed_engine(off, ids)
        rows = [("on", dispatches, run, prefill_s, step_s),
                ("off", _dispatches(off, ids), off_run, off_prefill_s, off_step_s)]
        result["ablation"] = [
            {"fusion": name, "decode_dispatches_per_token": d["decode_per_token"],
             "prefill_dispatches": d["prefill"], "ttft_ms": r["ttft_ms"], "prefill_ms": p * 1e3,
             "decode_tok_s": 1 / s, "actor_decode_tok_s": r["decode_tok_s"]}
            for name, d, r, p, s in rows
        ]
        result["ablation_what"] = (
            "WebGPU: the fused plan (three dispatches a layer; five where a matrix needs bands, and "
            "Gemma's) vs norm, rotary + KV write and SwiGLU as dispatches of their own" if webgpu else
            "CPU: lean TorchScript decode step vs the module forward" if dev.type == "cpu" else
            "CUDA graphs with fused Triton kernels vs graphs of the plain ops")
    return result
