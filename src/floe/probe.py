"""`floe probe zero-copy`: prove the chain region == guest memory == tensor (== device pointer),
measure what a zero-copy view costs in resident memory against a copy, and run a GEMM the guest
sets up and checks while the engine computes it in place in guest memory."""

from __future__ import annotations

import gc
import struct

import numpy as np
import torch

from floe.memory import rss_bytes
from floe.wasm import GuestInstance, GuestPointerError, HostFunction, default_runtime
from floe.wasm.raw import trap_new

RSS_PROBE_BYTES = 16 << 20
GEMM_N = 128
_RESULT = struct.Struct("<iifIII")  # status, mismatches, max_error, a, b, c (probe.c's probe_result)


def probe_zero_copy(device: str = "cpu") -> dict:
    """Run the probe on `device` ("cpu" or "cuda"); returns the figures `--json` prints."""
    from floe.actor import builtin_guest

    device_t = torch.device(device)
    module = default_runtime().compile(builtin_guest("probe"))
    pointers: dict[str, int] = {}
    gemm_state: dict = {}
    guest: GuestInstance | None = None

    def gemm(raw) -> int:
        try:
            a, b, c, n = (raw[2 * i] & 0xFFFFFFFF for i in range(4))
            _gemm_in_place(guest, device_t, a, b, c, n, pointers)
            raw[0] = 0
            return 0
        except BaseException as e:  # noqa: BLE001 - trap the guest, report after
            gemm_state["error"] = e
            return trap_new(str(e))

    guest = GuestInstance(module, "floe", [HostFunction("gemm", 4, 1, gemm)], memory_cap=1 << 30)
    try:
        region = guest.region
        if device_t.type == "cuda":
            pointers["device_pointer"] = region.register(device_t)
        pointers["region_base"] = region.base
        pointers["guest_memory_base"] = guest.memory_base
        pointers["tensor_at_base"] = region.torch(0, 16, torch.uint8).data_ptr()

        rss = _rss_deltas(guest)
        result_ptr = guest.call("run", GEMM_N, deadline_s=60, pending=lambda: gemm_state.pop("error", None))
        status, mismatches, max_error, a, b, c = _RESULT.unpack(region.read(result_ptr, _RESULT.size))
        if status != 0:
            raise RuntimeError(f"probe guest reported status {status}")
        identity = _pointer_identity(pointers, c)
        return {
            "device": str(device_t),
            "pointer_identity": identity,
            "pointers": {k: hex(v) for k, v in pointers.items()},
            "rss_delta_zero_copy_mb": rss["zero_copy"] / 1e6,
            "rss_delta_copy_mb": rss["copy"] / 1e6,
            "rss_probe_bytes": RSS_PROBE_BYTES,
            "gemm_n": GEMM_N,
            "gemm_max_abs_error": float(max_error),
            "gemm_mismatches": int(mismatches),
        }
    finally:
        guest.close()


def _gemm_in_place(guest: GuestInstance, device: torch.device, a: int, b: int, c: int, n: int,
                   pointers: dict[str, int]) -> None:
    region = guest.region
    for name, off in (("A", a), ("B", b), ("C", c)):
        if off % 4:
            raise GuestPointerError(f"gemm: {name} at {off} is not 4-byte aligned")
        region.check(off, 4 * n * n)
    if device.type == "cuda":
        views = [region.cuda_tensor(off, n * n, torch.float32, device, (n, n)) for off in (a, b, c)]
        torch.mm(views[0], views[1], out=views[2])
        torch.cuda.synchronize(device)
    else:
        views = [region.torch(off, n * n, torch.float32).view(n, n) for off in (a, b, c)]
        torch.mm(views[0], views[1], out=views[2])
    pointers["gemm_c_tensor"] = views[2].data_ptr()


def _pointer_identity(p: dict[str, int], c_offset: int) -> bool:
    same_base = p["region_base"] == p["guest_memory_base"] == p["tensor_at_base"]
    device_ok = p.get("device_pointer", p["region_base"]) == p["region_base"]
    gemm_ok = p["gemm_c_tensor"] == p["region_base"] + c_offset
    return bool(same_base and device_ok and gemm_ok)


def _rss_deltas(guest: GuestInstance) -> dict[str, int]:
    """Resident-memory growth from exposing 16 MiB of guest memory to torch: a view vs a copy."""
    ptr = guest.call("alloc", RSS_PROBE_BYTES, deadline_s=10, pending=lambda: None)
    if ptr == 0:
        raise RuntimeError("probe guest could not allocate 16 MiB")
    guest.region.numpy(ptr, RSS_PROBE_BYTES).fill(0x5A)  # the guest's data, resident before we start
    # Warm both paths on one page first, so one-time allocations (kernels, caches) are not counted.
    guest.region.torch(ptr, 1024, torch.float32)[::1024].sum()
    torch.from_numpy(np.array(guest.region.numpy(ptr, 4096)))[::4096].sum()
    gc.collect()
    before = rss_bytes()
    view = guest.region.torch(ptr, RSS_PROBE_BYTES // 4, torch.float32)
    view[:: 4096 // 4].sum()  # read every page through the view: the same pages, nothing new
    zero_copy = rss_bytes() - before
    before = rss_bytes()
    copy = torch.from_numpy(np.array(guest.region.numpy(ptr, RSS_PROBE_BYTES)))
    copy[::4096].sum()
    copied = rss_bytes() - before
    del view, copy
    return {"zero_copy": zero_copy, "copy": copied}
