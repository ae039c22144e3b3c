"""The sampler: each row's draw follows softmax(logits / temperature) cut to top_k, then to the top_p
nucleus, checked against a direct float64 reference with a grid of uniforms (deterministic: the share
of a grid of N uniforms that lands on a token is its probability within 1/N)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from floe.engine.sampling import SamplingParams, draw_uniforms, sample_rows, sample_token

GRID = 4000


def reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution the sampler must follow, written the obvious way (a full sort)."""
    probs = torch.softmax(logits.double() / p.temperature, -1)
    values, order = torch.sort(probs, descending=True)
    if 0 < p.top_k < len(values):
        values[p.top_k:] = 0
    values = values / values.sum()
    values = values * ((values.cumsum(-1) - values) < p.top_p)
    out = torch.zeros_like(probs)
    out[order] = values / values.sum()
    return out


def grid_shares(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    u = (torch.arange(GRID, dtype=torch.float64) + 0.5) / GRID
    tokens = sample_rows(logits.expand(GRID, -1), [p] * GRID, u)
    return torch.bincount(torch.tensor(tokens), minlength=len(logits)).double() / GRID


PARAMS = [SamplingParams(1.0), SamplingParams(0.7), SamplingParams(2.5), SamplingParams(1.0, top_k=3),
          SamplingParams(1.0, top_p=0.8), SamplingParams(0.8, top_k=5, top_p=0.9),
          SamplingParams(1.0, top_k=1), SamplingParams(3.0, top_p=1e-6)]


@pytest.mark.parametrize("counted", [True, False], ids=["host", "kernels"])
@pytest.mark.parametrize("p", PARAMS, ids=str)
def test_draws_follow_the_cut_distribution(p, counted, monkeypatch):
    import floe.engine.sampling as sampling

    monkeypatch.setattr(sampling, "HOST_DRAWS", ("cpu",) if counted else ())
    logits = torch.tensor([2.0, 1.5, 1.4, 0.3, -0.2, -1.0, -3.0, 0.9, 1.1, -0.5])
    assert torch.allclose(grid_shares(logits, p), reference(logits, p), atol=1.5 / GRID)


@pytest.mark.parametrize("counted", [True, False], ids=["host", "kernels"])
def test_a_flat_row_whose_nucleus_is_past_its_likely_tokens_is_still_exact(counted, monkeypatch):
    """The nucleus search looks at the likely tokens first (counted on the CPU; a fixed number of
    candidates on CUDA, tried here too); a row where those fall short of top_p (a few strong tokens
    over a long, nearly flat tail) is drawn again over all of them."""
    import floe.engine.sampling as sampling

    monkeypatch.setattr(sampling, "HOST_DRAWS", ("cpu",) if counted else ())
    logits = torch.zeros(8192)
    logits[:3] = 12.0  # 3 tokens at ~e^12 each: ~0.983 of the mass at temperature 1; the tail holds ~0.017
    p = SamplingParams(1.0, top_p=0.995)
    shares, expected = grid_shares(logits, p), reference(logits, p)
    assert expected[3:].sum() > 0.005  # part of the tail is in the nucleus
    assert torch.allclose(shares[:3], expected[:3], atol=1.5 / GRID)
    assert abs(shares[3:].sum() - expected[3:].sum()) < 1.5 / GRID


@pytest.mark.parametrize("counted", [True, False], ids=["host", "kernels"])
def test_a_row_nothing_can_be_drawn_from_gets_minus_3(counted, monkeypatch):
    """Also where its top_k is past the candidates (a row flagged to be drawn again stays -3)."""
    import floe.engine.sampling as sampling

    monkeypatch.setattr(sampling, "HOST_DRAWS", ("cpu",) if counted else ())
    good = torch.linspace(0, 4, 3000)
    bad = [torch.full((3000,), float("-inf")), good.clone(), good.clone()]
    bad[1][7], bad[2][7] = float("nan"), float("inf")
    logits = torch.stack([*bad, good])
    for p in (SamplingParams(1.0), SamplingParams(1.0, top_p=0.5), SamplingParams(1.0, top_k=2000)):
        tokens = sample_rows(logits, [p] * 4, torch.full((4,), 0.5, dtype=torch.float64))
        assert tokens[:3] == [-3, -3, -3] and 0 <= tokens[3] < 3000, p


def test_a_top_k_past_the_candidates_beside_a_top_p_row_keeps_all_its_k(monkeypatch):
    """A batch of a top_p row (no top_k) and a top_k row larger than the candidates looked at first:
    the top_k row still draws among its whole top k (the CUDA path's candidate count covers it)."""
    import floe.engine.sampling as sampling

    monkeypatch.setattr(sampling, "HOST_DRAWS", ())
    logits = torch.linspace(0, 3, 8192)  # nearly flat: ranks past 1024 carry real mass
    p_top, p_k = SamplingParams(1.0, top_p=0.9), SamplingParams(1.0, top_k=2000)
    u = (torch.arange(GRID, dtype=torch.float64) + 0.5) / GRID
    tokens = sample_rows(logits.expand(2 * GRID, -1), [p_top, p_k] * GRID, u.repeat_interleave(2))
    shares = torch.bincount(torch.tensor(tokens[1::2]), minlength=8192).double() / GRID
    expected = reference(logits, p_k)
    ranked = torch.argsort(logits, descending=True)
    assert expected[ranked[1024:]].sum() > 0.3
    assert abs(shares[ranked[1024:]].sum() - expected[ranked[1024:]].sum()) < 1.5 / GRID


def test_masked_tokens_are_never_drawn_and_extreme_temperatures_hold():
    logits = torch.tensor([1.0, float("-inf"), 0.5, float("-inf"), 0.2])
    for p in (SamplingParams(1.0), SamplingParams(1.0, top_p=0.9), SamplingParams(3.4e38),
              SamplingParams(1e-30), SamplingParams(1e-30, top_k=2)):
        shares = grid_shares(logits, p)
        assert shares[1] == 0 and shares[3] == 0, p
    assert grid_shares(logits, SamplingParams(1e-30))[0] == 1  # a tiny temperature is the argmax
    assert torch.allclose(grid_shares(logits, SamplingParams(3.4e38))[[0, 2, 4]],
                          torch.full((3,), 1 / 3, dtype=torch.float64), atol=1.5 / GRID)


def test_a_batch_draws_each_row_as_it_would_alone():
    torch.manual_seed(0)
    logits = torch.randn(12, 3000) * 3
    params = [PARAMS[i % len(PARAMS)] for i in range(12)]
    u = torch.rand(12, dtype=torch.float64)
    together = sample_rows(logits, params, u)
    alone = [sample_rows(logits[i:i + 1], params[i:i + 1], u[i:i + 1])[0] for i in range(12)]
    assert together == alone


def test_a_draw_takes_one_uniform_from_the_generator():
    """What a snapshot relies on: the generator's state after n draws depends on n only."""
    a, b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for vocab in (10, 49152):
        sample_token(torch.randn(vocab), SamplingParams(0.9, top_p=0.5), a)
        torch.rand(1, generator=b, dtype=torch.float64)
    assert torch.equal(a.get_state(), b.get_state())
    assert draw_uniforms([a]).item() == draw_uniforms([b]).item()


@pytest.mark.parametrize("p", [*PARAMS, SamplingParams(1.0, top_k=2000), SamplingParams(1.0, top_p=0.995)],
                         ids=str)
def test_the_fixed_shape_draw_a_cuda_graph_holds_follows_the_same_distribution(p):
    """draw_rows (every shape fixed, no host sync: what the CUDA step's draw graph runs) plus
    finish_draw's second draw of its flagged rows gives the distribution sample_rows gives: on short
    rows, a flat row whose nucleus is past the candidates, and a top_k larger than them."""
    from floe.engine.sampling import Draw, draw_rows, finish_draw

    vocab = 8192
    logits = torch.zeros(vocab)
    logits[:3] = 12.0  # the flat tail of test_a_flat_row_whose_nucleus_...
    logits[3:13] = torch.tensor([2.0, 1.5, 1.4, 0.3, -0.2, -1.0, -3.0, 0.9, 1.1, -0.5]) + 10
    u = (torch.arange(GRID, dtype=torch.float64) + 0.5) / GRID
    rows = logits.expand(GRID, -1)
    k = p.top_k if 0 < p.top_k < vocab else vocab
    tokens, wider = draw_rows(rows, torch.full((GRID,), p.temperature, dtype=torch.float64),
                              torch.full((GRID,), p.top_p, dtype=torch.float64), torch.full((GRID,), k), u)
    drawn = finish_draw(Draw(tokens, wider, rows, [p] * GRID, u))
    shares = torch.bincount(torch.tensor(drawn), minlength=vocab).double() / GRID
    expected = reference(logits, p)
    assert torch.allclose(shares[:13], expected[:13], atol=1.5 / GRID)
    assert abs(shares[13:].sum() - expected[13:].sum()) < 1.5 / GRID


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_host_argmax_is_torchs_first_maximum_nan_included(dtype):
    """floe.engine.sampling.host_argmax (numpy's where it can: PyTorch's CPU reduction is not vectorized)
    picks what torch.argmax picks: the first of tied maxima, the first NaN, rows of -inf, one row or many."""
    from floe.engine.sampling import host_argmax

    g = torch.Generator().manual_seed(3)
    rows = torch.randn(6, 4099, generator=g).to(dtype)
    rows[1, [7, 4000]] = 50.0  # a tie
    rows[2, [9, 11]] = float("nan")
    rows[3] = float("-inf")
    rows[4, 0] = float("inf")
    for logits in (rows, rows[:, ::2], rows[5]):
        assert torch.as_tensor(host_argmax(logits)).tolist() == logits.argmax(-1).tolist()


DRAWS = """
import sys, torch
from floe.engine.sampling import SamplingParams, sample_rows
g = torch.Generator().manual_seed(11)
logits = (torch.randn(256, 3000, generator=g) * 3).bfloat16().float()  # (bf16-rounded: many ties)
u = torch.rand(256, generator=g, dtype=torch.float64)
for p in (SamplingParams(0.8, top_p=0.95), SamplingParams(1.0, top_k=40), SamplingParams(0.7)):
    print(sample_rows(logits, [p] * 256, u))
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="names x86-64's vector features")
def test_host_draws_are_the_same_with_other_vector_instructions():
    """A session thawed on another machine draws the same: tied tokens rank by id, not as numpy's sort
    (whose code differs by the CPU's vector instructions) leaves them. The draws of tied bf16-rounded
    logits with top_p, top_k and neither, here and with AVX-512 and AVX2 turned off in numpy."""
    env = {**os.environ, "NPY_DISABLE_CPU_FEATURES": "AVX512_SPR AVX512_ICL X86_V4 X86_V3"}
    here = subprocess.run([sys.executable, "-c", DRAWS], capture_output=True, text=True, check=True)
    older = subprocess.run([sys.executable, "-c", DRAWS], capture_output=True, text=True, check=True, env=env)
    assert here.stdout == older.stdout and here.stdout.count("\n") == 3


def test_a_tiny_temperature_or_huge_logits_draw_without_a_warning():
    """(A warning raised as an error in the engine loop would fail every turn of its step.)"""
    import warnings

    logits = torch.tensor([[3.0e38, -3.0e38, 1.0, 3.0e38], [1.0, 0.5, 0.25, 0.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for p in (SamplingParams(1e-38), SamplingParams(1e-38, top_p=0.5), SamplingParams(3.4e38, top_k=2)):
            tokens = sample_rows(logits, [p, p], torch.tensor([0.99, 0.5], dtype=torch.float64))
            assert tokens[0] in (0, 3) and 0 <= tokens[1] < 4, p
