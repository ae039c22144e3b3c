"""Quantized matrix-vector products for CPU decode: int8 activations × 4- or 8-bit weight codes.

PyTorch's packed int4 CPU kernel turns every weight into a float and multiplies in fp32, which made
the GEMVs ~6 of a SmolLM2 decode step's ~8 ms. This kernel (csrc/gemv_q.cpp, built on first use with
the machine's compiler and cached) does what llama.cpp does: quantize the input row to int8 per group
of 32, take each group's integer dot product with the codes on VNNI, and combine groups in float.
The weights are the file's values exactly; the input's int8 rounding is the one approximation
(relative error ~5e-3 per product; docs/PERF.md measures what it does to the tokens).

    Q4_0, Q4_1, Q4_K  →  4-bit codes, w = scale·code + offset per group of 32 (from int4_groups)
    Q8_0              →  8-bit codes = q + 128, scale d, offset −128·d
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from floe.engine import cbuild
from floe.engine.int4 import DENSE_FROM_ROWS  # longer inputs (prefill): a bf16 copy and a GEMM
from floe.model.quant import GROUP, QuantizedWeight

SOURCE = Path(__file__).parent / "csrc" / "gemv_q.cpp"

_lock = threading.Lock()
_state: dict[str, object] = {}


def load() -> bool:
    """Build (once per machine; cached by PyTorch) and load the kernels; False where they cannot run
    here (not x86-64, no compiler, no VNNI), with the reason in `unavailable_reason()`."""
    with _lock:
        if "ok" not in _state:
            _state["ok"], _state["reason"] = _build()
        return bool(_state["ok"])


def unavailable_reason() -> str:
    return str(_state.get("reason", ""))


def ensure_ops() -> None:
    """Make `torch.ops.floe.gemv_q4/q8` exist: the built kernels, or, where they cannot be built,
    declarations that refuse to run (so code that names them still compiles under TorchScript; no
    layer uses them then)."""
    if load() or hasattr(torch.ops.floe, "gemv_q4"):
        return
    lib = torch.library.Library("floe", "DEF")
    _state["fallback"] = lib  # kept alive: the registration lives as long as the Library object

    def refuse(*args):
        raise RuntimeError(f"floe's quantized CPU kernels are not available: {unavailable_reason()}")

    for name in ("gemv_q4", "gemv_q8"):
        lib.define(f"{name}(Tensor x, Tensor codes, Tensor scale, Tensor offset) -> Tensor")
        lib.impl(name, refuse, "CPU")


def _build() -> tuple[bool, str]:
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        return False, f"the kernel is written for x86-64, this is {platform.machine()}"
    try:
        torch.ops.load_library(cbuild.build("floe_gemv_q", [SOURCE], ["-O3", "-march=native", "-fopenmp"],
                                            ["-fopenmp"], what="the CPU decode kernels (~30 s)"))
    except Exception as e:  # noqa: BLE001 - no compiler, no headers...: the packed int4 path remains
        return False, f"building {SOURCE.name} failed: {type(e).__name__}: {str(e)[:300]}"
    if not torch.ops.floe.vnni():
        return False, "this CPU has no AVX-512 VNNI (the int8 dot products would be emulated)"
    return True, ""


def supports(weight: QuantizedWeight) -> bool:
    return weight.qtype in ("Q4_0", "Q4_1", "Q4_K", "Q8_0") and weight.has_int4_form


def _codes(weight: QuantizedWeight) -> tuple[Tensor, Tensor, int]:
    """(codes, [scale, offset], bits) for the kernel, from the file's blocks without changing a value.
    Q4_0 and Q4_1 keep the file's nibble bytes as they are. Scales and offsets are stored in float16
    where that is exact (the file's own fp16 scales: Q4_0, Q4_1, Q8_0), else float32 (Q4_K's products
    of two scales)."""
    import numpy as np

    rows, cols = weight.shape
    b = weight.blocks.reshape(rows, cols // GROUP, -1)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if weight.qtype == "Q8_0":  # w = d * q8 = d * (q8 + 128) - 128 d
        codes, bits = (b[..., 2:34].copy().view(np.int8).astype(np.int16) + 128).astype(np.uint8), 8
        scale, offset = d, -128 * d
    elif weight.qtype == "Q4_0":  # w = d * (q - 8); byte j holds values j (low) and j + 16 (high)
        codes, bits, scale, offset = b[..., 2:18], 4, d, -8 * d
    elif weight.qtype == "Q4_1":  # w = d * q + m
        codes, bits, scale = b[..., 4:20], 4, d
        offset = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:  # Q4_K via its exact groups: w = (q - 8) * scale + zero = scale * q + (zero - 8 * scale)
        g = weight.int4_groups()
        q = g.codes.reshape(rows, cols // GROUP, GROUP)
        codes, bits, scale, offset = q[..., :16] | (q[..., 16:] << 4), 4, g.scale, g.zero - 8 * g.scale
    scale_offset = np.stack([scale, offset]).astype(np.float32)
    half = scale_offset.astype(np.float16)
    if np.array_equal(half.astype(np.float32), scale_offset):
        scale_offset = half  # exact in half the bytes
    return (torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, -1)),
            torch.from_numpy(np.ascontiguousarray(scale_offset)), bits)


class QLinear(nn.Module):
    """y = x Wᵀ (+ b) on the file's quantized weight: the int8-activation kernel for a few rows,
    a bf16 copy for many (prefill). Output float32."""

    def __init__(self, weight: QuantizedWeight, bias: Tensor | None = None, dense: bool = True) -> None:
        super().__init__()
        if not supports(weight):
            raise ValueError(f"{weight.qtype} {weight.shape} has no kernel here")
        self.qtype = weight.qtype
        self.out_features, self.in_features = weight.shape
        codes, scale_offset, self.bits = _codes(weight)
        self.codes = codes.contiguous()
        self.scale_offset = scale_offset.contiguous()  # [2, rows, groups], float16 or float32
        self.bias = None if bias is None else bias.float()
        self.dense = weight.dequantize().to(torch.bfloat16) if dense else None

    @property
    def nbytes(self) -> int:
        """Bytes one pass over the weight reads."""
        return self.codes.nbytes + self.scale_offset.nbytes

    def forward(self, x: Tensor) -> Tensor:
        if self.dense is not None and x.shape[0] >= DENSE_FROM_ROWS:
            return F.linear(x.to(torch.bfloat16), self.dense, None if self.bias is None
                            else self.bias.to(torch.bfloat16)).float()
        y = gemv(x, self.codes, self.scale_offset, self.bits)
        return y if self.bias is None else y.add_(self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.qtype} as {self.bits}-bit codes"


def gemv(x: Tensor, codes: Tensor, scale_offset: Tensor, bits: int) -> Tensor:
    """x [M, K] (any float dtype) times the coded weight; float32 [M, N]."""
    op = torch.ops.floe.gemv_q4 if bits == 4 else torch.ops.floe.gemv_q8
    return op(x, codes, scale_offset[0], scale_offset[1])
