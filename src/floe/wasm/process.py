"""What guests' code needs of the host process (floe.wasm): the size of the calling thread's native
stack (a guest runs on it), and the handlers of the signals through which Wasmtime makes a guest's
trap an error, kept when another library installs its own."""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Iterator
from contextlib import contextmanager

# ---- the calling thread's native stack -------------------------------------------------------------

# Called with the GIL held (ctypes.PyDLL): they read the thread's own descriptor (the main thread's,
# /proc/self/maps), microseconds, where each GIL hand-off of CDLL's calls cost a new chat thread's first
# guest call ~0.9 ms in a burst of 64 (bench/probes/arrival_timeline.py --profile)
_pthread = ctypes.PyDLL(ctypes.util.find_library("c") or None)
_pthread.pthread_self.restype = ctypes.c_void_p
_ATTR_BYTES = 256  # > sizeof(pthread_attr_t) on every Linux ABI (56 on x86-64 glibc, 64 on aarch64)


def thread_stack_bytes() -> int | None:
    """The size of the calling thread's native stack in bytes, or None where the platform does not
    say (Linux: pthread_getattr_np; macOS: pthread_get_stacksize_np)."""
    if hasattr(_pthread, "pthread_getattr_np"):
        attr = ctypes.create_string_buffer(_ATTR_BYTES)
        if _pthread.pthread_getattr_np(ctypes.c_void_p(_pthread.pthread_self()), attr) != 0:
            return None
        try:
            addr, size = ctypes.c_void_p(), ctypes.c_size_t()
            if _pthread.pthread_attr_getstack(attr, ctypes.byref(addr), ctypes.byref(size)) != 0:
                return None
            return size.value
        finally:
            _pthread.pthread_attr_destroy(attr)
    if hasattr(_pthread, "pthread_get_stacksize_np"):
        _pthread.pthread_get_stacksize_np.restype = ctypes.c_size_t
        return int(_pthread.pthread_get_stacksize_np(ctypes.c_void_p(_pthread.pthread_self())))
    return None


# Wasmtime turns a guest's trap (an out-of-bounds access, `unreachable`, a division by zero) into an
# error through its own handlers of these signals; a library that installs crash handlers of its own
# afterwards (Ray's core worker does at ray.init, and resets them to the default at ray.shutdown)
# makes the next trap kill the process instead.
TRAP_SIGNALS = (4, 7, 8, 11)  # SIGILL, SIGBUS, SIGFPE, SIGSEGV (Linux)
_SIGACTION_BYTES = 256  # more than any libc's struct sigaction: copied whole, never interpreted


@contextmanager
def trap_handlers_kept() -> Iterator[None]:
    """Run the block (e.g. ray.init, ray.shutdown), then put back the handlers of TRAP_SIGNALS it
    found, so guests' traps stay errors."""
    libc = ctypes.CDLL(None, use_errno=True)
    saved = {}
    for sig in TRAP_SIGNALS:
        buf = ctypes.create_string_buffer(_SIGACTION_BYTES)
        if libc.sigaction(sig, None, buf) == 0:
            saved[sig] = buf
    try:
        yield
    finally:
        for sig, buf in saved.items():
            libc.sigaction(sig, buf, None)
