"""Batch-1 decode on the CPU as a flat sequence of tensor ops.

On a CPU a decode token of a small model is a few hundred tiny operations, and each costs a few
microseconds of dispatch whatever its size, so their number matters as much as the weight bytes.
This path runs the same mathematics as `Transformer.forward` with about half the operations: no
module calls, RMSNorm as a dot product and one fused multiply into a preallocated buffer of the
next projection's input dtype, rotary for all Q and K heads as one small matrix product (with the
attention scale folded in), batched attention over grouped heads, and the residual stream updated
in place. It reads the model's own weights; nothing is copied.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from floe.engine.int4 import Int4Linear
from floe.engine.kvcache import KVCache
from floe.engine.transformer import Transformer


def project(x: Tensor, weight: Tensor, scales: Tensor, repeat: int) -> Tensor:
    """x Wᵀ. repeat > 0: W packed int4 (x bf16, repeated `repeat` times along its row); 0: dense
    (x already in W's dtype); < 0: W as 4- or 8-bit codes for floe's kernel number -repeat (x float32,
    scales the [2, rows, groups] scale and offset)."""
    if repeat == 0:
        return F.linear(x, weight)
    if repeat < 0:
        return torch.ops.floe.gemv_q(x, weight, scales[0], scales[1], -repeat)
    if repeat > 1:
        x = x.repeat(1, repeat)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight, 32, scales)


def input_dtype(weight: Tensor, repeat: int) -> torch.dtype:
    """The dtype `project` takes its input in."""
    return torch.bfloat16 if repeat > 0 else torch.float32 if repeat < 0 else weight.dtype


def rms_norm(x: Tensor, x0: Tensor, weight: Tensor, eps: float, zero: Tensor, out: Tensor) -> Tensor:
    """RMSNorm of the one fp32 row x [1, dim] (x0 = x[0]) written into `out`, the next projection's
    input buffer (of that projection's dtype): one dot product and one fused multiply."""
    r = 1.0 / math.sqrt(float(torch.dot(x0, x0)) / x0.shape[0] + eps)
    return torch.addcmul(zero, x, weight, value=r, out=out)


def decode_layers(x: Tensor, rotary: Tensor, row_scale: Tensor, position: int, eps: float,
                  norms: list[Tensor], inputs: list[Tensor], weights: list[Tensor], scales: list[Tensor],
                  repeats: list[int], qkv_bias: list[Tensor], k_caches: list[Tensor],
                  v_caches: list[Tensor], n_heads: int, n_kv: int, head_dim: int, ffn_dim: int,
                  zero: Tensor) -> None:
    """Every layer of one decode step, updating the fp32 residual row x [1, dim] in place.

    Per layer i: norms[2i], norms[2i+1] (attention, ffn) and their output buffers inputs[2i],
    inputs[2i+1]; weights/scales/repeats[4i..4i+3] the qkv, o, gate+up and down projections (see
    `project`); qkv_bias[i] (empty if none); zero: a float32 [1] of 0 (addcmul's base).
    """
    qk_size, group = (n_heads + n_kv) * head_dim, n_heads // n_kv
    x0 = x[0]
    for i in range(len(k_caches)):
        k_cache, v_cache, j = k_caches[i], v_caches[i], 4 * i
        h = rms_norm(x, x0, norms[2 * i], eps, zero, inputs[2 * i])
        y = project(h, weights[j], scales[j], repeats[j])
        if qkv_bias[i].numel() > 0:
            y = y + qkv_bias[i]
        # Rotary for all Q and K heads in one product; Q's rows also carry the attention scale.
        rot = torch.mm(torch.mul(y[:, :qk_size].view(n_heads + n_kv, head_dim), row_scale), rotary)
        if rot.dtype != k_cache.dtype:
            rot = rot.to(k_cache.dtype)
        k_cache[:, position].copy_(rot[n_heads:])
        v_cache[:, position].copy_(y[:, qk_size:].view(n_kv, head_dim))
        keys, values = k_cache[:, : position + 1].transpose(1, 2), v_cache[:, : position + 1]
        scores = torch.bmm(rot[:n_heads].view(n_kv, group, head_dim), keys)
        att = torch.bmm(torch.softmax(scores, dim=-1), values).view(1, n_heads * head_dim)
        o_dtype = input_dtype(weights[j + 1], repeats[j + 1])
        x.add_(project(att.to(o_dtype), weights[j + 1], scales[j + 1], repeats[j + 1]))
        gate_up = project(rms_norm(x, x0, norms[2 * i + 1], eps, zero, inputs[2 * i + 1]), weights[j + 2],
                          scales[j + 2], repeats[j + 2])
        gate = F.silu(gate_up[:, :ffn_dim]).mul_(gate_up[:, ffn_dim:])
        down_dtype = input_dtype(weights[j + 3], repeats[j + 3])
        if gate.dtype != down_dtype:
            gate = gate.to(down_dtype)
        x.add_(project(gate, weights[j + 3], scales[j + 3], repeats[j + 3]))


def _script(fn):
    """TorchScript runs the loop without Python between ops (~20 % of a CPU decode step on
    SmolLM2-135M); where scripting is unavailable the same function runs eagerly."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.jit.script(fn)
    except Exception:  # noqa: BLE001 - TorchScript missing or changed: the eager function is the same math
        return fn


_scripted: dict[str, object] = {}


def _compiled() -> dict[str, object]:
    """The scripted step functions, made on first use (TorchScript resolves `torch.ops.floe.gemv_q`
    when it compiles: importing qgemv declares it, built or not)."""
    if not _scripted:
        import floe.engine.qgemv  # noqa: F401 - declares torch.ops.floe.gemv_q

        _scripted.update(decode_layers=_script(decode_layers), project=_script(project),
                         rms_norm=_script(rms_norm))
    return _scripted


def _weights(module) -> tuple[Tensor, Tensor, int]:
    """(weight, scales, repeat) of a projection as `project` takes them."""
    from floe.engine.qgemv import QLinear

    if isinstance(module, QLinear):
        return module.codes, module.scale_offset, -module.number
    if isinstance(module, Int4Linear):
        return module.packed, module.scales_zeros, module.k_repeat
    return module.weight, torch.empty(0), 0


class CpuDecoder:
    """Decode steps of one KV cache slot on the CPU (its buffers serve one thread at a time)."""

    def __init__(self, model: Transformer, cache: KVCache, slot: int, script: bool = True) -> None:
        c = model.config
        self.model, self.cache, self.slot, self.config = model, cache, slot, c
        hd, half = c.head_dim, c.head_dim // 2
        # Rotary of a row x is x @ R(position), R = diag(cos) + P diag(sin_signed), P the half-roll
        # permutation; Q's rows are first scaled by 1/sqrt(head_dim), the attention scale.
        self.sin_signed = model.sin.clone()
        self.sin_signed[:, :half] = -self.sin_signed[:, :half]
        self.roll = torch.roll(torch.eye(hd), half, dims=1)  # x @ roll == torch.roll(x, half)
        self.row_scale = torch.ones(c.n_heads + c.n_kv_heads, 1)
        self.row_scale[: c.n_heads] = 1 / math.sqrt(hd)
        self.x = torch.empty(1, c.dim)  # the residual stream, fp32 whatever the weights' dtype
        self.zero = torch.zeros(1)
        self.norms, self.inputs, self.qkv_bias = [], [], []
        self.weights, self.scales, self.repeats = [], [], []
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
            self.qkv_bias.append(torch.empty(0) if bias is None else bias)
        self.k_caches = [cache.k[i, slot] for i in range(c.n_layers)]
        self.v_caches = [cache.v[i, slot] for i in range(c.n_layers)]
        if model.head is not None:
            self.head, self.head_input = _weights(model.head), self._input(model.head)
        else:
            self.head = (model.output_weight(), torch.empty(0), 0)
            self.head_input = torch.empty(1, c.dim, dtype=model.output_weight().dtype)
        fns = _compiled() if script else {"decode_layers": decode_layers, "project": project,
                                          "rms_norm": rms_norm}
        self.run_layers, self.project, self.rms_norm = fns["decode_layers"], fns["project"], fns["rms_norm"]

    def _input(self, module) -> Tensor:
        """The buffer a norm writes a projection's input into, in the dtype `project` takes."""
        weight, _, repeat = _weights(module)
        return torch.empty(1, self.config.dim, dtype=input_dtype(weight, repeat))

    @torch.inference_mode()
    def step(self, token: int, position: int, out: Tensor | None = None) -> Tensor:
        """Logits [vocab] (float32) after appending `token` at `position` to the slot's cache."""
        c, m, x = self.config, self.model, self.x
        x.copy_(m.token_row(token))
        rotary = torch.diag(m.cos[position]) + self.roll * self.sin_signed[position]
        self.run_layers(x, rotary, self.row_scale, position, c.norm_eps, self.norms, self.inputs,
                        self.weights, self.scales, self.repeats, self.qkv_bias, self.k_caches,
                        self.v_caches, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, self.zero)
        h = self.rms_norm(x, x[0], m.norm.weight, c.norm_eps, self.zero, self.head_input)
        weight, scales, repeat = self.head
        if out is not None and repeat == 0 and weight.dtype == torch.float32:
            return torch.mv(weight, h[0], out=out)  # straight into the caller's buffer
        logits = self.project(h, weight, scales, repeat)[0]
        return logits.float() if out is None else out.copy_(logits)
