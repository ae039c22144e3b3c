"""Prefill on floe's quantized layers without a stored dense copy of their weights.

Many rows at once (a prompt) run fastest as a bf16 matrix product (AMX / AVX-512 BF16 GEMM), not as
one int8 GEMV per row, and bf16 activations keep the prompt's numerics those of the dense weights
(the int8 rounding of every activation flips SmolLM2's near-tie on the README prompt). A stored bf16
copy of every matrix would cost 2 bytes per weight, 3.5x the 4-bit codes; instead each matrix is
dequantized from the codes the kernel reads, a band of rows at a time, right before its band of
the product: one band (~2 MB) exists at a time. docs/PERF.md has the measurements.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from floe.engine.int4 import DENSE_FROM_ROWS
from floe.engine.qgemv import QLinear
from floe.model.quant import GROUP

BAND = 1 << 20  # weights dequantized at a time


def project(module: nn.Module, x: Tensor) -> Tensor:
    """module(x); a QLinear without a stored bf16 copy given a prompt's rows (DENSE_FROM_ROWS or more,
    where it would use one) runs banded_linear instead of its kernel row by row."""
    if x.shape[0] >= DENSE_FROM_ROWS and isinstance(module, QLinear) and module.dense is None:
        return banded_linear(module, x)
    return module(x)


def banded_linear(layer: QLinear, x: Tensor) -> Tensor:
    """x Wᵀ (+ b) for x [T, in], float32 out, as QLinear computes it with a bf16 copy (bf16 inputs,
    weights and output), the weight dequantized a band of rows at a time."""
    xb = x.to(torch.bfloat16)
    out = torch.empty(x.shape[0], layer.out_features)
    step = max(1, BAND // layer.in_features)
    for start in range(0, layer.out_features, step):
        end = min(start + step, layer.out_features)
        bias = None if layer.bias is None else layer.bias[start:end].to(torch.bfloat16)
        out[:, start:end] = F.linear(xb, dequantized_rows(layer, start, end), bias)
    return out


def dequantized_rows(layer: QLinear, start: int, end: int) -> Tensor:
    """Rows start..end of the layer's weight, bf16: w = scale·code + offset in float32 per group of 32
    (qgemv's code layout: 8-bit codes as they are; 4-bit, byte j of a group holds value j in its low
    nibble and value j + 16 in its high one)."""
    n, groups = end - start, layer.in_features // GROUP
    scale, offset = (t[start:end, :, None].float() for t in layer.scale_offset)
    codes = layer.codes[start:end]
    w = torch.empty(n, groups, GROUP)
    if layer.bits == 8:
        torch.addcmul(offset, codes.view(n, groups, GROUP).float(), scale, out=w)
    else:
        codes = codes.view(n, groups, GROUP // 2)
        torch.addcmul(offset, (codes & 15).float(), scale, out=w[..., : GROUP // 2])
        torch.addcmul(offset, (codes >> 4).float(), scale, out=w[..., GROUP // 2 :])
    return w.view(n, layer.in_features).to(torch.bfloat16)
