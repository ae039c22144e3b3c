"""The profiler tells the truth: copies with their exact bytes, zero-copy checked by pointers, exact
dispatch counts, and a `floe profile` report with every field the issue names."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from floe.actor import Actor, builtin_guest
from floe.engine import Engine
from floe.memory import Region
from floe.profile import Ledger, count_dispatches, linear_params, prefill_flops


def test_a_deliberate_copy_shows_exactly_its_bytes():
    ledger = Ledger()
    ledger.copy("a", 100)
    ledger.copy("a", 28, copies=2)
    ledger.share("b", 4096)
    a, b = ledger.boundaries["a"], ledger.boundaries["b"]
    assert (a.calls, a.copies, a.bytes_copied, a.bytes_shared) == (2, 3, 156, 0)
    assert (b.calls, b.copies, b.bytes_copied, b.bytes_shared) == (1, 0, 0, 4096)
    off = Ledger(enabled=False)
    off.copy("a", 1)
    assert off.boundaries == {}


def test_actor_turn_ledger_copies_and_shares(default_engine):
    prompt = "Name a colour."
    with Actor(default_engine, builtin_guest("chat")) as actor:
        reply = actor.send(prompt, max_tokens=6)
    rows = reply.ledger.boundaries
    # The message is copied into guest memory once, exactly its UTF-8 bytes.
    assert rows["host→guest message"].copies == 1
    assert rows["host→guest message"].bytes_copied == len(prompt.encode())
    # The guest's prompt ids reach the engine as a view of guest memory: shared, never copied.
    ids = rows["guest→engine prompt ids"]
    assert ids.copies == 0 and ids.bytes_shared == 4 * reply.stats.prompt_tokens
    # ... and are then widened to int64 for the embedding: one copy of twice the bytes.
    assert rows["prompt ids int32→int64"].bytes_copied == 8 * reply.stats.prompt_tokens


def test_zero_copy_is_checked_against_the_pointers():
    region = Region(1 << 16)
    try:
        view = region.torch(4096, 16, torch.float32)
        assert region.holds(view) and view.data_ptr() == region.base + 4096
        assert not region.holds(view.clone())  # same values, other memory: a copy
        assert not region.holds(torch.empty(16))
    finally:
        region.close()


def test_dispatch_counter_counts_a_known_op_sequence_exactly():
    a, b = torch.randn(64), torch.randn(64)

    def three_ops():
        torch.add(a, b).mul_(2.0).neg()

    counts = count_dispatches(three_ops, "cpu", steps=4)
    assert counts == {"framework_ops": 3.0, "device_kernels": None}


def test_lean_decode_step_dispatches_fewer_ops_than_the_module(default_checkpoint):
    counts = {}
    for fused in (True, False):
        engine = Engine(default_checkpoint, max_seq_len=64, fused_kernels=fused)
        engine.prefill([1, 2, 3])
        counts[fused] = count_dispatches(lambda e=engine: (e.kv_truncate(3), e.decode_step(4)), "cpu")
    assert counts[True]["framework_ops"] < 0.75 * counts[False]["framework_ops"]


def test_prefill_flops_count_the_head_once(default_engine):
    c = default_engine.config
    layers, head = linear_params(c)
    in_layers = sum(p.numel() for name, p in default_engine.model.layers.named_parameters() if p.ndim == 2)
    assert layers == in_layers and head == default_engine.model.output_weight().numel()
    n = 100
    assert prefill_flops(c, n) == 2 * layers * n + 2 * head + 2 * c.n_layers * c.n_heads * c.head_dim * n * n


# `floe` whose profile times the engine's prefill and 32 decode steps once each, with no warm-up (eight
# times each, for both engines of --fusion both: ~10 of the command's ~28 s on 2 cores): the report's
# fields and how they are computed are the command's own, those two figures one sample, not a median.
ENGINE_TIMED_ONCE = ("import sys\n"
                     "from floe.cli import main, polite_openmp\n"
                     "polite_openmp()  # (as main does, before floe.profiling imports torch)\n"
                     "import floe.profiling as profiling\n"
                     "timed = profiling.timed\n"
                     "profiling.timed = lambda fn, repeats, warmup=3: timed(fn, 1, warmup=0)\n"
                     "sys.exit(main(sys.argv[1:]))\n")


@pytest.mark.slow
def test_floe_profile_json_plot_and_html(tmp_path):
    png, html = tmp_path / "roof.png", tmp_path / "report.html"
    proc = subprocess.run(
        [sys.executable, "-c", ENGINE_TIMED_ONCE, "profile", "What is the capital of France?",
         "--max-tokens", "8", "--context", "256", "--fusion", "both", "--json", "--plot", str(png),
         "--html", str(html)],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert {"name", "copies", "bytes", "seconds"} <= set(r["boundaries"][0])
    names = {b["name"] for b in r["boundaries"]}
    assert {"guest→engine prompt ids", "snapshot write (actor → file)"} <= names
    assert any(n.startswith("snapshot read") for n in names)
    assert "snapshot read: KV host→cache slot (hashed in the same pass)" in names  # each copy shown
    d = r["dispatches"]
    assert d["prefill"] > 0 and d["decode_per_token"] > 0 and d["counted"] == "framework_ops"
    roof = r["roofline"]
    for key in ("decode_bytes_per_token", "bandwidth_gb_s", "decode_pct_of_ceiling",
                "prefill_pct_of_ceiling"):
        assert roof[key] > 0
    assert r["weights"]["kind"] == "native"
    assert roof["decode_bytes_per_token"] < 110e6  # packed int4: ~102 MB, not fp32's 538 MB
    on, off = r["ablation"]
    assert on["fusion"] == "on" and off["fusion"] == "off"
    assert on["decode_dispatches_per_token"] < off["decode_dispatches_per_token"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = html.read_text()
    assert page.startswith("<!doctype html>") and "data:image/png;base64," in page
    assert "Fusion ablation" in page
