"""Linear layers that run a GGUF file's 4-bit weights as they are, on the CPU.

PyTorch's CPU build packs 4-bit weights for `_weight_int4pack_mm_for_cpu` (groups of 32 along the
input, a scale and a zero per group, bf16 activations). Batch-1 decode reads each weight once per
token, so 4.5 bits per weight instead of 16 is the whole game; see docs/PERF.md for the numbers.
The kernel only runs fast with bf16 inputs, and for many rows at once (prefill) a bf16 matrix
multiply is faster than it, so a layer keeps a bf16 copy of the same values for long inputs.
Its output is bf16: fine for a layer (added to the fp32 residual stream), not for the vocabulary
head, whose rounded logits tie near-equal tokens, so the engine never uses it for the head. floe's own
kernels (qgemv) are preferred wherever a compiler exists; this is the fallback where none does.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from floe.model.quant import GROUP, QuantizedWeight

# Inputs of at least this many rows (prefill) use the bf16 copy; shorter ones the int4 kernel.
DENSE_FROM_ROWS = 8


@functools.cache
def gemm_dtype() -> torch.dtype:
    """The dtype a prompt's matrix products on a quantized layer's dense values run in on this CPU:
    bfloat16 where oneDNN runs it natively (AVX-512 BF16, AMX), else float32 (on AVX2 alone oneDNN
    emulates bf16, ~7x slower than fp32: docs/PERF.md). It follows ONEDNN_MAX_CPU_ISA."""
    return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32


def int4_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def _int4_mm(x: Tensor, packed: Tensor, group: int, scales_zeros: Tensor) -> Tensor:
    return torch.ops.aten._weight_int4pack_mm_for_cpu.default(x, packed, group, scales_zeros)


class Int4Linear(nn.Module):
    """y = x Wᵀ (+ b) with W held as packed 4-bit groups; output bf16."""

    def __init__(self, weight: QuantizedWeight, bias: Tensor | None = None, dense: bool = True) -> None:
        super().__init__()
        groups = weight.int4_groups()
        if groups is None:
            raise ValueError(f"{weight.qtype} weights have no exact int4 form")
        self.qtype = weight.qtype
        self.out_features, self.in_features = weight.shape
        self.k_repeat = groups.k_repeat
        codes = torch.from_numpy(groups.codes).to(torch.int32)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        # [rows, groups, 2] -> the kernel's [groups, rows, 2]
        sz = torch.stack([torch.from_numpy(groups.scale), torch.from_numpy(groups.zero)], dim=-1)
        self.scales_zeros = sz.transpose(0, 1).contiguous().to(torch.bfloat16)
        self.bias = None if bias is None else bias.to(torch.bfloat16)
        self.dense = weight.dequantize(torch.bfloat16) if dense else None

    @property
    def nbytes(self) -> int:
        """Bytes one pass over the packed weight reads."""
        return self.packed.nbytes + self.scales_zeros.nbytes

    def forward(self, x: Tensor) -> Tensor:
        xb = x.to(torch.bfloat16)
        if self.dense is not None and xb.shape[0] >= DENSE_FROM_ROWS:
            return F.linear(xb, self.dense, self.bias)
        return self.forward_short(xb)

    def forward_short(self, xb: Tensor) -> Tensor:
        """The int4 kernel on bf16 rows xb [M, in] (what decode runs)."""
        if self.k_repeat > 1:
            xb = xb.repeat(1, self.k_repeat)
        y = _int4_mm(xb, self.packed, GROUP, self.scales_zeros)
        return y if self.bias is None else y.add_(self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.qtype} as int4 x{self.k_repeat}"
