"""Prefill on floe's quantized layers without a stored dense copy of their weights.

Many rows at once (a prompt) run fastest as a bf16 matrix product (AMX / AVX-512 BF16 GEMM), not as
one int8 GEMV per row, and bf16 activations keep the prompt's numerics those of the dense weights
(the int8 rounding of every activation flips SmolLM2's near-tie on the README prompt). A stored bf16
copy of every matrix would cost 2 bytes per weight, 3.5x the 4-bit codes; instead each matrix is
dequantized from the codes the kernel reads, a band of rows at a time, right before its band of
the product: one band (~2 MB) exists at a time. The kernel dequantizes a band in one pass, straight
to the product's dtype (`QLinear.rows`; three float passes in PyTorch took ~0.7 of a 64-token
prompt). docs/PERF.md has the measurements.

Where the CPU has no native bf16 matrix product (AVX2 without AVX-512 BF16 or AMX: oneDNN emulates
it, ~7x slower than fp32 there) the bands and the product are float32 instead (`gemm_dtype`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from floe.engine.int4 import DENSE_FROM_ROWS, gemm_dtype
from floe.engine.qgemv import BAND_ROWS, QLinear

BAND = 1 << 20  # weights dequantized at a time
# Prompts of up to this many rows, where the GEMM runs in float32: floe's own product (gemm_q), each
# band dequantized into the core's cache and met by every row there, instead of a dequantized band in
# memory and PyTorch's GEMM. A prefill of the default model on a 2-core Zen 3 (AVX2), interleaved: 1.8x
# faster at 16 tokens, 1.3x at 64, 1.1x at 128 with OpenMP's threads polite (as floe's CLI sets them:
# floe.cli.machine.polite_openmp); 4.5x / 2.4x / 1.6x with libgomp's default spinning, which holds the
# cores the band's dequant on floe's pool needs; at 256, 0.95-1.1x (PyTorch's GEMM reuses each value
# across more rows).
FUSED_ROWS = 128


def project(module: nn.Module, x: Tensor, splits: list[int] | None = None) -> Tensor:
    """module(x); a QLinear without a stored bf16 copy given a prompt's rows (DENSE_FROM_ROWS or more,
    where it would use one) runs fused_linear (a short prompt, float32 GEMMs) or banded_linear instead
    of its kernel row by row.

    splits: x's rows are several prompts' (their row counts): each prompt's product is computed as
    it would be alone (a matrix product's rounding can depend on its row count), the dequantized
    bands shared. Each split must be DENSE_FROM_ROWS rows or more."""
    if x.shape[0] >= DENSE_FROM_ROWS and isinstance(module, QLinear) and module.dense is None:
        parts = [x.shape[0]] if splits is None else splits
        fused = [fuses(n) for n in parts]
        if all(fused):  # (each row's outputs alone: the splits as one product)
            return fused_linear(module, x)
        if not any(fused):
            return banded_linear(module, x, splits=splits)
        return torch.cat([fused_linear(module, part) if f else banded_linear(module, part)
                          for part, f in zip(x.split(parts), fused, strict=True)])
    if splits is not None and len(splits) > 1:
        return torch.cat([module(part) for part in x.split(splits)])
    return module(x)


def fuses(rows: int) -> bool:
    """Whether a prompt of `rows` rows runs fused_linear here (float32 GEMMs, FUSED_ROWS at most)."""
    return rows <= FUSED_ROWS and gemm_dtype() == torch.float32


def fused_linear(layer: QLinear, x: Tensor) -> Tensor:
    """x Wᵀ (+ b), float32, by floe's operator (torch.ops.floe.gemm_q): each output row x's row alone
    times the weight's float32 values (dequant_q's), whatever rows are beside it."""
    y = torch.ops.floe.gemm_q(x, layer.blocks, layer.number)
    return y if layer.bias is None else y.add_(layer.bias)


def banded_linear(layer: QLinear, x: Tensor, dtype: torch.dtype | None = None,
                  splits: list[int] | None = None) -> Tensor:
    """x Wᵀ (+ b) for x [T, in], float32 out, the weight dequantized a band of rows at a time; the
    product in `dtype` (default gemm_dtype(); in bf16 as QLinear computes it with a bf16 copy: bf16
    inputs, weights and output); with splits (see project), one product per split and band."""
    dtype = dtype or gemm_dtype()
    xb = x.to(dtype)
    parts = [xb] if splits is None else xb.split(splits)
    out = torch.empty(x.shape[0], layer.out_features)
    outs = [out] if splits is None else out.split(splits)
    step = max(BAND_ROWS, BAND // layer.in_features // BAND_ROWS * BAND_ROWS)  # whole bands (qgemv)
    for start in range(0, layer.out_features, step):
        end = min(start + step, layer.out_features)
        bias = None if layer.bias is None else layer.bias[start:end].to(dtype)
        band = layer.rows(slice(start, end), dtype)
        for part, o in zip(parts, outs, strict=True):
            o[:, start:end] = F.linear(part, band, bias)
    return out
