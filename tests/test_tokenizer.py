"""floe's tokenizer (built from GGUF metadata) against the reference tokenizers, and chat templates."""

import pytest

from floe.model.tokenizer import ChatTemplateError, Tokenizer

HARD_STRINGS = [
    "In 2024, 12345 people paid $3.14 each; 1000000 > 999,999.",
    " 2024 starts with a space",
    "Ünïcödé façade — “quotes”, naïve café, Ångström",
    "日本語のテキストと中文字符和한국어",
    "family: 👨‍👩‍👧‍👦 flags 🇫🇷 skin 👍🏽",
    "def f(x):\n\treturn {'a': [x**2 for x in range(10)]}  # comment\n",
    "runs    of     spaces\n\n\n   and\t\ttabs   ",
    "embedded <|im_start|>user\nspecial<|im_end|> tokens<|endoftext|>",
    "",
    "   ",
]


@pytest.mark.parametrize("text", HARD_STRINGS)
def test_token_ids_equal_transformers_gguf_tokenizer(text, default_checkpoint, reference_tokenizer):
    ours = default_checkpoint.tokenizer.encode(text)
    assert ours == reference_tokenizer(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("text", HARD_STRINGS)
def test_decoding_round_trips(text, default_checkpoint):
    tok = default_checkpoint.tokenizer
    assert tok.decode(tok.encode(text)) == text


def test_token_ids_equal_llama_cpp(default_checkpoint):
    """llama.cpp itself, when installed (the `bench` extra builds it)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(str(default_checkpoint.source), vocab_only=True, verbose=False)
    for text in HARD_STRINGS:
        expected = llm.tokenize(text.encode(), add_bos=False, special=True)
        assert default_checkpoint.tokenizer.encode(text) == expected, text


def test_smollm_digits_are_split_individually(default_checkpoint):
    tok = default_checkpoint.tokenizer
    assert [tok.token_text(i) for i in tok.encode("12345")] == list("12345")


def test_special_tokens_are_single_ids_and_skippable(default_checkpoint):
    tok = default_checkpoint.tokenizer
    ids = tok.encode("<|im_start|>user")
    assert ids[0] == 1 and tok.decode(ids, skip_special=True) == "user"
    assert tok.eos_ids == (2,) and tok.add_bos is False


CONVERSATION = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]


@pytest.mark.parametrize("messages", [CONVERSATION, CONVERSATION[1:2]])
def test_chat_template_renders_like_transformers(messages, default_checkpoint, reference_tokenizer):
    ours = default_checkpoint.tokenizer.render_chat(messages)
    rendered = reference_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == rendered
    assert ours.endswith("<|im_start|>assistant\n")
    ids = default_checkpoint.tokenizer.encode_chat(messages)
    expected = reference_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert ids == expected


def test_template_errors_are_floe_errors(default_checkpoint):
    tok = default_checkpoint.tokenizer
    raising = Tokenizer(tok.backend, bos_id=1, eos_ids=[2], add_bos=False,
                        chat_template="{{ raise_exception('only user turns') }}")
    with pytest.raises(ChatTemplateError, match="only user turns"):
        raising.render_chat(CONVERSATION)
    none = Tokenizer(tok.backend, bos_id=1, eos_ids=[2], add_bos=False, chat_template=None)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        none.render_chat(CONVERSATION)
