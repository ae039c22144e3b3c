"""Read a GGUF file (llama.cpp's format): config, weights (memory-mapped, read lazily), tokenizer,
chat template."""

from __future__ import annotations

import functools
import mmap
import re
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quant_shape_to_byte_shape

from floe.errors import NotAModel, UnsupportedModel
from floe.model.checkpoint import (
    ROTARY_WEIGHTS,
    Checkpoint,
    Lazy,
    LazyWeights,
    Progress,
    fused_part_rows,
    mapped,
    model_fingerprint,
    rotary_rows,
    take_rows,
    unpermute_rotary_rows,
)
from floe.model.config import ARCHITECTURES, LongRope, ModelConfig
from floe.model.gguf_tokenizer import tokenizer_from_gguf
from floe.model.quant import QuantizedWeight, dequantized

_GLOBAL_NAMES = {
    "token_embd.weight": "tok_embeddings.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "output.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "attention_norm.weight",
    "attn_q.weight": "attention.wq.weight",
    "attn_k.weight": "attention.wk.weight",
    "attn_v.weight": "attention.wv.weight",
    "attn_q.bias": "attention.wq.bias",
    "attn_k.bias": "attention.wk.bias",
    "attn_v.bias": "attention.wv.bias",
    "attn_output.weight": "attention.wo.weight",
    "attn_q_norm.weight": "attention.q_norm.weight",
    "attn_k_norm.weight": "attention.k_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "post_attention_norm.weight": "post_attention_norm.weight",  # Gemma's post-norms
    "post_ffw_norm.weight": "post_ffn_norm.weight",
    "ffn_gate.weight": "feed_forward.w1.weight",
    "ffn_up.weight": "feed_forward.w3.weight",
    "ffn_down.weight": "feed_forward.w2.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
# Tensors llama.cpp writes that carry nothing floe needs as a weight (rotary factors: read into the
# config).
_IGNORED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensor:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order (rows, cols): GGUF's ne reversed
    path: Path
    offset: int  # of its first byte in the file
    byte_shape: tuple[int, ...]  # uint8 [rows, bytes per row] (1-D tensors: [bytes])

    @property
    def data(self) -> np.ndarray:
        """The tensor's bytes, uint8 `byte_shape`: a view of a mapping of just this tensor (private,
        copy-on-write), unmapped when the last view goes; its pages count as this process's memory
        only while mapped and touched."""
        return map_bytes(self.path, self.offset, int(np.prod(self.byte_shape))).reshape(self.byte_shape)


def map_bytes(path: Path, offset: int, nbytes: int) -> np.ndarray:
    """Bytes offset..offset+nbytes of the file at `path`, memory-mapped, as a writable uint8 array
    (writes stay private to this process)."""
    if nbytes == 0:
        return np.zeros(0, dtype=np.uint8)
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), offset + nbytes - start, offset=start, access=mmap.ACCESS_COPY)
    return np.frombuffer(mapping, dtype=np.uint8, count=nbytes, offset=offset - start)


class Strings(Sequence[str]):
    """A GGUF array of strings as the file stores them (each a length, then its UTF-8 bytes), a string
    decoded each time it is read. A vocabulary's tokens and merges parsed as ~100,000 Python strings
    outlived the tokenizer's build in part: freed, they left the small-object arenas they had filled
    pinned by the few objects made among them (with tokenizer_from_gguf's Python objects made for the
    build alone, 3 MB of `floe run`'s peak: 391.8 -> 388.7 MB on a 2-core Zen 3)."""

    __slots__ = ("_data", "_ends")

    def __init__(self, data: bytes, ends: np.ndarray) -> None:
        self._data, self._ends = data, ends  # (ends[i]: where string i's bytes end in data)

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = range(len(self._ends))[i]  # (an IndexError past either end, as a list's)
        start = (int(self._ends[i - 1]) if i else 0) + 8
        return self._data[start:int(self._ends[i])].decode()

    def __iter__(self) -> Iterator[str]:
        data, start = self._data, 8
        for end in self._ends.tolist():
            yield data[start:end].decode()
            start = end + 8


