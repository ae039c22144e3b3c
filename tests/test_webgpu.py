"""The WebGPU backend (floe.engine.webgpu, `Engine(checkpoint, device="webgpu")`): WGSL kernels that
compute what the CPU's float32 forward computes, in both GEMV layouts (a thread a row, as a CPU
adapter runs; lanes splitting rows, as a GPU's is: forced here) and with f16 weights, an engine whose
greedy replies are the CPU's, KV snapshots that cross between the two, and a ledger that shows each
logits readback and its bytes.

Runs wherever wgpu finds an adapter (CI: Mesa's lavapipe, a Vulkan driver on the CPU); skipped,
saying why, where none answers."""

import json

import pytest
import torch

from floe.engine.webgpu import WebGPUUnavailable, adapter

try:
    adapter()
except WebGPUUnavailable as e:
    pytest.skip(f"no WebGPU adapter: {e}", allow_module_level=True)

from floe import snapshot  # noqa: E402
from floe.actor import Actor, builtin_guest  # noqa: E402
from floe.engine import Engine  # noqa: E402
from floe.engine.kvcache import KVDigestMismatch  # noqa: E402
from floe.engine.webgpu import decoder as webgpu_decoder  # noqa: E402
from floe.engine.webgpu.decoder import CHUNK, SPLIT, input_bytes, planned_dispatches  # noqa: E402
from floe.engine.webgpu.device import gpu  # noqa: E402
from floe.errors import FloeError  # noqa: E402
from floe.model.config import KNOWN_SHAPES, ModelConfig  # noqa: E402
from floe.model.synthetic import random_checkpoint  # noqa: E402

# Small random models: grouped-query attention, a tied and an untied head, QKV biases (Qwen2), a
# 128-wide head (two dimensions per attention thread), Qwen3's per-head q/k norm with its heads
# wider than dim / n_heads (32 against 16, as Qwen3-0.6B's 128 against 64), and Mistral's sliding window
# (40 positions: the prompts below are 3 and 5 windows long, and it is no multiple of a chunk).
CONFIGS = {
    "llama-tied": ModelConfig("llama", 64, 2, 4, 2, 160, 1024, 512, head_dim=16, tie_embeddings=True),
    "qwen2-bias": ModelConfig("qwen2", 64, 2, 4, 2, 160, 1024, 512, head_dim=16, qkv_bias=True,
                              rope_theta=1e6),
    "wide-heads": ModelConfig("llama", 256, 1, 2, 1, 256, 512, 512, head_dim=128, tie_embeddings=True),
    "qwen3-qk-norm": ModelConfig("qwen3", 64, 2, 4, 2, 160, 1024, 512, head_dim=32, norm_eps=1e-6,
                                 rope_theta=1e6),
    "mistral-window": ModelConfig("mistral", 64, 2, 4, 2, 160, 1024, 512, head_dim=16, sliding_window=40),
    # Gemma 3: GeGLU, scaled embeddings, post norms, q/k norms, its query scale, a window on two layers
    # of three with their own rotary base; Gemma 2: its attention and logit soft-capping (caps low
    # enough to bend these random weights' scores and logits).
    "gemma3-like": ModelConfig("gemma3", 64, 3, 4, 2, 160, 1024, 512, head_dim=32, norm_eps=1e-6,
                               rope_theta=1e6, tie_embeddings=True, sliding_window=40, activation="gelu_tanh",
                               embedding_scale=8.0, post_norms=True, attention_scale=0.15,
                               sliding_window_pattern=3, rope_local_theta=10000.0),
    "gemma2-like": ModelConfig("gemma2", 64, 2, 4, 2, 160, 1024, 512, head_dim=16, tie_embeddings=True,
                               sliding_window=40, activation="gelu_tanh", embedding_scale=8.0,
                               post_norms=True, attention_scale=0.2, attn_softcap=2.0, logit_softcap=1.5,
                               sliding_window_pattern=2),
}
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]
# The default model's conversations open with this one-token system message instead of its template's
# own (15 tokens more): lavapipe prefills ~0.6-0.8 s a token, and what these tests compare is the same.
# Their replies are a few tokens for the same reason (a decode step is ~1.8 s on 2 busy cores).
SYSTEM = "."


def tiny(name: str, tokenizer, **engine) -> tuple[Engine, Engine]:
    """(WebGPU engine, CPU float32 module-forward engine) on one random model (f16 weights: its
    weights are f16 values, which the CPU runs in float32)."""
    dtype = torch.float16 if engine.get("weights") == "f16" else torch.float32
    checkpoint = random_checkpoint(CONFIGS[name], tokenizer, dtype=dtype, scale=0.1)
    return (Engine(checkpoint, device="webgpu", max_seq_len=256, **engine),
            Engine(checkpoint, max_seq_len=256, fused_kernels=False))


