"""The CUDA path, on a machine with a GPU (skipped elsewhere). Random seeded weights; the tokenizer
is the default model's, or the folder named by FLOE_TEST_TOKENIZER (tokenizer.json)."""

import os
from pathlib import Path

import pytest
import torch
from graph_steps import (
    arrivals_beside_fed_rows_answer_as_unfed,
    fed_rows_equal_host_fed,
    greedy_steps,
    prompts_ride_as_prefilled_alone,
    sampled_turns_answer_as_plain_steps,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(scope="module")
def tokenizer():
    folder = os.environ.get("FLOE_TEST_TOKENIZER")
    if folder:
        from floe.model.hf_folder import tokenizer_from_folder

        return tokenizer_from_folder(Path(folder), {})
    from floe.model import load_checkpoint

    return load_checkpoint().tokenizer


@pytest.fixture(scope="module")
def engines(tokenizer):
    from floe.engine import Engine
    from floe.model.synthetic import random_checkpoint

    # Larger weights than an initialiser's give peaked logits, so greedy choices are not near-ties.
    ckpt = random_checkpoint("smollm2-135m", tokenizer, dtype=torch.float32, scale=0.08)
    return {
        "cpu": Engine(ckpt, max_seq_len=512),
        "eager": Engine(ckpt, device="cuda", max_seq_len=512, cuda_graphs=False),
        "graph": Engine(ckpt, device="cuda", max_seq_len=512, n_slots=2, cuda_graphs=True,
                        fused_kernels=False),
    }


def stream(engine, n=24):
    engine.kv_truncate(0)
    logits = engine.prefill(list(range(100, 140)))
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = engine.decode_step(out[-1])
    engine.kv_truncate(0)
    return out, logits.float().cpu().clone()


def test_graph_replay_and_eager_decode_agree(engines):
    eager_tokens, eager_logits = stream(engines["eager"])
    graph_tokens, graph_logits = stream(engines["graph"])
    assert eager_tokens == graph_tokens
    torch.testing.assert_close(graph_logits, eager_logits, atol=1e-3, rtol=1e-3)


def test_cuda_logits_match_the_cpu_fp32_path(engines):
    cpu_tokens, cpu_logits = stream(engines["cpu"])
    cuda_tokens, cuda_logits = stream(engines["graph"])
    assert cpu_tokens[:8] == cuda_tokens[:8]
    assert ((cuda_logits - cpu_logits).norm() / cpu_logits.norm()) < 1e-2


def test_guest_logits_land_in_guest_memory_from_the_gpu(engines):
    from guests_wat import LOGITS_IN_PLACE

    from floe.actor import Actor

    engine = engines["graph"]
    with Actor(engine, LOGITS_IN_PLACE) as actor:
        actor.send("x")
        in_guest = actor.region.torch(65536, engine.config.vocab_size, torch.float32).clone()
    slot = engine.claim_slot()
    expected = engine.prefill([17], slot).cpu()
    engine.release_slot(slot)
    torch.testing.assert_close(in_guest, expected)


def test_probe_zero_copy_on_cuda_has_pointer_identity():
    from floe.probe import probe_zero_copy

    r = probe_zero_copy("cuda")
    assert r["pointer_identity"] and r["gemm_mismatches"] == 0
    assert r["pointers"]["device_pointer"] == r["pointers"]["region_base"]


def test_snapshot_migrates_between_cpu_and_cuda(engines, tmp_path):
    from floe import snapshot
    from floe.actor import Actor

    with Actor(engines["cpu"]) as a:
        a.send("Tell me about the sea.", max_tokens=6)
        snapshot.freeze(a, tmp_path / "cpu.safetensors")
        expected = a.send("And the sky?", max_tokens=8).stats.token_ids
    with snapshot.thaw(engines["graph"], tmp_path / "cpu.safetensors") as b:
        assert b.send("And the sky?", max_tokens=8).stats.token_ids[:4] == expected[:4]


def test_a_cuda_thaw_continues_identically_and_refuses_a_damaged_kv_byte(engines, tmp_path):
    """Same device and dtype: the thawed actor continues token for token; a damaged KV byte is
    named, and nothing is created (the slot stays free)."""
    import json
    import struct

    from floe import snapshot
    from floe.actor import Actor
    from floe.snapshot import SnapshotCorrupt

    engine = engines["graph"]
    with Actor(engine) as a:
        a.send("Tell me about the sea.", max_tokens=6)
        snapshot.freeze(a, tmp_path / "a.safetensors")
        expected = a.send("And the sky?", max_tokens=8).stats.token_ids
    with snapshot.thaw(engine, tmp_path / "a.safetensors") as b:
        assert {"KV host→pinned (hashed in the same pass)", "KV pinned→cuda (DMA)",
                "KV cuda staging→cache slot"} <= set(b.ledger.boundaries)  # every copy of the load shown
        assert b.send("And the sky?", max_tokens=8).stats.token_ids == expected
    data = bytearray((tmp_path / "a.safetensors").read_bytes())
    (n,) = struct.unpack_from("<Q", data, 0)
    start, end = json.loads(data[8:8 + n])["kv.2.k"]["data_offsets"]
    data[8 + n + (start + end) // 2] ^= 0x10
    (tmp_path / "bad.safetensors").write_bytes(bytes(data))
    free = engine.slots.free
    with pytest.raises(SnapshotCorrupt, match="kv.2.k"):
        snapshot.thaw(engine, tmp_path / "bad.safetensors")
    assert engine.slots.free == free


@pytest.mark.parametrize("pinned", [False, True])
@pytest.mark.parametrize("staging", ["one group", "a group per tensor"])
def test_a_checked_load_onto_the_gpu_lands_exactly_in_groups_too(engines, monkeypatch, staging, pinned):
    """Host tensors through the pinned buffer (hashed as they land) into a slot, in one group or,
    with a tiny staging buffer, a group per tensor; tensors already in pinned memory (the store's
    pinned tier) sent from there, hashed where they lie; a wrong digest leaves the slot empty."""
    from floe.engine import copyhash, kvcache

    if staging != "one group":
        monkeypatch.setattr(kvcache, "STAGING_BYTES", 1)
    engine = engines["graph"]
    c, n = engine.config, 37
    g = torch.Generator().manual_seed(3)
    k = [torch.randn(c.n_kv_heads, n, c.head_dim, generator=g).to(engine.dtype) for _ in range(c.n_layers)]
    v = [torch.randn(c.n_kv_heads, n, c.head_dim, generator=g).to(engine.dtype) for _ in range(c.n_layers)]
    if pinned:
        k, v = [t.pin_memory() for t in k], [t.pin_memory() for t in v]
    digests = copyhash.digests(k + v)
    slot = engine.claim_slot()
    try:
        load = engine.cache.start_load(k, v, digests)
        try:
            assert (load.direct, load.staged) == (pinned, not pinned)
        finally:  # (a load holds the GPU's staging lock until it is finished or closed)
            load.into(slot, list(range(n)))
        got_k, got_v = engine.cache.export(slot)
        assert engine.kv_len(slot) == n
        assert all(torch.equal(a.cpu(), b) for a, b in zip(got_k + got_v, k + v, strict=True))
        for wrong in (len(digests) - 1, 0):
            bad = [*digests]
            bad[wrong] = "0" * 32
            with pytest.raises(kvcache.KVDigestMismatch):
                engine.cache.load(slot, k, v, list(range(n)), bad)
            assert engine.kv_len(slot) == 0
    finally:
        engine.release_slot(slot)


def test_a_thaw_from_the_pinned_tier_is_checked_where_it_lies(engines, tmp_path):
    """A session in the store's pinned tier thaws onto the GPU straight from that memory, hashed there:
    it continues token for token; a KV byte damaged in the tier's memory is refused, the slot left free."""
    import json
    import struct

    from floe.actor import Actor
    from floe.snapshot import SnapshotCorrupt, encode
    from floe.snapshot.store import DiskTier, PinnedTier, SnapshotStore

    engine = engines["graph"]
    with Actor(engine) as a:
        a.send("Tell me about the sea.", max_tokens=6)
        data = encode(a)
        expected = a.send("And the sky?", max_tokens=8).stats.token_ids
    pinned = PinnedTier(1 << 30)
    store = SnapshotStore([pinned, DiskTier(tmp_path / "home")], owner="t")
    store.put("s", data)
    with store.thaw("s", engine) as b:
        assert any("hashed where it lies" in x for x in b.ledger.boundaries)
        assert b.send("And the sky?", max_tokens=8).stats.token_ids == expected
    held = pinned._held["s"][0]  # (the tier's pinned memory, as numpy bytes)
    (n,) = struct.unpack_from("<Q", data, 0)
    start, end = json.loads(data[8:8 + n])["kv.2.k"]["data_offsets"]
    held[8 + n + (start + end) // 2] ^= 0x10
    free = engine.slots.free
    with pytest.raises(SnapshotCorrupt, match="kv.2.k"):
        store.thaw("s", engine)
    assert engine.slots.free == free


def test_fused_triton_decode_tracks_the_eager_step(engines, tokenizer):
    from floe.engine import Engine

    fused = Engine(engines["eager"].checkpoint, device="cuda", max_seq_len=512, fused_kernels=True)
    (eager_tokens, eager_logits), (fused_tokens, fused_logits) = stream(engines["eager"]), stream(fused)
    assert eager_tokens == fused_tokens
    torch.testing.assert_close(fused_logits, eager_logits, atol=2e-3, rtol=2e-3)


def first_step_logits(engine):
    engine.kv_truncate(0)
    engine.prefill(list(range(100, 140)))
    logits = engine.decode_step(7).float().cpu().clone()
    engine.kv_truncate(0)
    return logits


def test_fused_kernels_in_bfloat16_are_as_close_to_fp32_as_eager_bf16(tokenizer):
    """bf16 streams of different kernels diverge by rounding; what must hold is that the fused step
    is no further from the fp32 result than PyTorch's own bf16 step."""
    from floe.engine import Engine
    from floe.model.synthetic import random_checkpoint

    ckpt = random_checkpoint("smollm2-135m", tokenizer, dtype=torch.bfloat16, device="cuda", scale=0.08)
    reference = first_step_logits(Engine(ckpt, device="cuda", dtype="float32", max_seq_len=512,
                                         cuda_graphs=False))
    errors = {}
    for name, kwargs in (("eager", {"cuda_graphs": False}), ("fused", {"fused_kernels": True})):
        engine = Engine(ckpt, device="cuda", dtype="bfloat16", max_seq_len=512, **kwargs)
        errors[name] = float((first_step_logits(engine) - reference).norm() / reference.norm())
    assert errors["fused"] <= 1.5 * errors["eager"] + 1e-3, errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_heads,n_kv,hd,pos", [(9, 3, 64, 0), (32, 8, 64, 200), (32, 8, 128, 1000),
                                                 (14, 2, 64, 63)])
def test_split_decode_attention_matches_softmax_attention(dtype, n_heads, n_kv, hd, pos):
    from floe.engine import triton_kernels as tk

    torch.manual_seed(pos)
    bucket = 1024
    q = torch.randn(n_heads, hd, device="cuda", dtype=dtype)
    k = torch.randn(n_kv, bucket, hd, device="cuda", dtype=dtype)
    v = torch.randn(n_kv, bucket, hd, device="cuda", dtype=dtype)
    p = torch.tensor([pos], device="cuda")
    out = tk.decode_attention(q, k, v, p, n_kv, bucket).view(n_heads, hd).float()
    group = n_heads // n_kv
    keys = k[:, : pos + 1].float().repeat_interleave(group, 0)
    values = v[:, : pos + 1].float().repeat_interleave(group, 0)
    probs = torch.softmax((q.float()[:, None, :] @ keys.transpose(1, 2)) * hd**-0.5, dim=-1)
    ref = (probs @ values)[:, 0]
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_heads,n_kv,hd,start,n", [(9, 3, 64, 0, 300), (32, 8, 64, 0, 512),
                                                     (32, 8, 128, 700, 260), (14, 2, 64, 63, 129)])
