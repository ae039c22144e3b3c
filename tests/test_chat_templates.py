"""Each architecture's real chat template, rendered by floe from a Hugging Face folder, equals transformers'
apply_chat_template(..., tokenize=False) byte for byte: system turns (Gemma folds them into the first user
turn, Gemma 2 refuses them), multi-turn conversations, unicode, Qwen3's <think> handling and
enable_thinking, and the special tokens a template reads by name (tests/chat_templates/README.md says
where each template comes from)."""

import json
import re
from pathlib import Path

import jinja2
import pytest

from floe.model.chat_template import ChatTemplateError
from floe.model.hf_folder import tokenizer_from_folder
from floe.model.tokenizer import Tokenizer

TEMPLATES = Path(__file__).parent / "chat_templates"

# Each model's special tokens as its tokenizer_config.json names them, and generation_config's EOS ids
# (indices into the vocabulary below): where they differ (Llama-3.1, Phi-3), a template must see the
# config's eos_token.
LLAMA3 = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
MODELS = {
    "qwen3": ("qwen3.jinja", {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, ["<|im_end|>"]),
    "gemma2": ("gemma2.jinja", {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>",
                                "pad_token": "<pad>"}, ["<eos>", "<end_of_turn>"]),
    "gemma3": ("gemma3.jinja", {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>",
                                "pad_token": "<pad>"}, ["<eos>", "<end_of_turn>"]),
    "mistral-v0.3": ("mistral-v0.3.jinja", {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
                     ["</s>"]),
    "phi3-mini": ("phi3-mini.jinja", {"bos_token": "<s>", "eos_token": "<|endoftext|>", "unk_token": "<unk>",
                                      "pad_token": "<|endoftext|>"}, ["<|end|>", "<|endoftext|>"]),
    "phi3-small": ("phi3-small.jinja", {"bos_token": "<s>", "eos_token": "<|endoftext|>"},
                   ["<|end|>", "<|endoftext|>"]),
    "phi3.5-mini": ("phi3.5-mini.jinja", {"bos_token": "<s>", "eos_token": "<|endoftext|>",
                                          "unk_token": "<unk>", "pad_token": "<|endoftext|>"},
                    ["<|end|>", "<|endoftext|>"]),
    "llama3.1": ("llama3.1.jinja", LLAMA3, ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]),
    "llama3.2": ("llama3.2.jinja", LLAMA3, ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]),
    "smollm2": ("smollm2.jinja", {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                                  "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>"}, ["<|im_end|>"]),
}

SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in one line."}
USER = {"role": "user", "content": "What is the capital of France?"}
ASSISTANT = {"role": "assistant", "content": "Paris."}
USER2 = {"role": "user", "content": "And of Italy?"}
CONVERSATIONS = {
    "user": [USER],
    "system+user": [SYSTEM, USER],
    "multi-turn": [USER, ASSISTANT, USER2],
    "system+multi-turn": [SYSTEM, USER, ASSISTANT, USER2],
    "unicode": [
        {"role": "system", "content": "Réponds en français — «brièvement».\n"},
        {"role": "user", "content": "  日本語と中文 👨‍👩‍👧‍👦 🇫🇷\n\n\ttabs   and runs of spaces  "},
        {"role": "assistant", "content": "\nD'accord : naïve café, Ångström ✓ \n"},
        {"role": "user", "content": "한국어? ünïcödé"},
    ],
    "ends-with-assistant": [USER, ASSISTANT],
}