@pytest.fixture(params=["threads", "lanes"])
def layout(request, monkeypatch):
    """Each GEMV layout in turn (the adapter's own choice is Gpu.gemv_layout), the deep plan wherever it
    applies (a GPU adapter's lanes take it only with FLOE_WEBGPU_DEEP=1: deep_fused)."""
    monkeypatch.setattr(gpu(), "gemv_layout", request.param)
    monkeypatch.setenv("FLOE_WEBGPU_DEEP", "1")
    return request.param


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to float32 rounding: the kernels sum in another order than PyTorch's CPU kernels."""
    return bool((a - b).abs().max() <= 2e-5 * max(1.0, float(b.abs().max())))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_and_decode_logits_equal_the_cpu_float32_forward(default_checkpoint, name, fused, layout):
    webgpu, cpu = tiny(name, default_checkpoint.tokenizer, fused_kernels=fused)
    # one band a matrix here: three dispatches a layer (Gemma's layers: six)
    assert webgpu._batch_decoder().deep == (fused and not CONFIGS[name].beyond_llama())
    prompt = [(7 * i + 3) % 500 for i in range(CHUNK * 2 + 9)]  # three chunks of a prompt
    assert close(webgpu.prefill(prompt, all_logits=True), cpu.prefill(prompt, all_logits=True))
    for token in (11, 400, 2):
        assert close(webgpu.decode_step(token), cpu.decode_step(token))
    more = [5, 6, 7]  # appended to a prefix: the rows attend to the cache and to each other
    assert close(webgpu.prefill(more), cpu.prefill(more))


@pytest.mark.parametrize("name", ["llama-tied", "wide-heads", "gemma3-like"])
def test_f16_weights_compute_what_the_cpu_float32_forward_does_on_those_weights(default_checkpoint, name,
                                                                                  layout):
    webgpu, cpu = tiny(name, default_checkpoint.tokenizer, weights="f16")
    full, _ = tiny(name, default_checkpoint.tokenizer)
    assert webgpu._batch_decoder().weight_bytes < 0.6 * full._batch_decoder().weight_bytes
    prompt = [(5 * i + 1) % 500 for i in range(CHUNK + 7)]
    assert close(webgpu.prefill(prompt), cpu.prefill(prompt))
    for token in (3, 77, 9):
        assert close(webgpu.decode_step(token), cpu.decode_step(token))


def test_f16_weights_are_webgpu_storage_only(default_checkpoint):
    with pytest.raises(FloeError, match="webgpu"):
        Engine(default_checkpoint, weights="f16")


def test_the_adapter_chooses_the_gemv_layout_and_the_environment_overrides_it(monkeypatch):
    from floe.engine.webgpu.device import gemv_layout

    monkeypatch.delenv("FLOE_WEBGPU_GEMV", raising=False)
    assert gemv_layout("CPU") == "threads" and gemv_layout("DiscreteGPU") == "lanes"
    monkeypatch.setenv("FLOE_WEBGPU_GEMV", "lanes")
    assert gemv_layout("CPU") == "lanes"
    monkeypatch.setenv("FLOE_WEBGPU_GEMV", "warps")
    with pytest.raises(FloeError, match="threads, lanes"):
        gemv_layout("CPU")


def test_a_decode_row_beside_others_is_bitwise_that_row_alone(default_checkpoint, layout):
    webgpu, _ = tiny("llama-tied", default_checkpoint.tokenizer, n_slots=3)
    slots = [webgpu.claim_slot() for _ in range(3)]
    for i, slot in enumerate(slots):
        webgpu.prefill(list(range(10 + i, 30 + 7 * i)), slot)  # three lengths
    together = webgpu.decode_batch([1, 2, 3], slots)
    for token, slot, row in zip([1, 2, 3], slots, together, strict=True):
        webgpu.kv_truncate(webgpu.kv_len(slot) - 1, slot)
        assert torch.equal(webgpu.decode_step(token, slot), row)


