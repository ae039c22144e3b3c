"""A batched step's launch on CUDA without handing the GIL to another thread (issue 40).

Each PyTorch call of a replay's launch lets go of the GIL around its CUDA call: the inputs' copy to the
device, recording the copy's event, the graph's replay, recording its done event. Alone that costs
nothing; in `floe serve`'s core, where 64 chat threads, the socket's reader and the flusher want the GIL
during a burst, the engine loop's thread waits to take it back after each release (up to the switch
interval, 5 ms, behind a thread running Python), and the same launches took 3.1x the actors' time (an
H100, 64 sessions: 108 against 35 ms; docs/PERF_HISTORY.md, "the 64-burst on an H100").

DriverLaunch makes those four calls through the CUDA driver's C API with ctypes.PyDLL, which keeps the GIL
for the call (each is an enqueue of a few microseconds: nothing waits on the device there). The handles are
PyTorch's own: the current stream's, the events' (created up front: a torch.cuda.Event makes its CUDA event
at its first record), the graph's instantiated executable (CUDAGraph.raw_cuda_graph_exec); and only where
the calling thread's current CUDA context is the device's (DriverLaunch.usable: else that launch takes
PyTorch's calls, which set the device). On by default (BatchGraphDecoder); FLOE_GIL_LAUNCH=0 turns it off.
On an H100 (1B shape, floe serve, 64 / 128 sessions, taking turns with PyTorch's calls): the loop's launches
0.04-0.05 s against 0.11-0.14 at 64 and 0.06-0.07 against 0.18-0.19 at 128 (the actors' own: 0.05-0.06), a
64-burst's TTFT p50 82-91 ms against 101-125; tok/s within the runs' spread (docs/PERF_HISTORY.md, the
eighth session of 2026-12-06).
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch

log = logging.getLogger("floe.engine")

ENABLED = os.environ.get("FLOE_GIL_LAUNCH", "1") != "0"
RING = 16  # done events taken in turn (steps' and draws'): each recorded again 16 records later (4 in flight)


class DriverError(RuntimeError):
    """A CUDA driver call of a launch failed."""


class DriverLaunch:
    """The launch's CUDA driver calls, the GIL held through each (see the module)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        lib = ctypes.PyDLL("libcuda.so.1")  # (PyDLL: the call keeps the GIL; CDLL would let it go)
        ptr, size = ctypes.c_void_p, ctypes.c_size_t
        self._copy = _fn(lib, "cuMemcpyHtoDAsync_v2", ctypes.c_uint64, ptr, size, ptr)
        self._record = _fn(lib, "cuEventRecord", ptr, ptr)
        self._query = _fn(lib, "cuEventQuery", ptr)
        self._launch = _fn(lib, "cuGraphLaunch", ptr, ptr)
        self._current = _fn(lib, "cuCtxGetCurrent", ctypes.POINTER(ptr))
        with torch.cuda.device(device):  # the device's (primary) context, current in this block
            torch.cuda.synchronize(device)
            self._context = self._current_context()
        if not self._context:
            raise DriverError(f"no CUDA context is current for {device}")
        self.ring = [created(torch.cuda.Event(), device) for _ in range(RING)]
        self._execs: dict[torch.cuda.CUDAGraph, int] = {}  # each graph's instantiated executable
        self._turn = 0

    def usable(self) -> bool:
        """Whether this thread's driver calls go to the device's context (the one current in it): a thread
        that has made no CUDA call yet, or whose current device is another GPU, launches through
        PyTorch's calls instead (which set the device themselves, and make its context current here)."""
        return self._current_context() == self._context

    def _current_context(self) -> int | None:
        ctx = ctypes.c_void_p()
        return ctx.value if self._current(ctypes.byref(ctx)) == 0 else None

    def stream(self) -> int:
        """The device's current stream in this thread (its handle)."""
        return torch.cuda.current_stream(self.device).cuda_stream

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: int) -> None:
        """dst <- src (pinned host memory, as many bytes), enqueued on `stream`."""
        self._check(self._copy(dst.data_ptr(), src.data_ptr(), src.nbytes, stream), "cuMemcpyHtoDAsync")

    def record(self, event: torch.cuda.Event, stream: int) -> None:
        self._check(self._record(event.cuda_event, stream), "cuEventRecord")

    def done(self, event: torch.cuda.Event) -> bool:
        """Whether the work before the event's last record has finished (never waits)."""
        code = self._query(event.cuda_event)
        if code == 600:  # CUDA_ERROR_NOT_READY
            return False
        self._check(code, "cuEventQuery")
        return True

    def launch(self, graph: torch.cuda.CUDAGraph, stream: int) -> None:
        exe = self._execs.get(graph)
        if exe is None:  # (its binding lets go of the GIL: asked once a graph)
            exe = self._execs[graph] = graph.raw_cuda_graph_exec()
        self._check(self._launch(exe, stream), "cuGraphLaunch")

    def next_done(self, stream: int) -> torch.cuda.Event:
        """The next of the ring's done events, recorded on `stream` now."""
        event = self.ring[self._turn]
        self._turn = (self._turn + 1) % RING
        self.record(event, stream)
        return event

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code:
            raise DriverError(f"{what} failed: CUDA driver error {code}")


def created(event: torch.cuda.Event, device: torch.device) -> torch.cuda.Event:
    """`event` with its CUDA event made (recorded once, on the device's current stream)."""
    event.record(torch.cuda.current_stream(device))
    return event


def driver_launch(device: torch.device) -> DriverLaunch | None:
    """A DriverLaunch for `device` unless FLOE_GIL_LAUNCH=0, where the driver and this PyTorch have what
    it needs (else None: PyTorch's calls)."""
    if not ENABLED:
        return None
    try:
        if not hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec"):
            raise DriverError("this PyTorch's CUDAGraph has no raw_cuda_graph_exec")
        return DriverLaunch(device)
    except (OSError, AttributeError, RuntimeError) as e:  # (no driver, no GPU, an old PyTorch)
        log.warning("FLOE_GIL_LAUNCH: PyTorch's launch calls instead (%s)", e)
        return None


def _fn(lib, name: str, *argtypes):
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
    return fn