def _reference(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request, tmp_path_factory):
    """(name, floe's tokenizer, transformers') of one model's Hugging Face folder."""
    return request.param, *_folder_pair(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return _folder_pair("qwen3", tmp_path_factory.mktemp("qwen3"))


def _folder_pair(name: str, folder: Path):
    """(floe's tokenizer, transformers') of a Hugging Face folder written in `folder`: a tiny vocabulary
    holding the model's special tokens, its real chat template, its tokenizer and generation configs."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    template_file, special, eos = MODELS[name]
    tokens = sorted({*special.values(), *eos, "<unk>"})
    backend = Backend(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    template = (TEMPLATES / template_file).read_text()
    reference = PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=template, **special)
    reference.save_pretrained(folder)
    eos_ids = [tokens.index(t) for t in eos]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    ours = tokenizer_from_folder(folder, {})
    assert ours.chat_template == template and ours.eos_ids[0] == eos_ids[0]
    return ours, _reference(folder)


def _render_both(ours, reference, messages, **kwargs):
    """(floe's render, transformers') of `messages`; a template's raise_exception gives (its message,
    its message) when both raise it."""
    try:
        expected = reference.apply_chat_template(messages, tokenize=False, **kwargs)
    except jinja2.TemplateError as e:
        with pytest.raises(ChatTemplateError) as raised:
            ours.render_chat(messages, **kwargs)
        assert str(e) in str(raised.value)
        return str(e), str(e)
    return ours.render_chat(messages, **kwargs), expected


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_rendering_equals_transformers_apply_chat_template(model, conversation):
    _, ours, reference = model
    messages = CONVERSATIONS[conversation]
    got, expected = _render_both(ours, reference, messages, add_generation_prompt=True)
    assert got == expected
    got, expected = _render_both(ours, reference, messages, add_generation_prompt=False)
    assert got == expected


def test_gemma_folds_the_system_turn_into_the_first_user_turn(model):
    name, ours, _ = model
    if name == "gemma3":
        assert ours.render_chat([SYSTEM, USER]) == (
            f"<bos><start_of_turn>user\n{SYSTEM['content']}\n\n{USER['content']}<end_of_turn>\n"
            "<start_of_turn>model\n")
    elif name == "gemma2":
        with pytest.raises(ChatTemplateError, match="System role not supported"):
            ours.render_chat([SYSTEM, USER])


THINKING = [
    USER,
    {"role": "assistant", "content": "<think>\nThe capital of France is Paris.\n</think>\n\nParis."},
    USER2,
    {"role": "assistant", "content": "Rome.", "reasoning_content": "Italy's capital: Rome."},
]


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}],
                         ids=["default", "no-thinking", "thinking"])
@pytest.mark.parametrize("turns", [3, 4], ids=["asking", "answered"])
def test_qwen3_think_blocks_and_enable_thinking_equal_transformers(qwen3, kwargs, turns):
    """Earlier turns' <think> blocks are dropped, the last answer's kept (from its content or its
    reasoning_content); enable_thinking=False writes an empty think block after the generation prompt."""
    ours, reference = qwen3
    messages = THINKING[:turns]
    for generation_prompt in (True, False):
        expected = reference.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=generation_prompt, **kwargs)
        assert ours.render_chat(messages, add_generation_prompt=generation_prompt,
                                chat_template_kwargs=kwargs) == expected
        assert ours.encode_chat(messages, add_generation_prompt=generation_prompt,
                                chat_template_kwargs=kwargs) == reference.encode(
            expected, add_special_tokens=False)
    if kwargs == {"enable_thinking": False} and turns == 3:
        assert ours.render_chat(messages, chat_template_kwargs=kwargs).endswith(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning", "thinking"])
def test_reasoning_under_any_of_its_names_reaches_the_template(qwen3, field):
    ours, reference = qwen3
    messages = [USER, {"role": "assistant", "content": "Paris.", field: "France -> Paris."}]
    expected = reference.apply_chat_template(messages, tokenize=False)
    assert ours.render_chat(messages, add_generation_prompt=False) == expected
    assert "<think>\nFrance -> Paris.\n</think>" in expected


PROBE = ("{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token is defined }}|"
         "{{ messages[0].content is defined }}|{{ messages[0].tool_calls is defined }}|"
         "{{ {'b': 1, 'a': 'é <tag>'} | tojson }}|{{ dict(x=1) }}|{% set ns = namespace(n=0) %}"
         "{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}|{{ strftime_now('%Y') }}"
         "\n  {% if true %}\n    trimmed\n  {% endif %}\n")


def test_a_template_sees_what_transformers_passes_it(model):
    """The tokenizer config's special tokens by name (not generation's first EOS id), messages without
    their None-valued keys, tojson without HTML escapes, trim_blocks and lstrip_blocks."""
    _, ours, reference = model
    messages = [{"role": "assistant", "content": None, "tool_calls": None}, USER]
    expected = reference.apply_chat_template(messages, tokenize=False, chat_template=PROBE)
    probe = Tokenizer(ours.backend, bos_id=ours.bos_id, eos_ids=ours.eos_ids, add_bos=ours.add_bos,
                      chat_template=PROBE, special_tokens=ours.special_tokens)
    assert probe.render_chat(messages, add_generation_prompt=False) == expected


def test_floe_keeps_the_special_tokens_across_processes(model):
    _, ours, _ = model
    again = Tokenizer.from_wire(json.loads(json.dumps(ours.wire())))
    assert again.special_tokens == ours.special_tokens
    assert again.render_chat(CONVERSATIONS["multi-turn"]) == ours.render_chat(CONVERSATIONS["multi-turn"])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_each_template_renders_from_a_ggufs_special_tokens_as_transformers(name, default_checkpoint,
                                                                         reference_tokenizer):
    """From a GGUF (floe's default, SmolLM2's, as transformers reads it too), the special tokens a
    template reads come from the file's ids (tokenizer.ggml.bos/eos/unknown/padding_token_id)."""
    gguf = default_checkpoint.tokenizer
    template = (TEMPLATES / MODELS[name][0]).read_text()
    ours = Tokenizer(gguf.backend, bos_id=gguf.bos_id, eos_ids=gguf.eos_ids, add_bos=gguf.add_bos,
                     chat_template=template, special_tokens=gguf.special_tokens)
    assert gguf.special_tokens == reference_tokenizer.special_tokens_map
    for messages in CONVERSATIONS.values():
        try:
            expected = reference_tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, chat_template=template)
        except jinja2.TemplateError as e:
            with pytest.raises(ChatTemplateError, match=re.escape(str(e))):
                ours.render_chat(messages)
            continue
        assert ours.render_chat(messages) == expected
