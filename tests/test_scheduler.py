"""The decode scheduler and Engine.decode_batch on the CPU (where a batch runs its slots in turn, so
every number must equal the unbatched run exactly); the batched CUDA forward is in test_cuda.py."""

import threading
import time

import pytest
import torch

from floe.actor import Actor, DecodeScheduler
from floe.engine import Engine, SamplingParams
from floe.errors import ContextOverflow, FloeError

QUESTIONS = ["What is the capital of France?", "Name a colour.", "Count to three.", "Say hello."]


@pytest.fixture(scope="module")
def engine(default_checkpoint):
    return Engine(default_checkpoint, max_seq_len=256, n_slots=4)


def test_decode_batch_equals_each_slot_stepped_alone(engine):
    slots = [engine.claim_slot() for _ in range(3)]
    try:
        prompts = [list(range(10, 10 + n)) for n in (5, 9, 14)]
        alone = []
        for slot, prompt in zip(slots, prompts, strict=True):
            engine.prefill(prompt, slot)
            alone.append(engine.decode_step(7, slot).clone())
            engine.kv_truncate(len(prompt), slot)
        batched = engine.decode_batch([7, 7, 7], slots)
        for slot, prompt, logits, reference in zip(slots, prompts, batched, alone, strict=True):
            # dense float32 rows: one GEMM for the batch, a GEMV alone (float rounding apart)
            torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-4)
            assert int(logits.argmax()) == int(reference.argmax())
            assert engine.kv_len(slot) == len(prompt) + 1
            assert engine.cache.tokens[slot][-1] == 7
    finally:
        for slot in slots:
            engine.release_slot(slot)


def test_one_slots_error_does_not_stop_the_others(engine):
    full, ok = engine.claim_slot(), engine.claim_slot()
    try:
        engine.prefill(list(range(engine.max_seq_len)), full)
        engine.prefill([1, 2, 3], ok)
        overflow, logits = engine.decode_batch([5, 5], [full, ok])
        assert isinstance(overflow, ContextOverflow)
        assert isinstance(logits, torch.Tensor) and engine.kv_len(ok) == 4
        bad_token, good = engine.decode_batch([engine.config.vocab_size, 6], [ok, full])
        assert isinstance(bad_token, FloeError) and "out of range" in str(bad_token)
        assert isinstance(good, ContextOverflow) and engine.kv_len(ok) == 4
        with pytest.raises(ValueError, match="distinct"):
            engine.decode_batch([1, 2], [ok, ok])
    finally:
        engine.release_slot(full)
        engine.release_slot(ok)


def run_actors(engine, scheduler, guest, max_tokens=12):
    """Four ABI v1 actors answering at once, each in its own thread; their replies in order."""
    actors = [Actor(engine, guest, scheduler=scheduler) for _ in QUESTIONS]
    replies = [None] * len(actors)

    def work(i):
        replies[i] = actors[i].send(QUESTIONS[i], max_tokens=max_tokens, params=SamplingParams(0.0))

    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(actors))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for a in actors:
            a.close()
    return replies


def test_scheduled_actors_batch_their_steps_and_answer_as_alone(engine, chat_v1):
    alone = run_actors(engine, None, chat_v1)
    sizes = []
    scheduler = DecodeScheduler(engine, on_batch=sizes.append)
    batched = run_actors(engine, scheduler, chat_v1)
    assert [r.text for r in batched] == [r.text for r in alone] and all(r.text for r in alone)
    # every decode step went through the scheduler
    assert scheduler.rows == sum(sizes) == sum(len(r.stats.decoded) for r in batched)
    assert max(sizes) > 1  # some forwards advanced several actors at once
    assert not scheduler._expected  # every actor said its message ended


def test_an_actor_whose_message_ended_is_not_waited_for(engine, chat_v1):
    # With a 60 s gather window, a step waiting for the finished actor would stall the test.
    scheduler = DecodeScheduler(engine, gather_s=60.0)
    first, second = Actor(engine, chat_v1, scheduler=scheduler), Actor(engine, chat_v1, scheduler=scheduler)
    try:
        first.send("Say hello.", max_tokens=4, params=SamplingParams(0.0))
        t = time.monotonic()
        reply = second.send("Name a colour.", max_tokens=4, params=SamplingParams(0.0))
        assert reply.stats.generated_tokens >= 1
        assert time.monotonic() - t < 30
    finally:
        first.close()
        second.close()


