"""Quantized weights as a file stores them, and their exact re-expression as 4-bit groups.

A GGUF block type stores each weight row as blocks of 32 (or 256) values with per-block scales.
`QuantizedWeight` keeps those bytes untouched (a view of the memory-mapped file) so that an engine can
run them natively; `int4_groups` rewrites the supported types, without changing a single weight value,
as unsigned 4-bit codes q in [0, 15] with a scale and a zero per group of 32 along the row:

    w = (q - 8) * scale + zero

which is the layout of PyTorch's packed int4 CPU kernels. A type whose codes are wider than 4 bits
(Q8_0) is split into two 4-bit halves laid side by side along the row (the input is repeated to
match), so `k_repeat` tells the caller how many times to repeat the input.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from floe.errors import NotAModel

GROUP = 32
# Values dequantized at a time (float32, 4 MB): a whole matrix never exists in float32 on its way
# to another dtype.
BAND = 1 << 20

# Block types whose values int4_groups re-expresses exactly (in float32 arithmetic). Not here:
# Q6_K (sub-blocks of 16 weights, finer than the kernel's smallest group of 32), Q5_x, Q2_K/Q3_K.
INT4_EXACT = ("Q4_0", "Q4_1", "Q8_0", "Q4_K")


@dataclass
class Int4Groups:
    codes: np.ndarray  # uint8 [rows, cols * k_repeat], values 0..15
    scale: np.ndarray  # float32 [rows, cols * k_repeat / 32]
    zero: np.ndarray  # float32, same shape as scale
    k_repeat: int  # the input is repeated this many times along its last axis


@dataclass
class QuantizedWeight:
    """A 2-D weight in a GGUF block type: `blocks` uint8 [rows, bytes per row], untouched file bytes."""

    qtype: str
    shape: tuple[int, int]  # (rows, cols) as the matrix is used: y = W x, W [rows, cols]
    blocks: np.ndarray
    # Where `blocks` lie in their file, row after row (path, offset of row 0); None for a copy.
    file: tuple[Path, int] | None = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight's values [rows, cols] in `dtype` (computed in float32, as gguf does)."""
        return dequantized(self.blocks, self.qtype, self.shape, dtype)

    def rows(self, order: np.ndarray | torch.Tensor) -> QuantizedWeight:
        """The same weight with its rows reordered (quantization blocks never span rows)."""
        index = np.asarray(order)
        return QuantizedWeight(self.qtype, (len(index), self.shape[1]), self.blocks[index])

    def read_rows(self, ids: np.ndarray, fd: int | None) -> QuantizedWeight:
        """Rows `ids` (a table lookup), read with pread from `fd`, this weight's file opened, where the
        weight knows its place in it: through the mapping, the kernel would map the page cache's folio
        around each row (2 MB on Linux 6.x) into this process's resident memory."""
        if self.file is None or fd is None:
            return self.rows(ids)
        path, offset = self.file
        width = self.blocks.shape[1]
        out = np.empty((len(ids), width), dtype=np.uint8)
        for row, i in zip(out, np.asarray(ids).tolist(), strict=True):
            if os.preadv(fd, [row], offset + i * width) != width:
                raise NotAModel(f"{path} is shorter than when it was loaded")
        return QuantizedWeight(self.qtype, (len(ids), self.shape[1]), out)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight | None:
        """Rows of several weights stacked, or None if they differ in type or width."""
        first = parts[0]
        if len(parts) == 1:
            return first  # as it is: a view of the file stays one
        if any(p.qtype != first.qtype or p.shape[1] != first.shape[1] for p in parts):
            return None
        rows = sum(p.shape[0] for p in parts)
        return QuantizedWeight(first.qtype, (rows, first.shape[1]),
                               np.concatenate([p.blocks for p in parts]))

    @property
    def has_int4_form(self) -> bool:
        """Whether int4_groups() can re-express this weight exactly (decided without converting)."""
        block = 256 if self.qtype == "Q4_K" else GROUP
        return self.qtype in INT4_EXACT and self.shape[1] % block == 0

    def int4_groups(self) -> Int4Groups | None:
        """This weight as exact 4-bit groups of 32, or None if its type has no such form here."""
        if not self.has_int4_form:
            return None
        rows, cols = self.shape
        if self.qtype == "Q4_K":
            return _q4_k_groups(self.blocks, rows, cols)
        nb = cols // GROUP
        b = self.blocks.reshape(rows, nb, -1)
        d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        if self.qtype == "Q8_0":  # w = d * q, q int8 = 16 * hi + lo, hi in [-8, 7], lo in [0, 15]
            q = b[..., 2:34].copy().view(np.int8).astype(np.int16)
            hi, lo = (q >> 4) + 8, q & 15
            # hi half: (hi+8 - 8) * 16d + 0;  lo half: (lo - 8) * d + 8d
            codes = np.concatenate([hi.reshape(rows, cols), lo.reshape(rows, cols)], axis=1)
            scale = np.concatenate([16 * d, d], axis=1)
            zero = np.concatenate([np.zeros_like(d), 8 * d], axis=1)
            return Int4Groups(codes.astype(np.uint8), scale, zero, 2)
        if self.qtype == "Q4_0":  # w = d * (q - 8)
            qs, zero = b[..., 2:18], np.zeros_like(d)
        else:  # Q4_1: w = d * q + m = (q - 8) * d + (m + 8d)
            m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            qs, zero = b[..., 4:20], m + 8 * d
        # Byte j of a block holds value j in its low nibble and value j + 16 in its high nibble.
        codes = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(rows, cols)
        return Int4Groups(codes, d, zero, 1)


