"""A guest call's cost with and without Wasmtime's type check at each call (floe.wasm.raw.PreparedCall
calls an export unchecked once its first checked call showed its type): ns a call, for the engine
loop's native rows (floe.wasm.rows.call_slots, 64 guests a call) and for one call from Python.

    python bench/probes/wasm_call_cost.py [--guests 64] [--rounds 2000]
"""

from __future__ import annotations

import argparse
import math
import threading
import time

import numpy as np

from floe.wasm import GuestInstance, GuestModule, default_runtime, start_guest_thread
from floe.wasm import rows as guest_rows
from floe.wasm.raw import RAW_RESULTS
from floe.wasm.rows import NONE, Col

WAT = b"""(module (memory (export "memory") 1)
  (func (export "on_token") (result i32) (i32.add (i32.load (i32.const 64)) (i32.const 1))))"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--guests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2000)
    args = ap.parse_args()
    module = GuestModule(default_runtime(), WAT)
    guests = [GuestInstance(module, "floe", [], memory_cap=16 << 20) for _ in range(args.guests)]
    out: dict[str, float] = {}
    thread = threading.Thread(target=lambda: out.update(measure(guests, args.rounds)))
    start_guest_thread(thread)  # (the native loop runs off the main thread, as the engine loop's)
    thread.join()
    for name, ns in out.items():
        print(f"{name}: {ns:.0f} ns a call")


def measure(guests: list[GuestInstance], rounds: int) -> dict[str, float]:
    n = len(guests)
    table = np.zeros((n, guest_rows.WIDTH), np.int64)
    table[:, Col.CONTEXT:Col.WHEN_AT + 1] = guest_rows.heads(guests, "on_token", [0] * n)
    table.view(np.float64)[:, Col.DEADLINE] = math.inf
    table[:, [Col.CHOICE, Col.SPECULATED, Col.NEXT_TOKEN]] = NONE
    slots = np.arange(n, dtype=np.int64)
    results = table[:, Col.RESULTS].copy() & ~RAW_RESULTS
    out = {}
    if guest_rows.usable(guests):
        for name, tag in (("native rows, checked", 0), ("native rows, unchecked", RAW_RESULTS)):
            spent = 0.0
            for _ in range(rounds):
                table[:, Col.RESULTS] = results | tag  # (checked: the type learned anew each call)
                t = time.perf_counter()
                guest_rows.call_slots(table, slots, guests, "on_token", 1.0, lambda k: None)
                spent += time.perf_counter() - t
            out[name] = 1e9 * spent / (rounds * n)
    call = guests[0].prepared("on_token", 0)
    for name, raw in (("one call from Python, checked", False), ("one call from Python, unchecked", True)):
        t = time.perf_counter()
        for _ in range(rounds * 8):
            call.raw = raw
            call((), hold_gil=True)
        out[name] = 1e9 * (time.perf_counter() - t) / (rounds * 8)
    return out


if __name__ == "__main__":
    main()
