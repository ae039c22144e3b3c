"""Fused Triton kernels for the batch-1 decode step (CUDA only).

Each replaces a chain of small PyTorch ops whose launch latency, not their bytes, dominated the step:
  rmsnorm            residual add + RMSNorm (7-8 kernels -> 1)
  rope_kv_write      rotary on q and k, k and v written into the cache at the step's position (~16 -> 1)
  decode_attention   one query over the cached positions with an online softmax (~7 -> 1)
  swiglu             silu(gate) * up (2 -> 1)
Positions are read from a device tensor, so all of them can live inside a CUDA graph.
Rounding follows the PyTorch reference: fp32 math, bf16 results where the reference has them.

Every kernel also takes B rows at once (continuous batching: one row per KV cache slot, each with its
own position); a row's math does not depend on B. With `slots`, the caches are a layer's whole
[n_slots, n_kv, S, hd] tensor and row b reads and writes slot slots[b]; a row whose slot is -1 is
padding: it writes nothing and sees no positions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

LOG2E = 1.4426950408889634


@triton.jit
def _tanh(x):
    # (tanh through the sigmoid: Triton's libdevice path differs between versions; the soft-capped
    # scores it bends are within ~1e-7 of torch.tanh's relative to the cap)
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _rmsnorm_kernel(X, R, W, Y, RES_OUT, W_PRE, N, eps, HAS_RES: tl.constexpr, HAS_PRE: tl.constexpr,
                    BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    row = tl.program_id(0) * N
    x = tl.load(X + row + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_PRE:  # (Gemma's post norms) x normed on its own first, rounded as RMSNorm rounds, then added
        pre = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
        w_pre = tl.load(W_PRE + offs, mask=mask, other=0.0)
        x = ((x * pre).to(Y.dtype.element_ty) * w_pre).to(Y.dtype.element_ty).to(tl.float32)
    if HAS_RES:
        x = x + tl.load(R + row + offs, mask=mask, other=0.0).to(tl.float32)
        x = x.to(RES_OUT.dtype.element_ty)  # the residual stream is stored in the model dtype
        tl.store(RES_OUT + row + offs, x, mask=mask)
        x = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(W + offs, mask=mask, other=0.0)
    y = (x * inv).to(Y.dtype.element_ty) * w
    tl.store(Y + row + offs, y, mask=mask)


def rmsnorm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None,
            pre_weight: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(norm(x + residual) * weight, x + residual) for rows x [B, N]; pre_weight: x is first
    norm(x) * pre_weight (Gemma's post-attention and post-feed-forward norms, in the same kernel as the
    residual's: within a rounding of two calls, not their bits: the product and the sum may become one
    FMA)."""
    n = x.shape[-1]
    y = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    _rmsnorm_kernel[(x.shape[0],)](x, residual if residual is not None else x, weight, y, res_out,
                                   pre_weight if pre_weight is not None else weight, n, eps,
                                   HAS_RES=residual is not None, HAS_PRE=pre_weight is not None,
                                   BLOCK=triton.next_power_of_2(n), num_warps=8)
    return y, res_out


@triton.jit
def _position_and_slot(POS, SLOTS, b, HAS_SLOTS: tl.constexpr):
    """Row b's position and KV slot (slot 0 without per-row slots; a padding row's slot is -1)."""
    pos = tl.load(POS + b)
    if HAS_SLOTS:
        slot = tl.load(SLOTS + b)
    else:
        slot = b * 0
    return pos, slot


