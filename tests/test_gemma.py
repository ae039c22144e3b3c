"""Gemma 2 and Gemma 3's text model (embeddings times sqrt(dim), (1 + w) norms, GeGLU, four norms a layer,
q·k scaled by query_pre_attn_scalar, a window on every layer but each 2nd (Gemma 2) or 6th (Gemma 3);
Gemma 2's attention and logit soft-capping; Gemma 3's q/k norms and its windowed layers' own rotary base)
give transformers' logits and greedy tokens on the CPU, from a Hugging Face folder and from the same
weights as llama.cpp writes them in GGUF; the step without those hooks (CUDA's reference graph) refuses
them by name (the CPU's lean step has them: test_gemma_cpu_decode.py; CUDA's fused step and its module
forward too: test_gemma_on_cuda_matches_the_cpu; WebGPU's shaders: test_gemma_on_webgpu_matches_the_cpu)."""

import dataclasses

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from models import CUDA_STEPS, assert_cuda_matches_the_cpu, convert_to_gguf, save_hf_folder
from models import assert_matches_transformers as assert_matches

from floe.engine import Engine
from floe.engine.weights import check_backend
from floe.errors import UnsupportedModel
from floe.model import load_checkpoint

WINDOW = 8
IDS = [1, 504, 3575, 282, 4649, 314, 7042, 30, 17, 42, 9000, 31000] * 4  # 48 positions: 6 windows
PROMPT = IDS[:20]
SOFTCAPS = (1.0, 3.0)  # small enough to bend these tiny models' scores and logits


def _reference(folder):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def assert_same_config(a, b):
    """Equal but for the name and norm_eps (a float32 in GGUF)."""
    assert a.norm_eps == pytest.approx(b.norm_eps)
    assert dataclasses.replace(a, name="", norm_eps=0.0) == dataclasses.replace(b, name="", norm_eps=0.0)


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    """A Gemma 2 folder whose query_pre_attn_scalar (24) is not its head_dim (32)."""
    return save_hf_folder(tmp_path_factory.mktemp("gemma2"), "gemma2", tie=True, sliding_window=WINDOW,
                          query_pre_attn_scalar=24, softcaps=SOFTCAPS)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return save_hf_folder(tmp_path_factory.mktemp("gemma3"), "gemma3_text", tie=True, sliding_window=WINDOW)


def test_gemma2_config_from_an_hf_folder(gemma2):
    c = load_checkpoint(gemma2).config
    assert (c.arch, c.activation, c.embedding_scale, c.post_norms, c.qk_norm) == (
        "gemma2", "gelu_tanh", 8.0, True, False)
    assert (c.attention_scale, c.attn_softcap, c.logit_softcap) == (24**-0.5, *SOFTCAPS)
    assert [c.layer_window(i) for i in range(c.n_layers)] == [WINDOW, None]  # even layers local
    assert '"attn_softcap":1.0' in c.to_json()  # part of the fingerprint


def test_gemma2_hf_folder_matches_transformers(gemma2):
    assert_matches(gemma2, _reference(gemma2))


def test_gemma2_soft_capping_query_scale_and_window_each_matter(gemma2):
    """Each of Gemma 2's differences left out changes the logits: the comparison above sees them."""
    checkpoint = load_checkpoint(gemma2)
    c = checkpoint.config
    full = Engine(checkpoint, max_seq_len=64).prefill(IDS, all_logits=True)
    for change in ({"attn_softcap": None}, {"logit_softcap": None}, {"attention_scale": None},
                   {"sliding_window": None}):
        checkpoint.config = dataclasses.replace(c, **change)
        other = Engine(checkpoint, max_seq_len=64).prefill(IDS, all_logits=True)
        assert (other - full).abs().max() > 1e-3, change  # 10x the tolerance compared with transformers


