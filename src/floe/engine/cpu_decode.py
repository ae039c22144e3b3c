"""Decode on the CPU, one step for B rows (B = 1 alone, or several actors' slots at once), as a flat
sequence of tensor ops.

On a CPU a decode token of a small model is a few hundred tiny operations, and each costs a few
microseconds of dispatch whatever its size, so their number matters as much as the weight bytes.
This path runs the same mathematics as `Transformer.forward` with about half the operations: no
module calls, RMSNorm as a dot product and one fused multiply into a preallocated buffer of the
next projection's input dtype, rotary for all Q and K heads as one small matrix product (with the
attention scale folded in), batched attention over grouped heads, and the residual stream updated
in place. It reads the model's own weights; nothing is copied. What architectures add to Llama's layer
is data the step takes, empty or zero where a model has none: Q/K/V biases (Qwen2), q/k norms (Qwen3,
Gemma 3), a window per layer (Mistral, Gemma), and Gemma's post norms, GeGLU flag, query scale, score
and logit caps, scaled embeddings and per-layer rotary tables.

Rows share what is shared: each projection runs once over the B rows, so its weights are read from
memory once a step, not once a row; what differs per row (its slot, its position, its length of
context) runs in a loop over the rows: the KV cache write and the attention. Every op a row goes
through computes that row alone, in the same order whatever B is, so a row's logits are bitwise
the same alone or beside others. The exception is PyTorch's products, whose sums are blocked
differently for one row than for several: a dense (float32, bfloat16) weight runs as a GEMV for one
row and as a GEMM for several, and the packed int4 kernel (native_kernel="int4pack") also changes
its order with B (float rounding, ~1e-6 relative: tests compare those with a tolerance and the same
argmax). floe's quantized kernel computes each input row alone, so on it every row's logits are
bitwise its batch-1 logits.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from floe.engine.int4 import Int4Linear
from floe.engine.kvcache import KVCache
from floe.engine.transformer import Transformer, norm_heads, qk_norm_weight
from floe.errors import UnsupportedModel


def project(x: Tensor, weight: Tensor, scales: Tensor, repeat: int) -> Tensor:
    """x Wᵀ for the rows of x. repeat > 0: W packed int4 (x bf16, repeated `repeat` times along its
    rows); 0: dense (x already in W's dtype); < 0: W the file's quantized blocks for floe's kernel
    number -repeat (x float32, scales unused)."""
    if repeat == 0:
        return F.linear(x, weight)
    if repeat < 0:
        return torch.ops.floe.gemv_q(x, weight, -repeat)
    if repeat > 1:
        x = x.repeat(1, repeat)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight, 32, scales)


def input_dtype(weight: Tensor, repeat: int) -> torch.dtype:
    """The dtype `project` takes its input in."""
    return torch.bfloat16 if repeat > 0 else torch.float32 if repeat < 0 else weight.dtype


def rms_norm(x: Tensor, rows: list[Tensor], weight: Tensor, eps: float, zero: Tensor, out: Tensor) -> Tensor:
    """RMSNorm of each fp32 row of x [B, dim] (rows: x's rows, views) written into `out` [B, dim], the
    next projection's input buffer (of that projection's dtype). Per row one dot product (its scale in
    float64, as Python computes it); one row: one fused multiply, several: two multiplies, which round
    alike."""
    dim = x.shape[1]
    if len(rows) == 1:
        r = 1.0 / math.sqrt(float(torch.dot(rows[0], rows[0])) / dim + eps)
        return torch.addcmul(zero, x, weight, value=r, out=out)
    scale = [1.0 / math.sqrt(float(torch.dot(row, row)) / dim + eps) for row in rows]
    return torch.mul(torch.mul(x, torch.tensor(scale).unsqueeze(1)), weight, out=out)


def norm(x: Tensor, rows: list[Tensor], weight: Tensor, eps: float, zero: Tensor, out: Tensor,
         native: bool) -> Tensor:
    """`rms_norm`, or with `native` floe's operator for it (float32 throughout)."""
    if native:
        torch.ops.floe.rms_norm_rows(x, weight, eps, out)
        return out
    return rms_norm(x, rows, weight, eps, zero, out)


def attend(rot: Tensor, v: Tensor, out: list[Tensor], slots: list[int], positions: list[int],
           k_cache: Tensor, v_cache: Tensor, n_heads: int, group: int, window: int = 0,
           softcap: float = 0.0) -> None:
    """Per row b: write its k (rot[b]'s last heads, rotated) and v [B, n_kv, head_dim] at positions[b]
    of its slot's cache [n_slots, n_kv, seq, head_dim], then attend its q (rot[b]'s first n_heads,
    rotated and scaled) over that slot's first positions[b] + 1 positions (window > 0: the last
    `window` of them; softcap > 0: the scores softcap * tanh(scores / softcap), Gemma 2) into out[b]
    [n_kv, group, head_dim]."""
    n_kv, head_dim = v.shape[1], v.shape[2]
    for b in range(len(slots)):
        length, rb = positions[b] + 1, rot.select(0, b)
        first = max(0, length - window) if window > 0 else 0
        k_slot, v_slot = k_cache.select(0, slots[b]), v_cache.select(0, slots[b])
        k_slot.select(1, positions[b]).copy_(rb.narrow(0, n_heads, n_kv))
        v_slot.select(1, positions[b]).copy_(v.select(0, b))
        scores = torch.bmm(rb.narrow(0, 0, n_heads).view(n_kv, group, head_dim),
                           k_slot.narrow(1, first, length - first).transpose(1, 2))
        if softcap > 0.0:
            scores = torch.tanh(scores / softcap) * softcap
        torch.bmm(torch.softmax(scores, dim=-1), v_slot.narrow(1, first, length - first), out=out[b])


def attend_ops(y: Tensor, rotary: Tensor, row_scale: Tensor, att_rows: list[Tensor], slots: list[int],
               positions: list[int], k_cache: Tensor, v_cache: Tensor, n_heads: int, n_kv: int,
               head_dim: int, window: int = 0, softcap: float = 0.0) -> None:
    """`attend` after rotary, in PyTorch's ops, from a layer's qkv rows y [B, (n_heads + 2 n_kv)
    head_dim]: rotary for all Q and K heads of a row in one product (Q's rows also carry the
    attention scale), then the cache write and attention per row."""
    rows, qk_size = y.shape[0], (n_heads + n_kv) * head_dim
    qk = y.narrow(1, 0, qk_size).view(rows, n_heads + n_kv, head_dim)
    rot = torch.bmm(torch.mul(qk, row_scale), rotary)
    if rot.dtype != k_cache.dtype:
        rot = rot.to(k_cache.dtype)
    v = y.narrow(1, qk_size, n_kv * head_dim).view(rows, n_kv, head_dim)
    attend(rot, v, att_rows, slots, positions, k_cache, v_cache, n_heads, n_heads // n_kv, window, softcap)


def post_norm(y: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Gemma's norm of a sub-layer's output rows y [B, dim] before they join the residual stream, as
    the module's RMSNorm computes it (float32 statistics); y itself where the layer has none (weight
    empty)."""
    if weight.numel() == 0:
        return y
    yf = y.float()
    return weight * (yf * torch.rsqrt(yf.pow(2).mean(-1, keepdim=True) + eps)).to(y.dtype)


def gated(gate_up: Tensor, ffn_dim: int, gelu: bool) -> Tensor:
    """The feed-forward's gate times its up rows: SiLU's (Llama), or GELU's tanh form (Gemma's GeGLU)."""
    gate = gate_up.narrow(1, 0, ffn_dim)
    gate = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
    return gate.mul_(gate_up.narrow(1, ffn_dim, ffn_dim))


def decode_layers(x: Tensor, x_rows: list[Tensor], rotaries: list[Tensor], row_scale: Tensor,
                  slots: list[int], positions: list[int], eps: float, norms: list[Tensor],
                  inputs: list[Tensor], weights: list[Tensor], scales: list[Tensor], repeats: list[int],
                  qkv_bias: list[Tensor], qk_norms: list[Tensor], post_norms: list[Tensor],
                  k_caches: list[Tensor], v_caches: list[Tensor], att: Tensor, att_rows: list[Tensor],
                  n_heads: int, n_kv: int, head_dim: int, ffn_dim: int, zero: Tensor,
                  native_ops: bool, tables: list[Tensor], layer_rope: list[int], windows: list[int],
                  softcap: float, gelu: bool, q_factor: float) -> None:
    """Every layer of one decode step of B rows, updating the fp32 residual rows x [B, dim] (x_rows:
    its rows, views) in place.

    Row b appends at positions[b] of KV slot slots[b]; rotaries[r] [B, head_dim, head_dim] is its
    position's rotation by rotary table r (0: the model's; 1: Gemma 3's windowed layers' own base),
    layer i using table layer_rope[i]. Per layer i: norms[2i], norms[2i+1] (attention, ffn) and their
    output buffers inputs[2i], inputs[2i+1] ([B, dim]); weights/scales/repeats[4i..4i+3] the qkv, o,
    gate+up and down projections (see `project`); qkv_bias[i] (empty if none); qk_norms[i] the
    layer's q and k norm weights stacked per head [n_heads + n_kv, head_dim] (empty if none);
    post_norms[2i], post_norms[2i+1] Gemma's norms of the attention's and the feed-forward's output
    (empty if none); k_caches[i], v_caches[i] the layer's cache [n_slots, n_kv, seq, head_dim];
    windows[i] > 0: its rows attend over the last windows[i] positions only (Mistral, Gemma's windowed
    layers); att [B, n_heads * head_dim] in the cache's dtype, attention's output
    buffer, att_rows its rows as [n_kv, n_heads / n_kv, head_dim] views; zero: a float32 [1] of 0
    (addcmul's base); softcap > 0: the attention scores soft-capped (Gemma 2);
    gelu: the gate is GELU's tanh form (Gemma), not SiLU. native_ops: RMSNorm, and rotary, the cache
    write and attention, by floe's operators (`torch.ops.floe.rms_norm_rows`, `torch.ops.floe.attend`;
    float32 throughout) from the tables tables[2r], tables[2r + 1] (cos, sin [seq, head_dim] of rotary
    table r), with the queries first times q_factor (the model's attention scale over the operator's
    1/sqrt(head_dim)); rotaries and row_scale then go unused.
    """
    for i in range(len(k_caches)):
        k_cache, v_cache, j, r = k_caches[i], v_caches[i], 4 * i, layer_rope[i]
        h = norm(x, x_rows, norms[2 * i], eps, zero, inputs[2 * i], native_ops)
        y = project(h, weights[j], scales[j], repeats[j])
        if qkv_bias[i].numel() > 0:
            y = y + qkv_bias[i]
        if y.dtype != k_cache.dtype:  # packed int4's bf16 rows: normed and rotated in the cache's dtype,
            y = y.to(k_cache.dtype)  # as the module forward does
        if qk_norms[i].numel() > 0:  # before rotary, which both attention paths below apply
            norm_heads(y, qk_norms[i], eps, n_heads + n_kv, head_dim)
        if native_ops:
            if q_factor != 1.0:
                y.narrow(1, 0, n_heads * head_dim).mul_(q_factor)
            torch.ops.floe.attend(y, tables[2 * r], tables[2 * r + 1], k_cache, v_cache, slots, positions,
                                  n_heads, att, windows[i], softcap)
        else:
            attend_ops(y, rotaries[r], row_scale, att_rows, slots, positions, k_cache, v_cache, n_heads, n_kv,
                       head_dim, windows[i], softcap)
        o_dtype = input_dtype(weights[j + 1], repeats[j + 1])
        x.add_(post_norm(project(att.to(o_dtype), weights[j + 1], scales[j + 1], repeats[j + 1]),
                         post_norms[2 * i], eps))
        gate_up = project(norm(x, x_rows, norms[2 * i + 1], eps, zero, inputs[2 * i + 1], native_ops),
                          weights[j + 2], scales[j + 2], repeats[j + 2])
        gate = gated(gate_up, ffn_dim, gelu)
        down_dtype = input_dtype(weights[j + 3], repeats[j + 3])
        if gate.dtype != down_dtype:
            gate = gate.to(down_dtype)
        x.add_(post_norm(project(gate, weights[j + 3], scales[j + 3], repeats[j + 3]), post_norms[2 * i + 1],
                         eps))


def _script(fn):
    """TorchScript runs the loop without Python between ops (~20 % of a CPU decode step on
    SmolLM2-135M); where scripting is unavailable the same function runs eagerly."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scripted = torch.jit.script(fn)
    except Exception:  # noqa: BLE001 - TorchScript missing or changed: the eager function is the same math
        return fn
    _plain_executor(scripted)
    return scripted