def test_flash_prompt_attention_matches_causal_softmax_attention(dtype, n_heads, n_kv, hd, start, n):
    """One prompt's rows at positions start..start+n-1 of slot 1 (padding rows after them, as a
    prompt graph pads), each over keys 0..its own position of its slot only."""
    from floe.engine import triton_kernels as tk

    torch.manual_seed(start + n)
    rows, seq = n + 37, 1024  # 37 padding rows: position 0, slot -1
    q = torch.randn(rows, n_heads, hd, device="cuda", dtype=dtype)
    k = torch.randn(3, n_kv, seq, hd, device="cuda", dtype=dtype)
    v = torch.randn(3, n_kv, seq, hd, device="cuda", dtype=dtype)
    pos = torch.cat([torch.arange(start, start + n), torch.zeros(rows - n, dtype=torch.long)]).cuda()
    slots = torch.cat([torch.full((n,), 1), torch.full((rows - n,), -1)]).cuda()
    out = tk.flash_prompt_attention(q, k, v, pos, slots, n_kv)[:n].view(n, n_heads, hd).float()
    group = n_heads // n_kv
    keys = k[1, :, : start + n].float().repeat_interleave(group, 0)  # [H, L, hd]
    values = v[1, :, : start + n].float().repeat_interleave(group, 0)
    scores = (q[:n].float().transpose(0, 1) @ keys.transpose(1, 2)) * hd**-0.5  # [H, n, L]
    visible = torch.arange(start + n, device="cuda")[None, :] <= pos[:n, None]
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    ref = (probs @ values).transpose(0, 1)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def test_argmax_matches_torch_and_takes_the_first_of_ties():
    from floe.engine import triton_kernels as tk

    for n in (49152, 128256, 151936):
        x = torch.randn(n, device="cuda")
        assert int(tk.argmax(x)) == int(torch.argmax(x))
    x = torch.zeros(128256, device="cuda")
    x[[70000, 5000, 90000]] = 3.0
    assert int(tk.argmax(x)) == 5000


