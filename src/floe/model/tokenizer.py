"""Tokenizer (Hugging Face `tokenizers`): text <-> token ids, the bytes each token stands for, and a
conversation rendered with the model's chat template (floe.model.chat_template) and tokenized so that no
message's content becomes a special token."""

from __future__ import annotations

import json
import re
import secrets
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cached_property
from itertools import repeat
from typing import NamedTuple

import jinja2
import jinja2.meta
import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from floe.errors import FloeError
from floe.model.chat_template import ChatTemplateError, compile_template, template_messages
from floe.model.template_vars import TEMPLATE_NAMES, TemplateKwargsError

# The tools a chat template is offered in this thread's renders (Tokenizer.offering_tools): the host ABI's
# chat_render carries a guest's messages only, and a server that offers tools sets them around the turn.
_OFFERED_TOOLS: ContextVar[list[dict] | None] = ContextVar("floe_offered_tools", default=None)
# The extra variables a chat template gets in this thread's renders (Tokenizer.rendering_with): a request's
# chat_template_kwargs, set around its turn as the tools are.
_TEMPLATE_KWARGS: ContextVar[Mapping | None] = ContextVar("floe_template_kwargs", default=None)


class Hint:
    """A conversation's render and token ids made ahead (by floe serve's HTTP front, in its own process:
    floe.server.hints), used by this thread's renders while Tokenizer.hinted(it): render_chat_spans of
    exactly these messages (with the generation prompt, no tools offered, the template's variables
    `kwargs`) answers `rendered`, and encode_rendered of that render answers `ids` (its key is the render
    itself). Anything else is rendered and tokenized as without it. used: how many renders and encodes it
    answered."""

    __slots__ = ("messages", "rendered", "ids", "kwargs", "used")

    def __init__(self, messages: list[dict], rendered: Rendered, ids: list[int],
                 kwargs: Mapping | None = None) -> None:
        self.messages, self.rendered, self.ids, self.used = messages, rendered, ids, 0
        self.kwargs = dict(kwargs or {})


_HINT: ContextVar[Hint | None] = ContextVar("floe_prompt_hint", default=None)

# A text up to this long is tokenized holding the GIL (Tokenizer.encode_plain): ~1 ms of work at most.
GIL_HELD_CHARS = 4096


class Rendered(NamedTuple):
    """A rendered conversation: its text, and the (start, end) of each message's content in it (none
    when no content holds special-token text: the whole text is then tokenized as one)."""

    text: str
    spans: tuple[tuple[int, int], ...]


