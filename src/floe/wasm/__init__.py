"""Wasmtime set-up: guest linear memory backed by floe Regions, raw host functions, limits, traps."""

from floe.wasm.runtime import (
    GuestBudgetExceeded,
    GuestCancelled,
    GuestDeadlineExceeded,
    GuestError,
    GuestHostCallError,
    GuestInstance,
    GuestLoadError,
    GuestMemoryLimit,
    GuestModule,
    GuestPointerError,
    GuestTrap,
    HostFunction,
    WasmRuntime,
    default_runtime,
)

__all__ = [
    "GuestBudgetExceeded",
    "GuestCancelled",
    "GuestDeadlineExceeded",
    "GuestError",
    "GuestHostCallError",
    "GuestInstance",
    "GuestLoadError",
    "GuestMemoryLimit",
    "GuestModule",
    "GuestPointerError",
    "GuestTrap",
    "HostFunction",
    "WasmRuntime",
    "default_runtime",
]