class GGUFFile:
    """The metadata and tensor table of a GGUF file; tensor data mapped when a tensor's `data` is read.

    gguf.GGUFReader builds a numpy view per metadata string (~4 s for a 49k-token vocabulary);
    this reads the same header in ~0.1 s. Dequantization still goes through gguf.quants.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            # A plain ndarray view: memmap subclass bookkeeping costs seconds in gguf.quants.
            self._buf = np.asarray(np.memmap(path, dtype=np.uint8, mode="r"))
            self._mv = memoryview(self._buf)
            self._pos = 0
            self._parse()
        except (struct.error, ValueError, UnicodeDecodeError, KeyError, OverflowError) as e:
            raise NotAModel(f"{path} is not a readable GGUF file (truncated or corrupt: {e})") from e
        finally:  # the header is parsed into Python objects: the whole-file mapping can go
            self._mv = self._buf = None

    def _unpack(self, fmt: str):
        value = struct.unpack_from(fmt, self._mv, self._pos)[0]
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._unpack("<Q")
        if self._pos + n > len(self._mv):
            raise ValueError("string runs past the end of the file")
        s = bytes(self._mv[self._pos : self._pos + n]).decode("utf-8")
        self._pos += n
        return s

    def _value(self, vtype: int):
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            itype, n = self._unpack("<I"), self._unpack("<Q")
            if itype in _SCALARS and itype != 7:
                dt = np.dtype(_SCALARS[itype])
                arr = np.frombuffer(self._mv, dtype=dt, count=n, offset=self._pos)
                self._pos += n * dt.itemsize
                return arr.tolist()
            if itype == _STRING:
                return self._strings(n)
            return [self._value(itype) for _ in range(n)]
        return self._unpack(_SCALARS[vtype])

    def _strings(self, n: int) -> Strings:
        """An array of n strings, kept as the file's bytes (each checked to be UTF-8 as it is passed)."""
        first, ends = self._pos, np.empty(n, dtype=np.int64)
        for i in range(n):
            size = self._unpack("<Q")
            if self._pos + size > len(self._mv):
                raise ValueError("string runs past the end of the file")
            str(self._mv[self._pos:self._pos + size], "utf-8")  # (a check: decoded again when read)
            self._pos += size
            ends[i] = self._pos - first
        return Strings(bytes(self._mv[first:self._pos]), ends)

    def _parse(self) -> None:
        if bytes(self._mv[:4]) != b"GGUF":
            raise ValueError("bad magic")
        self._pos = 4
        self.version = self._unpack("<I")
        if self.version not in (2, 3):
            raise ValueError(f"GGUF version {self.version} (floe reads 2 and 3)")
        n_tensors, n_kv = self._unpack("<Q"), self._unpack("<Q")
        self.fields: dict = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            ne = [self._unpack("<Q") for _ in range(self._unpack("<I"))]
            infos.append((name, ne, GGMLQuantizationType(self._unpack("<I")), self._unpack("<Q")))
        align = int(self.fields.get("general.alignment", 32))
        start = (self._pos + align - 1) // align * align
        self.tensors: list[GGUFTensor] = []
        for name, ne, qtype, offset in infos:
            shape = tuple(reversed(ne)) if len(ne) > 1 else (ne[0],)
            byte_shape = quant_shape_to_byte_shape(shape, qtype)
            size = int(np.prod(byte_shape))
            begin = start + offset
            if begin + size > len(self._buf):
                raise ValueError(f"tensor {name} runs past the end of the file")
            self.tensors.append(GGUFTensor(name, qtype, shape, self.path, begin, tuple(byte_shape)))