def test_native_quantized_weights_are_refused_on_cuda(tokenizer):
    from floe.engine import Engine
    from floe.errors import FloeError
    from floe.model.synthetic import random_checkpoint

    ckpt = random_checkpoint("smollm2-135m", tokenizer, dtype=torch.float32)
    with pytest.raises(FloeError, match="native quantized weights run on the CPU"):
        Engine(ckpt, device="cuda", max_seq_len=64, weights="native")


@pytest.fixture(scope="module")
def batching(engines):
    from floe.engine import Engine

    return Engine(engines["eager"].checkpoint, device="cuda", max_seq_len=512, n_slots=4, fused_kernels=True)


def test_batched_decode_matches_each_slot_decoded_alone(batching):
    engine = batching
    assert engine.batched_decode
    slots = [engine.claim_slot() for _ in range(3)]  # 3 rows: padded to the 4-row graph
    try:
        prompts = [list(range(100, 105)), list(range(7, 47)), list(range(300, 600))]  # crosses a bucket
        alone_tokens, alone_logits = greedy_steps(engine, slots, prompts, 8, batched=False)
        tokens, logits = greedy_steps(engine, slots, prompts, 8, batched=True)
        assert tokens == alone_tokens
        for a, b in zip(alone_logits, logits, strict=True):
            torch.testing.assert_close(torch.stack(b), torch.stack(a), atol=1e-3, rtol=1e-3)
        # one row alone and three padded to four: the same batched step (one step for B = 1 and N)
        assert {size for size, _, prefill in engine._batch.graphs if not prefill} == {1, 4}
        free = ({0, 1, 2, 3} - set(slots)).pop()
        assert engine.cache.k[:, free].count_nonzero() == 0  # the padding row wrote no cache
    finally:
        for s in slots:
            engine.release_slot(s)


