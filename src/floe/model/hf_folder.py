"""Read a Hugging Face model folder: config.json, *.safetensors (sharded too), tokenizer.json."""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer as HFTokenizer

from floe.errors import NotAModel, UnsupportedModel
from floe.model.checkpoint import (
    ROTARY_WEIGHTS,
    Checkpoint,
    LazyWeights,
    Progress,
    fused_part_rows,
    mapped,
    model_fingerprint,
    rotary_rows,
    take_rows,
    weight_rows,
)
from floe.model.config import (
    ARCHITECTURES,
    UNIT_OFFSET_NORM_ARCHITECTURES,
    LongRope,
    ModelConfig,
    RopeScaling,
)
from floe.model.tokenizer import Tokenizer

_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "input_layernorm.weight": "attention_norm.weight",
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.q_proj.bias": "attention.wq.bias",
    "self_attn.k_proj.bias": "attention.wk.bias",
    "self_attn.v_proj.bias": "attention.wv.bias",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
}
# Gemma's four norms a layer: its post_attention_layernorm follows attention (Llama's feeds the MLP).
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffn_norm.weight",
}
# model_type -> floe's architecture where they differ (gemma3_text: Gemma 3's text model, as in GGUF)
_ARCHS = {"gemma3_text": "gemma3"}
# Fused tensors (Phi-3), split by rows at load (checkpoint.FUSED_PARTS).
_FUSED_NAMES = {"self_attn.qkv_proj.weight": "qkv", "mlp.gate_up_proj.weight": "gate_up"}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_IGNORED = re.compile(r".*rotary_emb\.inv_freq")
# safetensors' dtype names as torch names them (Checkpoint.file_type).
_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise NotAModel(f"cannot read {path}: {e}") from e


def _read_optional_json(path: Path) -> dict:
    return _read_json(path) if path.is_file() else {}


def config_from_hf(cfg: dict, name: str) -> ModelConfig:
    model_type = cfg.get("model_type")
    if model_type == "gemma3":
        raise UnsupportedModel("model_type 'gemma3' is Gemma 3's image-text model: floe runs its text model "
                               "(a gemma3_text folder, or a GGUF of it)")
    arch = _ARCHS.get(model_type, model_type)
    if arch not in ARCHITECTURES:
        raise UnsupportedModel(
            f"model_type {model_type!r} ({', '.join(cfg.get('architectures') or [])}) is not supported "
            f"(floe runs: {', '.join(ARCHITECTURES)})"
        )
    # transformers >= 5 nests rope settings in rope_parameters (Gemma 3: one set per layer type); older
    # configs use rope_theta/rope_scaling.
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    local_rope = rope.pop("sliding_attention", None)
    rope = dict(rope.pop("full_attention", None) or rope)
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    scaling, long_rope, linear = None, None, 1.0
    if rope_type == "llama3":
        scaling = RopeScaling(
            float(rope["factor"]),
            float(rope["low_freq_factor"]),
            float(rope["high_freq_factor"]),
            int(rope["original_max_position_embeddings"]),
        )
    elif rope_type in ("longrope", "su") and model_type == "phi3":
        long_rope = _long_rope(cfg, rope)
    elif rope_type == "linear" and arch == "gemma3":  # its global layers only
        linear = float(rope["factor"])
    elif rope_type != "default":
        raise UnsupportedModel(f"rope scaling {rope_type!r} is not supported (llama3; longrope for phi3; "
                               "linear for gemma3)")
    gemma = arch in UNIT_OFFSET_NORM_ARCHITECTURES
    n_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
    partial = float(rope.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0)
    if cfg.get("use_sliding_window"):  # Qwen2/Qwen3: a window on some layers only
        raise UnsupportedModel(f"{model_type} with use_sliding_window (a window on the layers past "
                               "max_window_layers) is not supported")
    return ModelConfig(
        arch=arch,
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        ffn_dim=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        context_length=cfg.get("max_position_embeddings", 2048),
        head_dim=head_dim,
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0),
        rope_scaling=scaling,
        long_rope=long_rope,
        rope_linear_factor=linear,
        rotary_dim=int(head_dim * partial) if partial != 1.0 else 0,
        qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias")),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", model_type == "qwen2" or gemma)),
        name=name,
        # Mistral's, Phi-3's and Gemma's window (null in Mistral 7B v0.2 and later); Qwen's
        # sliding_window is unused without use_sliding_window.
        sliding_window=cfg.get("sliding_window") if model_type in ("mistral", "phi3") or gemma else None,
        **(_gemma(cfg, arch, head_dim, local_rope) if gemma else {}),
    )


