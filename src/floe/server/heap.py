"""A serving process's heap made ready to serve (floe serve's engine core, each of its HTTP fronts, a Ray
replica): what exists at its start frozen out of the cyclic collector's passes, and the collector's
thresholds set for a server's allocation rate. No import beyond the standard library's: a front loads
no more than it did."""

from __future__ import annotations

import gc
import os

from floe.errors import FloeError

GC_THRESHOLDS = (5_000, 10, 10)  # the cyclic collector's once a process serves (settle_heap)


def settle_heap() -> tuple[int, int, int]:
    """This process's heap made ready to serve; the cyclic collector's thresholds it set. What exists now
    (in the engine core: the model's modules, the tokenizer, imported code, ~10^5 to 10^6 objects; in a
    front: FastAPI's and pydantic's) lives as long as the server: out of the cyclic collector's reach
    (gc.freeze), whose full passes over all of it stalled every session at once for ~0.1 s
    (docs/PERF_HISTORY.md, "A token without a host call"). Then the youngest generation is collected
    every GC_THRESHOLDS[0] new containers instead of Python's 700: a burst's requests made the core
    collect every other request and pass over everything unfrozen every ~250 (0.23 ms of its GIL a
    request on a 2-core VM, 37-44 ms full passes; 0.10 ms and 13 ms at most so), the containers a request
    makes mostly freed by their counts anyway (docs/PERF_HISTORY.md, "The core's cyclic collector").
    FLOE_GC_THRESHOLD="g0,g1,g2" sets them."""
    thresholds = gc_thresholds()
    gc.collect()
    gc.freeze()
    gc.set_threshold(*thresholds)
    return thresholds


def gc_thresholds() -> tuple[int, int, int]:
    """A serving process's cyclic collector thresholds: FLOE_GC_THRESHOLD's three integers (gen0,gen1,
    gen2; a gen0 of 0 turns the collector off), else GC_THRESHOLDS. Raises FloeError for anything else."""
    raw = os.environ.get("FLOE_GC_THRESHOLD", "").strip()
    if not raw:
        return GC_THRESHOLDS
    parts = raw.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise FloeError(f"FLOE_GC_THRESHOLD must be three integers >= 0 (gen0,gen1,gen2, as "
                        f"gc.set_threshold takes them), got {raw!r}")
    return tuple(int(p) for p in parts)  # type: ignore[return-value]