def test_fed_rows_launched_before_their_token_is_known_equal_steps_fed_from_the_host(batching):
    fed_rows_equal_host_fed(batching, [list(range(100, 105)), list(range(7, 47)), list(range(300, 420))])


def test_warm_up_captures_every_graph_and_leaves_slots_empty(batching):
    batching.warm_up()
    graphs = batching._batch.graphs
    assert max(batching._batch.mixed_sizes) > 256  # (a burst's prompts at a short context: more rows
    # than one slot's bucket holds, captured over several slots)
    for bucket in (256, 512):
        mixed = set(batching._batch.mixed_sizes)
        assert {size for size, b, prefill in graphs if b == bucket and not prefill} == {1, 2, 4} | mixed
        assert {size for size, b, prefill in graphs if b == bucket and prefill} == {2, 4, 8, 16, 32, 64,
                                                                                   128, 256}
    assert set(batching._batch.draw_graphs) == {1, 2, 4}
    assert batching.cache.lengths == [0, 0, 0, 0] and len(batching.slots.free) == 4


def test_graphs_left_for_later_are_captured_beside_decoding_slots(engines):
    """warm_up(graphs="first") captures the smallest KV bucket's graphs of the batched step (a model
    loaded on demand answers sooner); warm_up_graphs_later captures the others in another thread while
    slots decode, one graph at a time under the step lock in slots free then. The decoding slots' tokens
    and logits are those of a wholly warmed engine's; a graph whose slots are taken waits for them; then
    the graphs are a whole warm-up's."""
    import threading

    from floe.engine import Engine

    def made():
        return Engine(engines["eager"].checkpoint, device="cuda", max_seq_len=1024, n_slots=4,
                      fused_kernels=True)

    full, engine = made(), made()
    full.warm_up()
    engine.warm_up(graphs="first")
    first, whole = set(engine._batch.graphs), set(full._batch.graphs)
    assert first < whole and {bucket for _, bucket, _ in first} == {0, 256}  # (0: the long-prompt graph)
    assert engine.warm_up_graphs_later(_set_event()) == 0  # stopped at once
    prompts = [list(range(100, 105)), list(range(300, 560))]  # the second crosses into the 512 bucket
    slots = [full.claim_slot() for _ in prompts]
    want_tokens, want_logits = greedy_steps(full, slots, prompts, 12, batched=True)
    del full
    slots = [engine.claim_slot() for _ in prompts]
    captured = []
    later = threading.Thread(target=lambda: captured.append(engine.warm_up_graphs_later(retry_s=0.05)))
    later.start()
    try:
        tokens, logits = greedy_steps(engine, slots, prompts, 12, batched=True)
        assert later.is_alive()  # (the 4-row graphs wait for the slots these rows hold)
    finally:
        for s in slots:
            engine.release_slot(s)
    later.join(120)
    assert tokens == want_tokens
    for a, b in zip(want_logits, logits, strict=True):
        torch.testing.assert_close(torch.stack(b), torch.stack(a), atol=1e-3, rtol=1e-3)
    assert captured and captured[0] > 0
    assert set(engine._batch.graphs) == whole  # (the 4-row graphs once the rows gave their slots back)
    assert engine.warm_up_graphs_later() == 0
    assert engine.cache.lengths == [0, 0, 0, 0] and len(engine.slots.free) == 4