def _gemma(cfg: dict, arch: str, head_dim: int, local_rope: dict | None) -> dict:
    """Gemma 2 and 3's config fields, as transformers reads them."""
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModel(f"{arch} with use_bidirectional_attention (an encoder) is not supported")
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModel(f"{arch} with hidden_activation {cfg['hidden_activation']!r} is not supported "
                               "(gelu_pytorch_tanh)")
    pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or (
        2 if arch == "gemma2" else 6)
    types = cfg.get("layer_types")
    if types:  # the pattern they follow: every layer windowed but each pattern-th (0: none global)
        pattern = types.index("full_attention") + 1 if "full_attention" in types else 0
        if types != [_layer_type(i, pattern) for i in range(cfg["num_hidden_layers"])]:
            raise UnsupportedModel(f"{arch} layer_types {types} are not supported: floe runs a window on "
                                   "every layer but each n-th")
    if local_rope and (local_rope.get("rope_type") or "default") != "default":
        raise UnsupportedModel(f"rope scaling {local_rope['rope_type']!r} on {arch}'s windowed layers is "
                               "not supported")
    local_theta = (local_rope or {}).get("rope_theta") or cfg.get("rope_local_base_freq")
    return dict(
        activation="gelu_tanh", embedding_scale=cfg["hidden_size"] ** 0.5, post_norms=True,
        attention_scale=float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        attn_softcap=cfg.get("attn_logit_softcapping"), logit_softcap=cfg.get("final_logit_softcapping"),
        sliding_window_pattern=pattern,
        rope_local_theta=None if arch == "gemma2" else float(local_theta or 10000.0),
    )


def _layer_type(layer: int, pattern: int) -> str:
    return "full_attention" if pattern and (layer + 1) % pattern == 0 else "sliding_attention"


def _long_rope(cfg: dict, rope: dict) -> LongRope:
    """Phi-3's LongRoPE, as transformers computes it (_compute_longrope_parameters)."""
    original = int(rope.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
                   or cfg["max_position_embeddings"])
    factor = rope.get("factor") or cfg["max_position_embeddings"] / original
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return LongRope(tuple(float(x) for x in rope["short_factor"]),
                    tuple(float(x) for x in rope["long_factor"]), original, float(attention))


def _shards(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(_read_json(index)["weight_map"].values()))
        return [folder / f for f in files]
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise NotAModel(f"{folder} has config.json but no *.safetensors weights")
    return shards


def _parts(name: str, c: ModelConfig) -> list[tuple[str, torch.Tensor | None]]:
    """The canonical weights a stored tensor holds, each with the stored rows it takes (None: all):
    one for most, none for an ignored one, each part of a fused one (Phi-3's qkv and gate+up)."""
    if name in _GLOBAL_NAMES:
        return [(_GLOBAL_NAMES[name], None)]
    if _IGNORED.fullmatch(name):
        return []
    m = _LAYER.fullmatch(name)
    if m and m.group(2) in _FUSED_NAMES:
        return fused_part_rows(c, _FUSED_NAMES[m.group(2)], int(m.group(1)))
    names = _GEMMA_LAYER_NAMES if c.post_norms else _LAYER_NAMES
    if m and m.group(2) in names:
        canonical = f"layers.{m.group(1)}.{names[m.group(2)]}"
        if c.rotary_dim and canonical.endswith(ROTARY_WEIGHTS):  # a partial rotary's Q/K order
            return [(canonical, rotary_rows(c, canonical, torch.arange(weight_rows(c, canonical))))]
        return [(canonical, None)]
    raise UnsupportedModel(f"unexpected tensor {name!r}: not a Llama/Mistral/Phi-3/Qwen2/Qwen3/Gemma weight")