def _plain_executor(scripted) -> None:
    """Give a scripted function TorchScript's plain graph executor now, not the profiling executor
    (PyTorch's default), which keeps a profiled copy of the graph, then an optimized one and its
    fallback: ~4 MB of `floe run`'s peak resident memory on the default model (399-400 -> 395-396 MB,
    bench/peak_rss.py on a 2-core Zen 3), for the same ops on the CPU (no fuser runs there: the same
    tokens), no slower a step. A function's executor is made at its first call, of the kind the
    process-wide flag says then: get_debug_state makes it now, the flag set for that moment only."""
    set_profiling = getattr(torch._C, "_jit_set_profiling_executor", None)
    if set_profiling is None:  # a PyTorch without the choice: its default executor
        return
    previous = set_profiling(False)
    try:
        scripted.get_debug_state()
    except Exception:  # noqa: BLE001 - made at the first call instead, by the default executor
        pass
    finally:
        set_profiling(previous)


_scripted: dict[str, object] = {}


def _compiled() -> dict[str, object]:
    """The scripted step functions, made on first use (TorchScript resolves `torch.ops.floe.gemv_q`
    when it compiles: importing qgemv declares it, built or not)."""
    if not _scripted:
        import floe.engine.qgemv  # noqa: F401 - declares torch.ops.floe.gemv_q

        _scripted.update(decode_layers=_script(decode_layers), project=_script(project), norm=_script(norm))
    return _scripted