def _set_event():
    import threading

    stop = threading.Event()
    stop.set()
    return stop


def test_short_prompts_prefill_as_one_graph_replay_like_the_eager_forward(engines, batching):
    eager = engines["eager"]
    for n in (1, 5, 40, 256, 300):  # 300: longer than a prefill graph: the fused layers eagerly
        ids = [(13 * i) % 900 + 3 for i in range(n)]
        eager.kv_truncate(0)
        expected = eager.prefill(ids).float().cpu()
        slot = batching.claim_slot()
        try:
            got = batching.prefill(ids, slot).float().cpu().clone()
            assert batching.greedy_token(slot) == int(got.argmax())
            follow = batching.decode_step(int(got.argmax()), slot).float().cpu()
            eager_follow = eager.decode_step(int(expected.argmax())).float().cpu()
        finally:
            batching.release_slot(slot)
        torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(follow, eager_follow, atol=2e-3, rtol=2e-3)


def test_scheduled_actors_on_cuda_batch_and_answer_as_alone(batching):
    """Four ABI v2 actors through one engine loop: batched steps answer as rows stepped one by one."""
    import threading

    from floe.actor import Actor, EngineLoop
    from floe.engine import SamplingParams

    questions = ["Hello there.", "What is two plus two?", "Name a river.", "Tell me a story."]

    ledgers = {}

    def run(loop):
        actors = [Actor(batching, loop=loop) for _ in questions]
        replies = [None] * len(actors)

        def work(i):
            reply = actors[i].send(questions[i], max_tokens=16, params=SamplingParams(0.0))
            replies[i] = reply.stats.token_ids
            ledgers[loop.batch, i] = reply.ledger

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(actors))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for a in actors:
            a.close()
        return replies

    alone = run(EngineLoop(batching, batch=False))
    sizes = []
    batched = run(EngineLoop(batching, on_step=sizes.append))
    assert batched == alone and all(alone)
    assert max(sizes) > 1
    # The ledger shows what a batched step copied host→device: each row's share of the input block.
    shared = [b for (was_batched, _), ledger in ledgers.items() if was_batched
              for name, b in ledger.boundaries.items() if name.startswith("batched step inputs")]
    block = batching._batch.host_in[0].nbytes  # one of the two pinned input buffers
    assert shared and all(0 < b.bytes_copied / b.calls <= block / 2 for b in shared)
    alone_rows = [b for (was_batched, _), ledger in ledgers.items() if not was_batched
                  for name, b in ledger.boundaries.items() if name.startswith("batched step inputs")]
    assert alone_rows and all(b.bytes_copied == b.calls * block for b in alone_rows)


