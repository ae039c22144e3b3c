"""Tiny real models for tests: random Llama/Mistral/Phi-3/Qwen2/Qwen3/Gemma written with transformers'
save_pretrained (and as llama.cpp's converter writes them), and tiny GGUF files written with gguf's
GGUFWriter in every tensor type floe must read.

Both borrow the default model's real tokenizer (SmolLM2's 49152-token byte-level BPE).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, RopeScalingType
from gguf.quants import GGML_QUANT_SIZES, quantize

from floe.model import default_model_path
from floe.model.checkpoint import permute_rotary_rows
from floe.model.gguf_file import GGUFFile

VOCAB = 49152


def tokenizer_fields() -> dict:
    fields = GGUFFile(default_model_path()).fields
    return {k: v for k, v in fields.items() if k.startswith("tokenizer.")}


def save_hf_folder(folder: Path, arch: str, *, seed: int = 0, tie: bool, rope_llama3: bool = False,
                   shard: bool = True, sliding_window: int | None = None, partial_rotary: float = 1.0,
                   long_rope: bool = False, query_pre_attn_scalar: int = 32,
                   softcaps: tuple[float | None, float | None] = (None, None),
                   rope_linear: float | None = None, vocab_size: int = VOCAB,
                   picks: list[int] | None = None) -> Path:
    """A random transformers model of `arch` ("llama", "mistral", "phi3", "qwen2", "qwen3", "gemma2" or
    "gemma3_text") saved as safetensors shards. qwen3's and gemma's head_dim (32) is not hidden_size /
    heads (16), as in Qwen3-0.6B (128 vs 64); mistral's, phi3's and gemma's attention sees the last
    `sliding_window` positions (None: all; gemma: on its windowed layers: gemma2's 2 layers, the first;
    gemma3_text's 6 layers, all but the last); phi3 rotates the first `partial_rotary` of each head,
    with LongRoPE (random factors, pretrained on 32 positions of 512) if `long_rope`; gemma scales q·k
    by query_pre_attn_scalar ** -0.5 and gemma2 soft-caps (attention, final logits) by `softcaps`;
    gemma3_text's global layers scale their rotary linearly by `rope_linear` (as Gemma 3 4B-27B).
    picks: the only token ids the model's greedy choice can be (the others' output rows are zero, so
    their logit 0 is below the best of these random ones; untied embeddings)."""
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    from floe.model.gguf_tokenizer import tokenizer_from_gguf

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        if rope_llama3:
            rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64}
        config = LlamaConfig(**common, rope_parameters=rope)
        cls = LlamaForCausalLM
    elif arch == "mistral":
        config = MistralConfig(**common, sliding_window=sliding_window,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        cls = MistralForCausalLM
    elif arch == "phi3":
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial_rotary}
        if long_rope:
            pairs = int(16 * partial_rotary) // 2
            factors = np.random.default_rng(seed).uniform(1.0, 8.0, (2, pairs)).round(3).tolist()
            rope.update(rope_type="longrope", short_factor=factors[0], long_factor=factors[1],
                        original_max_position_embeddings=32)
        config = Phi3Config(**common, sliding_window=sliding_window, rope_parameters=rope,
                            original_max_position_embeddings=32 if long_rope else 512, pad_token_id=0)
        cls = Phi3ForCausalLM
    elif arch in ("gemma2", "gemma3_text"):
        gemma = dict(head_dim=32, sliding_window=sliding_window, query_pre_attn_scalar=query_pre_attn_scalar,
                     hidden_activation="gelu_pytorch_tanh", pad_token_id=0)
        if arch == "gemma2":
            config = Gemma2Config(**common, **gemma, attn_logit_softcapping=softcaps[0],
                                  final_logit_softcapping=softcaps[1],
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
            cls = Gemma2ForCausalLM
        else:
            rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6}}
            if rope_linear:
                rope["full_attention"].update(rope_type="linear", factor=rope_linear)
            config = Gemma3TextConfig(**{**common, "num_hidden_layers": 6}, **gemma, rope_parameters=rope)
            cls = Gemma3ForCausalLM
        config._attn_implementation = "eager"  # transformers' SDPA attention has no soft-capping
    elif arch == "qwen2":
        config = Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        cls = Qwen2ForCausalLM
    else:
        rope = {"rope_type": "default", "rope_theta": 1e6}
        config = Qwen3Config(**common, head_dim=32, rope_parameters=rope)
        cls = Qwen3ForCausalLM
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # default init leaves biases at zero: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if arch.startswith("gemma") and name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8)  # scores of order 1, where soft-capping bends them
    if picks is not None:
        assert not tie, "picks zero output rows: the embedding must be the model's own"
        with torch.no_grad():
            silent = torch.ones(vocab_size, dtype=torch.bool)
            silent[picks] = False
            model.lm_head.weight[silent] = 0
    model.save_pretrained(folder, max_shard_size="2MB" if shard else "10GB")
    tokenizer_from_gguf(tokenizer_fields()).backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        '{"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": false}'
    )
    return folder


REFERENCE_IDS = [1, 504, 3575, 282, 4649, 314, 7042, 30, 17, 42, 9000, 31000] * 4  # 48 positions


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' logits [len(ids), vocab] of one forward over ids."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' n greedy tokens after prompt, each from a forward over everything so far."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(reference_logits(model, ids)[-1].argmax()))
    return ids[len(prompt):]


def floe_greedy(engine, prompt: list[int], n: int) -> list[int]:
    """An engine's n greedy tokens after prompt, through its decode step (the CPU's lean step)."""
    out = [int(engine.prefill(prompt).argmax())]
    while len(out) < n:
        out.append(int(engine.decode_step(out[-1]).argmax()))
    return out


def assert_matches_transformers(path, model, tolerance: float = 1e-4, *, max_seq_len: int = 128,
                                ids: list[int] = REFERENCE_IDS, prompt_len: int = 20, n_new: int = 8) -> None:
    """An engine over the checkpoint at `path` gives transformers' `model`'s fp32 logits over `ids` (cut to
    max_seq_len) within `tolerance`, and its n_new greedy tokens after ids[:prompt_len]."""
    from floe.engine import Engine
    from floe.model import load_checkpoint

    engine = Engine(load_checkpoint(path), max_seq_len=max_seq_len)
    ids = ids[:max_seq_len]
    ref = reference_logits(model, ids)
    ours = engine.prefill(ids, all_logits=True)
    assert ref.abs().max() > 0.5  # the comparison means something
    assert (ours - ref).abs().max().item() <= tolerance
    engine.kv_truncate(0)
    assert floe_greedy(engine, ids[:prompt_len], n_new) == reference_greedy(model, ids[:prompt_len], n_new)


# transformers' names of a layer's tensors -> llama.cpp's (convert_hf_to_gguf)
_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # Phi-3's fused tensors, kept fused
}
# Gemma's: its post_attention_layernorm follows attention; pre_feedforward_layernorm feeds the MLP
_GGUF_GEMMA_NAMES = {**_GGUF_LAYER_NAMES, "post_attention_layernorm": "post_attention_norm",
                     "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def gguf_name(hf_name: str, gemma: bool = False) -> str:
    """llama.cpp's name of a transformers tensor (of a Gemma model's where `gemma`)."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{(_GGUF_GEMMA_NAMES if gemma else _GGUF_LAYER_NAMES)[module]}.{kind}"