def dequantized(data: np.ndarray, qtype: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """GGUF bytes `data` (uint8 [rows, bytes per row], or 1-D) of type `qtype` as a `dtype` tensor of
    `shape`, a band of rows at a time, so the float32 values of the whole tensor never exist at once
    (unless `dtype` is float32)."""
    rows = data.reshape(-1, data.shape[-1]) if data.ndim > 1 else data.reshape(1, -1)
    out = torch.empty(len(rows), int(np.prod(shape)) // len(rows), dtype=dtype)
    step = max(1, BAND // out.shape[1])
    for start in range(0, len(rows), step):
        band = np.asarray(dequantize(rows[start : start + step], Q[qtype]), dtype=np.float32)
        out[start : start + step] = torch.from_numpy(band.reshape(-1, out.shape[1]))
    return out.reshape(shape)


def _q4_k_groups(blocks: np.ndarray, rows: int, cols: int) -> Int4Groups:
    """Q4_K: super-blocks of 256 = 8 sub-blocks of 32, w = d·sc_j·q − dmin·m_j with 6-bit sc_j, m_j
    packed in 12 bytes (llama.cpp's get_scale_min_k4); 4-bit q, 128 bytes: byte l of 32-byte chunk c
    holds sub-block 2c's weight l (low nibble) and sub-block 2c+1's weight l (high nibble)."""
    b = blocks.reshape(rows, cols // 256, 144)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    q = b[..., 4:16].astype(np.uint8)  # the 12 scale bytes
    sc = np.empty(q.shape[:-1] + (8,), dtype=np.float32)
    mn = np.empty_like(sc)
    sc[..., :4], mn[..., :4] = q[..., 0:4] & 63, q[..., 4:8] & 63
    sc[..., 4:] = (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    scale = d[..., None] * sc  # [rows, n_super, 8]
    zero = 8 * scale - dmin[..., None] * mn  # (q - 8)·scale + zero = scale·q − dmin·m
    qs = b[..., 16:144].reshape(rows, cols // 256, 4, 32)
    codes = np.stack([qs & 15, qs >> 4], axis=3)  # [rows, super, chunk, lo/hi, 32]
    return Int4Groups(codes.reshape(rows, cols), scale.reshape(rows, -1), zero.reshape(rows, -1), 1)