@pytest.mark.parametrize("name", ["llama-tied", "mistral-window", "gemma2-like", "qwen3-qk-norm"])
def test_decode_attention_in_splits_equals_the_cpu_over_many_splits_a_window_and_rows_of_other_lengths(
        default_checkpoint, monkeypatch, layout, name):
    # (attention_split.wgsl + attention_merge.wgsl: the fused plan where it is not the deep one; rows
    # at other positions in one step; a window of 40 that starts inside a split of SPLIT positions)
    monkeypatch.setattr(webgpu_decoder, "deep_fused", lambda *a, **k: False)
    checkpoint = random_checkpoint(CONFIGS[name], default_checkpoint.tokenizer, scale=0.1)
    webgpu = Engine(checkpoint, device="webgpu", max_seq_len=256, n_slots=2)
    cpu = Engine(checkpoint, max_seq_len=256, fused_kernels=False, n_slots=2)
    assert not webgpu._batch_decoder().deep
    long = [(5 * i + 1) % 500 for i in range(9 * SPLIT + 3)]  # nine splits and a bit: past the window
    short = [(3 * i + 7) % 500 for i in range(SPLIT - 5)]  # not one whole split
    for ids, slot in ((long, 0), (short, 1)):
        assert close(webgpu.prefill(ids, slot), cpu.prefill(ids, slot))
    for tokens in ([3, 77], [401, 12], [9, 250]):
        got, want = webgpu.decode_batch(tokens, [0, 1]), cpu.decode_batch(tokens, [0, 1])
        assert all(close(a, b) for a, b in zip(got, want, strict=True))


def test_prompts_launched_together_prefill_on_webgpu_as_each_alone(default_checkpoint):
    webgpu, cpu = tiny("llama-tied", default_checkpoint.tokenizer, n_slots=3)
    prompts = [(list(range(20, 40)), 1), (list(range(50, 80)), 2)]  # long enough to go together on a CPU
    step = webgpu.launch_batch([], [], prompts=prompts)
    webgpu.finish_batch(step)
    for (ids, slot), result in zip(prompts, step.prompt_results, strict=True):
        assert webgpu.kv_len(slot) == len(ids) and webgpu.cache.tokens[slot] == ids
        assert close(result, cpu.prefill(ids))
        cpu.kv_truncate(0)


def test_projections_split_into_bands_compute_what_one_band_does(default_checkpoint, monkeypatch):
    whole, _ = tiny("qwen2-bias", default_checkpoint.tokenizer, fused_kernels=False)
    monkeypatch.setattr(gpu(), "max_binding", 64 << 10)  # the head (256 KiB) in 4 bands, gate/up in 2
    banded, _ = tiny("qwen2-bias", default_checkpoint.tokenizer, fused_kernels=False)
    prompt = list(range(40, 90))
    assert torch.equal(banded.prefill(prompt), whole.prefill(prompt))
    assert torch.equal(banded.decode_step(9), whole.decode_step(9))
    plan = banded._batch_decoder().decode_plan
    assert len(plan.head) == 5 and len(plan.embed) == 4  # the head's norm, then its 4 bands
    assert banded._batch_decoder().dispatches_per_step() == planned_dispatches(banded.config, 64 << 10, False)


@pytest.mark.parametrize("binding", [64 << 10, 128 << 10], ids=["gate-up-banded", "head-banded"])
def test_a_fused_step_with_banded_matrices_equals_the_cpu_and_is_the_planned_dispatches(
        default_checkpoint, monkeypatch, binding):
    monkeypatch.setattr(gpu(), "max_binding", binding)  # 64 KiB: gate/up in 2 bands (six a layer);
    webgpu, cpu = tiny("qwen2-bias", default_checkpoint.tokenizer)  # 128: the head in 2, layers whole
    decoder = webgpu._batch_decoder()
    assert decoder.deep == (binding > 64 << 10)
    prompt = list(range(40, 90))
    assert close(webgpu.prefill(prompt), cpu.prefill(prompt))
    assert close(webgpu.decode_step(9), cpu.decode_step(9))
    planned = planned_dispatches(webgpu.config, binding)
    assert decoder.last_dispatches == decoder.dispatches_per_step() == planned


