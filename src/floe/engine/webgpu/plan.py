"""How a WebGPU step is laid out for an adapter, before anything is uploaded: the GEMV's workgroup shapes and
loads (the lanes layout's, overridable through FLOE_WEBGPU_* for bench/probes/webgpu_decode.py), whether a
decode layer runs the deep plan (three dispatches) or six, and the dispatches a step records
(planned_dispatches: floe.engine.webgpu.decoder builds the plan itself; this counts it without weights)."""

from __future__ import annotations

import os

from floe.engine.webgpu.device import WEIGHT_FORMATS
from floe.model.config import ModelConfig

WG = 64  # threads per workgroup (GEMV columns / 4, attention positions per chunk)
UNROLL = 1  # WLs a lane of the lanes GEMV reads a row an iteration (lanes_unroll)
# 1: the lanes GEMV reads f16 weights eight at a time, 16 bytes a load (lanes_wide; LANE_LOADS): an H100
# through Vulkan, 1B shape, six a layer: 283.0 against 258.7 tok/s (GEMVs 2.85 against 3.21 ms a token);
# unroll 2 beside it 261.2, alone 265.0 (bench/probes/webgpu_decode.py, docs/PERF_HISTORY.md's eighth
# session of 2026-12-06)
WIDE = 1
GEMV_WG_WIDE = 256  # a GEMV's threads per workgroup where it has rows enough (fewer workgroups: less set-up)
LANES = (128, 4)  # the lanes layout's GEMV: lanes per workgroup, output rows per workgroup
# The deep plan's fused dispatches per layout: attend_out (lanes, output rows a tile, lanes a row of
# Wo) and mlp (lanes, MLP columns a tile, lanes a row of W13). A CPU adapter runs one tile of Wo and
# wide MLP tiles (fewer fixed-point additions); a GPU wants many workgroups and coalesced rows.
# FLOE_WEBGPU_ATTEND=64x256x4 and FLOE_WEBGPU_MLP=256x32x32 override the lanes layout's (bench/probes).
DEEP = {"threads": {"attend": (64, 1 << 30, 1), "mlp": (64, 128, 1)},
        "lanes": {"attend": (64, 256, 4), "mlp": (256, 32, 32)}}


def band_count(n: int, k: int, max_binding: int, weights: str = "f32") -> int:
    """Bands upload_matrix cuts an [n, k] weight stored as `weights` into."""
    per_band = max(WG, (max_binding // (WEIGHT_FORMATS[weights][0] * k)) // WG * WG)
    return -(-n // per_band)


def _gemv_dispatches(n: int, k: int, max_binding: int, weights: str = "f32", layout: str = "threads",
                     max_workgroups: int = 65535) -> int:
    """Dispatches WebGPUDecoder._gemv records for an [n, k] weight: one a band (upload_matrix's), more
    where a band's workgroups pass the adapter's limit on one dimension."""
    def up(a: int, b: int) -> int:
        return -(-a // b)

    per_band = up(up(n, band_count(n, k, max_binding, weights)), WG) * WG
    per_group = lanes_shape()[1] if layout == "lanes" else GEMV_WG_WIDE if n >= 8 * GEMV_WG_WIDE else WG
    return sum(up(up(min(per_band, n - start), per_group), max_workgroups) for start in range(0, n, per_band))


def _shape(variable: str, default: tuple[int, ...]) -> tuple[int, ...]:
    forced = os.environ.get(variable, "")
    return tuple(int(n) for n in forced.split("x")) if forced else default


def lanes_shape() -> tuple[int, int]:
    """The lanes layout's GEMV workgroup: (lanes, output rows); FLOE_WEBGPU_LANES=128x4 overrides."""
    return _shape("FLOE_WEBGPU_LANES", LANES)


def lanes_unroll() -> int:
    """WLs a lane of the lanes layout's GEMV reads a row an iteration; FLOE_WEBGPU_UNROLL=2 overrides."""
    return _shape("FLOE_WEBGPU_UNROLL", (UNROLL,))[0]


def lanes_wide() -> bool:
    """Whether the lanes layout's GEMV reads f16 weights 16 bytes a load; FLOE_WEBGPU_WIDE=1|0 overrides."""
    return bool(_shape("FLOE_WEBGPU_WIDE", (WIDE,))[0])


def deep_shape(layout: str, dispatch: str) -> tuple[int, int, int]:
    """The deep plan's attend_out or mlp shape for `layout` (DEEP; the lanes layout's overridable)."""
    default = DEEP[layout][dispatch]
    return default if layout != "lanes" else _shape(f"FLOE_WEBGPU_{dispatch.upper()}", default)


def deep_fused(c: ModelConfig, max_binding: int, weights: str = "f32", layout: str = "threads",
               storage_buffers: int = 16, workgroup_bytes: int = 32768) -> bool:
    """Whether a fused decode layer runs as three dispatches (the deep plan): every layer matrix in one
    band, and the adapter's limits hold attend_out's nine storage bindings and mlp's workgroup memory;
    and the adapter a CPU (the threads layout) unless FLOE_WEBGPU_DEEP=1: attend_out's attention is a
    workgroup per KV head, which on a GPU held a token longer than the six-a-layer plan's dispatches
    cost (an H100 through Vulkan, 1B shape: 103 against 325 tok/s)."""
    if c.beyond_llama():  # Gemma's (post norms, GeGLU, caps, ...): the six-a-layer plan
        return False
    if layout == "lanes" and os.environ.get("FLOE_WEBGPU_DEEP") != "1":
        return False
    q_n, qkv_n = c.n_heads * c.head_dim, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
    one_band = all(band_count(n, k, max_binding, weights) == 1
                   for n, k in ((qkv_n, c.dim), (c.dim, q_n), (2 * c.ffn_dim, c.dim), (c.dim, c.ffn_dim)))
    mwg, ft, lanes = deep_shape(layout, "mlp")
    rows_per_group = -(-2 * ft // (mwg // lanes))
    mlp_bytes = 4 * (c.dim + rows_per_group * mwg + 3 * ft)
    return one_band and storage_buffers >= 9 and mlp_bytes <= workgroup_bytes and c.ffn_dim % 4 == 0


def planned_dispatches(c: ModelConfig, max_binding: int, fused: bool = True, weights: str = "f32",
                       **limits) -> int:
    """Dispatches one decode step of WebGPUDecoder records for config `c` on an adapter whose largest
    binding is max_binding bytes, weights stored as `weights` (as its plan would hold them; no weights
    needed; `limits`: deep_fused's layout and adapter limits, and max_workgroups, the adapter's limit
    on a dispatch's workgroups along one dimension)."""
    q_n, qkv_n = c.n_heads * c.head_dim, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
    table, qk_norm = band_count(c.vocab_size, c.dim, max_binding, weights), int(c.qk_norm)
    head = _gemv_dispatches(c.vocab_size, c.dim, max_binding, weights, limits.get("layout", "threads"),
                            limits.pop("max_workgroups", 65535))
    if fused and deep_fused(c, max_binding, weights, **limits):
        return table + (3 + qk_norm) * c.n_layers + head
    layer = sum(band_count(n, k, max_binding, weights)
                for n, k in ((qkv_n, c.dim), (c.dim, q_n), (2 * c.ffn_dim, c.dim), (c.dim, c.ffn_dim)))
    layer += 2 if fused else 5  # attention in splits with rotary inside, and their merge | two norms,
    # rope_kv, attention, SwiGLU
    layer += qk_norm + 2 * int(c.post_norms)  # (Gemma's post norms: a dispatch each)
    return table + c.n_layers * layer + head + (0 if fused else 1)