def _weights(module) -> tuple[Tensor, Tensor, int]:
    """(weight, scales, repeat) of a projection as `project` takes them."""
    from floe.engine.qgemv import QLinear

    if isinstance(module, QLinear):
        return module.blocks, torch.empty(0), -module.number
    if isinstance(module, Int4Linear):
        return module.packed, module.scales_zeros, module.k_repeat
    return module.weight, torch.empty(0), 0


class CpuDecoder:
    """Decode steps of up to `cache.n_slots` rows at once, each row a slot of `cache`, on the CPU (its
    buffers serve one thread at a time)."""

    def __init__(self, model: Transformer, cache: KVCache, script: bool = True,
                 native_ops: bool | None = None) -> None:
        c = model.config
        if c.llama_step_lacks():
            raise UnsupportedModel(f"the CPU's lean decode step computes Llama's layer without "
                                   f"{', '.join(c.llama_step_lacks())}, which {c.arch} models need: "
                                   "run them by the module forward (Engine(fused_kernels=False))")
        self.model, self.cache, self.config = model, cache, c
        hd, half, rows = c.head_dim, c.head_dim // 2, cache.n_slots
        # Rotary of a row x is x @ R(position), R = diag(cos) + P diag(sin_signed), P the half-roll
        # permutation; Q's rows are first scaled by the attention scale (1/sqrt(head_dim) but Gemma's).
        # Gemma 3's windowed layers rotate by tables of their own base (table 1).
        self.tables = [model.cos, model.sin] + ([] if model.cos_local is None else [model.cos_local,
                                                                                   model.sin_local])
        self.sin_signed = [sin.clone() for sin in self.tables[1::2]]
        for sin in self.sin_signed:
            sin[:, :half] = -sin[:, :half]
        self.layer_rope = [int(layer.attention.local_rope) for layer in model.layers]
        self.roll = torch.roll(torch.eye(hd), half, dims=1)  # x @ roll == torch.roll(x, half)
        self.row_scale = torch.ones(c.n_heads + c.n_kv_heads, 1)
        self.row_scale[: c.n_heads] = c.attention_scale or 1 / math.sqrt(hd)
        # floe's attend operator scales by 1/sqrt(head_dim): Gemma's queries are first times this
        q_factor = 1.0 if c.attention_scale is None else c.attention_scale * math.sqrt(hd)
        self.q_factor = 1.0 if math.isclose(q_factor, 1.0, rel_tol=1e-12) else q_factor
        self.x = torch.empty(rows, c.dim)  # the residual stream, fp32 whatever the weights' dtype
        # attention's output, in the KV cache's dtype (its values' product; bf16 caches: bf16)
        self.att = torch.empty(rows, c.n_heads * hd, dtype=cache.v.dtype)
        self.zero = torch.zeros(1)
        self.norms, self.inputs, self.qkv_bias, self.qk_norms, self.post_norms = [], [], [], [], []
        self.weights, self.scales, self.repeats = [], [], []
        none = torch.empty(0)
        for layer in model.layers:
            a, f = layer.attention, layer.feed_forward
            for module in (a.wqkv, a.wo, f.w13, f.w2):
                w, s, r = _weights(module)
                self.weights.append(w)
                self.scales.append(s)
                self.repeats.append(r)
            self.norms += [layer.attention_norm.weight, layer.ffn_norm.weight]
            self.inputs += [self._input(a.wqkv), self._input(f.w13)]
            bias = a.wqkv.bias
            self.qkv_bias.append(none if bias is None else bias)
            qk_norm = qk_norm_weight(a)
            self.qk_norms.append(none if qk_norm is None else qk_norm)
            self.post_norms += [none if n is None else n.weight for n in (layer.post_attention_norm,
                                                                          layer.post_ffn_norm)]
        # Each layer's window, where it is shorter than the cache (0: none: every query sees every
        # earlier position anyway).
        limits = c.window_limits(cache.max_seq_len)
        self.windows = [layer.attention.window if limits and layer.attention.window else 0
                        for layer in model.layers]
        self.softcap = c.attn_softcap or 0.0
        # floe's operators for RMSNorm and attention (windows and caps included) where floe's kernels
        # are loaded (a native projection) and the norms, their outputs and the cache are float32;
        # else PyTorch's ops (`native_ops` chooses, for tests)
        if native_ops is None:
            native_ops = any(r < 0 for r in self.repeats) and all(
                t.dtype == torch.float32 for t in (cache.k, *self.norms, *self.inputs, model.norm.weight))
        self.native_ops = native_ops
        self.k_caches = [cache.k[i] for i in range(c.n_layers)]
        self.v_caches = [cache.v[i] for i in range(c.n_layers)]
        # The head as `project` takes it; a quantized head's exact_top pass (QLinear) runs after it,
        # as in the module forward.
        head = model.head
        self.head = _weights(head) if head is not None else (model.output_weight(), torch.empty(0), 0)
        self.exact_head = head if getattr(head, "rounding_bound", None) is not None else None
        self.head_input = torch.empty(rows, c.dim, dtype=input_dtype(self.head[0], self.head[2]))
        self._rows_views: dict[int, tuple] = {}
        fns = _compiled() if script else {"decode_layers": decode_layers, "project": project, "norm": norm}
        self.run_layers, self.project, self.norm = fns["decode_layers"], fns["project"], fns["norm"]

    def _input(self, module) -> Tensor:
        """The buffer a norm writes a projection's input rows into, in the dtype `project` takes."""
        weight, _, repeat = _weights(module)
        return torch.empty(self.cache.n_slots, self.config.dim, dtype=input_dtype(weight, repeat))

    def _views(self, rows: int) -> tuple:
        """The buffers' first `rows` rows as the step passes them (made once per row count)."""
        views = self._rows_views.get(rows)
        if views is None:
            c = self.config
            x, att = self.x[:rows], self.att[:rows]
            views = (x, list(x.unbind()), [buffer[:rows] for buffer in self.inputs], att,
                     [row.view(c.n_kv_heads, c.n_heads // c.n_kv_heads, c.head_dim) for row in att.unbind()],
                     self.head_input[:rows])
            self._rows_views[rows] = views
        return views

    def _rotaries(self, positions: list[int]) -> list[Tensor]:
        """Each rotary table's rotation [B, head_dim, head_dim] of the rows' positions (unused by the
        native operators: their tables are the step's)."""
        if self.native_ops:
            return [self.roll]
        at = torch.tensor(positions)
        return [torch.diag_embed(cos[at]) + self.roll * sin[at].unsqueeze(1)
                for cos, sin in zip(self.tables[::2], self.sin_signed, strict=True)]

    @torch.inference_mode()
    def step(self, tokens: list[int], positions: list[int], slots: list[int],
             out: Tensor | None = None) -> Tensor:
        """Logits [B, vocab] (float32): row b after appending tokens[b] at positions[b] to the cache
        of slot slots[b] (distinct slots). With `out` (float32 [B, vocab]) they are written there."""
        c, m = self.config, self.model
        x, x_rows, inputs, att, att_rows, head_input = self._views(len(tokens))
        rows = m.tok_embeddings(torch.tensor(tokens))
        if c.embedding_scale != 1.0:  # Gemma's, rounded to the rows' dtype first, as the module does
            rows = rows * torch.tensor(c.embedding_scale, dtype=rows.dtype)
        x.copy_(rows)
        self.run_layers(x, x_rows, self._rotaries(positions), self.row_scale, slots, positions, c.norm_eps,
                        self.norms, inputs, self.weights, self.scales, self.repeats, self.qkv_bias,
                        self.qk_norms, self.post_norms, self.k_caches, self.v_caches, att, att_rows,
                        c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, self.zero, self.native_ops,
                        self.tables, self.layer_rope, self.windows, self.softcap, c.activation == "gelu_tanh",
                        self.q_factor)
        h = self.norm(x, x_rows, m.norm.weight, c.norm_eps, self.zero, head_input,
                      self.native_ops and head_input.dtype == torch.float32)
        weight, scales, repeat = self.head
        if out is not None and repeat == 0 and weight.dtype == torch.float32:
            logits = torch.mm(h, weight.t(), out=out)  # straight into the caller's buffer
        else:
            logits = self.project(h, weight, scales, repeat)
            if self.exact_head is not None:
                self.exact_head.exact_top(h, logits)
            logits = logits.float() if out is None else out.copy_(logits)
        cap = c.logit_softcap  # Gemma 2's, in place as the module forward caps its `out`
        return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)
