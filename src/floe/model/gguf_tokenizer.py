"""Tokenizers from a GGUF file's metadata (llama.cpp's vocabularies: byte-level BPE with its
pre-tokenizer by name, SentencePiece with scores), built as transformers' GGUF loader builds them."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from floe.errors import UnsupportedModel
from floe.model.tokenizer import Tokenizer

# GGUF token types (llama.cpp's llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_GPT2_PATTERN = (
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
)
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _gpt2_bytes() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])


# llama.cpp's `tokenizer.ggml.pre` names -> (pre-tokenizer, ignore_merges), as llama-vocab.cpp sets them.
_PRE_TOKENIZERS = {
    "default": (_gpt2_bytes, False),
    "gpt-2": (_gpt2_bytes, False),
    "gpt2": (_gpt2_bytes, False),
    "smollm": (_smollm, False),
    "llama-bpe": (lambda: _split_then_bytes(_LLAMA3_PATTERN), True),
    "llama3": (lambda: _split_then_bytes(_LLAMA3_PATTERN), True),
    "qwen2": (lambda: _split_then_bytes(_QWEN2_PATTERN), False),
}


def tokenizer_from_gguf(fields: dict) -> Tokenizer:
    """Build the tokenizer from GGUF `tokenizer.ggml.*` metadata: byte-level BPE (`gpt2`) or
    SentencePiece (`llama`)."""
    kind = fields.get("tokenizer.ggml.model")
    if kind == "llama":
        return _sentencepiece_from_gguf(fields)
    if kind != "gpt2":
        raise UnsupportedModel(
            f"tokenizer model {kind!r} is not supported (floe reads byte-level BPE, 'gpt2', and "
            f"SentencePiece, 'llama')"
        )
    pre_name = fields.get("tokenizer.ggml.pre", "default")
    if pre_name not in _PRE_TOKENIZERS:
        raise UnsupportedModel(
            f"pre-tokenizer {pre_name!r} is not supported; known: {', '.join(sorted(_PRE_TOKENIZERS))}"
        )
    make_pre, ignore_merges = _PRE_TOKENIZERS[pre_name]
    tokens: Sequence[str] = fields["tokenizer.ggml.tokens"]
    # The vocabulary and merges as Python objects exist for this call only: gone before anything that stays
    # is made (~100,000 small objects among which one kept object pins a 1 MB arena of them).
    backend = HFTokenizer(models.BPE({tok: i for i, tok in enumerate(tokens)},
                                     [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]],
                                     ignore_merges=ignore_merges))
    backend.pre_tokenizer = make_pre()
    backend.decoder = decoders.ByteLevel()
    _add_gguf_tokens(backend, fields, ())
    return _gguf_tokenizer(backend, fields, add_bos=False)


# Architectures whose SentencePiece tokenizer.json prepends "▁" in a normalizer (before every piece of
# text, even one that starts with a space or follows a special token) rather than with Metaspace (to
# the text's start only, where it does not start with a space): transformers' GGUF loader decides by
# the architecture, as nothing in the file says which (its phi3_tokenizer).
_PREPEND_BY_NORMALIZER = frozenset({"phi3"})
# Architectures whose GGUF SentencePiece is Gemma's: no "▁" prepended (spaces become "▁" in a
# normalizer), tokens of spaces stored as spaces, no merges and scores that do not follow the merge
# order, which is the file's order: as transformers' GGUF loader builds it (its gemma_tokenizer).
_GEMMA = frozenset({"gemma", "gemma2", "gemma3"})


def _sentencepiece_from_gguf(fields: dict) -> Tokenizer:
    """A SentencePiece vocabulary (Llama-2, Mistral, Phi-3, Gemma) as transformers' GGUF loader builds
    it: a BPE whose merges are every split of a token into two tokens, ranked by the token's score
    (Gemma: its place in the file), with byte fallback to the `<0xNN>` tokens; spaces spelled "▁", and
    one prepended (not Gemma)."""
    arch = fields.get("general.architecture")
    tokens: Sequence[str] = fields["tokenizer.ggml.tokens"]
    gemma, respelled = arch in _GEMMA, []
    if gemma:  # "  " is looked up as "▁▁"
        respelled = [i for i, t in enumerate(tokens) if " " in t and not t.strip()]
        tokens = list(tokens)
        for i in respelled:
            tokens[i] = "\u2581" * len(tokens[i])
        fields = {**fields, "tokenizer.ggml.tokens": tokens}
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if "tokenizer.ggml.merges" in fields:
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    elif gemma:
        merges = merges_by_score(vocab, {tok: -i for i, tok in enumerate(tokens)})
    else:
        merges = merges_by_score(vocab, dict(zip(tokens, fields["tokenizer.ggml.scores"], strict=True)))
    backend = HFTokenizer(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True))
    prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True)) and not gemma
    if gemma:
        backend.normalizer = normalizers.Replace(" ", "\u2581")
    elif arch in _PREPEND_BY_NORMALIZER:
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                                   normalizers.Replace(" ", "\u2581")])
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix else steps)
    named = [fields.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown", "padding")]
    _add_gguf_tokens(backend, fields, [i for i in named if i is not None and 0 <= i < len(tokens)],
                     plain=respelled)
    # Files written before the flag existed: llama.cpp adds BOS to a SentencePiece vocabulary.
    return _gguf_tokenizer(backend, fields, add_bos=True)


def merges_by_score(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges for a vocabulary of scored tokens (SentencePiece): every split of a token into two
    tokens, best score first (then the longer left part, then the longer right part), as
    transformers' generate_merges orders them. ~0.1 s for 32,000 tokens."""
    merges = []
    for token, score in scores.items():
        splits = [(token[:k], token[k:]) for k in range(1, len(token))]
        splits = [(a, b) for a, b in splits if a in vocab and b in vocab]
        merges += [(score, a, b) for a, b in sorted(splits, key=lambda s: (vocab[s[0]], vocab[s[1]]))]
    merges.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(a, b) for _, a, b in merges]