def test_a_long_prompt_after_a_prefix_runs_the_fused_layers_like_the_eager_forward(engines, batching):
    """A prompt longer than a prefill graph appended to a slot that already holds a context (its
    attention masked to each row's prefix) gives the eager forward's logits, greedy choice and cache."""
    eager = engines["eager"]
    first = [(7 * i) % 800 + 5 for i in range(40)]
    second = [(11 * i) % 900 + 3 for i in range(290)]
    eager.kv_truncate(0)
    eager.prefill(first)
    expected = eager.prefill(second).float().cpu()
    slot = batching.claim_slot()
    try:
        batching.prefill(first, slot)
        got = batching.prefill(second, slot).float().cpu().clone()
        assert batching.greedy_token(slot) == int(got.argmax()) == int(expected.argmax())
        n = len(first) + len(second)
        torch.testing.assert_close(batching.cache.k[:, slot, :, :n].float().cpu(),
                                   eager.cache.k[:, 0, :, :n].float().cpu(), atol=2e-3, rtol=2e-3)
    finally:
        batching.release_slot(slot)
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)


def test_prompts_riding_along_decode_rows_equal_their_own_prefill(batching):
    prompts_ride_as_prefilled_alone(batching, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("pick, driver", [(True, False), (False, True), (True, True)])
def test_a_mixed_steps_head_on_its_kept_rows_and_the_drivers_launch_step_as_before(engines, monkeypatch, pick,
                                                                                   driver):
    """BatchGraphDecoder.PICK_LOGITS (a mixed step's head only on the rows that keep logits) and the launch
    through the driver with the GIL held (FLOE_GIL_LAUNCH: floe.engine.cuda_launch) give the logits and
    greedy choices of the plain step: a decode row with two prompts riding, then batched decode steps."""
    from floe.engine import Engine, cuda_launch
    from floe.engine.cuda_graph import BatchGraphDecoder

    def engine(pick: bool, driver: bool) -> Engine:
        monkeypatch.setattr(BatchGraphDecoder, "PICK_LOGITS", pick)
        monkeypatch.setattr(cuda_launch, "ENABLED", driver)
        made = Engine(engines["eager"].checkpoint, device="cuda", max_seq_len=512, n_slots=4,
                      fused_kernels=True)
        graph = made._batch_decoder()
        assert (graph.pick > 0) == pick and (graph._driver is not None) == driver
        return made

    def run(e: Engine):
        slots = [e.claim_slot() for _ in range(3)]
        try:
            a, b, c = slots
            first = int(e.prefill(list(range(100, 130)), a).argmax())
            step = e.launch_batch([first], [a], [(list(range(7, 47)), b), (list(range(300, 317)), c)])
            mixed = [r.float().cpu().clone() for r in e.finish_batch(step) + step.prompt_results]
            greedy = [e.greedy_token(s) for s in slots]
            for s in slots:
                e.kv_truncate(0, s)
            tokens, logits = greedy_steps(e, slots, [list(range(100, 105)), list(range(7, 47)),
                                                     list(range(300, 600))], 6, batched=True)
            return mixed, greedy, tokens, [torch.stack(rows) for rows in logits]
        finally:
            for s in slots:
                e.kv_truncate(0, s)
                e.release_slot(s)

    got, want = run(engine(pick, driver)), run(engine(False, False))
    assert got[1] == want[1] and got[2] == want[2]
    for a, b in zip([*got[0], *got[3]], [*want[0], *want[3]], strict=True):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)