def test_gemma2_gguf_matches_transformers(tmp_path):
    """As llama.cpp writes it: norms plus 1, soft-capping keys, no query_pre_attn_scalar (the head_dim
    below 27B, as in Gemma 2 2B and 9B): the same config as the folder's."""
    folder = save_hf_folder(tmp_path / "hf", "gemma2", tie=True, sliding_window=WINDOW, softcaps=SOFTCAPS)
    path = convert_to_gguf(folder, tmp_path / "gemma2.gguf")
    assert_same_config(load_checkpoint(path).config, load_checkpoint(folder).config)
    assert_matches(path, _reference(folder))


def test_gemma3_config_from_an_hf_folder(gemma3):
    c = load_checkpoint(gemma3).config
    assert (c.arch, c.qk_norm, c.post_norms, c.attn_softcap, c.logit_softcap) == (
        "gemma3", True, True, None, None)
    assert [c.layer_window(i) for i in range(c.n_layers)] == [WINDOW] * 5 + [None]  # every 6th global
    assert [c.layer_rope_theta(i) for i in range(c.n_layers)] == [10000.0] * 5 + [1e6]


def test_gemma_configs_as_older_transformers_wrote_them(gemma2, gemma3):
    """Before layer_types and nested rope_parameters (Gemma 2 2B-27B, Gemma 3 1B on the Hub): flat
    rope_theta, rope_local_base_freq, sliding_window_pattern and rope_scaling give the same config."""
    import json

    from floe.model.hf_folder import config_from_hf

    for folder in (gemma2, gemma3):
        cfg = json.loads((folder / "config.json").read_text())
        rope = cfg.pop("rope_parameters")
        old = {k: v for k, v in cfg.items() if k not in ("layer_types", "_sliding_window_pattern")}
        if "full_attention" in rope:
            old.update(rope_theta=rope["full_attention"]["rope_theta"], sliding_window_pattern=6,
                       rope_local_base_freq=rope["sliding_attention"]["rope_theta"], rope_scaling=None)
        else:
            old.update(rope_theta=rope["rope_theta"])
        assert config_from_hf(old, folder.name) == load_checkpoint(folder).config
    linear = {**old, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}  # Gemma 3 4B-27B's
    assert config_from_hf(linear, "g").rope_linear_factor == 8.0
    other = config_from_hf({**old, "rope_local_base_freq": 20000.0, "sliding_window_pattern": 3}, "g")
    assert (other.rope_local_theta, other.sliding_window_pattern) == (20000.0, 3)  # read, not defaults


def test_gemma3_hf_folder_matches_transformers(gemma3):
    assert_matches(gemma3, _reference(gemma3))


def test_gemma3_local_rope_base_matters(gemma3):
    checkpoint = load_checkpoint(gemma3)
    full = Engine(checkpoint, max_seq_len=64).prefill(IDS, all_logits=True)
    c = checkpoint.config
    checkpoint.config = dataclasses.replace(c, rope_local_theta=None)
    assert (Engine(checkpoint, max_seq_len=64).prefill(IDS, all_logits=True) - full).abs().max() > 1e-2


def test_gemma3_gguf_matches_transformers(gemma3, tmp_path):
    path = convert_to_gguf(gemma3, tmp_path / "gemma3.gguf")
    assert_same_config(load_checkpoint(path).config, load_checkpoint(gemma3).config)
    assert_matches(path, _reference(gemma3))


def test_gemma3_linear_rope_scaling_on_its_global_layers_matches_transformers(tmp_path):
    """Gemma 3 4B-27B: the global layers' frequencies divided by the factor, the windowed layers' not."""
    folder = save_hf_folder(tmp_path / "hf", "gemma3_text", tie=True, sliding_window=WINDOW, rope_linear=8.0)
    path = convert_to_gguf(folder, tmp_path / "gemma3.gguf")
    c = load_checkpoint(folder).config
    assert c.rope_linear_factor == 8.0
    assert_same_config(load_checkpoint(path).config, c)
    reference = _reference(folder)
    assert_matches(folder, reference)
    assert_matches(path, reference)
    unscaled = load_checkpoint(folder)
    unscaled.config = dataclasses.replace(c, rope_linear_factor=1.0)
    scaled = Engine(load_checkpoint(folder), max_seq_len=64).prefill(IDS, all_logits=True)
    assert (Engine(unscaled, max_seq_len=64).prefill(IDS, all_logits=True) - scaled).abs().max() > 1e-3


