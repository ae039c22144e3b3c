"""A checkpoint's weights into the transformer, once, on its device: dense in the engine's dtype, or
(native, CPU) the file's quantized projections run as the file stores them by a kernel chosen for this
CPU. Set-up only: nothing here runs per token."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from floe.engine.transformer import (
    QuantizedEmbedding,
    Transformer,
    fused_quantized,
    fused_state_dict,
    module_weight,
    quantized_paths,
    stacked,
)
from floe.errors import FloeError, NotAModel, UnsupportedModel
from floe.memory import trim_heap
from floe.model.checkpoint import Checkpoint
from floe.model.config import ModelConfig

WEIGHTS = ("dense", "native")


class LogitsHead(nn.Module):
    """The projection to the vocabulary with float32 logits from bf16 activations. A bf16 matmul
    rounds its output to bf16 (steps of 0.125 at 25), which ties logits that fp32 tells apart. On
    CUDA the bf16 weight is read as it is (cuBLAS writes fp32); PyTorch's CPU has no such matmul, so
    there the weight is kept in float32 (twice the head's bytes)."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight if weight.is_cuda else weight.float(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        if self.weight.dtype == torch.float32:
            return F.linear(x.float(), self.weight)
        return torch.mm(x, self.weight.t(), out_dtype=torch.float32)


def check_backend(c: ModelConfig, backend: str, max_seq_len: int) -> None:
    """Raise UnsupportedModel, naming the architecture, where `backend` ("cpu", "cuda", "cuda-graph":
    CUDA's reference graph of one slot without the fused kernels, "webgpu") has no step for something
    the model computes in a context of max_seq_len positions; before any weight is read."""
    # Gemma's extras (GeGLU, post-norms, soft-capping, ...): the CPU's steps, CUDA's fused ones, WebGPU's.
    lacks = c.llama_step_lacks(backend)  # (none but CUDA's reference graph's)
    if lacks:
        raise UnsupportedModel(f"{c.arch} models run on CUDA through the fused Triton step or the module "
                               f"forward: floe's reference graph step computes Llama's layer without "
                               f"{', '.join(lacks)}; use Engine(fused_kernels=True) (Triton installed) or "
                               "cuda_graphs=False")
    # A sliding window shorter than the context: the CPU's steps, CUDA's fused ones, the module forward
    # and WebGPU's shaders mask it; CUDA's reference graph attends over every written position.
    if c.window_limits(max_seq_len) and backend == "cuda-graph":
        raise UnsupportedModel(
            f"{c.arch} models with sliding-window attention (a window of {c.sliding_window} positions, "
            f"shorter than this engine's context of {max_seq_len}) run on the CPU, WebGPU and CUDA's "
            "fused step only in this version: floe's cuda-graph step attends over the whole context; use "
            f"Engine(fused_kernels=True) (Triton installed), or a context of at most {c.sliding_window} "
            "positions (--context, Engine(max_seq_len=...))")


@dataclass
class LoadedModel:
    """What load_model made: the model (eval mode, float32 logits), the native kernel that runs its
    quantized projections (None: dense weights) and how many matrices of each file type it runs."""

    model: Transformer
    native_kernel: str | None
    packed: dict[str, int]


def load_model(checkpoint: Checkpoint, max_seq_len: int, device: torch.device, dtype: torch.dtype,
               weights: str = "dense", native_kernel: str = "auto",
               prefill_copy: bool = False) -> LoadedModel:
    """The model, its weights read from the checkpoint one at a time in `dtype`, on `device`. Native
    weights: the file's quantized projections run as they are (native_kernel: auto, a variant of
    floe.engine.qgemv, or int4pack) and a quantized embedding table is looked up in the file
    (QuantizedEmbedding); only what they cannot run is dequantized. prefill_copy: quantized layers
    keep a dense copy for long inputs."""
    if weights not in WEIGHTS:
        raise FloeError(f"weights {weights!r}: choose 'dense' or 'native'")
    check_backend(checkpoint.config, device.type, max_seq_len)
    kernel = None
    if weights == "native":
        if device.type != "cpu":
            raise FloeError("native quantized weights run on the CPU; on CUDA choose dense weights")
        kernel = choose_native_kernel(native_kernel)
    c = checkpoint.config
    with torch.device("meta"):
        model = Transformer(c, max_seq_len)

    def take(name: str) -> Tensor:
        return checkpoint.weight(name, dtype).to(device)

    native = quantized_paths(checkpoint.quantized, c) if kernel else []
    table = "tok_embeddings.weight"
    lookup = kernel is not None and table in checkpoint.quantized
    skip = {module_weight(path, c) for path in native} | ({table} if lookup else set())
    for name, tensor in fused_state_dict(take, c, skip):
        model.load_state_dict({name: tensor}, strict=False, assign=True)
    packed = _pack_native(model, checkpoint, native, take, kernel, prefill_copy) if native else {}
    if lookup and (not c.tie_embeddings or model.head is not None):
        model.tok_embeddings = QuantizedEmbedding(checkpoint.quantized[table], dtype)
    elif lookup:  # tied, and the head runs dense: the table is that head's weight
        model.load_state_dict({table: take(table)}, strict=False, assign=True)
    model.cos, model.sin = model.cos.to(device), model.sin.to(device)
    if model.cos_local is not None:
        model.cos_local, model.sin_local = model.cos_local.to(device), model.sin_local.to(device)
    unread = [name for name, p in model.named_parameters() if p.is_meta]
    if unread:
        raise NotAModel(f"{checkpoint.source}: no weight was read for {unread[0]}")
    if dtype != torch.float32 and model.head is None:
        model.head = LogitsHead(model.output_weight())  # the sampler sees float32 logits
    return LoadedModel(model.eval(), kernel, packed)


def _pack_native(model: Transformer, checkpoint: Checkpoint, paths: list[str], take: Callable[[str], Tensor],
                 kernel: str, prefill_copy: bool) -> dict[str, int]:
    """Swap in quantized layers for the file's quantized projections (`paths`, see quantized_paths)
    that a kernel runs exactly: floe's int8-activation kernel (QLinear), else PyTorch's packed int4
    (Int4Linear) for the layers only: that kernel rounds its output to bf16, which ties near-equal
    logits, so the head stays float32. A projection no kernel runs is dequantized instead (the tied
    head: see load_model). One projection at a time, so one layer's stacked blocks at most exist
    beside the packed ones. Returns how many matrices of each type were swapped."""
    from floe.engine import qgemv
    from floe.engine.int4 import Int4Linear

    config, packed = checkpoint.config, {}
    for path in paths:
        weight, head = fused_quantized(checkpoint.quantized, path, config), path == "output"
        bias = None if head else model.get_submodule(path).bias
        layer = None
        if weight is not None and kernel != "int4pack" and qgemv.supports(weight):
            layer = qgemv.QLinear(weight, bias, dense=prefill_copy and not head, kernel=kernel,
                                  exact_top=head)
        elif weight is not None and weight.has_int4_form and not head:
            layer = Int4Linear(weight, bias, dense=prefill_copy)
        if layer is None:
            name = module_weight(path, config)
            if name != "tok_embeddings.weight":
                model.load_state_dict({name: stacked(take, name)}, strict=False, assign=True)
            continue
        if head:
            model.head, model.output = layer, None  # untied: its dense weight is never read
        else:
            parent, name = path.rsplit(".", 1)
            setattr(model.get_submodule(parent), name, layer)
        packed[weight.qtype] = packed.get(weight.qtype, 0) + 1
        del weight, layer
        trim_heap()  # the matrix's temporary copies leave this process's memory now, not at its end
    return packed


def choose_native_kernel(kernel: str) -> str:
    """The kernel `kernel` names, built and loaded now: auto is floe's best variant for this CPU
    (chosen from its flags before anything compiles), or PyTorch's packed int4 where floe's kernels
    cannot be built (said on stderr)."""
    from floe.engine import qgemv
    from floe.engine.int4 import int4_available

    choices = ("auto", *qgemv.VARIANTS, "int4pack")
    if kernel not in choices:
        raise FloeError(f"native kernel {kernel!r}: choose one of {', '.join(choices)}")
    if kernel == "int4pack":
        if not int4_available():
            raise FloeError("this PyTorch build has no CPU int4 kernel; choose another native kernel "
                            "or dense weights")
        return kernel
    name = qgemv.runnable()[0] if kernel == "auto" else kernel
    try:
        qgemv.load(name)
    except qgemv.KernelUnavailable as e:
        if kernel != "auto" or not int4_available():
            raise
        print(f"floe: {e}; running PyTorch's packed int4 kernel instead", file=sys.stderr, flush=True)
        return "int4pack"
    return name