def config_from_fields(fields: dict, tensor_names: set[str], rope_freqs: np.ndarray | None,
                       long_factors: tuple[np.ndarray, np.ndarray] | None = None) -> ModelConfig:
    arch = fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModel(
            f"architecture {arch!r} is not supported (floe runs: {', '.join(ARCHITECTURES)})"
        )

    def key(name: str, default=None):
        value = fields.get(f"{arch}.{name}", default)
        if value is None:
            raise NotAModel(f"GGUF metadata lacks {arch}.{name}")
        return value

    n_heads = int(key("attention.head_count"))
    n_kv = key("attention.head_count_kv", n_heads)
    dim = int(key("embedding_length"))
    scaling = None
    # Mistral's and Phi-3's window, where the file states it (0: none, as llama.cpp writes Phi-4's;
    # Qwen's GGUFs run without one, as in llama.cpp)
    window = (fields.get(f"{arch}.attention.sliding_window")
              if arch in ("llama", "mistral", "phi3", "gemma2", "gemma3") else None)
    linear = 1.0
    if fields.get(f"{arch}.rope.scaling.type") == "linear" and arch == "gemma3":  # its global layers only
        linear = float(key("rope.scaling.factor"))
    elif fields.get(f"{arch}.rope.scaling.type") not in (None, "none"):
        raise UnsupportedModel(f"rope scaling {fields[f'{arch}.rope.scaling.type']!r} is not supported")
    head_dim = int(fields.get(f"{arch}.attention.key_length") or dim // n_heads)
    rotary_dim = int(fields.get(f"{arch}.rope.dimension_count") or head_dim)
    return ModelConfig(
        arch=arch,
        dim=dim,
        n_layers=int(key("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(n_kv if not isinstance(n_kv, list) else n_kv[0]),
        ffn_dim=int(key("feed_forward_length")),
        vocab_size=int(fields.get(f"{arch}.vocab_size") or len(fields["tokenizer.ggml.tokens"])),
        context_length=int(key("context_length")),
        head_dim=head_dim,
        norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rope_linear_factor=linear,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        tie_embeddings="output.weight" not in tensor_names,
        name=str(fields.get("general.name") or ""),
        rope_freq_factors=None if rope_freqs is None else tuple(float(x) for x in rope_freqs),
        sliding_window=int(window) if window else None,
        rotary_dim=rotary_dim if rotary_dim < head_dim else 0,
        long_rope=_long_rope(fields, arch, long_factors),
        **(_gemma(fields, arch, dim, n_heads, head_dim) if arch in ("gemma2", "gemma3") else {}),
    )


# Gemma's sizes whose query scale is 1/sqrt(dim / n_heads) rather than 1/sqrt(head_dim) (27B), by
# block_count, as llama.cpp tells them apart (its GGUFs carry no query_pre_attn_scalar).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gemma(fields: dict, arch: str, dim: int, n_heads: int, head_dim: int) -> dict:
    """Gemma 2 and 3's config fields as llama.cpp reads them: soft-capping from the metadata (Gemma 2),
    the window on every 2nd (Gemma 2) or 6th (Gemma 3) layer but one, Gemma 3's windowed layers' rotary
    base (10000 unless the file says), the query scale by size; the norms as stored (the converter
    added Gemma's 1)."""
    big = fields.get(f"{arch}.block_count") == _GEMMA_27B_LAYERS[arch]
    pattern = fields.get(f"{arch}.attention.sliding_window_pattern")
    return dict(
        activation="gelu_tanh", embedding_scale=dim**0.5, post_norms=True,
        attention_scale=(dim // n_heads if big else head_dim) ** -0.5,
        attn_softcap=fields.get(f"{arch}.attn_logit_softcapping"),
        logit_softcap=fields.get(f"{arch}.final_logit_softcapping"),
        sliding_window_pattern=int(pattern) if isinstance(pattern, int) else 2 if arch == "gemma2" else 6,
        rope_local_theta=None if arch == "gemma2" else float(fields.get(f"{arch}.rope.freq_base_swa", 1e4)),
    )


def _long_rope(fields: dict, arch: str, factors: tuple[np.ndarray, np.ndarray] | None) -> LongRope | None:
    """Phi-3's LongRoPE as llama.cpp's converter writes it: rope_factors_short/long tensors, the
    attention factor and the pretraining length in the metadata."""
    if factors is None:
        return None
    short, long = factors
    original = fields.get(f"{arch}.rope.scaling.original_context_length")
    if original is None:
        raise NotAModel(f"GGUF metadata lacks {arch}.rope.scaling.original_context_length beside its "
                        "rope_factors_long/short")
    return LongRope(tuple(float(x) for x in short), tuple(float(x) for x in long), int(original),
                    float(fields.get(f"{arch}.rope.scaling.attn_factor", 1.0)))


def canonical_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise UnsupportedModel(f"unexpected tensor {gguf_name!r}: not a Llama/Mistral/Phi-3/Qwen2/Qwen3/Gemma "
                           "weight")


def _parts(config: ModelConfig, t: GGUFTensor) -> list[tuple[str, torch.Tensor | None]]:
    """The canonical weights tensor t holds, each with the stored rows it takes in the engine's order
    (None: all as stored): Llama's Q/K rows un-permuted; Phi-3's fused attn_qkv and ffn_up (gate and
    up, 2 x feed_forward_length rows) split."""
    m = _BLOCK.fullmatch(t.name)
    if m and m.group(2) == "attn_qkv.weight":
        return fused_part_rows(config, "qkv", int(m.group(1)))
    if m and m.group(2) == "ffn_up.weight" and t.shape[0] == 2 * config.ffn_dim:
        return fused_part_rows(config, "gate_up", int(m.group(1)))
    name = canonical_name(t.name)
    heads = _permuted_heads(config, name)
    if heads:
        return [(name, unpermute_rotary_rows(torch.arange(t.shape[0]), heads))]
    if config.rotary_dim and name.endswith(ROTARY_WEIGHTS):
        return [(name, rotary_rows(config, name, torch.arange(t.shape[0])))]
    return [(name, None)]


@functools.cache
def _readable(qtype: GGMLQuantizationType) -> bool:
    """Whether gguf can dequantize `qtype` (tried on one zero block)."""
    try:
        dequantize(np.zeros(GGML_QUANT_SIZES[qtype][1], dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


_FLOATS = ("F32", "F16", "BF16", "F64")


def load_gguf(path: Path, dtype: torch.dtype, progress: Progress | None = None) -> Checkpoint:
    """The file's checkpoint: header parsed, every tensor's bytes hashed once for the fingerprint,
    weights left in the file until an engine takes them (Checkpoint.weights is lazy)."""
    reader = GGUFFile(path)
    tensors = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        if not _readable(t.qtype):
            raise UnsupportedModel(f"tensor {t.name} uses quantization {t.qtype.name}, which gguf cannot "
                                   "dequantize")
    def floats(name: str) -> np.ndarray | None:
        t = tensors.get(name)
        return None if t is None else dequantized(t.data, t.qtype.name, t.shape, torch.float32).numpy()

    long_factors = (floats("rope_factors_short.weight"), floats("rope_factors_long.weight"))
    config = config_from_fields(reader.fields, set(tensors), floats("rope_freqs.weight"),
                                None if long_factors[0] is None or long_factors[1] is None else long_factors)
    todo = [t for t in reader.tensors if t.name not in _IGNORED]
    weights, quantized = {}, {}
    for t in todo:
        for name, rows in _parts(config, t):
            if t.qtype.name not in _FLOATS and len(t.shape) == 2:
                quantized[name] = functools.partial(_quantized, t, rows)
                weights[name] = functools.partial(_from_quantized, quantized[name])
            else:
                weights[name] = functools.partial(_dense, t, rows)
    missing = [n for n in config.qk_norm_weights() if n not in weights]
    if missing:
        raise NotAModel(f"{path}: {config.arch} normalises q and k per head, but the file lacks {missing[0]}")

    def stored():
        return ((t.name, t.qtype.name, t.shape, t.data) for t in todo)

    checkpoint = Checkpoint(
        config=config,
        weights=LazyWeights(weights, dtype),
        tokenizer=tokenizer_from_gguf(reader.fields),
        fingerprint=model_fingerprint(config, stored(), progress=progress, total=len(todo)),
        source=path,
        file_type=_file_type({t.qtype.name for t in todo}),
        quantized=Lazy(quantized),
        stored=stored,
    )
    checkpoint.check_complete()
    return checkpoint


def _quantized(t: GGUFTensor, rows: torch.Tensor | None) -> QuantizedWeight:
    """A block-quantized matrix as the file stores it (a view of its mapping), only rows `rows` in
    that order where given (a copy of their blocks: llama.cpp's Q/K permutation undone, a fused
    tensor's part)."""
    q = QuantizedWeight(t.qtype.name, t.shape, t.data, file=(t.path, t.offset))
    return q if rows is None else q.rows(rows)


def _from_quantized(quantized, dtype: torch.dtype) -> torch.Tensor:
    return quantized().dequantize(dtype)


def _dense(t: GGUFTensor, rows: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """A float (or 1-D) tensor in `dtype`, its rows `rows` only where given (take_rows): where the
    file stores it so (F32 for float32, BF16 for bfloat16), the file's values as they are (a view of
    its mapping, see `mapped`), else converted."""
    as_stored = (t.qtype.name, dtype) in (("F32", torch.float32), ("BF16", torch.bfloat16))
    if as_stored:
        raw = t.data.view(np.float32 if dtype == torch.float32 else np.int16).reshape(t.shape)
        w = mapped(torch.from_numpy(raw).view(dtype))
    else:
        w = dequantized(t.data, t.qtype.name, t.shape, dtype)
    return take_rows(w, rows)


def _permuted_heads(config: ModelConfig, name: str) -> int:
    """llama.cpp permutes the rows of Llama's (and so Mistral's) Q and K projections; how many heads,
    0 if not."""
    if config.arch not in ("llama", "mistral"):
        return 0
    if name.endswith(("wq.weight", "wq.bias")):
        return config.n_heads
    if name.endswith(("wk.weight", "wk.bias")):
        return config.n_kv_heads
    return 0


def _file_type(kinds: set[str]) -> str:
    # The weight quantization is the most common non-float type; norms are always F32.
    quant = sorted(kinds - {"F32"}) or ["F32"]
    return "+".join(quant)