def test_gemma_decode_steps_equal_one_shot_prefill(gemma2):
    """Decode rows, a chunk appended past the window and two slots stepped together all see the
    windows, caps and scales as the one-shot prompt does."""
    engine = Engine(load_checkpoint(gemma2), max_seq_len=64, n_slots=2)
    assert engine.fused_kernels  # decode rows by the CPU's lean step
    full = engine.prefill(IDS, all_logits=True)
    engine.kv_truncate(0)
    engine.prefill(IDS[:10])
    engine.prefill(IDS[10:30])
    steps = [engine.decode_step(t) for t in IDS[30:]]
    torch.testing.assert_close(torch.stack(steps), full[30:], atol=1e-5, rtol=0)
    engine.kv_truncate(30)
    engine.prefill(IDS[:30], slot=1)
    for row in engine.decode_batch([IDS[30], IDS[30]], [0, 1]):
        torch.testing.assert_close(row, full[30], atol=1e-5, rtol=0)


def test_native_quantized_gemma_tracks_the_dense_engine(gemma3, tmp_path):
    """floe's int8-activation kernels for the file's Q8_0 projections, in the module forward."""
    ckpt = load_checkpoint(convert_to_gguf(gemma3, tmp_path / "q.gguf", Q.Q8_0))
    dense, native = Engine(ckpt, max_seq_len=64), Engine(ckpt, max_seq_len=64, weights="native")
    assert sum(native.packed.values()) >= 6 * 4
    full = dense.prefill(PROMPT, all_logits=True)
    steps = [native.prefill(PROMPT[:14])] + [native.decode_step(t) for t in PROMPT[14:]]
    for position, b in zip(range(13, len(PROMPT)), steps, strict=True):
        a = full[position]
        assert (a - b).norm() / a.norm() < 4e-2, position  # int8 inputs: ~5e-3 per product


