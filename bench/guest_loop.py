"""What the sandbox costs: guest-driven vs host-driven decode, host-call and guest-call prices, and
bounds-checked vs guard-page guest memory.

    python bench/guest_loop.py [--tokens 64] [--threads 2]

Prints tables; writes bench/results/guest_loop.json. Every figure is a median over repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import wasmtime
from smoke import results, shrink

from floe.actor import Actor
from floe.bench import wall_time
from floe.engine import Engine, Generation, SamplingParams, generate
from floe.model import load_checkpoint
from floe.wasm import GuestInstance, HostFunction, WasmRuntime

PROMPT = "Write a long story about a lighthouse keeper and a storm."

CALL_LOOP = wasmtime.wat2wasm("""
(module
  (import "floe" "kv_len" (func $f (result i32)))
  (memory (export "memory") 1)
  (func (export "nop") (result i32) (i32.const 0))
  (func (export "loop") (param $n i32) (result i32) (local $i i32)
    (loop $l
      (drop (call $f))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $l (i32.lt_u (local.get $i) (local.get $n))))
    (i32.const 0)))
""")

# Sums a 4 MiB array of i32 `reps` times: loads whose bounds Wasmtime may or may not elide.
MEMORY_LOOP = wasmtime.wat2wasm("""
(module
  (memory (export "memory") 64)
  (func (export "sum") (param $reps i32) (result i32) (local $i i32) (local $acc i32)
    (loop $r
      (local.set $i (i32.const 0))
      (loop $l
        (local.set $acc (i32.add (local.get $acc) (i32.load (local.get $i))))
        (local.set $i (i32.add (local.get $i) (i32.const 4)))
        (br_if $l (i32.lt_u (local.get $i) (i32.const 4194304))))
      (local.set $reps (i32.sub (local.get $reps) (i32.const 1)))
      (br_if $r (local.get $reps)))
    (local.get $acc)))
""")


def host_call_costs(n: int = 200_000) -> dict:
    runtime = WasmRuntime()
    module = runtime.compile(CALL_LOOP)

    def kv_len(raw) -> int:
        raw[0] = 0
        return 0

    floe_guest = GuestInstance(module, "floe", [HostFunction("kv_len", 0, 1, kv_len)], 1 << 24)
    none = lambda: None  # noqa: E731
    raw_ns = wall_time(lambda: floe_guest.call("loop", n, deadline_s=60, pending=none)) / n * 1e9

    # The peer: wasmtime-py's own host functions (Python values built per call).
    engine = wasmtime.Engine()
    store = wasmtime.Store(engine)
    linker = wasmtime.Linker(engine)
    linker.define_func("floe", "kv_len", wasmtime.FuncType([], [wasmtime.ValType.i32()]), lambda: 0)
    inst = linker.instantiate(store, wasmtime.Module(engine, CALL_LOOP))
    loop = inst.exports(store)["loop"]
    py_ns = wall_time(lambda: loop(store, n)) / n * 1e9

    nop = floe_guest.function("nop")
    m = 20_000
    guest_call_us = wall_time(lambda: [nop(floe_guest.store) for _ in range(m)]) / m * 1e6
    return {"floe_raw_host_call_ns": raw_ns, "wasmtime_py_host_call_ns": py_ns,
            "host_to_guest_call_us": guest_call_us}


def memory_modes(reps: int = 20) -> dict:
    out = {}
    for name, settings in (("guard pages (floe)", {}),
                           ("bounds-checked", {"memory_reservation": 0, "memory_guard_size": 0,
                                               "memory_may_move": True})):
        runtime = WasmRuntime()
        if settings:  # rebuild the engine with the bounds-checked settings
            config = wasmtime.Config()
            config.epoch_interruption = True
            config.memory_init_cow = False
            for key, value in settings.items():
                setattr(config, key, value)
            runtime.memory_creator.install(config)
            runtime.engine = wasmtime.Engine(config)
        guest = GuestInstance(runtime.compile(MEMORY_LOOP), "floe", [], 1 << 30)
        s = wall_time(lambda g=guest: g.call("sum", reps, deadline_s=60, pending=lambda: None))
        out[name] = {"s": s, "gb_s": reps * 4 * 2**20 / s / 1e9}
        guest.close()
    return out


def decode_paths(engine: Engine, tokens: int) -> dict:
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])

    def host() -> Generation:
        slot = engine.claim_slot()
        try:
            r = Generation()
            list(generate(engine, ids, SamplingParams(), tokens, slot=slot, result=r))
            return r
        finally:
            engine.release_slot(slot)

    def guest():
        with Actor(engine) as actor:
            return actor.send(PROMPT, max_tokens=tokens)

    host(), guest()  # warm-up
    runs: dict[str, list] = {"host-driven (generate)": [], "guest-driven (chat.wasm)": []}
    for _ in range(5):  # interleaved, so drift on a shared machine hits both alike
        runs["host-driven (generate)"].append(host())
        runs["guest-driven (chat.wasm)"].append(guest().stats)
    rows = {name: {"decode_tok_s": statistics.median(s.decode_tokens_per_s for s in stats),
                   "ttft_ms": statistics.median(s.ttft_s for s in stats) * 1e3,
                   "tokens": stats[0].generated_tokens} for name, stats in runs.items()}
    guest_stats = runs["guest-driven (chat.wasm)"]
    outside = statistics.median(s.outside_engine_s / s.forwards for s in guest_stats)
    step = statistics.median(s.forward_s / s.forwards for s in guest_stats)
    rows["guest-driven (chat.wasm)"]["outside_engine_ms_per_step"] = outside * 1e3
    rows["guest-driven (chat.wasm)"]["engine_ms_per_step"] = step * 1e3
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=200_000, help="guest -> host calls timed a run")
    args = shrink(ap.parse_args(), tokens=4, calls=10_000)
    torch.set_num_threads(args.threads)

    calls = host_call_costs(args.calls)
    mem = memory_modes()
    engine = Engine(load_checkpoint(), max_seq_len=1024, n_slots=2)
    paths = decode_paths(engine, args.tokens)

    print("\nhost calls (a guest loop calling one import; host->guest from Python)")
    print(f"  floe raw host function      {calls['floe_raw_host_call_ns']:8.0f} ns/call")
    print(f"  wasmtime-py Func (peer)     {calls['wasmtime_py_host_call_ns']:8.0f} ns/call")
    print(f"  host -> guest export call   {calls['host_to_guest_call_us']:8.2f} us/call")
    print("\nguest memory (sum 4 MiB of i32, 20 times)")
    for name, r in mem.items():
        print(f"  {name:<22} {r['s'] * 1e3:8.1f} ms  {r['gb_s']:6.2f} GB/s")
    print(f"\ndecode, SmolLM2-135M fp32, {args.threads} threads, greedy, {args.tokens} tokens")
    for name, r in paths.items():
        print(f"  {name:<26} {r['decode_tok_s']:7.2f} tok/s  TTFT {r['ttft_ms']:6.1f} ms")
    g = paths["guest-driven (chat.wasm)"]
    print(f"  measured inside the guest path: engine {g['engine_ms_per_step']:.2f} ms/step, guest + ABI "
          f"{g['outside_engine_ms_per_step'] * 1e3:.0f} us/step "
          f"({100 * g['outside_engine_ms_per_step'] / g['engine_ms_per_step']:.2f} % of a step)")
    out = results(Path(__file__).parent / "results" / "guest_loop.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"host_calls": calls, "memory": mem, "decode": paths}, indent=2))


if __name__ == "__main__":
    main()