def test_a_burst_of_prompts_fills_the_padded_mixed_graph_beside_the_decode_rows(batching):
    """ride_room: the prompt rows a step of D decode rows takes along fill the graph it replays (padded to
    a captured size) rather than MIXED_ROWS of it; prompts of more rows than MIXED_ROWS in all ride in
    one replay and each gets its own prefill's logits."""
    graph = batching._batch_decoder()
    sizes = {*graph.sizes, *graph.mixed_sizes}
    for d in (1, 2, 3, 4):
        room = batching.ride_room(d)
        assert room >= graph.MIXED_ROWS and d + room in sizes
    slots = [batching.claim_slot() for _ in range(4)]
    try:
        a, *others = slots
        first = int(batching.prefill(list(range(100, 130)), a).argmax())
        lengths = (200, 200, 100)
        prompts = [(list(range(5 + 300 * k, 5 + 300 * k + lengths[k])), s) for k, s in enumerate(others)]
        assert sum(len(p) for p, _ in prompts) > graph.MIXED_ROWS
        assert sum(len(p) for p, _ in prompts) <= batching.ride_room(1)
        step = batching.launch_batch([first], [a], prompts)
        assert [k for k, _ in step.chunks] == [0, 1, 2]  # all three ride in the step's replay
        together = [r.float().cpu().clone() for r in batching.finish_batch(step) + step.prompt_results]
        for s in slots:
            batching.kv_truncate(0, s)
        first = int(batching.prefill(list(range(100, 130)), a).argmax())
        alone = [batching.decode_step(first, a).float().cpu().clone()]
        alone += [batching.prefill(p, s).float().cpu().clone() for p, s in prompts]
        for got, want in zip(together, alone, strict=True):
            torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    finally:
        for s in slots:
            batching.kv_truncate(0, s)
            batching.release_slot(s)


def test_prompts_arriving_while_others_decode_leave_the_decode_rows_beside_them_fed(batching):
    arrivals_beside_fed_rows_answer_as_unfed(batching)


def test_draws_on_the_device_follow_the_distribution_without_a_sync_for_candidates():
    """sample_rows on CUDA (a fixed number of nucleus candidates, no host sync until the readback)
    follows the float64 reference as the CPU's does, flat rows drawn again over everything included."""
    from test_sampling import GRID, PARAMS, reference

    from floe.engine.sampling import SamplingParams, sample_rows

    u = (torch.arange(GRID, dtype=torch.float64) + 0.5) / GRID
    flat = torch.zeros(8192)
    flat[:3] = 12.0
    cases = [(torch.tensor([2.0, 1.5, 1.4, 0.3, -0.2, -1.0, -3.0, 0.9, 1.1, -0.5]), p) for p in PARAMS]
    cases.append((flat, SamplingParams(1.0, top_p=0.995)))
    for logits, p in cases:
        tokens = sample_rows(logits.cuda().expand(GRID, -1), [p] * GRID, u)
        shares = torch.bincount(torch.tensor(tokens), minlength=len(logits)).double() / GRID
        expected = reference(logits, p)
        assert torch.allclose(shares[:10], expected[:10], atol=1.5 / GRID), p
        assert abs(shares[10:].sum() - expected[10:].sum()) < 1.5 / GRID, p