class Tokenizer:
    """Text <-> token ids, special tokens, and the model's chat template."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_id: int | None,
        eos_ids: Sequence[int],
        add_bos: bool,
        chat_template: str | None,
        special_tokens: Mapping[str, str] | None = None,
    ) -> None:
        self.backend = backend
        self.bos_id = bos_id
        self.eos_ids = tuple(dict.fromkeys(eos_ids))
        self.add_bos = add_bos
        self.chat_template = chat_template
        # What the chat template sees as bos_token, eos_token, ... (transformers' special_tokens_map: the
        # tokenizer config's, which may differ from the ids generation stops at: Llama-3.1's eos_token is
        # <|eot_id|>, its generation config's first EOS <|end_of_text|>); a name it lacks is undefined.
        self.special_tokens = dict(special_tokens) if special_tokens is not None else {
            name: self._special_text(i)
            for name, i in (("bos_token", bos_id), ("eos_token", self.eos_ids[0] if self.eos_ids else None))
            if i is not None}
        self._bytes: dict[int, bytes] = {}  # token_bytes of the ids asked for so far
        self._reply_bytes: dict[int, bytes] = {}  # reply_bytes of the ids asked for so far
        self._every_id = False  # both hold every id of the vocabulary (reply_lengths): any other is b""
        self._reply_lengths: np.ndarray | None = None
        self._replaced_lengths: list[np.ndarray] = []
        self._lengths_lock = threading.Lock()

    @cached_property
    def vocab_size(self) -> int:
        """(Kept: the backend's vocabulary is complete when a Tokenizer is made, and a call into it cost
        ~1 us a streamed token.)"""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_text(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special tokens written in the text are recognised."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, no BOS; the tokenizer runs without holding the GIL."""
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of `text`, no BOS (special tokens written in it recognised): a short text holding the
        GIL, a long one without (encode_many). Releasing it for a short one's ~70 us of work cost a busy
        server's thread a wait to take it back (a spinning thread made it 570 us, holding it 110 us):
        a burst of arrivals each waited so for every other thread."""
        if len(text) <= GIL_HELD_CHARS:
            return self.backend.encode(text, add_special_tokens=False).ids
        return self.encode_many([text])[0]

    @cached_property
    def sequence_start(self) -> str:
        """The text a raw continuation (the complete guest, /v1/completions, `floe run --raw`) tokenizes
        before its prompt: the BOS token's where this tokenizer adds one, else none."""
        if not (self.add_bos and self.bos_id is not None):
            return ""
        start = self.decode([self.bos_id])
        if self.encode_many([start])[0] != [self.bos_id]:
            raise FloeError(f"the BOS token's text {start!r} does not tokenize back to it: text completions "
                            "cannot start a sequence with it")
        return start

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes a token stands for (possibly part of a character: byte-level BPE's, or
        SentencePiece's byte fallback; SentencePiece's "▁" is a space).

        Ids past the tokenizer's vocabulary (models often pad their embedding table) stand for nothing
        (and are not kept: a guest's ids cannot grow the cache past the vocabulary).
        Each token's bytes are worked out the first time it is asked for and kept (a few microseconds):
        no pass over the whole vocabulary stalls the first streamed token (a 49,152-token table took
        0.15-0.4 s, which `floe serve`'s engine loop spent while every session waited).
        """
        data = self._bytes.get(token_id)
        if data is None:
            if not 0 <= token_id < self.vocab_size:
                return b""
            data = self._bytes[token_id] = self._token_bytes(token_id)
        return data

    def ids_bytes(self, ids: Sequence[int]) -> bytes:
        """token_bytes() of each id, joined: the kept ones looked up in one pass in C (a chat guest's
        on_end detokenizes its whole reply: ~0.4 us a token through token_bytes, in 64 sessions' threads
        ending at once)."""
        return self._joined(self._bytes, self.token_bytes, ids)

    def reply_bytes(self, token_id: int) -> bytes:
        """The bytes a token adds to reply text: token_bytes(), none for a special (control) token (its
        text, e.g. "<|im_start|>", is not reply text). Kept per token, as token_bytes: one dict lookup
        a streamed token."""
        data = self._reply_bytes.get(token_id)
        if data is None:
            data = b"" if token_id in self.special_ids else self.token_bytes(token_id)
            if 0 <= token_id < self.vocab_size:
                self._reply_bytes[token_id] = data
        return data

    def ids_reply_bytes(self, ids: Sequence[int]) -> bytes:
        """reply_bytes() of each id, joined: the kept ones looked up in one pass in C, as ids_bytes."""
        return self._joined(self._reply_bytes, self.reply_bytes, ids)

    def _joined(self, kept: dict[int, bytes], each, ids: Sequence[int]) -> bytes:
        """each(id) of every id joined, looked up in `kept` in one pass in C where it can be."""
        if self._every_id:  # (an id past the vocabulary, or negative, stands for nothing)
            return b"".join(map(kept.get, ids, repeat(b"")))
        try:
            return b"".join(map(kept.__getitem__, ids))
        except KeyError:  # (one not asked for yet, or past the vocabulary)
            return b"".join(map(each, ids))

    def reply_lengths(self, n: int) -> np.ndarray:
        """len(reply_bytes(i)) of every id below n (at least the vocabulary: a model's may be larger,
        its ids past the tokenizer's have no text), int32, made once (the engine loop's native calls
        charge and count streamed tokens with it)."""
        lengths = self._reply_lengths
        if lengths is not None and len(lengths) >= n:
            return lengths
        with self._lengths_lock:  # (made once: a row may point into an array; a replaced one is kept)
            lengths = self._reply_lengths
            if lengths is None or len(lengths) < n:
                if lengths is not None:
                    self._replaced_lengths.append(lengths)
                lengths = np.zeros(max(n, self.vocab_size), np.int32)
                for i in range(self.vocab_size):
                    lengths[i] = len(self.reply_bytes(i))
                    self.token_bytes(i)  # (a special token's too: its reply bytes are none)
                self._reply_lengths = lengths
                self._every_id = True  # every id's token_bytes and reply_bytes kept
            return lengths

    def fill_reply_bytes(self) -> None:
        """reply_bytes of every token, worked out now (a server's start-up: 0.1-0.5 s), so that no
        streamed token pays for its first time."""
        self.reply_lengths(self.vocab_size)

    @property
    def reply_bytes_filled(self) -> bool:
        """Whether every token's reply bytes (and their lengths) are worked out already (fill_reply_bytes)."""
        return self._reply_lengths is not None

    @cached_property
    def most_text_bytes_per_token(self) -> int:
        """At least the most bytes of input text one token can stand for: the longest token's bytes,
        times 3 if a normalizer runs first (NFKC folds a 3-byte character into a 1-byte one). A text of
        n bytes is at least n / this many tokens (a bound that needs no tokenizing). ~0.05 s once (every
        token's bytes, kept: a server streams them)."""
        longest = max((len(self.token_bytes(i)) for i in range(self.vocab_size)), default=1)
        return longest * (1 if self.backend.normalizer is None else 3)

    def _token_bytes(self, token_id: int) -> bytes:
        added = self._added.get(token_id)
        if added is not None:
            return added.encode()
        text = self.backend.id_to_token(token_id) or ""
        if self._sentencepiece:
            byte = _BYTE_TOKEN.fullmatch(text)
            return bytes([int(byte[1], 16)]) if byte else text.replace("\u2581", " ").encode()
        if text.translate(_BYTE_LEVEL_DELETE):  # a character outside the byte-level alphabet: not one
            return text.encode()
        return text.translate(_BYTE_LEVEL_BYTES).encode("latin-1")

    @cached_property
    def strips_leading_space(self) -> bool:
        """Whether decode() drops one space at the start of a text (the SentencePiece decoders of
        Llama-2, Mistral and Phi-3: the space their encoding prepends). A reply's text then starts
        without one (Actor.send; the serve front's text of replies streamed as ids), as transformers'
        decode of its tokens does; byte-level BPE and Gemma keep it."""
        decoder = self.backend.decoder
        spaced = "\u2581a" if self._sentencepiece else "\u0120a"  # (" a" as the decoder reads tokens)
        return decoder is not None and decoder.decode([spaced]) == "a"

    @cached_property
    def _sentencepiece(self) -> bool:
        """Whether tokens are spelled as SentencePiece's (a space as "▁", a byte of byte fallback as
        "<0x0A>"), not in byte-level BPE's alphabet: the decoder says which."""
        decoder = self.backend.decoder
        return decoder is not None and "ByteFallback" in decoder.__getstate__().decode()

    @cached_property
    def _added(self) -> dict[int, str]:
        return {i: t.content for i, t in self.backend.get_added_tokens_decoder().items()}

    @cached_property
    def _template(self) -> jinja2.Template:
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template (a base model, not tuned for chat): "
                                    "continue a raw text instead (floe run --raw, or /v1/completions)")
        return compile_template(self.chat_template)

    @cached_property
    def uses_tools(self) -> bool:
        """Whether the chat template renders a `tools` list (as transformers passes it)."""
        if not self.chat_template:
            return False
        return "tools" in jinja2.meta.find_undeclared_variables(self._template.environment.parse(
            self.chat_template))

    @contextmanager
    def offering_tools(self, tools: list[dict] | None) -> Iterator[None]:
        """Within the block, this thread's renders pass `tools` (OpenAI's [{"type": "function",
        "function": {...}}]) into the chat template, as transformers' apply_chat_template(tools=...)."""
        token = _OFFERED_TOOLS.set(tools)
        try:
            yield
        finally:
            _OFFERED_TOOLS.reset(token)

    @contextmanager
    def rendering_with(self, kwargs: Mapping | None) -> Iterator[None]:
        """Within the block, this thread's renders give the chat template `kwargs` (a request's
        chat_template_kwargs, check_template_kwargs'), as transformers' apply_chat_template(**kwargs);
        None or {}: none. TemplateKwargsError for a name of this tokenizer's special tokens."""
        if kwargs:
            taken = sorted(set(kwargs) & (TEMPLATE_NAMES | set(self.special_tokens)))
            if taken:
                raise TemplateKwargsError(f"{taken[0]!r} is set by the renderer itself, not by a request")
        token = _TEMPLATE_KWARGS.set(kwargs or None)
        try:
            yield
        finally:
            _TEMPLATE_KWARGS.reset(token)

    @contextmanager
    def hinted(self, hint: Hint | None) -> Iterator[None]:
        """Within the block, this thread's renders and encodes of `hint`'s conversation are its own
        (Hint); None: no hint."""
        token = _HINT.set(hint)
        try:
            yield
        finally:
            _HINT.reset(token)

    def plain_hint(self) -> Hint | None:
        """This thread's hint (hinted) where render_chat_spans of its messages with the generation prompt
        and no variables of the call's own would answer it now: no tools offered, this thread's template
        variables the hint's (floe.actor.native_imports answers a guest's chat_render with it)."""
        hint = _HINT.get()
        if hint is None or _OFFERED_TOOLS.get() is not None or _given(None) != hint.kwargs:
            return None
        return hint

    def hint(self, messages: list[dict], chat_template_kwargs: Mapping | None = None) -> Hint:
        """The Hint of `messages` (rendered with the generation prompt, no tools, the template's variables
        `chat_template_kwargs`): what the chat guest's render and tokenize of this conversation give
        within rendering_with(them)."""
        rendered = self.render_chat_spans(messages, chat_template_kwargs=chat_template_kwargs)
        return Hint(messages, rendered, self.encode_rendered(rendered), chat_template_kwargs)

    def wire(self) -> dict:
        """What makes this tokenizer again in another process (from_wire): JSON-able."""
        return {"backend": self.backend.to_str(), "bos_id": self.bos_id, "eos_ids": list(self.eos_ids),
                "add_bos": self.add_bos, "chat_template": self.chat_template,
                "special_tokens": self.special_tokens}

    @classmethod
    def from_wire(cls, wire: dict) -> Tokenizer:
        return cls(HFTokenizer.from_str(wire["backend"]), bos_id=wire["bos_id"], eos_ids=wire["eos_ids"],
                   add_bos=wire["add_bos"], chat_template=wire["chat_template"],
                   special_tokens=wire.get("special_tokens"))

    def render_chat(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                    chat_template_kwargs: Mapping | None = None) -> str:
        """The prompt text for `messages` ([{"role", "content"}, ...]) under the model's template (with
        the tools offered in this thread, if any: offering_tools), as transformers' apply_chat_template(
        messages, tokenize=False, **chat_template_kwargs) renders it (e.g. {"enable_thinking": False});
        the variables of rendering_with, if any, come before chat_template_kwargs'."""
        try:
            return self._template.render(
                messages=template_messages(messages),
                add_generation_prompt=add_generation_prompt,
                tools=_OFFERED_TOOLS.get(),
                documents=None,
                **{**self.special_tokens, **_given(chat_template_kwargs)},
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e
        except (TypeError, ValueError, LookupError, ArithmeticError) as e:  # its Python on a value given
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e

    def encode_chat(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                    chat_template_kwargs: Mapping | None = None) -> list[int]:
        # The template writes BOS itself where the model wants it (transformers does the same).
        rendered = self.render_chat_spans(messages, add_generation_prompt=add_generation_prompt,
                                          chat_template_kwargs=chat_template_kwargs)
        return self.encode_rendered(rendered)

    def render_chat_spans(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                          chat_template_kwargs: Mapping | None = None) -> Rendered:
        """render_chat, and where each message's content lies in the text (for encode_rendered) if any
        content holds special-token text (else no spans are needed: none is looked for). The template
        is rendered again with every content between two markers of a random nonce, and the spans are
        kept only if removing the markers gives the same text (a template that changes the content,
        e.g. trims it, leaves none: then the content with special-token text is refused)."""
        hint = _HINT.get()
        if (hint is not None and add_generation_prompt and _OFFERED_TOOLS.get() is None
                and hint.messages == list(messages) and _given(chat_template_kwargs) == hint.kwargs):
            hint.used += 1
            return hint.rendered
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt,
                                chat_template_kwargs=chat_template_kwargs)
        if not any(self._special_in(m["content"]) for m in messages if _text(m)):
            return Rendered(text, ())
        nonce = secrets.token_hex(8)
        start, end = f"\ue000{nonce}\ue001", f"\ue002{nonce}\ue003"
        wrapped = [{**m, "content": f"{start}{m['content']}{end}"} if _text(m) else m for m in messages]
        marked = self.render_chat(wrapped, add_generation_prompt=add_generation_prompt,
                                  chat_template_kwargs=chat_template_kwargs)
        spans, at = [], 0
        for chunk in marked.split(start):
            content, sep, rest = chunk.partition(end)
            if sep:
                spans.append((at, at + len(content)))
                at += len(content)
                chunk = rest
            at += len(chunk)
        if marked.replace(start, "").replace(end, "") == text and len(spans) == sum(map(_text, messages)):
            return Rendered(text, tuple(spans))
        raise ChatTemplateError("a message holds the text of a special token, and this model's chat "
                                "template changes message contents, so it cannot be kept from being read "
                                "as that token")

    def encode_rendered(self, rendered: Rendered) -> list[int]:
        """The ids of a rendered conversation, where no message's content can make a special token: if a
        content holds special-token text (a user typing "<|im_end|>" to fake a turn), the text is
        tokenized in pieces — the template's with special tokens, each content's as plain text (as
        llama.cpp's server keeps user text from being parsed as special tokens). Otherwise it is the
        whole text's tokenization, exactly as before."""
        hint = _HINT.get()
        if hint is not None and rendered is hint.rendered:
            hint.used += 1
            return list(hint.ids)
        text, spans = rendered
        if not any(self._special_in(text[a:b]) for a, b in spans):
            return self.encode_plain(text)
        ids, at = [], 0
        for a, b in spans:
            if at < a:
                ids += self._encode_template_piece(text[at:a], at)
            if a < b:
                plain = self._plain if a == 0 else self._plain_continuing
                ids += plain.encode(text[a:b], add_special_tokens=False).ids
            at = b
        if at < len(text):
            ids += self._encode_template_piece(text[at:], at)
        return ids

    def encode_rendered_after(self, rendered: Rendered, kept: Sequence[int]) -> list[int] | None:
        """The ids of a rendered conversation's text after the bytes of `kept` (ids a KV cache holds, e.g.
        a reply as the model wrote it, which the whole text's tokenization may split otherwise); None
        where the text does not start with those bytes (or they end inside a character), or where one of
        them is a special token that the text's own tokenization (encode_rendered) does not hold at the
        same place: a message's text never becomes one. Where that tokenization has a token boundary
        after `kept`, its own ids from there; else encode_rendered_from's. None too where its tokens do
        not spell the text (a SentencePiece "▁" prepended): their places are then not the text's."""
        held, text = b"".join(map(self.token_bytes, kept)), rendered.text.encode()
        if not text.startswith(held):
            return None
        try:
            start = len(held.decode())
        except UnicodeDecodeError:
            return None
        ids, special = self.encode_rendered(rendered), self.special_ids
        if b"".join(map(self.token_bytes, ids)) != text:
            return None
        marks, at, cut = set(), 0, None
        for j, i in enumerate(ids):
            if cut is None and at == len(held):
                cut = j
            if i in special:
                marks.add((at, i))
            at += len(self.token_bytes(i))
        if cut is None and at == len(held):
            cut = len(ids)
        at = 0
        for i in kept:
            if i in special and (at, i) not in marks:
                return None
            at += len(self.token_bytes(i))
        return ids[cut:] if cut is not None else self.encode_rendered_from(rendered, start)

    def encode_rendered_from(self, rendered: Rendered, start: int) -> list[int]:
        """The ids of a rendered conversation's text from character `start` on, the text before it taken
        as already tokenized (a guest's KV cache holds it): as encode_rendered, no message's content
        makes a special token, and the text at `start` continues the text before it (SentencePiece
        prepends no "▁"). Where the whole text's tokenization has no token boundary at `start`, these
        ids split it differently from it there."""
        if start == 0:
            return self.encode_rendered(rendered)
        text, spans = rendered
        spans = tuple((max(a, start), b) for a, b in spans if b > start)
        if not any(self._special_in(text[a:b]) for a, b in spans):
            return self._encode_template_piece(text[start:], start) if start < len(text) else []
        ids, at = [], start
        for a, b in spans:
            if at < a:
                ids += self._encode_template_piece(text[at:a], at)
            if a < b:
                ids += self._plain_continuing.encode(text[a:b], add_special_tokens=False).ids
            at = b
        if at < len(text):
            ids += self._encode_template_piece(text[at:], at)
        return ids

    def _encode_template_piece(self, piece: str, start: int) -> list[int]:
        """The ids of the template's text `piece` at `start` in a rendered conversation. Past the start,
        the text before its first special token continues the text before it: SentencePiece prepends
        no "▁" to it (as the whole text's tokenization would not)."""
        if start == 0:
            return self.encode(piece, add_bos=False)
        first = self._specials.search(piece) if self._specials is not None else None
        cut = len(piece) if first is None else first.start()
        head = self._plain_continuing.encode(piece[:cut], add_special_tokens=False).ids if cut else []
        return head + (self.encode(piece[cut:], add_bos=False) if cut < len(piece) else [])

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """The ids of the special (control) tokens."""
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    def _special_in(self, text: str) -> bool:
        return self._specials is not None and self._specials.search(text) is not None

    @cached_property
    def _specials(self) -> re.Pattern | None:
        """The text of every special token, as one pattern (None: the tokenizer has none)."""
        added = self.backend.get_added_tokens_decoder().values()
        words = [t.content for t in added if t.special and t.content]
        return re.compile("|".join(map(re.escape, sorted(words, key=len, reverse=True)))) if words else None

    @cached_property
    def _plain(self) -> HFTokenizer:
        """A copy of the backend that reads special-token text as plain text."""
        plain = HFTokenizer.from_str(self.backend.to_str())
        plain.encode_special_tokens = True
        return plain

    @cached_property
    def _plain_continuing(self) -> HFTokenizer:
        """_plain for text that continues a text: a SentencePiece tokenizer prepends no "▁" to its start
        (Metaspace's prepend_scheme "never", no Prepend normalizer); any other tokenizer is _plain."""
        spec = json.loads(self.backend.to_str())
        for pre in _parts(spec.get("pre_tokenizer"), "pretokenizers"):
            if pre.get("type") == "Metaspace":
                pre["prepend_scheme"] = "never"
        for norm in _parts(spec.get("normalizer"), "normalizers"):
            if norm.get("type") == "Prepend":
                norm["prepend"] = ""
        plain = HFTokenizer.from_str(json.dumps(spec))
        plain.encode_special_tokens = True
        return plain

    def _special_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.backend.id_to_token(token_id) or "")


def _parts(spec: dict | None, key: str) -> list[dict]:
    """A tokenizer.json normalizer's or pre-tokenizer's steps: itself, or a Sequence's `key` list."""
    if spec is None:
        return []
    return spec[key] if spec.get("type") == "Sequence" else [spec]


def _given(chat_template_kwargs: Mapping | None) -> dict:
    """The template's extra variables of a render: this thread's (rendering_with), then the call's."""
    return {**(_TEMPLATE_KWARGS.get() or {}), **(chat_template_kwargs or {})}


def _text(message: dict) -> bool:
    """Whether a chat message's content is text (a template may be given other shapes)."""
    return isinstance(message.get("content"), str)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


# Byte-level BPE's characters: to their bytes (as Latin-1 characters, so that str.translate then
# .encode("latin-1") maps a token's text to its bytes in C), and deleted (what remains of a token's
# text is not byte-level).
_BYTE_LEVEL_BYTES = {ord(c): chr(b) for b, c in _bytes_to_unicode().items()}
_BYTE_LEVEL_DELETE = dict.fromkeys(_BYTE_LEVEL_BYTES)
# A byte of SentencePiece's byte fallback, as its token is spelled.
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