def tokenizer_from_folder(folder: Path, cfg: dict) -> Tokenizer:
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise NotAModel(f"{folder} has no tokenizer.json")
    backend = HFTokenizer.from_file(str(path))
    tcfg = _read_optional_json(folder / "tokenizer_config.json")
    template = tcfg.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)

    def token_id(entry) -> int | None:
        text = entry.get("content") if isinstance(entry, dict) else entry
        return None if text is None else backend.token_to_id(text)

    gen = _read_optional_json(folder / "generation_config.json")
    eos: list[int] = []
    for source in (gen.get("eos_token_id"), cfg.get("eos_token_id"), token_id(tcfg.get("eos_token"))):
        eos += source if isinstance(source, list) else [] if source is None else [source]
    bos = token_id(tcfg.get("bos_token")) if tcfg.get("bos_token") else cfg.get("bos_token_id")
    return Tokenizer(
        backend,
        bos_id=bos,
        eos_ids=eos,
        add_bos=bool(tcfg.get("add_bos_token", False)),
        chat_template=template,
        special_tokens=_special_tokens(tcfg),
    )


def _special_tokens(tcfg: dict) -> dict[str, str]:
    """The tokenizer config's special tokens by name, as transformers' special_tokens_map shows them to a
    chat template (a name set to null is left out)."""
    names = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
    texts = {name: tcfg[name].get("content") if isinstance(tcfg[name], dict) else tcfg[name]
             for name in names if tcfg.get(name) is not None}
    return {name: text for name, text in texts.items() if isinstance(text, str)}


def load_hf_folder(folder: Path, dtype: torch.dtype, progress: Progress | None = None,
                   name: str | None = None) -> Checkpoint:
    """The folder's checkpoint: every tensor's bytes hashed once for the fingerprint, weights left in
    the files until an engine takes them (Checkpoint.weights is lazy; a tensor the file stores in the
    dtype asked for is a view of safetensors' memory map of it). name: the model's (default: the
    folder's; a Hugging Face cache snapshot's folder is a commit hash, its repo's name is the name)."""
    cfg = _read_json(folder / "config.json")
    config = config_from_hf(cfg, name or folder.name)
    tokenizer = tokenizer_from_folder(folder, cfg)
    shards = _shards(folder)
    names, kinds = {}, set()
    try:
        for shard in shards:
            with safe_open(str(shard), framework="pt") as handle:
                for name in handle.keys():
                    names[name] = shard
                    if _parts(name, config):
                        stored_type = handle.get_slice(name).get_dtype()
                        kinds.add(_DTYPES.get(stored_type, stored_type.lower()))
    except (SafetensorError, OSError) as e:
        raise NotAModel(f"cannot read safetensors in {folder}: {e}") from e
    todo = sorted((name, shard) for name, shard in names.items() if _parts(name, config))
    # Gemma's norms scale by (1 + w): the canonical weight is that multiplier
    shifted = config.arch in UNIT_OFFSET_NORM_ARCHITECTURES
    weights = {canonical: functools.partial(_tensor, shard, name, rows=rows,
                                            shift=shifted and canonical.endswith("norm.weight"))
               for name, shard in todo for canonical, rows in _parts(name, config)}
    if config.tie_embeddings:
        weights.pop("output.weight", None)
    elif "output.weight" not in weights:
        raise NotAModel(f"{folder}: config says untied embeddings but lm_head.weight is missing")
    missing = [n for n in config.qk_norm_weights() if n not in weights]
    if missing:
        raise NotAModel(f"{folder}: {config.arch} normalises q and k per head, but {missing[0]} is missing")

    def stored():
        for name, shard in todo:
            t = _tensor(shard, name, None)
            yield name, str(t.dtype), tuple(t.shape), t.view(torch.uint8).numpy()

    checkpoint = Checkpoint(
        config=config,
        weights=LazyWeights(weights, dtype),
        tokenizer=tokenizer,
        fingerprint=model_fingerprint(config, stored(), progress=progress, total=len(todo)),
        source=folder,
        file_type="+".join(sorted(kinds)),
        stored=stored,
    )
    checkpoint.check_complete()
    return checkpoint


def _tensor(shard: Path, name: str, dtype: torch.dtype | None,
            rows: torch.Tensor | None = None, shift: bool = False) -> torch.Tensor:
    """Tensor `name` of `shard` in `dtype` (None: as stored, for the fingerprint), its rows `rows`
    only where given (take_rows); shift: 1 + the tensor, added in float32 (Gemma's norms). safetensors
    maps the file and hands out views of its mapping (kept where the dtype matches: see `mapped`);
    each read opens its own, so the pages a read touched leave this process's memory with its last
    view."""
    with safe_open(str(shard), framework="pt") as handle:
        t = handle.get_tensor(name)
    if dtype is None:
        return t
    t = take_rows(t, rows)
    if shift:
        return (t.float() + 1.0).to(dtype)
    return mapped(t) if t.dtype == dtype else t.to(dtype)
