"""The Llama step as WGSL compute shaders through wgpu: decode (B rows, each a slot) and prefill (a
prompt's rows, in chunks), the weights and the KV cache in GPU buffers.

Set-up (once): every projection's weight is uploaded as it is, row-major [out, in], in bands of rows no
larger than the adapter's largest binding; every dispatch of a step is planned as an `Op` (pipeline
variants, bind group, workgroup counts), so a step only records them. The hot path: one
queue.write_buffer of the rows' (token, position, slot), one command encoder with one compute pass
holding every dispatch, one submit, and the logits read back through a mapped buffer.

Fused (the default), a decode layer is three dispatches where each of its matrices fits one binding
(the deep plan): the QKV projection with the attention norm inside it; attention with rotary, the KV
write and the output projection inside it (attend_out.wgsl: a partial sum per KV head, not yet added
to the residual); and the whole MLP (mlp.wgsl: the partials added, the norm, gate/up, SwiGLU and the
down projection's columns, summed in fixed point so the order workgroups add in changes nothing).
The residual is thus deferred: the next projection reads it as base + fixed-point sums (gemv.wgsl
MODE 3) and writes it whole. Where a matrix needs bands, a layer is six dispatches: QKV; attention in
splits of SPLIT positions with rotary and the KV write inside (attention_split.wgsl: a workgroup per
split, KV head and row, as flash-decoding; one per KV head and row kept a GPU's SMs idle) and their
merge; the output projection adding into the residual; gate/up; the down projection with SwiGLU inside.
Unfused, norm, rotary + KV write and SwiGLU are dispatches of their own (nine per layer): the
ablation the dispatch-overhead study ran (arXiv 2604.02344). A prompt's rows attend to each other,
so its keys are written (rope_kv) before any row attends; prefill keeps the five-a-layer plan (its
attention a workgroup per KV head and row: a prompt's rows are enough of them).
Qwen3's q/k norm is one more dispatch a layer in every plan, right after the QKV projection: each
query and key head normalised in place (rmsnorm.wgsl over heads), so every rotary reads normed heads.
A sliding window (Mistral, Phi-3) is each attention shader's `WINDOW` constant: a row sees its last
WINDOW positions (the cache keeps every one).

Weights are stored as f32 or f16 (`weights`, WEIGHT_FORMATS); the GEMVs are laid out for the adapter
(Gpu.gemv_layout: a thread a row on a CPU adapter, lanes splitting each row on a GPU).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from floe.engine.transformer import Transformer, qk_norm_weight
from floe.engine.webgpu.device import WEIGHT_FORMATS, Gpu
from floe.engine.webgpu.kvcache import WebGPUKVCache
from floe.engine.webgpu.plan import (
    GEMV_WG_WIDE,
    WG,
    band_count,
    deep_fused,
    deep_shape,
    lanes_shape,
    lanes_unroll,
    lanes_wide,
    planned_dispatches,
)

SPLIT = 16  # positions a workgroup of a decode row's attention takes (attention_split.wgsl), at most
KT = 1024  # input elements a GEMV workgroup stages at once
MANY = 4  # rows a GEMV thread computes when a step has several (one alone: 1)
CHUNK = 64  # prompt rows per submit
GEMM_ROWS, GEMM_COLUMNS = 8, 32  # a prompt GEMM workgroup's rows (its lanes) and columns per thread


@dataclass
class Matrix:
    """A projection's weight as the shaders read it: row-major W [n, k] in bands of rows (first row,
    rows, buffer), each no larger than one binding."""

    k: int
    n: int
    bands: list[tuple[int, int, object]]


def upload_matrix(gpu: Gpu, weight: Tensor, label: str, weights: str = "f32") -> Matrix:
    """weight [n, k] into GPU buffers stored as `weights` (f32, f16), one band per binding's worth of
    rows."""
    n, k = weight.shape
    if k % 16:  # the shader reads a row 16 weights (a mat4x4) at a time
        raise ValueError(f"{label}: WebGPU projections need an input width divisible by 16, got {k}")
    per_band = -(-n // band_count(n, k, gpu.max_binding, weights))
    per_band = -(-per_band // WG) * WG
    dtype = torch.float16 if weights == "f16" else torch.float32
    bands = []
    for start in range(0, n, per_band):
        rows = min(per_band, n - start)
        data = weight[start:start + rows].to(dtype).contiguous().numpy()
        bands.append((start, rows, gpu.buffer(data.nbytes, data=data, label=f"{label}[{start}:]")))
    return Matrix(k, n, bands)


@dataclass
class Op:
    """One planned dispatch: pipeline by rows-per-thread tile, bind group, workgroups along x, and
    along y one per row ("rows"), per tile of rows ("tiles"), per tile of the head's rows ("head"), or
    per GEMM_ROWS rows ("block")."""

    kind: str
    pipelines: dict[int, object]
    group: object
    x: int
    y: str = "rows"
    weight_bytes: int = 0  # a projection band's weights, read once a step (op_times' GB/s)

    def workgroups_y(self, rows: int, head_rows: int, tile: int) -> int:
        if self.y == "rows":
            return rows
        if self.y == "block":
            return -(-rows // GEMM_ROWS)
        n = head_rows if self.y == "head" else rows
        return -(-n // tile)


@dataclass
class Plan:
    """A step's dispatches: the embedding, the layers, the head."""

    embed: list[Op] = field(default_factory=list)
    layers: list[Op] = field(default_factory=list)
    head: list[Op] = field(default_factory=list)