@triton.jit
def _rope_kv_kernel(QKV, COS, SIN, POS, SLOTS, Q_OUT, K_CACHE, V_CACHE, NORM, eps, stride_slot, stride_kh,
                    stride_ks, H: tl.constexpr, KV: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr,
                    HAS_SLOTS: tl.constexpr, HAS_NORM: tl.constexpr):
    h = tl.program_id(0)
    b = tl.program_id(1)
    pos, slot = _position_and_slot(POS, SLOTS, b, HAS_SLOTS)
    offs = tl.arange(0, HALF)
    cos1 = tl.load(COS + pos * HD + offs)
    cos2 = tl.load(COS + pos * HD + HALF + offs)
    sin1 = tl.load(SIN + pos * HD + offs)
    sin2 = tl.load(SIN + pos * HD + HALF + offs)
    row = b * (H + 2 * KV) * HD
    x1 = tl.load(QKV + row + h * HD + offs).to(tl.float32)
    x2 = tl.load(QKV + row + h * HD + HALF + offs).to(tl.float32)
    if HAS_NORM:  # the head's RMSNorm first (Qwen3's q/k norm), rounded as transformer.norm_heads rounds
        r = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HD + eps)
        dt = QKV.dtype.element_ty
        w1 = tl.load(NORM + h * HD + offs).to(tl.float32)
        w2 = tl.load(NORM + h * HD + HALF + offs).to(tl.float32)
        x1 = ((x1 * r).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
        x2 = ((x2 * r).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
    o1 = x1 * cos1 - x2 * sin1
    o2 = x2 * cos2 + x1 * sin2
    if h < H:
        tl.store(Q_OUT + (b * H + h) * HD + offs, o1.to(Q_OUT.dtype.element_ty))
        tl.store(Q_OUT + (b * H + h) * HD + HALF + offs, o2.to(Q_OUT.dtype.element_ty))
    elif slot >= 0:  # a padding row (slot -1) writes no cache
        kh = h - H
        dst = slot.to(tl.int64) * stride_slot + kh * stride_kh + pos * stride_ks
        tl.store(K_CACHE + dst + offs, o1.to(K_CACHE.dtype.element_ty))
        tl.store(K_CACHE + dst + HALF + offs, o2.to(K_CACHE.dtype.element_ty))
        d = tl.arange(0, HD)
        v = tl.load(QKV + row + (H + KV + kh) * HD + d)
        tl.store(V_CACHE + dst + d, v)


def rope_kv_write(qkv: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, k_cache: Tensor, v_cache: Tensor,
                  n_heads: int, n_kv_heads: int, head_dim: int, slots: Tensor | None = None,
                  norm: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """Rotary q [B, n_heads, head_dim] of qkv [B, *]; rotary k and v written into the caches at pos[b]
    (k_cache/v_cache [n_kv, S, hd], or [n_slots, n_kv, S, hd] with `slots` [B]). norm: each q and k
    head RMS-normed first with these weights [n_heads + n_kv, head_dim] (transformer.qk_norm_weight:
    Qwen3's q/k norm, as transformer.norm_heads computes it; ~8 kernels a layer saved)."""
    b = qkv.shape[0]
    q = torch.empty(b, n_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    stride_slot = k_cache.stride(0) if slots is not None else 0
    _rope_kv_kernel[(n_heads + n_kv_heads, b)](
        qkv, cos, sin, pos, slots if slots is not None else pos, q, k_cache, v_cache,
        norm if norm is not None else cos, eps, stride_slot, k_cache.stride(-3), k_cache.stride(-2),
        H=n_heads, KV=n_kv_heads, HD=head_dim, HALF=head_dim // 2, HAS_SLOTS=slots is not None,
        HAS_NORM=norm is not None, num_warps=1)
    return q


@triton.jit
def _attention_split_kernel(Q, K, V, POS, SLOTS, M_OUT, L_OUT, ACC_OUT, stride_slot, stride_kh, stride_ks,
                            scale, window, softcap, H: tl.constexpr, GROUP: tl.constexpr,
                            GROUP_P: tl.constexpr, HD: tl.constexpr, CHUNK: tl.constexpr,
                            SPLITS: tl.constexpr, IEEE: tl.constexpr, HAS_SLOTS: tl.constexpr,
                            HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    # One program: one row, one KV head, one chunk of positions, all GROUP query heads that share them
    # (padded to GROUP_P rows for the tensor cores), so each K/V row is read once. Writes the chunk's
    # max, sum of exponentials and weighted values for the combine kernel.
    kh = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    pos, slot = _position_and_slot(POS, SLOTS, b, HAS_SLOTS)
    g = tl.arange(0, GROUP_P)
    real = g < GROUP
    d = tl.arange(0, HD)
    n = split * CHUNK + tl.arange(0, CHUNK)
    valid = (n <= pos) & (slot >= 0)
    if HAS_WINDOW:  # (Mistral, Gemma's local layers) the last `window` positions, its own included
        valid = valid & (n > pos - window)
    q = tl.load(Q + (b * H + kh * GROUP + g)[:, None] * HD + d[None, :], mask=real[:, None], other=0.0)
    base = tl.maximum(slot, 0).to(tl.int64) * stride_slot + kh * stride_kh
    rows = base + n[:, None] * stride_ks + d[None, :]
    k = tl.load(K + rows, mask=valid[:, None], other=0.0)
    v = tl.load(V + rows, mask=valid[:, None], other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if HAS_SOFTCAP:  # (Gemma 2) softcap * tanh(scores / softcap), before the softmax
        s = tl.where(valid[None, :], softcap * _tanh(s * scale / softcap), float("-inf"))
    else:
        s = tl.where(valid[None, :], s * scale, float("-inf"))  # [GROUP_P, CHUNK]
    m = tl.max(s, axis=1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    p = tl.exp(s - m_safe[:, None])
    if IEEE:
        acc = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v)  # probabilities rounded to the cache dtype, as the reference
    heads = b * H + kh * GROUP + g
    tl.store(M_OUT + heads * SPLITS + split, m, mask=real)
    tl.store(L_OUT + heads * SPLITS + split, tl.sum(p, axis=1), mask=real)
    tl.store(ACC_OUT + (heads[:, None] * SPLITS + split) * HD + d[None, :], acc, mask=real[:, None])


@triton.jit
def _attention_reduce_kernel(M_IN, L_IN, ACC_IN, OUT, HD: tl.constexpr, SPLITS: tl.constexpr):
    h = tl.program_id(0)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, HD)
    m = tl.load(M_IN + h * SPLITS + s)
    m_max = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))  # chunks past pos weigh nothing
    total = tl.sum(tl.load(L_IN + h * SPLITS + s) * w, axis=0)
    total = tl.where(total == 0.0, 1.0, total)  # a padding row saw no positions: zeros, not NaN
    acc = tl.load(ACC_IN + (h * SPLITS + s)[:, None] * HD + d[None, :])
    out = tl.sum(acc * w[:, None], axis=0) / total
    tl.store(OUT + h * HD + d, out.to(OUT.dtype.element_ty))


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor, n_kv_heads: int,
                     bucket: int, chunk: int = 64, slots: Tensor | None = None, scale: float | None = None,
                     window: int | None = None, softcap: float | None = None) -> Tensor:
    """Attention of q [B, n_heads, hd] (or [n_heads, hd]) over positions 0..pos[b] (< bucket) of the
    caches ([n_kv, S, hd], or [n_slots, n_kv, S, hd] with `slots` [B]). scale: the factor on q·k (None:
    hd ** -0.5); window: each row sees only its last `window` positions, its own included (None: all);
    softcap: the scores soft-capped (Gemma 2), as transformer.Attention computes them.

    Split over the positions (flash-decoding): (KV heads x bucket/chunk x B) programs, then a combine.
    Returns [B, n_heads * hd].
    """
    n_heads, hd = q.shape[-2:]
    b = q.numel() // (n_heads * hd)
    splits = triton.next_power_of_2(triton.cdiv(bucket, chunk))
    m = torch.empty(b * n_heads, splits, dtype=torch.float32, device=q.device)
    lsum = torch.empty_like(m)
    acc = torch.empty(b * n_heads, splits, hd, dtype=torch.float32, device=q.device)
    group = n_heads // n_kv_heads
    stride_slot = k_cache.stride(0) if slots is not None else 0
    _attention_split_kernel[(n_kv_heads, splits, b)](
        q, k_cache, v_cache, pos, slots if slots is not None else pos, m, lsum, acc, stride_slot,
        k_cache.stride(-3), k_cache.stride(-2), hd**-0.5 if scale is None else scale, window or 0,
        softcap or 1.0, H=n_heads, GROUP=group, GROUP_P=max(16, triton.next_power_of_2(group)), HD=hd,
        CHUNK=chunk, SPLITS=splits, IEEE=q.dtype == torch.float32, HAS_SLOTS=slots is not None,
        HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None, num_warps=4)
    out = torch.empty(b, n_heads * hd, dtype=q.dtype, device=q.device)
    _attention_reduce_kernel[(b * n_heads,)](m, lsum, acc, out, HD=hd, SPLITS=splits, num_warps=2)
    return out


@triton.jit
def _prompt_attention_tile(q, K, V, base, stride_ks, cols, pos, hi, d, m_i, l_i, acc, scale, window,
                           softcap, MASKED: tl.constexpr, IEEE: tl.constexpr, HAS_WINDOW: tl.constexpr,
                           HAS_SOFTCAP: tl.constexpr):
    """One BLOCK_N tile of keys for a block of rows (online softmax, exp2 with log2(e) in `scale`;
    with HAS_SOFTCAP `scale` is q·k's own and log2(e) comes after the cap). With HAS_WINDOW a row may
    see no key of a tile: its running max stays -inf and the tile adds nothing."""
    if MASKED:
        inside = cols < hi
        k = tl.load(K + base + cols[:, None] * stride_ks + d[None, :], mask=inside[:, None], other=0.0)
        v = tl.load(V + base + cols[:, None] * stride_ks + d[None, :], mask=inside[:, None], other=0.0)
    else:
        k = tl.load(K + base + cols[:, None] * stride_ks + d[None, :])
        v = tl.load(V + base + cols[:, None] * stride_ks + d[None, :])
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    else:
        s = tl.dot(q, tl.trans(k)) * scale
    if HAS_SOFTCAP:
        s = softcap * _tanh(s / softcap) * 1.4426950408889634  # (LOG2E: a jit function reads no global)
    if MASKED:
        seen = cols[None, :] <= pos[:, None]
        if HAS_WINDOW:
            seen = seen & (cols[None, :] > pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite without a window: every row sees key 0 first
    if HAS_WINDOW:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)  # probabilities rounded to the cache dtype
    return m_new, l_i, acc


@triton.jit
def _prompt_attention_kernel(Q, K, V, POS, SLOTS, OUT, stride_slot, stride_kh, stride_ks, n_rows, scale,
                             window, softcap, H: tl.constexpr, GROUP: tl.constexpr, HD: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                             HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    # One program: BLOCK_M consecutive rows of one prompt (one slot: row 0's) and one query head. Keys
    # 0..the block's last position are read from the cache in BLOCK_N tiles (flash attention: running
    # max and sum); row r sees keys up to its own position, read from POS on the device. Tiles below
    # the block's first position need no mask.
    h = tl.program_id(1)
    kh = h // GROUP
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    real = rows < n_rows
    pos = tl.load(POS + rows, mask=real, other=0)
    slot = tl.maximum(tl.load(SLOTS), 0)
    d = tl.arange(0, HD)
    q = tl.load(Q + (rows[:, None] * H + h) * HD + d[None, :], mask=real[:, None], other=0.0)
    base = slot.to(tl.int64) * stride_slot + kh * stride_kh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HD], tl.float32)
    hi = tl.max(pos, axis=0) + 1
    # (a padding row, past n_rows, sees unmasked keys too: its output is not stored)
    first = tl.min(tl.where(real, pos, hi), axis=0)
    if HAS_WINDOW:  # from the tile of the block's first row's first key, every tile masked
        for start in range((tl.maximum(first - window + 1, 0) // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
            m_i, l_i, acc = _prompt_attention_tile(q, K, V, base, stride_ks, start + tl.arange(0, BLOCK_N),
                                                   pos, hi, d, m_i, l_i, acc, scale, window, softcap, True,
                                                   IEEE, True, HAS_SOFTCAP)
    else:
        lo = (first // BLOCK_N) * BLOCK_N
        for start in range(0, lo, BLOCK_N):
            m_i, l_i, acc = _prompt_attention_tile(q, K, V, base, stride_ks, start + tl.arange(0, BLOCK_N),
                                                   pos, hi, d, m_i, l_i, acc, scale, window, softcap, False,
                                                   IEEE, False, HAS_SOFTCAP)
        for start in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _prompt_attention_tile(q, K, V, base, stride_ks, start + tl.arange(0, BLOCK_N),
                                                   pos, hi, d, m_i, l_i, acc, scale, window, softcap, True,
                                                   IEEE, False, HAS_SOFTCAP)
    out = acc / l_i[:, None]
    tl.store(OUT + (rows[:, None] * H + h) * HD + d[None, :], out.to(OUT.dtype.element_ty),
             mask=real[:, None])


def flash_prompt_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor, slots: Tensor,
                           n_kv_heads: int, config: tuple[int, int, int, int] | None = None,
                           scale: float | None = None, window: int | None = None,
                           softcap: float | None = None) -> Tensor:
    """Causal attention of one prompt's rows q [T, n_heads, hd] at positions pos [T] (on the device)
    over their slot's cache (k_cache/v_cache [n_slots, n_kv, S, hd]; the slot is slots[0]): row t sees
    positions 0..pos[t] (with `window`, only the last `window` of them). No host value depends on the
    positions, so the call can be graph-captured. config: (BLOCK_M, BLOCK_N, warps, stages); scale,
    window, softcap: as decode_attention's. Returns [T, n_heads * hd]."""
    t, n_heads, hd = q.shape
    out = torch.empty(t, n_heads * hd, dtype=q.dtype, device=q.device)
    ieee = q.dtype == torch.float32
    block_m, block_n, warps, stages = config or ((64, 32, 4, 2) if ieee else (64, 64, 4, 3))
    _prompt_attention_kernel[(triton.cdiv(t, block_m), n_heads)](
        q, k_cache, v_cache, pos, slots, out, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), t,
        (hd**-0.5 if scale is None else scale) * (1.0 if softcap is not None else LOG2E), window or 0,
        softcap or 1.0, H=n_heads, GROUP=n_heads // n_kv_heads, HD=hd, BLOCK_M=block_m, BLOCK_N=block_n,
        IEEE=ieee, HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None, num_warps=warps,
        num_stages=stages)
    return out


@triton.jit
def _argmax_partial_kernel(X, VAL, IDX, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < N, other=float("-inf"))
    best = tl.max(x, axis=0)
    # the first index holding the maximum, as torch.argmax answers
    idx = tl.min(tl.where(x == best, offs, N), axis=0)
    tl.store(VAL + tl.program_id(0), best)
    tl.store(IDX + tl.program_id(0), idx)


@triton.jit
def _argmax_final_kernel(VAL, IDX, OUT, PARTS: tl.constexpr):
    p = tl.arange(0, PARTS)
    v = tl.load(VAL + p)
    best = tl.max(v, axis=0)
    idx = tl.min(tl.where(v == best, tl.load(IDX + p), 2147483647), axis=0)
    tl.store(OUT, idx.to(tl.int64))


def argmax(x: Tensor, block: int = 4096) -> Tensor:
    """torch.argmax of a float32 vector in two parallel passes (one block-wide pass took 27 us)."""
    n = x.numel()
    parts = triton.next_power_of_2(triton.cdiv(n, block))
    val = torch.full((parts,), float("-inf"), dtype=torch.float32, device=x.device)
    idx = torch.zeros(parts, dtype=torch.int32, device=x.device)
    out = torch.empty(1, dtype=torch.int64, device=x.device)
    _argmax_partial_kernel[(triton.cdiv(n, block),)](x, val, idx, n, BLOCK=block, num_warps=8)
    _argmax_final_kernel[(1,)](val, idx, out, PARTS=parts, num_warps=1)
    return out


@triton.jit
def _swiglu_kernel(GU, OUT, F, BLOCK: tl.constexpr, GELU: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < F
    row = tl.program_id(1) * F
    g = tl.load(GU + 2 * row + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + 2 * row + F + offs, mask=mask, other=0.0)
    if GELU:  # GeGLU (Gemma): GELU's tanh approximation, as torch's gelu(approximate="tanh")
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        act = (0.5 * g * (1.0 + _tanh(inner))).to(OUT.dtype.element_ty)
    else:
        act = (g * tl.sigmoid(g)).to(OUT.dtype.element_ty)
    tl.store(OUT + row + offs, act * u, mask=mask)


def swiglu(gate_up: Tensor, gelu: bool = False) -> Tensor:
    """silu(gate) * up for rows gate_up [B, 2F] (gate first): [B, F]; gelu: GELU's tanh form for SiLU
    (Gemma's GeGLU)."""
    b, f = gate_up.shape[0], gate_up.shape[-1] // 2
    out = torch.empty(b, f, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _swiglu_kernel[(triton.cdiv(f, block), b)](gate_up, out, f, BLOCK=block, GELU=gelu, num_warps=4)
    return out