@pytest.mark.parametrize("name", ["llama-tied", "gemma3-like"])
def test_a_head_of_more_workgroups_than_a_dispatch_may_have_is_dispatched_in_pieces(default_checkpoint,
                                                                                   monkeypatch, layout, name):
    # (Gemma 3's 262,144-row head is 65,536 workgroups of the lanes layout's four rows, one past the
    # limit on a dimension, which the H100's Vulkan driver enforces: here a limit this head passes)
    limit = 100 if layout == "lanes" else 10  # the head: 256 workgroups (lanes), 16 (threads); no other
    monkeypatch.setattr(gpu(), "max_workgroups", limit)
    webgpu, cpu = tiny(name, default_checkpoint.tokenizer)
    decoder = webgpu._batch_decoder()
    assert len(decoder.decode_plan.head) == (3 if layout == "lanes" else 2)
    prompt = list(range(40, 90))
    assert close(webgpu.prefill(prompt), cpu.prefill(prompt))
    for token in (9, 300):
        assert close(webgpu.decode_step(token), cpu.decode_step(token))
    g = gpu()
    limits = {"layout": layout, "storage_buffers": g.max_storage_buffers,
              "workgroup_bytes": g.device.limits["max-compute-workgroup-storage-size"]}
    assert decoder.last_dispatches == decoder.dispatches_per_step() == planned_dispatches(
        webgpu.config, g.max_binding, max_workgroups=limit, **limits)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_decode_token_is_the_planned_dispatches_three_a_layer_fused_nine_unfused(default_checkpoint, name):
    counts = {}
    for fused in (True, False):
        engine, _ = tiny(name, default_checkpoint.tokenizer, fused_kernels=fused)
        engine.prefill([1, 2, 3])
        engine.decode_step(4)
        decoder = engine._batch_decoder()
        counts[fused] = decoder.last_dispatches
        assert counts[fused] == decoder.dispatches_per_step() == planned_dispatches(
            engine.config, gpu().max_binding, fused)
    c = CONFIGS[name]
    if not c.post_norms:  # (Qwen3: its q/k norm a dispatch more)
        assert counts[True] == 2 + (3 + c.qk_norm) * c.n_layers
        assert counts[False] - counts[True] == 6 * c.n_layers + 1
    else:  # Gemma: six a layer fused (no deferred residual; attention in splits and their merge), two post
        # norms, and its q/k norm (Gemma 3)
        assert counts[True] == 2 + (6 + 2 + c.qk_norm) * c.n_layers
        assert counts[False] - counts[True] == 3 * c.n_layers + 1


@pytest.mark.parametrize("name", ["llama-tied", "gemma3-like"])
def test_a_steps_dispatches_timed_one_by_one_are_its_plan_with_every_projections_weights(default_checkpoint,
                                                                                          name):
    # (WebGPUDecoder.op_times: issue 21's per-kernel device time; each projection's weights counted once:
    # the GEMVs' bands, the deep plan's attention-and-output and MLP dispatches)
    engine, _ = tiny(name, default_checkpoint.tokenizer)
    engine.prefill([1, 2, 3])
    decoder = engine._batch_decoder()
    if not gpu().timestamps:
        assert decoder.op_times(4, 3) == []
        return
    times = decoder.op_times(4, 3)
    assert len(times) == decoder.dispatches_per_step()
    assert all(t["us"] >= 0 for t in times) and sum(t["us"] for t in times) > 0
    model, size = engine.model, 4
    projections = [model.output_weight()] + [w for layer in model.layers for w in (
        layer.attention.wqkv.weight, layer.attention.wo.weight, layer.feed_forward.w13.weight,
        layer.feed_forward.w2.weight)]
    assert sum(t["weight_bytes"] for t in times) == size * sum(w.numel() for w in projections)


def greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after `prompt` (argmax of each step's logits)."""
    tokens = [int(engine.prefill(prompt).argmax())]
    for _ in range(n - 1):
        tokens.append(int(engine.decode_step(tokens[-1]).argmax()))
    return tokens


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_qwen3_greedy_tokens_on_webgpu_equal_the_cpu_float32_forward(default_checkpoint, fused):
    webgpu, cpu = tiny("qwen3-qk-norm", default_checkpoint.tokenizer, fused_kernels=fused)
    prompt = [(11 * i + 5) % 1000 for i in range(CHUNK + 13)]
    assert greedy(webgpu, prompt, 10) == greedy(cpu, prompt, 10)


def test_without_its_qk_norm_a_qwen3_step_is_not_the_cpus(default_checkpoint, monkeypatch):
    """What the Qwen3 comparisons above would catch: the WGSL step with the q/k norm left out."""
    from floe.engine.webgpu.decoder import WebGPUDecoder

    monkeypatch.setattr(WebGPUDecoder, "_qk_norm", lambda self, i, layer: [])
    webgpu, cpu = tiny("qwen3-qk-norm", default_checkpoint.tokenizer)
    prompt = list(range(40, 90))
    assert not close(webgpu.prefill(prompt), cpu.prefill(prompt))
    assert not close(webgpu.decode_step(9), cpu.decode_step(9))


def test_webgpu_runs_qwen3_gemma_and_sliding_windows_and_cudas_reference_graph_refuses_gemma():
    from floe.engine.weights import check_backend
    from floe.errors import UnsupportedModel

    qwen3 = CONFIGS["qwen3-qk-norm"]
    assert qwen3.qk_norm
    for c in (qwen3, CONFIGS["mistral-window"], KNOWN_SHAPES["gemma-3-1b"], CONFIGS["gemma2-like"]):
        check_backend(c, "webgpu", 4096)
    with pytest.raises(UnsupportedModel, match="gemma3 models run on CUDA through the fused Triton step"):
        check_backend(KNOWN_SHAPES["gemma-3-1b"], "cuda-graph", 256)


@pytest.mark.parametrize("name", ["gemma3-like", "gemma2-like"])
def test_gemma_greedy_on_webgpu_equals_the_cpu_and_each_of_its_extras_matters(default_checkpoint, name,
                                                                              monkeypatch):
    """Greedy tokens past two windows equal the CPU's float32 ones; and what the comparisons would
    catch: the step without its post norms, or with SwiGLU for GeGLU, computes other logits."""
    webgpu, cpu = tiny(name, default_checkpoint.tokenizer)
    prompt = [(13 * i + 7) % 1000 for i in range(90)]
    assert greedy(webgpu, prompt, 8) == greedy(cpu, prompt, 8)
    from floe.engine.webgpu.decoder import WebGPUDecoder

    pipeline = WebGPUDecoder._pipeline

    def silu(self, shader, const):
        return pipeline(self, shader, const | ({"GELU": 0} if "GELU" in const else {}))

    for leave_out in ("_post", "gelu"):
        with monkeypatch.context() as m:
            if leave_out == "_post":
                m.setattr(WebGPUDecoder, "_post", lambda self, i, norm: [])
            else:
                m.setattr(WebGPUDecoder, "_pipeline", silu)
            broken, cpu = tiny(name, default_checkpoint.tokenizer)
            assert not close(broken.prefill(prompt[:30]), cpu.prefill(prompt[:30])), leave_out


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_a_windowed_mistral_greedy_on_webgpu_equals_the_cpu_and_the_window_matters(default_checkpoint,
                                                                                   fused, monkeypatch):
    """Greedy tokens past five windows equal the CPU's; and what these comparisons would catch: the
    shaders without the window (every WINDOW constant 0) compute other logits past it."""
    webgpu, cpu = tiny("mistral-window", default_checkpoint.tokenizer, fused_kernels=fused)
    prompt = [(11 * i + 5) % 1000 for i in range(5 * 40)]
    assert greedy(webgpu, prompt, 10) == greedy(cpu, prompt, 10)
    from floe.engine.webgpu.decoder import WebGPUDecoder

    constants = WebGPUDecoder._attention_constants
    monkeypatch.setattr(WebGPUDecoder, "_attention_constants", lambda self, layer: constants(self, layer)
                        | {"WINDOW": 0})
    unwindowed, cpu = tiny("mistral-window", default_checkpoint.tokenizer, fused_kernels=fused)
    assert close(unwindowed.prefill(prompt[:40]), cpu.prefill(prompt[:40]))  # (within the window)
    unwindowed.kv_truncate(0)
    cpu.kv_truncate(0)
    assert not close(unwindowed.prefill(prompt), cpu.prefill(prompt))
    assert not close(unwindowed.decode_step(9), cpu.decode_step(9))


@pytest.mark.parametrize("unroll, wide", [("2", "0"), ("3", "0"), ("1", "1"), ("3", "1")])
def test_the_lanes_gemv_reading_adjacent_weights_a_lane_computes_what_the_cpu_does(default_checkpoint,
                                                                                 monkeypatch, unroll, wide):
    # (FLOE_WEBGPU_UNROLL: 3 leaves a row's last iteration short of its loads; FLOE_WEBGPU_WIDE: f16
    # weights eight a load; f16 weights and f32)
    monkeypatch.setattr(gpu(), "gemv_layout", "lanes")
    monkeypatch.setenv("FLOE_WEBGPU_UNROLL", unroll)
    monkeypatch.setenv("FLOE_WEBGPU_WIDE", wide)
    for weights in ("f16", "dense"):
        webgpu, cpu = tiny("qwen2-bias", default_checkpoint.tokenizer, weights=weights)
        prompt = list(range(40, 90))
        assert close(webgpu.prefill(prompt), cpu.prefill(prompt))
        assert close(webgpu.decode_step(9), cpu.decode_step(9))


def test_a_gpus_lanes_layout_takes_the_six_a_layer_plan_unless_told_to_go_deep(monkeypatch):
    llama, one_band = KNOWN_SHAPES["llama-3.2-1b"], 1 << 31
    monkeypatch.delenv("FLOE_WEBGPU_DEEP", raising=False)
    assert webgpu_decoder.deep_fused(llama, one_band, "f16", "threads")
    assert not webgpu_decoder.deep_fused(llama, one_band, "f16", "lanes")
    assert planned_dispatches(llama, one_band, weights="f16", layout="lanes") == 2 + 6 * 16
    monkeypatch.setenv("FLOE_WEBGPU_DEEP", "1")
    assert webgpu_decoder.deep_fused(llama, one_band, "f16", "lanes")


def test_the_1b_shape_decodes_in_at_most_60_dispatches_where_its_layer_matrices_fit_a_binding():
    one_band, lavapipe = 1 << 31, 128 << 20
    llama = KNOWN_SHAPES["llama-3.2-1b"]
    assert planned_dispatches(llama, one_band) == 2 + 3 * 16 == 50
    assert planned_dispatches(llama, lavapipe, weights="f16") == 4 + 3 * 16 + 4 == 56  # the head in 4 bands
    assert planned_dispatches(llama, lavapipe) == 8 + 3 * 16 + 8 == 64  # f32: in 8
    assert planned_dispatches(llama, one_band, fused=False) == 2 + 9 * 16 + 1  # the head's norm apart
    assert planned_dispatches(llama, one_band, storage_buffers=8) == 2 + 6 * 16  # no room for attend_out
    smollm2 = KNOWN_SHAPES["smollm2-135m"]
    assert planned_dispatches(smollm2, one_band) == 2 + 3 * smollm2.n_layers


def test_the_kv_cache_reads_back_and_loads_exactly_and_a_bad_digest_leaves_the_slot_empty(default_checkpoint):
    from floe.engine import copyhash

    webgpu, cpu = tiny("llama-tied", default_checkpoint.tokenizer, n_slots=2)
    prompt = list(range(100, 170))
    webgpu.prefill(prompt)
    cpu.prefill(prompt)
    k, v = webgpu.cache.export(0)
    k_cpu, v_cpu = cpu.cache.export(0)
    assert all(close(a, b) for a, b in zip(k + v, k_cpu + v_cpu, strict=True))
    webgpu.cache.load(1, k, v, prompt, digests=copyhash.digests(k + v))
    k1, v1 = webgpu.cache.export(1)
    assert all(torch.equal(a, b) for a, b in zip(k + v, k1 + v1, strict=True))
    assert torch.equal(webgpu.decode_step(3, slot=1), webgpu.decode_step(3, slot=0))
    bad = copyhash.digests(k + v)
    bad[2] = "0" * 32
    with pytest.raises(KVDigestMismatch):
        webgpu.cache.load(1, k, v, prompt, digests=bad)
    assert webgpu.kv_len(1) == 0 and webgpu.cache.tokens[1] == []


def test_each_forward_copies_its_rows_in_and_one_logits_row_out_and_nothing_in_place(default_checkpoint):
    webgpu, _ = tiny("llama-tied", default_checkpoint.tokenizer)
    vocab = webgpu.config.vocab_size
    assert not webgpu.logits_in_place
    assert webgpu.output_transfer(1) == ("logits webgpu→host (mapped readback buffer)", 4 * vocab)
    assert webgpu.output_transfer(37)[1] == 4 * vocab  # a prompt reads back its last row only
    assert input_bytes(1) == 32 and input_bytes(1, batch_rows=4) == 20  # the rows' 16 bytes + a header
    assert input_bytes(CHUNK + 1) == 16 * (CHUNK + 1) + 2 * 16  # two submits, a header each
    out = torch.full((vocab,), float("nan"))
    logits = webgpu.decode_step(5, logits_out=out)
    assert logits.data_ptr() == out.data_ptr() and not out.isnan().any()


# ---- the default model (SmolLM2-135M) ---------------------------------------------------------------


@pytest.fixture(scope="module")
def webgpu_engine(default_checkpoint):
    return Engine(default_checkpoint, device="webgpu", max_seq_len=512, n_slots=2)


@pytest.fixture(scope="module")
def cpu_engine(default_checkpoint):
    return Engine(default_checkpoint, max_seq_len=512, n_slots=2)  # float32, dense: the reference


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_on_webgpu_equal_the_cpu_float32_path(webgpu_engine, cpu_engine, prompt):
    replies = []
    for engine in (webgpu_engine, cpu_engine):
        with Actor(engine, system_prompt=SYSTEM) as actor:
            replies.append(actor.send(prompt, max_tokens=8).stats.token_ids)
    assert replies[0] == replies[1]
    assert len(replies[0]) >= 6


def test_two_actors_at_once_reply_as_each_alone(webgpu_engine, cpu_engine):
    from floe.bench import together

    alone = []
    for prompt in PROMPTS:
        with Actor(cpu_engine, system_prompt=SYSTEM) as actor:
            alone.append(actor.send(prompt, max_tokens=5).stats.token_ids)
    actors = [Actor(webgpu_engine, system_prompt=SYSTEM) for _ in PROMPTS]
    try:  # both turns in the engine loop at once: batched decode rows (and prompts) on WebGPU
        sends = [lambda a=a, p=p: a.send(p, max_tokens=5) for a, p in zip(actors, PROMPTS, strict=True)]
        replies, _ = together(sends)
    finally:
        for actor in actors:
            actor.close()
    assert [r.stats.token_ids for r in replies] == alone


def test_a_snapshot_frozen_on_webgpu_thaws_on_the_cpu_and_back(webgpu_engine, cpu_engine, tmp_path):
    turns = ["Name a colour.", "And another one?", "Which of them is darker?"]
    # Straight through on the float32 reference, which WebGPU's greedy tokens equal (three turns on
    # lavapipe took ~50-100 s of CI's time); four tokens a turn, each turn's cache carried by the snapshot
    with Actor(cpu_engine, system_prompt=SYSTEM) as actor:
        straight = [actor.send(t, max_tokens=4).stats.token_ids for t in turns]
    with Actor(webgpu_engine, system_prompt=SYSTEM) as actor:
        first = actor.send(turns[0], max_tokens=4).stats.token_ids
        snapshot.freeze(actor, tmp_path / "webgpu.safetensors")
    with snapshot.thaw(cpu_engine, tmp_path / "webgpu.safetensors") as on_cpu:
        second = on_cpu.send(turns[1], max_tokens=4).stats.token_ids
        snapshot.freeze(on_cpu, tmp_path / "cpu.safetensors")
    with snapshot.thaw(webgpu_engine, tmp_path / "cpu.safetensors") as back:
        kv = back.ledger.boundaries["KV host→webgpu cache slot (queue.write_buffer) (hashed on the host "
                                    "first)"]
        assert kv.copies == 1 and kv.bytes_copied == webgpu_engine.kv_len(back.slot) * (
            webgpu_engine.cache.bytes_per_token)
        third = back.send(turns[2], max_tokens=4).stats.token_ids
    assert [first, second, third] == straight


def test_the_ledger_shows_every_logits_readback_and_the_copy_into_guest_memory(webgpu_engine):
    vocab = webgpu_engine.config.vocab_size
    with Actor(webgpu_engine, builtin_guest("constrained"), system_prompt=SYSTEM) as actor:
        reply = actor.send(PROMPTS[0], max_tokens=4)
    rows = reply.ledger.boundaries
    readback = rows["logits webgpu→host (mapped readback buffer)"]
    into_guest = next(b for name, b in rows.items() if name.startswith("engine→guest logits"))
    assert "in place" not in into_guest.name
    assert readback.copies == into_guest.copies == reply.stats.forwards >= len(reply.stats.token_ids)
    assert readback.bytes_copied == into_guest.bytes_copied == readback.copies * 4 * vocab
    rows_in = reply.ledger.boundaries["step rows host→webgpu (queue.write_buffer)"]
    assert rows_in.copies == reply.stats.forwards


@pytest.mark.slow
def test_floe_run_on_webgpu_replies_as_on_the_cpu(capsys):
    from floe.cli import main

    replies = []
    for device in ("webgpu", "cpu"):
        assert main(["run", PROMPTS[0], "--device", device, "--weights", "fp32", "--max-tokens", "4",
                     "--context", "256", "--system", SYSTEM, "--json"]) == 0
        replies.append(json.loads(capsys.readouterr().out))
    assert replies[0]["token_ids"] == replies[1]["token_ids"]
    assert [r["device"] for r in replies] == ["webgpu", "cpu"]  # (the WebGPU run said "cpu")
    assert any(b["name"].startswith("logits webgpu→host") for b in replies[0]["boundaries"])


@pytest.mark.slow
def test_floe_serve_on_webgpu_answers_as_floe_run_on_the_cpu(capsys, tmp_path):
    """`floe serve --device webgpu` (its own processes; the official openai client): a streamed chat and
    the same chat again in its session's next turn, each greedy reply the CPU's."""
    import socket
    import subprocess
    import sys
    import time

    import openai

    from floe.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = ["serve", "--device", "webgpu", "--port", str(port), "--context", "256", "--max-sessions", "2",
               "--snapshots", str(tmp_path), "--log-level", "error"]
    server = subprocess.Popen([sys.executable, "-m", "floe.cli", *command], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0,
                               timeout=600)
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, server.stderr.read().decode()[-2000:]
            try:
                model = client.models.list().data[0].id
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "floe serve --device webgpu did not start"
                time.sleep(1)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPTS[0]}]
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0,
                                                stream=True, extra_body={"session_id": "w"})
        first = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        messages += [{"role": "assistant", "content": first}, {"role": "user", "content": PROMPTS[1]}]
        second = client.chat.completions.create(model=model, messages=messages[-1:], max_tokens=4,
                                                temperature=0, extra_body={"session_id": "w"})
    finally:
        server.terminate()
        server.wait(60)
    assert main(["run", PROMPTS[0], "--device", "cpu", "--weights", "fp32", "--max-tokens", "4",
                 "--context", "256", "--system", SYSTEM, "--json"]) == 0
    assert first == json.loads(capsys.readouterr().out)["text"]
    assert second.choices[0].message.content and second.usage.prompt_tokens > 20  # (the turn before)