class WebGPUDecoder:
    """Decode and prefill steps of `model` (its weights read once into GPU buffers, stored as `weights`:
    f32 or f16) over the slots of `cache`; one thread at a time (the engine's step lock)."""

    def __init__(self, model: Transformer, cache: WebGPUKVCache, fused: bool = True,
                 weights: str = "f32") -> None:
        c = model.config
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"WebGPU weights {weights!r}: choose one of {', '.join(WEIGHT_FORMATS)}")
        self.config, self.cache, self.gpu, self.fused, self.weights = c, cache, cache.gpu, fused, weights
        gpu = self.gpu
        if c.head_dim % 4 or c.n_heads % c.n_kv_heads:
            raise ValueError("WebGPU attention needs a head_dim divisible by 4 and whole query groups")
        self.layout = gpu.gemv_layout
        self.rows = max(cache.n_slots, CHUNK)  # the most rows one submit carries
        r, qkv_n, q_n = self.rows, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim, c.n_heads * c.head_dim
        self.x, self.h = gpu.buffer(4 * r * c.dim, label="x"), gpu.buffer(4 * r * c.dim, label="h")
        self.qkv, self.q = gpu.buffer(4 * r * qkv_n, label="qkv"), gpu.buffer(4 * r * q_n, label="q")
        self.att = gpu.buffer(4 * r * q_n, label="att")
        self.gate_up, self.act = gpu.buffer(8 * r * c.ffn_dim, label="gate_up"), gpu.buffer(4 * r * c.ffn_dim)
        self.deep = fused and deep_fused(c, gpu.max_binding, weights, self.layout, gpu.max_storage_buffers,
                                         gpu.device.limits["max-compute-workgroup-storage-size"])
        if self.deep:  # the deferred residual: the output projection's partials, the MLP's sums
            self.partials = gpu.buffer(4 * c.n_kv_heads * r * c.dim, label="partials")
            self.sums = gpu.buffer(8 * r * c.dim, label="fixed-point sums")
        self.step_words = np.zeros(4 + 4 * r, dtype=np.uint32)  # header, then (token, position, slot, 0)
        self.rows_buffer = gpu.buffer(self.step_words.nbytes, label="step")
        self.logits_bytes = 4 * r * c.vocab_size
        self.readback = gpu.readback(self.logits_bytes, label="logits")
        self.logits = self.readback if gpu.mappable_storage else gpu.buffer(self.logits_bytes, label="logits")
        self.gelu = int(c.activation == "gelu_tanh")  # Gemma's GeGLU for SwiGLU
        # Gemma's post norms: a projection's output lands here, normalised into the residual (_post)
        self.post_out = gpu.buffer(4 * r * c.dim, label="post-norm input") if c.post_norms else None
        self.cos, self.sin = self._table(model.cos, "cos"), self._table(model.sin, "sin")  # the CPU's tables
        # Gemma 3's windowed layers rotate by tables of their own base
        self.local = None if model.cos_local is None else (self._table(model.cos_local, "cos (local)"),
                                                           self._table(model.sin_local, "sin (local)"))
        self.weight_bytes = 0
        self.split, self.parts = SPLIT, None  # the decode attention's splits (_split_attention)
        self.decode_plan, self.prefill_plan = self._plan(model)
        plan = self.decode_plan
        self._decode_ops = plan.embed + plan.layers + plan.head
        self._ahead: dict[tuple, object] = {}  # the next decode step's command buffer (_submit)
        self.last_dispatches = 0  # dispatches the latest submit recorded

    # ---- set-up: weights and the plan ------------------------------------------------------------

    def _table(self, t: Tensor, label: str):
        t = t[:self.cache.max_seq_len].contiguous()
        return self.gpu.buffer(t.numel() * 4, data=t.numpy(), label=label)

    def _rotary(self, layer) -> tuple:
        """The (cos, sin) buffers `layer` rotates by."""
        return self.local if layer.attention.local_rope and self.local is not None else (self.cos, self.sin)

    def _post(self, i: int, norm) -> list[Op]:
        """Gemma's post norm of layer i (`norm`: its module, None for other models): the projection's
        output (self.post_out) normalised and added into the residual; nothing where there is none."""
        if norm is None:
            return []
        c = self.config
        const = {"WG": WG, "DIM": c.dim, "EPS": float(c.norm_eps), "STRIDE": c.dim, "IN_PLACE": 0, "ADD": 1}
        buffers = [self.rows_buffer, self.post_out, self._vector(norm.weight, f"post{i}"), self.x]
        return [self._one("rmsnorm", "rmsnorm", const, buffers, 1)]

    def _vector(self, t: Tensor, label: str):
        self.weight_bytes += t.numel() * 4
        return self.gpu.buffer(t.numel() * 4, data=t.detach().float().contiguous().numpy(), label=label)

    def _matrix(self, t: Tensor, label: str) -> Matrix:
        self.weight_bytes += t.numel() * WEIGHT_FORMATS[self.weights][0]
        return upload_matrix(self.gpu, t.detach().float(), label, self.weights)

    def _pipeline(self, shader: str, const: dict):
        return self.gpu.pipeline(shader, const, self.weights)

    def _gemv(self, m: Matrix, inp, out, out_n: int, mode: int = 0, epi: int = 0, head: bool = False,
              norm=None, bias=None, in_stride: int | None = None, res=None) -> list[Op]:
        """The dispatches of out (=, +=) project(inp) with `m`, one per column band; mode 3 reads the
        deferred residual inp + self.sums (and writes it whole into `res` where given)."""
        gpu, ops = self.gpu, []
        const = {"MODE": mode, "EPI": epi, "HEAD": int(head), "RES": int(res is not None),
                 "EPS": float(self.config.norm_eps), "GELU": self.gelu}
        if self.layout == "lanes":
            shader, (lanes, per_group), unroll = "gemv_lanes", lanes_shape(), lanes_unroll()
            wide = int(lanes_wide() and self.weights == "f16" and m.k % 8 == 0)  # (else a W4 a load)
            const |= {"WG": lanes, "R": per_group, "U": unroll, "WIDE": wide}
        else:
            shader = "gemv"
            per_group = GEMV_WG_WIDE if m.n >= 8 * GEMV_WG_WIDE else WG
            const |= {"WG": per_group, "KT": KT}
        pipelines = {tb: self._pipeline(shader, {**const, "TB": tb}) for tb in (1, MANY)}
        sums = self.sums if mode == 3 else None
        size = WEIGHT_FORMATS[self.weights][0]
        for start, rows, weight in m.bands:
            groups = -(-rows // per_group)
            for first in range(0, groups, gpu.max_workgroups):  # (one dispatch where the limit allows)
                x = min(gpu.max_workgroups, groups - first)
                params = gpu.uniform([m.k, rows, out_n, start, in_stride or m.k, first])
                group = gpu.bind("gemv", [self.rows_buffer, params, inp, weight, out, norm, bias, sums, res])
                covered = min(rows, (first + x) * per_group) - first * per_group
                ops.append(Op("gemv", pipelines, group, x, "head" if head else "tiles", covered * m.k * size))
        return ops

    def _gemm(self, m: Matrix, inp, out, out_n: int, mode: int = 0, epi: int = 0, norm=None,
              bias=None) -> list[Op]:
        """A prompt's out (=, +=) project(inp) with `m` (gemm.wgsl): one dispatch per band."""
        gpu, ops = self.gpu, []
        const = {"ROWS": GEMM_ROWS, "NB": GEMM_COLUMNS, "MODE": mode, "EPI": epi,
                 "EPS": float(self.config.norm_eps)}
        pipeline = self._pipeline("gemm", const)
        for start, rows, weight in m.bands:
            params = gpu.uniform([m.k, rows, out_n, start, m.k])
            group = gpu.bind("gemv", [self.rows_buffer, params, inp, weight, out, norm, bias])
            ops.append(Op("gemm", {1: pipeline, MANY: pipeline}, group, -(-rows // GEMM_COLUMNS), "block"))
        return ops

    def _one(self, kind: str, shader: str, const: dict, buffers: list, x: int) -> Op:
        pipeline = self._pipeline(shader, const)
        return Op(kind, {1: pipeline, MANY: pipeline}, self.gpu.bind(shader, buffers), x)

    def _embed(self, table: Matrix, zero: bool) -> list[Op]:
        """x = the rows' embeddings, a dispatch per band of the table (zero: and self.sums = 0)."""
        c, gpu = self.config, self.gpu
        return [self._one("embed", "embed", {"WG": WG, "DIM": c.dim, "ZERO": int(zero),
                                             "SCALE": float(c.embedding_scale)},
                          [self.rows_buffer, gpu.uniform([start, rows]), buf, self.x,
                           self.sums if zero else None], -(-c.dim // (4 * WG)))
                for start, rows, buf in table.bands]

    def _attention_constants(self, layer) -> dict:
        """The attention shaders' constants for `layer` (its window: 0 where it has none shorter than
        the cache, where every row sees every earlier position anyway)."""
        c = self.config
        window = layer.attention.window if c.window_limits(self.cache.max_seq_len) else None
        return {"AWG": WG, "HEAD_DIM": c.head_dim, "HALF": c.head_dim // 2,
                "GROUP": c.n_heads // c.n_kv_heads, "N_HEADS": c.n_heads, "N_KV": c.n_kv_heads,
                "MAX_SEQ": self.cache.max_seq_len, "QKV_STRIDE": (c.n_heads + 2 * c.n_kv_heads) * c.head_dim,
                "SCALE": float(c.attention_scale or c.head_dim ** -0.5), "WINDOW": window or 0,
                "SOFTCAP": float(c.attn_softcap or 0.0)}

    def _split_attention(self, att: dict, k, v, cos, sin) -> list[Op]:
        """A decode layer's attention in splits of SPLIT positions (attention_split.wgsl, rotary and the
        KV write inside it) and their merge into self.att (attention_merge.wgsl): two dispatches."""
        c, gpu = self.config, self.gpu
        if self.parts is None:  # (made for the first layer: the deep plan needs none)
            # as many positions a split as attention_split's workgroup memory holds the scores of (beside
            # the queries); the partials per decode row, query head and split
            group, room = c.n_heads // c.n_kv_heads, gpu.device.limits["max-compute-workgroup-storage-size"]
            while self.split > 1 and 4 * (group * c.head_dim + self.split * group) > room:
                self.split //= 2
            n_split = -(-self.cache.max_seq_len // self.split)
            self.parts = gpu.buffer(4 * self.cache.n_slots * c.n_heads * n_split * (c.head_dim + 2),
                                    label="attention partials")
        split, n_split = self.split, -(-self.cache.max_seq_len // self.split)
        const = {**att, "SPLIT": split, "NSPLIT": n_split}
        splits = n_split if not att["WINDOW"] else min(n_split, -(-att["WINDOW"] // split) + 1)
        split = self._one("attention_split", "attention_split", const,
                          [self.rows_buffer, self.qkv, k, v, cos, sin, self.parts], c.n_kv_heads * splits)
        merge = self._one("attention_merge", "attention_merge",
                          {name: const[name] for name in ("AWG", "SPLIT", "NSPLIT", "HEAD_DIM", "N_HEADS",
                                                          "WINDOW")},
                          [self.rows_buffer, self.parts, self.att], c.n_heads)
        return [split, merge]

    def _deep_layer(self, i: int, layer, wqkv: Matrix, wo: Matrix, w13: Matrix, w2: Matrix, att_norm,
                    ffn_norm, bias, qk_norm: list[Op]) -> list[Op]:
        """A decode layer in three dispatches (the deep plan; the residual deferred, see the module),
        four with the q/k norm."""
        c, k, v = self.config, self.cache.k_buffers[i], self.cache.v_buffers[i]
        (awg, nt, attend_lanes), (mwg, ft, mlp_lanes) = deep_shape(self.layout, "attend"), deep_shape(
            self.layout, "mlp")
        nt = min(nt, c.dim)
        qkv_n = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
        qkv = self._gemv(wqkv, self.x, self.qkv, qkv_n, mode=3, epi=0 if bias is None else 2, norm=att_norm,
                         bias=bias, res=self.h)
        const = {**self._attention_constants(layer), "AWG": awg, "DIM": c.dim, "NT": nt, "ROWS": self.rows,
                 "LPR": attend_lanes}
        attend = self._one("attend_out", "attend_out", const,
                           [self.rows_buffer, self.qkv, k, v, self.cos, self.sin, wo.bands[0][2],
                            self.partials, self.sums], c.n_kv_heads * -(-c.dim // nt))
        mlp = self._one("mlp", "mlp", {"WG": mwg, "DIM": c.dim, "FFN": c.ffn_dim, "FT": ft, "LPR": mlp_lanes,
                                       "N_KV": c.n_kv_heads, "ROWS": self.rows, "EPS": float(c.norm_eps)},
                        [self.rows_buffer, self.h, self.partials, ffn_norm, w13.bands[0][2], w2.bands[0][2],
                         self.x, self.sums], -(-c.ffn_dim // ft))
        size = WEIGHT_FORMATS[self.weights][0]
        attend.weight_bytes, mlp.weight_bytes = size * wo.n * wo.k, size * (w13.n * w13.k + w2.n * w2.k)
        return [*qkv, *qk_norm, attend, mlp]

    def _qk_norm(self, i: int, layer) -> list[Op]:
        """Qwen3's q/k norm: each query and key head of the qkv rows RMS-normalised in place, before any
        rotary reads them (rmsnorm.wgsl, a workgroup per head and row); none where the model has none."""
        weight = qk_norm_weight(layer.attention)
        if weight is None:
            return []
        c = self.config
        const = {"WG": WG, "DIM": c.head_dim, "EPS": float(c.norm_eps),
                 "STRIDE": (c.n_heads + 2 * c.n_kv_heads) * c.head_dim, "IN_PLACE": 1, "ADD": 0}
        buffers = [self.rows_buffer, self.qkv, self._vector(weight, f"qk{i}")]
        return [self._one("rmsnorm", "rmsnorm", const, buffers, c.n_heads + c.n_kv_heads)]

    def _plan(self, model: Transformer) -> tuple[Plan, Plan]:
        c = self.config
        qkv_n, half = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim, c.head_dim // 2
        table = self._matrix(model.output_weight(), "head")  # the tied head's weight is the embedding's
        embed_table = table if model.output is None else self._matrix(model.tok_embeddings.weight, "embed")
        rope = {"WG": WG, "HEAD_DIM": c.head_dim, "HALF": half, "N_HEADS": c.n_heads, "N_KV": c.n_kv_heads,
                "MAX_SEQ": self.cache.max_seq_len, "QKV_STRIDE": qkv_n}
        rope_x = -(-((c.n_heads + c.n_kv_heads) * half + c.n_kv_heads * c.head_dim) // WG)
        norm = {"WG": WG, "DIM": c.dim, "EPS": float(c.norm_eps), "STRIDE": c.dim, "IN_PLACE": 0, "ADD": 0}
        decode = Plan(embed=self._embed(embed_table, zero=self.deep))
        prefill = Plan(embed=self._embed(embed_table, zero=False)) if self.deep else Plan(embed=decode.embed)
        for i, layer in enumerate(model.layers):
            a, f = layer.attention, layer.feed_forward
            att = self._attention_constants(layer)
            att_norm, ffn_norm = self._vector(layer.attention_norm.weight, f"n{i}a"), self._vector(
                layer.ffn_norm.weight, f"n{i}f")
            wqkv, wo = self._matrix(a.wqkv.weight, f"qkv{i}"), self._matrix(a.wo.weight, f"o{i}")
            w13, w2 = self._matrix(f.w13.weight, f"w13_{i}"), self._matrix(f.w2.weight, f"w2_{i}")
            bias = None if a.wqkv.bias is None else self._vector(a.wqkv.bias, f"b{i}")
            epi = 0 if bias is None else 2
            swiglu = self._one("swiglu", "swiglu", {"WG": WG, "FFN": c.ffn_dim, "GELU": self.gelu},
                               [self.rows_buffer, self.gate_up, self.act], -(-c.ffn_dim // WG))
            k, v = self.cache.k_buffers[i], self.cache.v_buffers[i]
            cos, sin = self._rotary(layer)
            qk_norm = self._qk_norm(i, layer)
            rope_kv = self._one("rope_kv", "rope_kv", rope,
                                [self.rows_buffer, self.qkv, k, v, cos, sin, self.q], rope_x)
            attend = self._one("attention", "attention", att,
                               [self.rows_buffer, self.q, k, v, cos, sin, self.att], c.n_kv_heads)
            # The output and down projections add into the residual, or (Gemma) land in post_out, whose
            # post norm adds them
            post_a, post_f = self._post(i, layer.post_attention_norm), self._post(i, layer.post_ffn_norm)
            res, res_epi = (self.x, 1) if self.post_out is None else (self.post_out, 0)
            out = self._gemv(wo, self.att, res, c.dim, epi=res_epi) + post_a
            if self.fused:
                if self.deep:
                    decode.layers += self._deep_layer(i, layer, wqkv, wo, w13, w2, att_norm, ffn_norm, bias,
                                                      qk_norm)
                else:
                    qkv = self._gemv(wqkv, self.x, self.qkv, qkv_n, mode=1, epi=epi, norm=att_norm, bias=bias)
                    mlp = (self._gemv(w13, self.x, self.gate_up, 2 * c.ffn_dim, mode=1, norm=ffn_norm)
                           + self._gemv(w2, self.gate_up, res, c.dim, mode=2, epi=res_epi,
                                        in_stride=2 * c.ffn_dim) + post_f)
                    decode.layers += qkv + qk_norm + self._split_attention(att, k, v, cos, sin) + out + mlp
                prefill.layers += [*self._gemm(wqkv, self.x, self.qkv, qkv_n, mode=1, epi=epi, norm=att_norm,
                                               bias=bias), *qk_norm, rope_kv, attend,
                                   *self._gemm(wo, self.att, res, c.dim, epi=res_epi), *post_a,
                                   *self._gemm(w13, self.x, self.gate_up, 2 * c.ffn_dim, mode=1,
                                               norm=ffn_norm),
                                   swiglu, *self._gemm(w2, self.act, res, c.dim, epi=res_epi), *post_f]
            else:
                qkv = [self._one("rmsnorm", "rmsnorm", norm, [self.rows_buffer, self.x, att_norm, self.h], 1),
                       *self._gemv(wqkv, self.h, self.qkv, qkv_n, epi=epi, bias=bias)]
                mlp = [self._one("rmsnorm", "rmsnorm", norm, [self.rows_buffer, self.x, ffn_norm, self.h], 1),
                       *self._gemv(w13, self.h, self.gate_up, 2 * c.ffn_dim),
                       swiglu,
                       *self._gemv(w2, self.act, res, c.dim, epi=res_epi), *post_f]
                decode.layers += qkv + qk_norm + [rope_kv, attend] + out + mlp
        if not self.fused:
            prefill.layers = decode.layers
        final = self._vector(model.norm.weight, "norm")
        if self.fused:
            head = self._gemv(table, self.x, self.logits, c.vocab_size, mode=1, head=True, norm=final)
            decode.head = (self._gemv(table, self.x, self.logits, c.vocab_size, mode=3, head=True, norm=final)
                           if self.deep else head)
        else:
            head = [self._one("rmsnorm", "rmsnorm", norm, [self.rows_buffer, self.x, final, self.h], 1),
                    *self._gemv(table, self.h, self.logits, c.vocab_size, head=True)]
            decode.head = head
        prefill.head = head
        return decode, prefill

    # ---- the hot path ----------------------------------------------------------------------------

    def _submit(self, ops: list[Op], tokens: list[int], positions: list[int], slots: list[int],
                head_first: int, head_rows: int, ahead: bool = False) -> None:
        """Write the rows, submit `ops` recorded into one compute pass (no wait). ahead (decode): the
        command buffer recorded for this shape of step while the step before computed, if there is one,
        and the next step's recorded now, while this one computes: a step's commands do not depend on
        its rows (written to rows_buffer before the submit, in the queue's order), and recording ~80
        dispatches took ~1 ms of the host a token (an H100 through Vulkan, 1B shape)."""
        n = len(tokens)
        words = self.step_words
        words[:4] = (n, head_first, head_rows, 0)
        rows = words[4:4 + 4 * n].reshape(n, 4)
        rows[:, 0], rows[:, 1], rows[:, 2] = tokens, positions, slots
        gpu = self.gpu
        gpu.queue.write_buffer(self.rows_buffer, 0, words[:4 + 4 * n])
        key = (len(ops), id(ops[0]) if ops else 0, n, head_rows)
        recorded = self._ahead.pop(key, None) if ahead else None
        gpu.queue.submit([recorded if recorded is not None else self._record(ops, n, head_rows)])
        self.last_dispatches = len(ops)
        self._ahead = {key: self._record(ops, n, head_rows)} if ahead else {}

    def _record(self, ops: list[Op], n: int, head_rows: int):
        """`ops` for a step of n rows (head_rows of logits) in one compute pass, and the logits' copy
        into the readback buffer where the head cannot write there: a command buffer."""
        gpu = self.gpu
        tile = 1 if n == 1 and head_rows <= 1 else MANY
        encoder = gpu.device.create_command_encoder()
        compute = encoder.begin_compute_pass()
        for op in ops:
            compute.set_pipeline(op.pipelines[tile])
            compute.set_bind_group(0, op.group)
            compute.dispatch_workgroups(op.x, op.workgroups_y(n, head_rows, tile))
        compute.end()
        if head_rows and not gpu.mappable_storage:
            nbytes = 4 * head_rows * self.config.vocab_size
            encoder.copy_buffer_to_buffer(self.logits, 0, self.readback, 0, nbytes)
        return encoder.finish()

    def _read(self, rows: int, out: Tensor | None) -> Tensor:
        """Wait for the submitted step and copy its `rows` logits rows out of the mapped buffer into
        `out` (float32 [rows, vocab]) or a new tensor: the readback, one copy."""
        nbytes = 4 * rows * self.config.vocab_size
        self.readback.map_sync(self.gpu.wgpu.MapMode.READ, 0, nbytes)
        try:
            mapped = np.frombuffer(self.readback.read_mapped(0, nbytes, copy=False), dtype=np.float32)
            result = torch.empty(rows, self.config.vocab_size) if out is None else out
            np.copyto(result.numpy(), mapped.reshape(rows, -1))
        finally:
            self.readback.unmap()
        cap = self.config.logit_softcap  # Gemma 2's, on the host as the CPU's forward caps its logits
        return result if cap is None else result.div_(cap).tanh_().mul_(cap)

    def step(self, tokens: list[int], positions: list[int], slots: list[int],
             out: Tensor | None = None) -> Tensor:
        """Logits [B, vocab] (float32, host): row b after appending tokens[b] at positions[b] to the
        cache of slot slots[b] (distinct slots); with `out` (float32 [B, vocab]) written there."""
        n = len(tokens)
        if n > self.rows:
            raise ValueError(f"a WebGPU step takes at most {self.rows} rows, got {n}")
        self._submit(self._decode_ops, tokens, positions, [int(s) for s in slots], 0, n, ahead=True)
        return self._read(n, out)

    def op_times(self, token: int, position: int, slot: int = 0) -> list[dict]:
        """One decode step of one row (token at `position` of `slot`, as step() appends it) with each
        planned dispatch in a compute pass of its own between two timestamps: per dispatch its kind,
        the weight bytes it streams and its device microseconds, in plan order (a pass a dispatch adds
        the gaps between passes, not counted). [] where the adapter has no timestamp queries."""
        gpu = self.gpu
        if not gpu.timestamps:
            return []
        ops = self._decode_ops
        words = self.step_words
        words[:8] = (1, 0, 1, 0, token, position, slot, 0)
        gpu.queue.write_buffer(self.rows_buffer, 0, words[:8])
        w = gpu.wgpu
        queries = gpu.device.create_query_set(type=w.QueryType.timestamp, count=2 * len(ops))
        encoder = gpu.device.create_command_encoder()
        for k, op in enumerate(ops):
            stamps = {"query_set": queries, "beginning_of_pass_write_index": 2 * k,
                      "end_of_pass_write_index": 2 * k + 1}
            compute = encoder.begin_compute_pass(timestamp_writes=stamps)
            compute.set_pipeline(op.pipelines[1])
            compute.set_bind_group(0, op.group)
            compute.dispatch_workgroups(op.x, op.workgroups_y(1, 1, 1))
            compute.end()
        resolved = gpu.buffer(16 * len(ops), usage=w.BufferUsage.QUERY_RESOLVE)
        encoder.resolve_query_set(queries, 0, 2 * len(ops), resolved, 0)
        gpu.queue.submit([encoder.finish()])
        stamps = np.frombuffer(gpu.queue.read_buffer(resolved), dtype=np.uint64).reshape(-1, 2)
        return [{"kind": op.kind, "weight_bytes": op.weight_bytes, "us": float(end - begin) / 1e3}
                for op, (begin, end) in zip(ops, stamps.tolist(), strict=True)]

    def prefill(self, ids: list[int], start: int, slot: int, all_logits: bool = False,
                out: Tensor | None = None) -> Tensor:
        """Append ids at positions start.. of `slot`: float32 logits [vocab] of the last ([T, vocab]
        with all_logits; into `out` if given), in chunks of CHUNK rows, one submit each."""
        plan, ops = self.prefill_plan, self.prefill_plan.embed + self.prefill_plan.layers
        pieces, dispatches = [], 0
        for first in range(0, len(ids), CHUNK):
            chunk = ids[first:first + CHUNK]
            last = first + CHUNK >= len(ids)
            head_rows = len(chunk) if all_logits else int(last)
            positions = list(range(start + first, start + first + len(chunk)))
            self._submit(ops + (plan.head if head_rows else []), chunk, positions, [slot] * len(chunk),
                         0 if all_logits else len(chunk) - 1, head_rows)
            dispatches += self.last_dispatches
            if all_logits:
                pieces.append(self._read(len(chunk), None if out is None else out[first:first + len(chunk)]))
        self.last_dispatches = dispatches
        if all_logits:
            return out if out is not None else torch.cat(pieces)
        return self._read(1, None if out is None else out.view(1, -1))[0]

    def gemm_rate(self, k: int = 1024, n: int = 1024, repeats: int = 8) -> float:
        """FLOP/s of the prompt's GEMM shader (gemm.wgsl, in this decoder's weight format) on CHUNK rows
        times a random [n, k] matrix (`floe profile`'s prefill ceiling): `repeats` dispatches in one
        pass and submit, waited for as a step is; the median of 3 after 1. Not within a step (it writes
        the step's row count)."""
        gpu = self.gpu
        weight = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
        m = upload_matrix(gpu, weight, "gemm rate", self.weights)
        inp = gpu.buffer(4 * CHUNK * k, data=np.ones((CHUNK, k), np.float32), label="gemm rate input")
        out = gpu.buffer(4 * CHUNK * n, label="gemm rate output")
        ops = self._gemm(m, inp, out, n)
        words = np.zeros(4 + 4 * CHUNK, dtype=np.uint32)
        words[0] = CHUNK
        u = gpu.wgpu.BufferUsage
        mapped = gpu.device.create_buffer(size=16, usage=u.MAP_READ | u.COPY_DST, label="gemm rate sync")

        def run() -> float:
            t = time.perf_counter()
            gpu.queue.write_buffer(self.rows_buffer, 0, words)
            encoder = gpu.device.create_command_encoder()
            compute = encoder.begin_compute_pass()
            for _ in range(repeats):
                for op in ops:
                    compute.set_pipeline(op.pipelines[MANY])
                    compute.set_bind_group(0, op.group)
                    compute.dispatch_workgroups(op.x, op.workgroups_y(CHUNK, 0, MANY))
            compute.end()
            encoder.copy_buffer_to_buffer(out, 0, mapped, 0, 16)
            gpu.queue.submit([encoder.finish()])
            mapped.map_sync(gpu.wgpu.MapMode.READ)
            mapped.unmap()
            return time.perf_counter() - t

        run()
        seconds = sorted(run() for _ in range(3))[1]
        return 2 * CHUNK * k * n * repeats / seconds

    def dispatches_per_step(self, rows: int = 1) -> int:
        """Dispatches one decode step records (independent of the row count)."""
        plan = self.decode_plan
        return len(plan.embed) + len(plan.layers) + len(plan.head)


def input_bytes(n_tokens: int, batch_rows: int = 1) -> int:
    """Bytes a forward of n_tokens writes host→GPU (its rows' token, position, slot and the count, one
    queue.write_buffer per submit); for one row of a decode step of `batch_rows` rows, its share."""
    if n_tokens == 1:
        return -(-16 * (batch_rows + 1) // batch_rows)
    return 16 * (n_tokens + -(-n_tokens // CHUNK))


def decode_bytes(decoder: WebGPUDecoder, kv_len: int) -> int:
    """Bytes a batch-1 decode step reads: every weight once, and kv_len positions of K and V."""
    return decoder.weight_bytes + kv_len * decoder.cache.bytes_per_token


__all__ = ["CHUNK", "Matrix", "WebGPUDecoder", "decode_bytes", "deep_fused", "input_bytes",
           "planned_dispatches", "upload_matrix"]
