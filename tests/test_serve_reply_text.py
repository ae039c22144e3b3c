"""A chat reply's text through `floe serve` is transformers' decode of its tokens, streamed or not, for
every kind of tokenizer floe reads: byte-level BPE (SmolLM2's) and SentencePiece as Llama-2/Mistral,
Phi-3 and Gemma write it. SentencePiece's Llama-2, Mistral and Phi-3 decoders drop the space a text's
first token starts with; the front's text of a reply streamed as token ids drops it as the core's does.
A text completion continues its prompt: it keeps that space, as OpenAI's and llama.cpp's do."""

from __future__ import annotations

import openai
import pytest
from models import convert_to_gguf, floe_greedy, save_hf_folder, tokenizer_fields
from test_server import ThreadServer, client
from test_tokenizer_sentencepiece import write_sentencepiece_gguf

from floe.engine import Engine
from floe.model import load_checkpoint
from floe.model.gguf_file import GGUFFile
from floe.server.app import create_app

MODEL_ID = "tiny"
N = 10
MESSAGES = [{"role": "user", "content": "Hello there, how are you?"}]

# kind -> (the model's transformers model_type, the SentencePiece vocabulary's GGUF architecture or
# None for SmolLM2's byte-level BPE, whether its decode drops a text's first space)
KINDS = {
    "byte-level BPE": ("mistral", None, False),
    "SentencePiece Llama-2/Mistral": ("mistral", "llama", True),
    "SentencePiece Phi-3": ("phi3", "phi3", True),
    "SentencePiece Gemma": ("gemma2", "gemma2", False),
}


@pytest.fixture(scope="module", params=list(KINDS))
def served(request, tmp_path_factory):
    """(the server, its checkpoint, transformers' tokenizer of the same file, whether it drops a first
    space) for a tiny random model whose greedy tokens all start with a space (every other token's
    output row is zero): the reply's first token starts with one."""
    from transformers import AutoTokenizer

    model_type, vocabulary, strips = KINDS[request.param]
    folder = tmp_path_factory.mktemp("model")
    if vocabulary is None:
        fields = tokenizer_fields()
        space = "\u0120"
    else:
        spm = GGUFFile(write_sentencepiece_gguf(folder / "vocabulary.gguf", vocabulary)).fields
        fields = {k: v for k, v in spm.items() if k.startswith("tokenizer.")}
        space = "\u2581"
    tokens = fields["tokenizer.ggml.tokens"]
    picks = [i for i, t in enumerate(tokens) if t.startswith(space) and len(t) > 1]
    save_hf_folder(folder / "hf", model_type, tie=False, vocab_size=len(tokens), picks=picks)
    path = convert_to_gguf(folder / "hf", folder / "model.gguf", tokenizer=fields)
    checkpoint = load_checkpoint(path)
    engine = Engine(checkpoint, max_seq_len=128, n_slots=2)
    server = ThreadServer(create_app(engine, snapshots=folder / "sessions", model_id=MODEL_ID,
                                     idle_seconds=3600))
    reference = AutoTokenizer.from_pretrained(folder, gguf_file=path.name)
    yield server, checkpoint, reference, strips
    server.stop()


def reply_ids(checkpoint) -> list[int]:
    """The chat's greedy reply tokens (to its first end-of-turn token), from a separate engine."""
    tokenizer = checkpoint.tokenizer
    ids = floe_greedy(Engine(checkpoint, max_seq_len=128), tokenizer.encode_chat(MESSAGES), N)
    ends = [k for k, i in enumerate(ids) if i in tokenizer.eos_ids]
    return ids[:ends[0]] if ends else ids


def chat_text(c: openai.OpenAI, *, stream: bool) -> str:
    kwargs = dict(model=MODEL_ID, messages=MESSAGES, temperature=0, max_tokens=N, stream=stream)
    if not stream:
        return c.chat.completions.create(**kwargs).choices[0].message.content
    return "".join(chunk.choices[0].delta.content or "" for chunk in c.chat.completions.create(**kwargs)
                   if chunk.choices)


def test_a_chat_reply_is_transformers_decode_of_its_tokens_streamed_or_not(served):
    server, checkpoint, reference, strips = served
    ids = reply_ids(checkpoint)
    assert checkpoint.tokenizer.token_bytes(ids[0]).startswith(b" ")  # (what the rule is about)
    expected = reference.decode(ids, skip_special_tokens=True)
    assert expected.startswith(" ") != strips
    c = client(server.url)
    assert chat_text(c, stream=False) == expected
    assert chat_text(c, stream=True) == expected
    assert checkpoint.tokenizer.strips_leading_space == strips


def test_a_text_completion_keeps_the_space_that_continues_its_prompt(served):
    server, checkpoint, reference, _ = served
    c = client(server.url)
    kwargs = dict(model=MODEL_ID, prompt="Hello there", temperature=0, max_tokens=4)
    text = c.completions.create(**kwargs).choices[0].text
    streamed = "".join(chunk.choices[0].text for chunk in c.completions.create(**kwargs, stream=True)
                       if chunk.choices)
    assert text == streamed and text.startswith(" ")  # (every token the model picks starts with one)