def test_sampled_turns_speculate_with_the_steps_own_draw_and_answer_as_plain_steps(batching):
    """On CUDA the engine loop overlaps: a chat guest that takes the host's draw (made by the step on
    the device) is speculated with it, or fed it (graph_steps.sampled_turns_answer_as_plain_steps)."""
    overlapped, _ = sampled_turns_answer_as_plain_steps(batching)
    # The chat guest took every draw it was speculated with: a row is undone only at a turn's end (EOS).
    assert overlapped.undone <= 4


def test_draws_for_guests_with_logits_in_their_memory_and_without_share_a_step(batching):
    """Sampled turns taking the host's choice, one with its logits written into its own memory (on the
    host) and one without (on the GPU), arriving together: their first draws are made in one batch."""
    import threading

    import wasmtime

    from floe.actor import Actor, EngineLoop
    from floe.engine import SamplingParams

    in_memory = wasmtime.wat2wasm("""
(module
  (import "floe" "prefill" (func $prefill (param i32 i32 i32) (result i32)))
  (import "floe" "choice_at" (func $choice_at (param i32) (result i32)))
  (memory (export "memory") 16)
  (func (export "floe_abi_version") (result i32) (i32.const 2))
  (func (export "alloc") (param i32) (result i32) (i32.const 2048))
  (func (export "on_message") (param i32 i32) (result i32)
    (drop (call $choice_at (i32.const 64)))
    (i32.store (i32.const 4096) (i32.const 17))
    (call $prefill (i32.const 4096) (i32.const 1) (i32.const 65536)))
  (func (export "on_token") (result i32) (i32.load (i32.const 64))))""")
    loop = EngineLoop(batching)
    out = {}
    start = threading.Barrier(4)

    def work(i, guest):
        with Actor(batching, guest, loop=loop, seed=i) as actor:
            start.wait()
            out[i] = actor.send("Hello there.", max_tokens=6, params=SamplingParams(0.9)).stats

    threads = [threading.Thread(target=work, args=(i, in_memory if i % 2 else None)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(out) == [0, 1, 2, 3] and all(s.generated_tokens == 6 or s.finish_reason == "stop"
                                               for s in out.values())


def test_two_engines_on_one_gpu_step_in_turn_and_answer_as_alone(engines, tokenizer):
    """Two models on one GPU (issue 44): a lone session on one engine while six stream on another
    (tests/test_device_sharing.py's share()): it answers as alone, neither engine starves."""
    from test_device_sharing import BUSY, TIMELINE, longest_run, share

    from floe.engine import Engine
    from floe.model.synthetic import random_checkpoint

    ckpt = random_checkpoint("smollm2-135m", tokenizer, dtype=torch.float32, scale=0.08)
    busy = Engine(ckpt, device="cuda", max_seq_len=512, n_slots=BUSY, cuda_graphs=True, fused_kernels=False)
    alone, shared, window = share(busy, engines["graph"])
    print(f"lone {window.count('lone')} steps, busy {window.count('busy')}; most in a row: busy "
          f"{longest_run(window, 'busy')}, lone {longest_run(window, 'lone')}")
    if TIMELINE:  # each step's loop, rows and ms since the lone session's first step (GPU steps are short)
        start = next((t for name, t, _ in TIMELINE if name == "lone"), TIMELINE[0][1])
        print(" ".join(f"{name[0]}{rows}@{1e3 * (t - start):.1f}" for name, t, rows in TIMELINE))
    assert shared == alone
    assert window.count("busy") >= 1
    assert longest_run(window, "busy") <= 8