@pytest.mark.parametrize("name", ["llama-tied", "gemma2-like"])
def test_floe_profile_on_webgpu_counts_its_planned_dispatches_against_its_ceilings(default_checkpoint, name):
    """`floe profile --device webgpu`'s measurements (profile_turn) on a small random model: the
    dispatches a decode step and a prompt record, fused and unfused (the ablation), are the planned
    ones; the ceilings are the adapter's (a copy's bandwidth, the GEMM shader's rate); the ledger shows
    the logits readback and a snapshot's KV; the report prints."""
    import dataclasses
    import io

    from rich.console import Console

    from floe.profiling import profile_turn
    from floe.report import print_report

    # (the default model's vocabulary: the chat guest's prompt is its tokenizer's)
    config = dataclasses.replace(CONFIGS[name], vocab_size=default_checkpoint.config.vocab_size)
    checkpoint = random_checkpoint(config, default_checkpoint.tokenizer, dtype=torch.float32, scale=0.1)
    r = profile_turn(checkpoint, "Hi", device="webgpu", max_tokens=3, fusion="both", repeats=1, context=256)
    c, binding = checkpoint.config, gpu().max_binding
    assert r["device"] == "webgpu" and r["dispatches"]["counted"] == "webgpu_dispatches"
    fused, unfused = r["ablation"]
    assert r["dispatches"]["decode_per_token"] == fused["decode_dispatches_per_token"] == planned_dispatches(
        c, binding, True)
    assert unfused["decode_dispatches_per_token"] == planned_dispatches(c, binding, False)
    prompt = r["run"]["prompt_tokens"]  # (a prompt's chunks each record the layers and, last, the head)
    assert r["dispatches"]["prefill"] > -(-prompt // CHUNK) * c.n_layers
    roof = r["roofline"]
    assert roof["bandwidth_gb_s"] > 0 and roof["matmul_tflop_s"] > 0 and roof["decode_pct_of_ceiling"] > 0
    names = [b["name"] for b in r["boundaries"]]
    assert any(n.startswith("logits webgpu→host") for n in names), names
    assert any(n.startswith("snapshot read: KV") for n in names), names
    out = io.StringIO()
    print_report(r, Console(file=out, width=160))
    assert "webgpu" in out.getvalue()


def test_commands_that_do_not_run_on_webgpu_yet_refuse_it_as_a_usage_error(capsys):
    from floe.cli import main

    with pytest.raises(SystemExit) as refused:
        main(["bench", "decode", "--device", "webgpu"])
    assert refused.value.code == 2 and "'webgpu'" in capsys.readouterr().err
    assert main(["serve", "--device", "webgpu", "--ray", "local"]) == 1  # (before any model loads)
    assert "--ray runs its replicas on cpu or cuda" in capsys.readouterr().err
    for command in ("run", "serve", "profile"):  # weights WebGPU does not store, before any model loads
        args = [command, *(["hi"] if command != "serve" else []), "--device", "webgpu", "--weights", "native"]
        assert main(args) == 1
        assert "--weights native: --device webgpu runs fp32 or f16" in capsys.readouterr().err
    assert main(["run", "hi", "--device", "cpu", "--weights", "f16"]) == 1
    assert "f16 is WebGPU's storage" in capsys.readouterr().err