def test_a_scheduler_of_another_engine_is_refused(engine, default_checkpoint):
    other = Engine(default_checkpoint, max_seq_len=64)
    with pytest.raises(FloeError, match="another engine"):
        Actor(engine, scheduler=DecodeScheduler(other))


def test_batched_step_inputs_pad_with_rows_that_write_nothing():
    """The pinned inputs of a batched graph (written in place each step; the graph runs on CUDA)."""
    import numpy as np

    from floe.engine.cuda_graph import fill_rows

    host = np.full((5, 8), 99, dtype=np.int64)
    fill_rows(host, 4, [11, 12, 13], [5, 9, 2], [0, 3, 1], [0, 3, 1], spare=6)  # decode, 3 of 4 rows
    assert host[:, :4].tolist() == [[11, 12, 13, 0], [5, 9, 2, 0], [0, 3, 1, -1], [0, 3, 1, 6],
                                    [-1, -1, -1, -1]]
    fill_rows(host, 4, [7, 8], [10, 11], [2, 2], [1, 2], spare=6)  # prefill: last row's index, slot
    assert host[:, :4].tolist() == [[7, 8, 0, 0], [10, 11, 0, 0], [2, 2, -1, -1], [1, 2, 6, 6],
                                    [-1, -1, -1, -1]]
    # a device-fed row: its token column is not read; its feed names the logits row holding its token
    fill_rows(host, 2, [0, 5], [3, 4], [1, 0], [1, 0], spare=6, feeds=[8, -1])
    assert host[:, :2].tolist() == [[0, 5], [3, 4], [1, 0], [1, 0], [8, -1]]
    assert (host[:, 4:] == 99).all()  # columns beyond the padded size are not touched


def test_a_mixed_step_picks_the_rows_that_keep_their_logits():
    """A mixed step's head runs on fill_rows' pick: the rows whose logits row is not the spare, then a
    row whose is (as many times as it takes), so that the picked rows' logits are those of the rows."""
    import numpy as np

    from floe.engine.cuda_graph import fill_rows

    host = np.full((6, 12), 99, dtype=np.int64)
    # two decode rows (slots 0, 3), then a 4-token prompt of slot 1 (its last row keeps logits), padded to 8
    rows = [0, 3, 6, 6, 6, 1]
    fill_rows(host, 8, [11, 12, 20, 21, 22, 23], [5, 9, 0, 1, 2, 3], [0, 3, 1, 1, 1, 1], rows, spare=6,
              pick=5)
    assert host[3, :8].tolist() == [0, 3, 6, 6, 6, 1, 6, 6]
    assert host[5, :5].tolist() == [0, 1, 5, 2, 2]  # kept rows, then the first spare row's index
    assert host[3, host[5, :5]].tolist() == [0, 3, 1, 6, 6]
    assert (host[5, 5:] == 99).all()
    # every row kept but the padding's
    fill_rows(host, 4, [1, 2, 3], [0, 0, 0], [0, 1, 2], [0, 1, 2], spare=6, pick=4)
    assert host[5, :4].tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="keep logits"):  # no row left for the spare
        fill_rows(host, 3, [1, 2, 3], [0, 0, 0], [0, 1, 2], [0, 1, 2], spare=6, pick=4)


def test_the_gil_held_launch_falls_back_to_pytorchs_calls_where_it_cannot_run(monkeypatch, caplog):
    """The GIL-held launch (on unless FLOE_GIL_LAUNCH=0) without what the driver's launch needs (here: no
    GPU, or no CUDA driver) is PyTorch's launch calls, said on the log, not an error."""
    import torch

    from floe.engine import cuda_launch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA (tests/test_cuda.py runs the driver's launch)")
    monkeypatch.setattr(cuda_launch, "ENABLED", False)
    assert cuda_launch.driver_launch(torch.device("cuda")) is None
    monkeypatch.setattr(cuda_launch, "ENABLED", True)
    with caplog.at_level("WARNING", logger="floe.engine"):
        assert cuda_launch.driver_launch(torch.device("cuda")) is None
    assert "FLOE_GIL_LAUNCH" in caplog.text