def _add_gguf_tokens(backend: HFTokenizer, fields: dict, named: Sequence[int],
                     plain: Sequence[int] = ()) -> None:
    """Control tokens (and the `named` ids: BOS, EOS, ...) as special tokens, user-defined ones (but
    those in `plain`: Gemma's space runs, which transformers leaves to the BPE) as added tokens, so
    that their text in a prompt is read as that one token."""
    tokens: Sequence[str] = fields["tokenizer.ggml.tokens"]
    types: list[int] = fields.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    special = sorted({*named, *(i for i, t in enumerate(types) if t == _CONTROL)})
    skipped = set(plain)
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
    backend.add_tokens(
        [AddedToken(tokens[i], normalized=False) for i, t in enumerate(types)
         if t == _USER_DEFINED and i not in skipped]
    )


def _gguf_tokenizer(backend: HFTokenizer, fields: dict, *, add_bos: bool) -> Tokenizer:
    eos = [fields[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                               "tokenizer.ggml.eom_token_id") if k in fields]
    tokens: Sequence[str] = fields["tokenizer.ggml.tokens"]
    # What the chat template sees by name: the file's special ids' texts, as transformers reads a GGUF.
    special = {name: tokens[fields[key]] for name, key in (
        ("bos_token", "tokenizer.ggml.bos_token_id"), ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("unk_token", "tokenizer.ggml.unknown_token_id"), ("pad_token", "tokenizer.ggml.padding_token_id"))
        if key in fields and 0 <= fields[key] < len(tokens)}
    return Tokenizer(
        backend,
        bos_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_ids=eos,
        add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", add_bos)),
        chat_template=fields.get("tokenizer.chat_template"),
        special_tokens=special,
    )
