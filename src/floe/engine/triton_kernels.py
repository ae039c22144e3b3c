"""Fused Triton kernels for the batch-1 decode step (CUDA only).

Each replaces a chain of small PyTorch ops whose launch latency, not their bytes, dominated the step:
  rmsnorm            residual add + RMSNorm (7-8 kernels -> 1)
  rope_kv_write      rotary on q and k, k and v written into the cache at the step's position (~16 -> 1)
  decode_attention   one query over the cached positions with an online softmax (~7 -> 1)
  swiglu             silu(gate) * up (2 -> 1)
Positions are read from a device tensor, so all of them can live inside a CUDA graph.
Rounding follows the PyTorch reference: fp32 math, bf16 results where the reference has them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rmsnorm_kernel(X, R, W, Y, RES_OUT, N, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x = x + tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)
        x = x.to(RES_OUT.dtype.element_ty)  # the residual stream is stored in the model dtype
        tl.store(RES_OUT + offs, x, mask=mask)
        x = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(W + offs, mask=mask, other=0.0)
    y = (x * inv).to(Y.dtype.element_ty) * w
    tl.store(Y + offs, y, mask=mask)


def rmsnorm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(norm(x + residual) * weight, x + residual) for one row x [1, N]."""
    n = x.shape[-1]
    y = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    _rmsnorm_kernel[(1,)](x, residual if residual is not None else x, weight, y, res_out, n, eps,
                          HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(n), num_warps=8)
    return y, res_out


@triton.jit
def _rope_kv_kernel(QKV, COS, SIN, POS, Q_OUT, K_CACHE, V_CACHE, stride_kh, stride_ks,
                    H: tl.constexpr, KV: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr):
    h = tl.program_id(0)
    pos = tl.load(POS)
    offs = tl.arange(0, HALF)
    cos1 = tl.load(COS + pos * HD + offs)
    cos2 = tl.load(COS + pos * HD + HALF + offs)
    sin1 = tl.load(SIN + pos * HD + offs)
    sin2 = tl.load(SIN + pos * HD + HALF + offs)
    x1 = tl.load(QKV + h * HD + offs).to(tl.float32)
    x2 = tl.load(QKV + h * HD + HALF + offs).to(tl.float32)
    o1 = x1 * cos1 - x2 * sin1
    o2 = x2 * cos2 + x1 * sin2
    if h < H:
        tl.store(Q_OUT + h * HD + offs, o1.to(Q_OUT.dtype.element_ty))
        tl.store(Q_OUT + h * HD + HALF + offs, o2.to(Q_OUT.dtype.element_ty))
    else:
        kh = h - H
        dst = kh * stride_kh + pos * stride_ks
        tl.store(K_CACHE + dst + offs, o1.to(K_CACHE.dtype.element_ty))
        tl.store(K_CACHE + dst + HALF + offs, o2.to(K_CACHE.dtype.element_ty))
        d = tl.arange(0, HD)
        v = tl.load(QKV + (H + KV + kh) * HD + d)
        tl.store(V_CACHE + dst + d, v)


def rope_kv_write(qkv: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, k_cache: Tensor, v_cache: Tensor,
                  n_heads: int, n_kv_heads: int, head_dim: int) -> Tensor:
    """Rotary q [n_heads, head_dim]; rotary k and v written into k_cache/v_cache [n_kv, S, hd] at pos."""
    q = torch.empty(n_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    _rope_kv_kernel[(n_heads + n_kv_heads,)](
        qkv, cos, sin, pos, q, k_cache, v_cache, k_cache.stride(0), k_cache.stride(1),
        H=n_heads, KV=n_kv_heads, HD=head_dim, HALF=head_dim // 2, num_warps=1)
    return q


@triton.jit
def _decode_attention_kernel(Q, K, V, POS, OUT, stride_kh, stride_ks, scale,
                             GROUP: tl.constexpr, HD: tl.constexpr, BLOCK_N: tl.constexpr):
    h = tl.program_id(0)
    kh = h // GROUP
    pos = tl.load(POS)
    d = tl.arange(0, HD)
    q = tl.load(Q + h * HD + d).to(tl.float32)
    m = tl.full((), float("-inf"), tl.float32)
    total = tl.full((), 0.0, tl.float32)
    acc = tl.zeros((HD,), tl.float32)
    for start in range(0, pos + 1, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        valid = n <= pos
        ptrs = kh * stride_kh + n[:, None] * stride_ks + d[None, :]
        k = tl.load(K + ptrs, mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.where(valid, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        v = tl.load(V + ptrs, mask=valid[:, None], other=0.0).to(tl.float32)
        total = total * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    tl.store(OUT + h * HD + d, (acc / total).to(OUT.dtype.element_ty))


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor, n_kv_heads: int) -> Tensor:
    """Attention of q [n_heads, hd] over positions 0..pos of k_cache/v_cache [n_kv, S, hd].

    Returns [1, n_heads * hd]."""
    n_heads, hd = q.shape
    out = torch.empty(1, n_heads * hd, dtype=q.dtype, device=q.device)
    _decode_attention_kernel[(n_heads,)](
        q, k_cache, v_cache, pos, out, k_cache.stride(0), k_cache.stride(1), hd**-0.5,
        GROUP=n_heads // n_kv_heads, HD=hd, BLOCK_N=64, num_warps=4)
    return out


@triton.jit
def _swiglu_kernel(GU, OUT, F, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < F
    g = tl.load(GU + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + F + offs, mask=mask, other=0.0)
    silu = (g * tl.sigmoid(g)).to(OUT.dtype.element_ty)
    tl.store(OUT + offs, silu * u, mask=mask)


def swiglu(gate_up: Tensor) -> Tensor:
    """silu(gate) * up for gate_up [1, 2F] (gate first): [1, F]."""
    f = gate_up.shape[-1] // 2
    out = torch.empty(1, f, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _swiglu_kernel[(triton.cdiv(f, block),)](gate_up, out, f, BLOCK=block, num_warps=4)
    return out
