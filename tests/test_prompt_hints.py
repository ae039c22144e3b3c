"""Prompt hints (floe.model.tokenizer.Hint): a conversation's render and token ids made in another
process (floe serve's HTTP front) answer the core's render and tokenize of exactly that conversation,
and nothing else; a tokenizer made again from its wire() tokenizes and renders as the original."""

from __future__ import annotations

import subprocess
import sys

import pytest

from floe.model.gguf_file import GGUFFile
from floe.model.gguf_tokenizer import tokenizer_from_gguf
from floe.model.tokenizer import Tokenizer

TEXTS = ["Hello, world!", "  two  spaces\tand a tab\n\nnew lines", "Ünïcödé, 中文, emoji 😀🎉",
         "<|im_start|>user\nfake turn<|im_end|>", "1234567890 3.14159 -42", "[INST] not a turn [/INST]"]
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|>!"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory) -> Tokenizer:
    from test_tokenizer_sentencepiece import write_sentencepiece_gguf

    path = write_sentencepiece_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf")
    return tokenizer_from_gguf(GGUFFile(path).fields)


@pytest.fixture(params=["default", "sentencepiece"])
def tokenizer(request, default_checkpoint, sentencepiece) -> Tokenizer:
    return default_checkpoint.tokenizer if request.param == "default" else sentencepiece


def test_a_tokenizer_from_its_wire_encodes_decodes_and_renders_as_the_original(tokenizer):
    again = Tokenizer.from_wire(tokenizer.wire())
    for text in TEXTS:
        assert again.encode(text) == tokenizer.encode(text)
        assert again.encode_plain(text) == tokenizer.encode_plain(text)
        ids = tokenizer.encode(text)
        assert again.decode(ids) == tokenizer.decode(ids)
    turns = CONVERSATION[1:]  # (Mistral's template takes no system message)
    assert again.render_chat_spans(turns) == tokenizer.render_chat_spans(turns)
    assert again.encode_chat(turns) == tokenizer.encode_chat(turns)
    for name in ("bos_id", "eos_ids", "add_bos", "chat_template"):
        assert getattr(again, name) == getattr(tokenizer, name), name
    assert again.hint(turns).ids == tokenizer.encode_chat(turns)


def test_a_hint_answers_the_render_and_tokenize_of_its_own_conversation_only(default_checkpoint):
    tok = default_checkpoint.tokenizer
    hint = tok.hint(CONVERSATION)
    hint.ids = [7, 8, 9]  # (not the real ids: seen only if the hint answered)
    other = [*CONVERSATION[:-1], {"role": "user", "content": "Name a number."}]
    with tok.hinted(hint):
        assert tok.encode_chat([dict(m) for m in CONVERSATION]) == [7, 8, 9]  # equal messages, not the same
        assert hint.used == 2  # the render and the tokenize
        assert tok.encode_chat(other) == tok.encode_rendered(tok.render_chat_spans(other)) != [7, 8, 9]
        assert tok.encode_chat(CONVERSATION, add_generation_prompt=False) != [7, 8, 9]
        with tok.offering_tools([{"type": "function", "function": {"name": "f", "parameters": {}}}]):
            assert tok.encode_chat(CONVERSATION) != [7, 8, 9]  # (a render with tools is another text)
        rendered = tok.render_chat_spans(CONVERSATION)
        assert tok.encode_rendered(type(rendered)(*rendered)) != [7, 8, 9]  # an equal render, not it
        assert hint.used == 3  # (the render just above)
    assert tok.encode_chat(CONVERSATION) == tok.hint(CONVERSATION).ids != [7, 8, 9]  # outside: none


def test_the_tokenizer_module_imports_no_torch():
    """floe serve's HTTP fronts never import torch (~230 MB and a second of start-up each)."""
    probe = "import sys, floe.model.tokenizer; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe]).returncode == 0
