"""Quantized matrix-vector products for CPU decode: int8 activations × 4- or 8-bit weight codes.

PyTorch's packed int4 CPU kernel turns every weight into a float and multiplies in fp32, which made
the GEMVs ~6 of a SmolLM2 decode step's ~8 ms. floe's kernel does what llama.cpp does: quantize the
input row to int8 per group of 32, take each group's exact integer dot product with the codes, and
combine groups in float. The weights are the file's values exactly; the input's int8 rounding is
the one approximation (relative error ~5e-3 per product; docs/PERF.md measures what it does to the
tokens). Every variant computes the same sums (csrc/qdot/qdot.h); they differ in instructions:

    vnni      AVX-512 VNNI (vpdpbusd; two bands a 512-bit op)  x86-64
    avx2      AVX2 vpmaddubsw + vpmaddwd, as llama.cpp         x86-64
    neon      vdotq_s32 (ARMv8.2-A dot product)                aarch64 (compiled in tests, not run)
    portable  plain C++, no intrinsics                         any CPU

The variant is chosen from the CPU's feature flags *before* anything is compiled; each is a shared
library of its own built with that variant's flags (a second or two), opened by one PyTorch operator,
`torch.ops.floe.gemv_q` (csrc/qdot/op.cpp, built once per machine, ~35 s).

The kernel reads the weight in its file's blocks of 32 (`csrc/qdot/abi.h`), each row one stream of
[scale, (offset,) codes] blocks: in place (the file's memory map; for stacked and re-ordered
matrices one copy of the file's blocks), or, on the x86 variants, the same blocks interleaved 8 rows
a band (`interleave_q`, as llama.cpp repacks Q4_0 for AVX2/AVX-512): one vector instruction then
serves 8 weight rows with one broadcast of the input, and a row's sum needs no horizontal add —
1.2–2.2x the GEMV's speed (docs/PERF.md). The bands are a copy made once at load, in place of the
file's pages (given back: `drop_file_pages`), so memory stays one copy of the weights. Several input
rows (a batched decode step) meet each block of bands while it is in the core's cache, up to 8 rows a
pass (vnni: two bands at a time in 512-bit registers, 16 weight rows an instruction), and the bands a
few ahead are prefetched as a band is read, so the next block's bytes arrive while this one computes.

    Q4_0  fp16 d, 16 nibble bytes           w = d·(q − 8)    the file's blocks, 18 bytes
    Q4_1  fp16 d, fp16 m, 16 nibble bytes   w = d·q + m      the file's blocks, 20 bytes
    Q8_0  fp16 d, 32 int8                   w = d·q          the file's blocks, 34 bytes
    Q4_K  → Q4_F: fp32 s, fp32 o, 16 nibble bytes, w = s·q + o (its exact groups of 32, repacked; 24 bytes)
"""

from __future__ import annotations

import os
import platform
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from floe.engine import cbuild
from floe.engine.int4 import DENSE_FROM_ROWS, gemm_dtype  # longer inputs (prefill): a dense copy, a GEMM
from floe.errors import FloeError
from floe.model.quant import GROUP, QuantizedWeight

CSRC = Path(__file__).parent / "csrc" / "qdot"
OPERATOR_SECONDS = 35  # building the operator (PyTorch's headers) on 2 cores
VARIANT_SECONDS = 2  # building one variant (no PyTorch headers)

X86, ARM = ("x86_64", "AMD64"), ("aarch64", "arm64")
ROUNDING_SLACK = 1.001  # exact_top's bound, widened for the float rounding of the sums


class KernelUnavailable(FloeError):
    """A native kernel that cannot run here: the CPU lacks its instructions, or it cannot be built."""


@dataclass(frozen=True)
class Variant:
    name: str
    machines: tuple[str, ...]  # platform.machine() values it is for; empty: any
    cpu_flags: tuple[str, ...]  # the CPU features it needs, as Linux's /proc/cpuinfo names them
    cflags: tuple[str, ...]  # what it is compiled with (never -march=native: one library per variant)

    @property
    def source(self) -> Path:
        return CSRC / f"{self.name}.cpp"


