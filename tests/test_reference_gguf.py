"""floe against an independent reference: transformers loading the same GGUF, CPU, fp32."""

import pytest
import torch

from floe.engine import Engine
from floe.model.checkpoint import Checkpoint, permute_rotary_rows

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers larger than 100 and say why they are prime.",
    "Traduis en français : « The cat sleeps on the warm windowsill. »",
]


@torch.no_grad()
def reference_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' own forward with its KV cache, argmax each step, straight through EOS."""
    out = model(torch.tensor([ids]), use_cache=True)
    tokens = []
    for _ in range(n):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def engine_greedy(engine: Engine, ids: list[int], n: int) -> list[int]:
    """floe's argmax stream straight through EOS (the raw model, not generate()'s stopping)."""
    tokens = []
    logits = engine.prefill(ids)
    for _ in range(n):
        tokens.append(int(logits.argmax()))
        logits = engine.decode_step(tokens[-1])
    engine.kv_truncate(0)
    return tokens


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_first_logits_and_64_greedy_tokens_match_transformers(prompt, default_engine, reference_model):
    ids = default_engine.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    slot = 0
    default_engine.kv_truncate(0, slot)
    with torch.no_grad():
        ref_logits = reference_model(torch.tensor([ids])).logits[0, -1]
    ours = default_engine.prefill(ids, slot)
    assert (ours - ref_logits).abs().max().item() <= 1e-3

    default_engine.kv_truncate(0, slot)
    assert engine_greedy(default_engine, ids, 64) == reference_greedy(reference_model, ids, 64)


@pytest.mark.slow
def test_raw_gguf_qk_order_with_half_split_rotary_gives_different_output(
    default_checkpoint, default_engine, reference_model
):
    """Why the loader un-permutes Q/K: keeping llama.cpp's row order with half-split rotary
    produces a different (fluent-looking, wrong) model."""
    c = default_checkpoint.config
    raw = dict(default_checkpoint.weights)
    for i in range(c.n_layers):
        for name, heads in (("wq", c.n_heads), ("wk", c.n_kv_heads)):
            key = f"layers.{i}.attention.{name}.weight"
            raw[key] = permute_rotary_rows(raw[key], heads)
    wrong = Engine(Checkpoint(**{**default_checkpoint.__dict__, "weights": raw}), max_seq_len=256)
    ids = wrong.tokenizer.encode_chat([{"role": "user", "content": PROMPTS[0]}])
    with torch.no_grad():
        ref_logits = reference_model(torch.tensor([ids])).logits[0, -1]
    assert (wrong.prefill(ids) - ref_logits).abs().max().item() > 1.0
    wrong.kv_truncate(0)
    assert engine_greedy(wrong, ids, 24) != reference_greedy(reference_model, ids, 24)


@pytest.mark.slow
def test_bfloat16_engine_tracks_float32(default_checkpoint, default_engine):
    from floe.model import load_checkpoint

    bf16 = Engine(load_checkpoint(default_checkpoint.source, torch.bfloat16), dtype="bfloat16",
                  max_seq_len=256)
    ids = bf16.tokenizer.encode_chat([{"role": "user", "content": PROMPTS[0]}])
    default_engine.kv_truncate(0)
    ref = default_engine.prefill(ids)
    default_engine.kv_truncate(0)
    ours = bf16.prefill(ids)
    assert ours.dtype == torch.float32
    assert int(ours.argmax()) == int(ref.argmax())
    assert torch.nn.functional.cosine_similarity(ours, ref, dim=0) > 0.99