# model_type -> the general.architecture llama.cpp's converter writes (MistralForCausalLM: LlamaModel)
_GGUF_ARCH = {"qwen3": "qwen3", "mistral": "llama", "phi3": "phi3", "gemma2": "gemma2",
              "gemma3_text": "gemma3"}


def convert_to_gguf(folder: Path, path: Path, qtype: Q = Q.F32, tokenizer: dict | None = None) -> Path:
    """The transformers model in `folder` (qwen3, mistral or phi3) as llama.cpp's converter writes
    it: qwen3 with its qwen3.* keys (attention.key_length: the explicit head_dim); mistral as
    general.architecture llama, Q/K rows permuted (rotary pairs adjacent), its window as
    llama.attention.sliding_window; phi3 with attn_qkv and ffn_up (gate and up) fused,
    rope.dimension_count (the partial rotary), sliding_window (0: none) and LongRoPE's
    rope_factors_short/long tensors, attention factor and original context; gemma2 and gemma3_text
    (general.architecture gemma3) with 1 added to every norm weight, four norms a layer, gemma2's
    soft-capping keys, gemma3's global rotary base (its windowed layers' is llama.cpp's 10000) and
    no query_pre_attn_scalar (llama.cpp's rule: head_dim below 27B). Matrices in `qtype`, norms F32.
    tokenizer: its tokenizer.* fields (default: SmolLM2's)."""
    import json

    from safetensors import safe_open

    cfg = json.loads((folder / "config.json").read_text())
    arch = _GGUF_ARCH[cfg["model_type"]]
    n_heads, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
    writer = GGUFWriter(path, arch)
    writer.add_name(f"tiny-test-{cfg['model_type']}")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv)
    if cfg.get("head_dim"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention") or rope  # gemma3_text: the global layers' base
    writer.add_rope_freq_base(float(cfg.get("rope_theta") or rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if arch == "phi3":
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        writer.add_sliding_window(cfg.get("sliding_window") or 0)
        writer.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
    elif cfg.get("sliding_window") is not None:
        writer.add_sliding_window(cfg["sliding_window"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if cfg.get("attn_logit_softcapping") is not None:
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
    if cfg.get("final_logit_softcapping") is not None:
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if rope.get("rope_type") == "longrope":
        factor = cfg["max_position_embeddings"] / cfg["original_max_position_embeddings"]
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(factor)
                                                       / math.log(cfg["original_max_position_embeddings"])))
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    for key, value in (tokenizer or tokenizer_fields()).items():
        _add_field(writer, key, value)
    tensors = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), framework="np") as f:
            tensors.update((name, f.get_tensor(name).astype(np.float32)) for name in f.keys())
    gemma = arch in ("gemma2", "gemma3")
    for name, w in sorted(tensors.items()):
        if gemma and name.endswith("norm.weight"):
            w = w + 1  # llama.cpp's Gemma converters store the (1 + w) the norm multiplies by
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = n_heads if "q_proj" in name else n_kv
            w = permute_rotary_rows(torch.from_numpy(w), heads).numpy()
        quantize_it = w.ndim == 2 and qtype != Q.F32
        writer.add_tensor(gguf_name(name, gemma), quantize(w, qtype) if quantize_it else w,
                          raw_dtype=qtype if quantize_it else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Where each fp16 scale of a K-quant block sits (byte offsets), so random blocks stay finite.
_FP16_FIELDS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q2_K: (80, 82), Q.Q3_K: (108,)}


def encode_tensor(w: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """w [rows, cols] float32 -> GGUF bytes of `qtype`. K-quants (gguf cannot quantize them) get
    random valid blocks instead of w's values: both readers must then agree on what they mean."""
    if qtype == Q.F32:
        return w.astype(np.float32)
    if qtype in _FP16_FIELDS:
        block, size = GGML_QUANT_SIZES[qtype]
        n_blocks = w.shape[0] * w.shape[1] // block
        raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
        for off in _FP16_FIELDS[qtype]:
            scale = (rng.random(n_blocks) * 0.02 + 0.001).astype(np.float16)
            raw[:, off:off + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
        return raw.reshape(w.shape[0], -1)
    return quantize(w, qtype)


def write_gguf(path: Path, qtypes: list[Q], *, seed: int = 0, dim: int = 256, n_layers: int = 2,
               extra_tensors: dict[str, tuple[np.ndarray, Q]] | None = None,
               arch: str = "llama") -> Path:
    """A tiny random Llama GGUF (llama.cpp layout: Q/K rows permuted) cycling weight types."""
    rng = np.random.default_rng(seed)
    n_heads, n_kv, ffn = 4, 2, 512
    hd = dim // n_heads
    writer = GGUFWriter(path, arch)
    writer.add_name("tiny-test-llama")
    writer.add_block_count(n_layers)
    writer.add_context_length(512)
    writer.add_embedding_length(dim)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(hd)
    for key, value in tokenizer_fields().items():
        _add_field(writer, key, value)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    weights: dict[str, np.ndarray] = {"token_embd.weight": rand(VOCAB, dim),
                                      "output_norm.weight": 1 + rand(dim),
                                      "output.weight": rand(VOCAB, dim)}
    for i in range(n_layers):
        p = f"blk.{i}."
        weights[p + "attn_norm.weight"] = 1 + rand(dim)
        weights[p + "ffn_norm.weight"] = 1 + rand(dim)
        # Written as llama.cpp's converter writes them: rotary pairs adjacent.
        wq, wk = torch.from_numpy(rand(dim, dim)), torch.from_numpy(rand(n_kv * hd, dim))
        weights[p + "attn_q.weight"] = permute_rotary_rows(wq, n_heads).numpy()
        weights[p + "attn_k.weight"] = permute_rotary_rows(wk, n_kv).numpy()
        weights[p + "attn_v.weight"] = rand(n_kv * hd, dim)
        weights[p + "attn_output.weight"] = rand(dim, dim)
        weights[p + "ffn_gate.weight"] = rand(ffn, dim)
        weights[p + "ffn_up.weight"] = rand(ffn, dim)
        weights[p + "ffn_down.weight"] = rand(dim, ffn)
    matrices = [n for n, w in weights.items() if w.ndim == 2]
    for j, name in enumerate(matrices):
        qtype = qtypes[j % len(qtypes)]
        data = encode_tensor(weights[name], qtype, rng)
        writer.add_tensor(name, data, raw_dtype=None if qtype == Q.F32 else qtype)
    for name, w in weights.items():
        if w.ndim == 1:
            writer.add_tensor(name, w)
    for name, (data, qtype) in (extra_tensors or {}).items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_field(writer: GGUFWriter, key: str, value) -> None:
    if key == "tokenizer.ggml.tokens":
        writer.add_token_list(value)
    elif key == "tokenizer.ggml.token_type":
        writer.add_token_types(value)
    elif key == "tokenizer.ggml.merges":
        writer.add_token_merges(value)
    elif key == "tokenizer.ggml.scores":
        writer.add_token_scores(value)
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)


def tiny_engine(n_slots: int = 8, max_seq_len: int = 512):
    """An Engine on a 2-layer random model (dim 64) with SmolLM2's real tokenizer: fast to build and
    to step, for tests of everything around the model."""
    from floe.engine import Engine
    from floe.model.config import ModelConfig
    from floe.model.gguf_tokenizer import tokenizer_from_gguf
    from floe.model.synthetic import random_checkpoint

    config = ModelConfig("llama", 64, 2, 4, 2, 160, VOCAB, 512, name="tiny-test")
    checkpoint = random_checkpoint(config, tokenizer_from_gguf(GGUFFile(default_model_path()).fields),
                                   dtype=torch.float32, scale=0.5)
    return Engine(checkpoint, max_seq_len=max_seq_len, n_slots=n_slots)


# Engine's CUDA steps by name: the module forward, its graph of one slot, the fused Triton graphs
CUDA_STEPS = {"eager": {"cuda_graphs": False}, "graph": {"cuda_graphs": True, "fused_kernels": False},
              "fused": {"cuda_graphs": True, "fused_kernels": True}}


def assert_cuda_matches_the_cpu(checkpoint, steps: dict, ids: list[int], two_slots: bool = True) -> None:
    """CUDA's `steps` (Engine's keywords) against the CPU's one-shot prefill of `ids` (over 300 of
    them): a 300-token prompt (a prompt graph past PREFILL_ROWS on the fused step), then each decode
    step, within 1e-3 with the same greedy tokens; with two_slots, a 20-token prompt in a second slot
    (riding in the rows' graph) and one decode_batch of both slots' next rows."""
    from floe.engine import Engine

    full = Engine(checkpoint, max_seq_len=512).prefill(ids, all_logits=True)
    cuda = Engine(checkpoint, device="cuda", max_seq_len=512, n_slots=2, **steps)
    got = torch.stack([cuda.prefill(ids[:300]).cpu()] + [cuda.decode_step(t).cpu() for t in ids[300:-1]])
    assert (got - full[299:-1]).abs().max().item() <= 1e-3
    assert torch.equal(got.argmax(-1), full[299:-1].argmax(-1))
    if two_slots:
        cuda.prefill(ids[:20], slot=1)
        rows = cuda.decode_batch([ids[-1], ids[20]], [0, 1])
        assert (rows[0].cpu() - full[-1]).abs().max().item() <= 1e-3
        assert (rows[1].cpu() - full[20]).abs().max().item() <= 1e-3