def test_cudas_reference_graph_refuses_gemma_by_name(gemma2, gemma3):
    """CUDA's reference graph of one slot (graphs without the fused kernels) computes Llama's layer: it
    refuses Gemma, naming what it lacks and what runs it; the CPU's steps, CUDA's fused ones (and its
    module forward) and WebGPU's shaders take it, windows and all."""
    for folder, arch in ((gemma2, "gemma2"), (gemma3, "gemma3")):
        c = load_checkpoint(folder).config
        with pytest.raises(UnsupportedModel, match=f"{arch} models run on CUDA through the fused Triton step"
                                                   ".*post-attention.*fused_kernels=True"):
            check_backend(c, "cuda-graph", WINDOW)  # even where no window applies
        for backend in ("cpu", "cuda", "webgpu"):
            check_backend(c, backend, 64)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_on_webgpu_matches_the_cpu(gemma2, gemma3, arch):
    """transformers' Gemma 2 and 3 folders on WebGPU's shaders (lavapipe in CI): a prompt past the
    window and decode steps give the CPU's float32 logits, and the same greedy tokens."""
    from floe.engine.webgpu import WebGPUUnavailable, adapter

    try:
        adapter()
    except WebGPUUnavailable as e:
        pytest.skip(f"no WebGPU adapter: {e}")
    ckpt = load_checkpoint(gemma2 if arch == "gemma2" else gemma3)
    webgpu = Engine(ckpt, device="webgpu", max_seq_len=64)
    cpu = Engine(ckpt, max_seq_len=64, fused_kernels=False)
    a, b = webgpu.prefill(PROMPT, all_logits=True), cpu.prefill(PROMPT, all_logits=True)
    assert (a - b).abs().max() <= 2e-5 * max(1.0, float(b.abs().max())), float((a - b).abs().max())
    tokens = {}
    for name, engine in (("webgpu", webgpu), ("cpu", cpu)):
        out = [int(engine.decode_step(int(a[-1].argmax())).argmax())]
        for _ in range(5):
            out.append(int(engine.decode_step(out[-1]).argmax()))
        tokens[name] = out
    assert tokens["webgpu"] == tokens["cpu"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("steps", ["eager", "fused"])
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_on_cuda_matches_the_cpu(gemma2, gemma3, arch, steps):
    """CUDA's module forward and its fused Triton graphs (a prompt graph past PREFILL_ROWS with its flash
    attention, decode rows, a short prompt riding in the rows' graph, two slots at once) compute Gemma's
    layer as the CPU does: its scaled embeddings, GeGLU, post-norms, query scale, a window of 8 on its
    local layers over 336 positions, Gemma 2's soft-capping, Gemma 3's q/k norms and local rotary base."""
    assert_cuda_matches_the_cpu(load_checkpoint(gemma2 if arch == "gemma2" else gemma3), CUDA_STEPS[steps],
                                IDS * 7)  # 336 positions: 42 windows


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cudas_reference_graph_refuses_gemma(gemma3):
    with pytest.raises(UnsupportedModel, match="gemma3 models run on CUDA through the fused Triton step"):
        Engine(load_checkpoint(gemma3), device="cuda", max_seq_len=64, cuda_graphs=True, fused_kernels=False)


def test_gemma3_image_text_folders_are_refused_by_name():
    from floe.model.hf_folder import config_from_hf

    with pytest.raises(UnsupportedModel, match="gemma3.*image-text.*gemma3_text"):
        config_from_hf({"model_type": "gemma3", "text_config": {}}, "g")


@pytest.fixture(scope="module")
def gemma_vocabulary(tmp_path_factory):
    """(floe's tokenizer, transformers') of a tiny SentencePiece vocabulary written as llama.cpp writes
    Gemma's: tokens of spaces spelled with spaces (user-defined), scores that do not follow the file's
    order (the merge order), a user-defined newline run, no space prefix."""
    from test_tokenizer_sentencepiece import write_sentencepiece_gguf, write_vocabulary_gguf
    from transformers import AutoTokenizer

    from floe.model.gguf_file import GGUFFile
    from floe.model.gguf_tokenizer import tokenizer_from_gguf

    folder = tmp_path_factory.mktemp("gemma-vocabulary")
    fields = GGUFFile(write_sentencepiece_gguf(folder / "llama.gguf")).fields
    tokens = [t.replace("\u2581", " ") if not t.strip("\u2581") else t
              for t in fields["tokenizer.ggml.tokens"]]
    tokens.append("\n\n")
    kinds = [*fields["tokenizer.ggml.token_type"], 4]
    types = [4 if not t.strip() else k for t, k in zip(tokens, kinds, strict=True)]  # 4: user-defined
    scores = [0.0] * 259 + [float(i) for i in range(len(tokens) - 259)]  # rising: against the merge order
    path = write_vocabulary_gguf(folder / "gemma.gguf", "gemma2", tokens, scores, types, space_prefix=False)
    theirs = AutoTokenizer.from_pretrained(folder, gguf_file=path.name)
    return tokenizer_from_gguf(GGUFFile(path).fields), theirs


GEMMA_TEXTS = ["Hello world, how are you?", "naïve café façade — “quotes”, Ångström",
               "日本語のテキストと中文字符和한국어",
               "def f(x):\n\treturn {'a': [x**2 for x in range(10)]}  # comment\n\n",
               "runs    of     spaces\n\n\n   and\t\ttabs   ", " starts with a space", "  two spaces", "",
               "embedded </s> and <s> tokens"]


@pytest.mark.parametrize("text", GEMMA_TEXTS)
def test_gemma_gguf_sentencepiece_equals_transformers(gemma_vocabulary, text):
    ours, theirs = gemma_vocabulary
    ids = ours.encode(text, add_bos=False)
    assert ids == theirs.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == theirs.decode(ids) == text
    if not ours.special_ids.intersection(ids):
        assert b"".join(ours.token_bytes(i) for i in ids) == text.encode()  # no space prepended


def test_gemma_merges_follow_the_files_order_and_space_runs_are_one_token(gemma_vocabulary):
    ours, _ = gemma_vocabulary
    spaces = [ours.token_text(i) for i in ours.encode("a    b", add_bos=False)]
    assert spaces == ["a", "\u2581\u2581\u2581\u2581", "b"]
    learned = [ours.token_text(i) for i in ours.encode("The quick brown fox", add_bos=False)]
    assert len(learned) <= 5, learned  # merged in the file's order (by the scores, hardly anything merges)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_gemma_3_1b_heads_on_cudas_fused_step_equal_its_module_forward():
    """Gemma 3 1B's own attention (head_dim 256, four query heads on one KV head, a window of 512) and
    vocabulary, six layers of it, float32 random weights: the fused step's kernels at that head size (a
    600-token prompt's flash attention past the window, then decode rows) give the module forward's
    logits on CUDA, and its greedy tokens."""
    from floe.model.config import KNOWN_SHAPES
    from floe.model.synthetic import random_checkpoint

    shape = dataclasses.replace(KNOWN_SHAPES["gemma-3-1b"], n_layers=6, context_length=1024)
    ckpt = random_checkpoint(shape, _tokenizer(), dtype=torch.float32, device="cuda")
    ids = torch.randint(0, shape.vocab_size, (608,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = {}
    for steps in ("eager", "fused"):
        engine = Engine(ckpt, device="cuda", max_seq_len=1024, **CUDA_STEPS[steps])
        # (each step's logits copied: the fused step's are its graph's buffer, valid until its next step)
        logits[steps] = torch.stack([engine.prefill(ids[:600]).clone()]
                                    + [engine.decode_step(t).clone() for t in ids[600:]])
        del engine
    eager, fused = logits["eager"], logits["fused"]
    assert ((fused - eager).norm(dim=-1) / eager.norm(dim=-1)).max().item() < 1e-4
    assert torch.equal(fused.argmax(-1), eager.argmax(-1))


def _tokenizer():
    """The tests' tokenizer: the folder FLOE_TEST_TOKENIZER names (tokenizer.json), else the default
    model's (as tests/test_cuda.py's; a random model's text is not read)."""
    import os
    from pathlib import Path

    folder = os.environ.get("FLOE_TEST_TOKENIZER")
    if folder:
        from floe.model.hf_folder import tokenizer_from_folder

        return tokenizer_from_folder(Path(folder), {})
    return load_checkpoint().tokenizer


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_fused_post_norm_computes_what_two_norms_do(dtype):
    """Gemma's post norm inside the residual's norm kernel (rmsnorm's pre_weight) computes what the two
    kernels did: norm(a) * w_post, rounded, plus the residual, rounded, normed — within one rounding of
    the dtype (the compiler may contract the product and the sum into one FMA: not the same bits)."""
    from floe.engine import triton_kernels as tk

    g = torch.Generator(device="cuda").manual_seed(0)
    a, x = (torch.randn(5, 1152, generator=g, device="cuda").to(dtype) for _ in range(2))
    w_post, w_next = ((1 + 0.1 * torch.randn(1152, generator=g, device="cuda")).to(dtype) for _ in range(2))
    post, _ = tk.rmsnorm(a, w_post, 1e-6)
    want_h, want_x = tk.rmsnorm(post, w_next, 1e-6, residual=x)
    got_h, got_x = tk.rmsnorm(a, w_next, 1e-6, residual=x, pre_weight=w_post)
    ulp = torch.finfo(dtype).eps
    for got, want in ((got_x, want_x), (got_h, want_h)):  # (a sum that cancels keeps the operands' error)
        scale = want.abs().max().item()
        off = (got - want).abs().max().item() / scale / ulp
        print(dtype, f"max |got - want|: {off:.2f} ulps of the largest")
        torch.testing.assert_close(got, want, rtol=2 * ulp, atol=4 * ulp * scale)