_AVX2 = ("avx2", "fma", "f16c")
# Best first: `auto` takes the first one this CPU can run.
VARIANTS = {v.name: v for v in (
    Variant("vnni", X86, (*_AVX2, "avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
            ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")),
    Variant("avx2", X86, _AVX2, ("-mavx2", "-mfma", "-mf16c")),
    Variant("neon", ARM, ("asimddp",), ("-march=armv8.2-a+dotprod",)),
    Variant("portable", (), (), ()),
)}

# The operator's schema, declared here so that TorchScript compiles code naming it even where the
# operator cannot be built (then no layer calls it); op.cpp adds the CPU implementation.
_schema = torch.library.Library("floe", "FRAGMENT")
_schema.define("gemv_q(Tensor x, Tensor blocks, int kernel) -> Tensor")
_schema.define("dequant_q(Tensor blocks, int k, ScalarType dtype, int kernel) -> Tensor")
_schema.define("gemm_q(Tensor x, Tensor blocks, int kernel) -> Tensor")  # a prompt's float32 product
_schema.define("top_candidates(Tensor y, Tensor bound, Tensor spread) -> Tensor[]")  # exact_top's
_schema.define("attend(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
               "int[] slots, int[] positions, int n_heads, Tensor(c!) out, int window=0, float softcap=0.0) "
               "-> ()")  # csrc/qdot/attend.cpp
_schema.define("rms_norm_rows(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()")  # and this
_schema.define("attend_lanes(int lanes) -> int")  # attend's lanes: 0 the CPU's, 8, 16 (tests)

_lock = threading.Lock()
_numbers: dict[str, int] = {}  # variant -> its number for torch.ops.floe.gemv_q
_operator: dict[str, object] = {}  # "error": why the operator did not build, once it failed


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (/proc/cpuinfo `flags`, or `Features` on ARM), less
    the x86 vector extensions this process cannot execute (cpu_executes: /proc/cpuinfo is the host's
    under an emulator such as qemu-user, whose CPU may have fewer); elsewhere, what PyTorch's CPU
    capability implies."""
    line = _cpuinfo(("flags", "Features"))
    if line is not None:
        flags = frozenset(line.split())
        return flags if platform.machine() not in X86 else frozenset(f for f in flags if cpu_executes(f))
    if platform.machine() == "arm64" and platform.system() == "Darwin":
        return frozenset({"asimddp"})  # every Apple silicon core
    capability = torch.backends.cpu.get_cpu_capability()
    return frozenset(_AVX2 if capability in ("AVX2", "AVX512") else ())


def cpu_executes(flag: str) -> bool:
    """Whether this process can run x86 instructions of extension `flag`, as the CPUID instruction
    says (PyTorch's cpuinfo, which also checks the OS saves the registers): AVX2 and AVX-512 (VNNI)
    only; any other flag is taken as /proc/cpuinfo names it."""
    import torch.cpu

    probes = {"avx2": "_is_avx2_supported", "avx512_vnni": "_is_vnni_supported"}
    probe = probes.get(flag, "_is_avx512_supported" if flag.startswith("avx512") else None)
    check = getattr(torch.cpu, probe, None) if probe else None
    return check is None or bool(check())


def missing(name: str) -> str | None:
    """Why this CPU cannot run variant `name` (the missing flags), or None if it can."""
    variant = VARIANTS[name]
    if variant.machines and platform.machine() not in variant.machines:
        return f"it is for {variant.machines[0]}, this machine is {platform.machine()}"
    lacks = [flag for flag in variant.cpu_flags if flag not in cpu_flags()]
    return f"this CPU lacks {', '.join(lacks)}" if lacks else None


def runnable() -> list[str]:
    """The variants this CPU can run, best first (`portable` always)."""
    return [name for name in VARIANTS if missing(name) is None]


def load(name: str = "auto") -> int:
    """The number `torch.ops.floe.gemv_q` takes for variant `name` (`auto`: the best this CPU runs),
    built on first use and cached per machine. The CPU is checked before anything is compiled.
    Raises KernelUnavailable (unknown name, the CPU lacks a flag, no compiler, a failed build)."""
    name = runnable()[0] if name == "auto" else name
    if name not in VARIANTS:
        raise KernelUnavailable(f"no native kernel {name!r}; choose one of: auto, {', '.join(VARIANTS)}")
    with _lock:
        if name not in _numbers:
            why = missing(name)
            if why:
                raise KernelUnavailable(f"the {name} kernel cannot run here: {why}; "
                                        f"this CPU runs: {', '.join(runnable())}")
            _load_operator()
            variant = VARIANTS[name]
            try:
                library = cbuild.build_plain(f"floe_qdot_{name}", [variant.source], list(variant.cflags),
                                             what=f"floe's {name} int8 GEMV kernel", seconds=VARIANT_SECONDS)
            except cbuild.BuildError as e:
                raise KernelUnavailable(f"building the {name} kernel failed: {e}") from e
            number = torch.ops.floe.qdot_load(str(library))
            torch.ops.floe.qdot_pair_rows(number, pair_rows())
            _numbers[name] = number
        return _numbers[name]


def pair_rows() -> int:
    """The input rows of a pass from which the AVX-512 kernel takes neighbouring bands two at a time in
    512-bit registers (csrc/qdot/qdot.h, g_pair_rows: the same values either way): 1 where the cores run
    512-bit operations whole (Intel's), 4 on AMD's, whose Zen 4 runs them as two 256-bit halves (a 2-core
    Zen 4, Llama-3.2-1B-shape Q4_0 decode: 58.9 tok/s without pairs at one row against 51.1 with them,
    two rows 111 against 98, four the same, eight 218 against 134 without). FLOE_QDOT_PAIR_ROWS=N sets it."""
    forced = os.environ.get("FLOE_QDOT_PAIR_ROWS", "")
    if forced:
        if not forced.isdigit() or int(forced) < 1:
            raise FloeError(f"FLOE_QDOT_PAIR_ROWS={forced!r}: a count of input rows, 1 or more")
        return int(forced)
    return 4 if cpu_vendor() == "AuthenticAMD" else 1


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD, ...), '' where there is none."""
    return (_cpuinfo(("vendor_id",)) or "").strip()


def _cpuinfo(keys: tuple[str, ...]) -> str | None:
    """The value of the first /proc/cpuinfo line starting with one of `keys`; None: no such line or file."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(keys):
                    return line.split(":", 1)[1]
    except OSError:
        pass
    return None


def _load_operator() -> None:
    """Build (once per machine) and load op.cpp; a failure is remembered, not retried."""
    if "error" in _operator:
        raise KernelUnavailable(str(_operator["error"]))
    if "loaded" in _operator:
        return
    try:
        torch.ops.load_library(cbuild.build(
            "floe_qdot_op", [CSRC / "op.cpp", CSRC / "attend.cpp", CSRC / "gemm.cpp"], ["-O3", "-fopenmp"],
            ["-fopenmp"],
            what="floe's PyTorch operator for the CPU kernels", seconds=OPERATOR_SECONDS))
    except Exception as e:  # noqa: BLE001 - no compiler, no headers...: the caller falls back
        _operator["error"] = f"building floe's CPU kernel operator failed: {type(e).__name__}: {str(e)[:300]}"
        raise KernelUnavailable(str(_operator["error"])) from e
    _operator["loaded"] = True


BAND_ROWS = 8  # rows a band of an interleaved weight (csrc/qdot/abi.h)


def interleaves(number: int) -> bool:
    """Whether kernel `number` runs interleaved bands of BAND_ROWS rows (one vector instruction
    serving 8 weight rows: csrc/qdot/abi.h); QLinear then holds its weight so."""
    return bool(torch.ops.floe.qdot_interleaves(number))


def drop_file_pages(array) -> None:
    """Give back the pages of a file's memory map that `array` (a numpy view of it: floe.model's
    map_bytes) spans and that this process read: they leave its resident memory, and a later read
    maps them from the file again (the same bytes: the mapping is never written). An array of
    anonymous memory (a copy) is left alone."""
    import mmap

    import numpy as np

    base = array
    while base is not None and not isinstance(base, mmap.mmap):
        base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
    if base is None or base.closed:
        return
    start = array.__array_interface__["data"][0] - np.frombuffer(base, np.uint8, count=1).ctypes.data
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # the whole pages inside the array only
    end = (start + array.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > first:
        base.madvise(mmap.MADV_DONTNEED, first, end - first)


def supports(weight: QuantizedWeight) -> bool:
    return weight.qtype in ("Q4_0", "Q4_1", "Q4_K", "Q8_0") and weight.has_int4_form


IN_PLACE = ("Q4_0", "Q4_1", "Q8_0")  # the kernel reads these types' blocks as the file has them


def kernel_blocks(weight: QuantizedWeight) -> Tensor:
    """The weight as the kernel reads it, uint8 [rows, bytes a row]: Q4_0, Q4_1 and Q8_0 the file's
    own blocks (the same memory: no copy), Q4_K its exact groups of 32 repacked as Q4_F."""
    import numpy as np

    if weight.qtype not in IN_PLACE:
        return q4_f_blocks(weight)
    blocks = weight.blocks if weight.blocks.flags.c_contiguous else np.ascontiguousarray(weight.blocks)
    return torch.from_numpy(blocks.reshape(weight.shape[0], -1))


def q4_f_blocks(weight: QuantizedWeight) -> Tensor:
    """A 4-bit weight's exact groups of 32 as Q4_F blocks: float32 scale s, float32 offset o and the 16
    nibble bytes (byte j: weight j low, j + 16 high), w = s·q + o."""
    import numpy as np

    g = weight.int4_groups()
    if g is None or g.k_repeat != 1:
        raise ValueError(f"{weight.qtype} {weight.shape} has no 4-bit groups")
    rows, cols = weight.shape
    q = g.codes.reshape(rows, cols // GROUP, GROUP)
    nibbles = q[..., : GROUP // 2] | (q[..., GROUP // 2 :] << 4)
    scale = g.scale.astype(np.float32).reshape(rows, -1, 1)
    offset = (g.zero - 8 * g.scale).astype(np.float32).reshape(rows, -1, 1)  # (q − 8)·s + z = s·q + o
    blocks = np.concatenate([scale.view(np.uint8), offset.view(np.uint8), nibbles.astype(np.uint8)], -1)
    return torch.from_numpy(blocks.reshape(rows, -1))


class QLinear(nn.Module):
    """y = x Wᵀ (+ b) on the file's quantized weight: floe's int8-activation kernel (`kernel`: a
    variant name or auto) for a few rows; for many (prefill), with `dense`, a stored copy in
    gemm_dtype() (else floe.engine.prefill dequantizes bands). Output float32."""

    def __init__(self, weight: QuantizedWeight, bias: Tensor | None = None, dense: bool = True,
                 kernel: str = "auto", exact_top: bool = False) -> None:
        super().__init__()
        if not supports(weight):
            raise ValueError(f"{weight.qtype} {weight.shape} has no kernel here")
        self.number = load(kernel)
        self.kernel = torch.ops.floe.qdot_name(self.number)
        self.qtype = weight.qtype
        self.out_features, self.in_features = weight.shape
        self.blocks = kernel_blocks(weight)  # uint8 [rows, bytes a row]: the file's blocks, in place
        if interleaves(self.number) and self.out_features % BAND_ROWS == 0:  # or 8 rows a band (abi.h)
            self.blocks = torch.ops.floe.interleave_q(self.blocks, self.in_features)
            drop_file_pages(weight.blocks)  # read once: this process's memory holds the bands alone
        self.bias = None if bias is None else bias.float()
        self.dense = weight.dequantize(gemm_dtype()) if dense else None
        # exact_top (the vocabulary head): per row, how far the int8 rounding of one input group of
        # absmax 1 can move the output at most (see exact_top); one float a row
        self.rounding_bound = self._abs_sums().amax(1).mul_(ROUNDING_SLACK / 254) if exact_top else None

    @property
    def nbytes(self) -> int:
        """Bytes one pass over the weight reads."""
        return self.blocks.nbytes

    def forward(self, x: Tensor) -> Tensor:
        if self.dense is not None and x.shape[0] >= DENSE_FROM_ROWS:
            return F.linear(x.to(self.dense.dtype), self.dense, None if self.bias is None
                            else self.bias.to(self.dense.dtype)).float()
        y = torch.ops.floe.gemv_q(x, self.blocks, self.number)
        if self.bias is not None:
            y.add_(self.bias)
        if self.rounding_bound is not None:
            self.exact_top(x, y)
        return y

    @property
    def interleaved(self) -> bool:
        """Whether `blocks` holds interleaved bands of BAND_ROWS rows (else the file's rows)."""
        return self.blocks.shape[0] != self.out_features

    def rows(self, index: slice | Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """Rows `index` of the weight in `dtype` (float32 or bfloat16): w = scale·code + offset,
        rounded once to float32 (then to bfloat16, to nearest even), in one pass of the kernel."""
        if not self.interleaved:
            return torch.ops.floe.dequant_q(self.blocks[index], self.in_features, dtype, self.number)
        if isinstance(index, slice):  # whole bands, or the rows one by one
            start, stop, step = index.indices(self.out_features)
            if step == 1 and start % BAND_ROWS == 0 and stop % BAND_ROWS == 0:
                return torch.ops.floe.dequant_q(self.blocks[start // BAND_ROWS:stop // BAND_ROWS],
                                                self.in_features, dtype, self.number)
            index = torch.arange(start, stop, step)
        index = torch.as_tensor(index, dtype=torch.long)
        return torch.ops.floe.dequant_rows_q(self.blocks, self.in_features, index, dtype, self.number)

    def _abs_sums(self, band: int = 1 << 20) -> Tensor:
        """float32 [rows, groups]: the sum of |w| over each group of 32 of each row."""
        out = torch.empty(self.out_features, self.in_features // GROUP)
        step = max(BAND_ROWS, band // self.in_features // BAND_ROWS * BAND_ROWS)
        for start in range(0, self.out_features, step):
            end = min(start + step, self.out_features)
            out[start:end] = self.rows(slice(start, end)).view(end - start, -1, GROUP).abs().sum(-1)
        return out

    def exact_top(self, x: Tensor, y: Tensor) -> None:
        """Recompute in float32, in place, every output of y [M, rows] that could be its row's
        largest. The kernel rounds each input group g to int8 steps of absmax_g / 127, each element by
        at most half a step, which moves output r by at most sum_g absmax_g / 254 · sum|w_rg| <=
        (sum_g absmax_g) · max_g sum|w_rg| / 254 (rounding_bound holds the last factor per row, with a
        little slack for float sums); any output whose interval reaches the best lower end is
        recomputed exactly. The argmax is then the float32 product's (a head's near-tie is not decided
        by the input's rounding), for one float a weight row and a few rows' dot products (1 to 20,
        ~7 on average, on SmolLM2's head)."""
        m = x.shape[0]
        xf = x.reshape(m, self.in_features).float()
        spread = xf.view(m, -1, GROUP).abs().amax(-1).sum(-1)  # [M]
        # per row: the j with y + b >= max(y - b), b = spread · rounding_bound + 1e-4
        candidates = torch.ops.floe.top_candidates(y, self.rounding_bound, spread)
        for row, index in enumerate(candidates):
            exact = torch.mv(self.rows(index), xf[row])
            y[row, index] = exact if self.bias is None else exact.add_(self.bias[index])
