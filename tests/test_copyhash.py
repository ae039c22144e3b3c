"""The copy-and-hash routine that checks snapshots while they load: its digests are xxhash's XXH3-128,
its copies are exact, with the built C++ routine and with the Python fallback alike."""

import numpy as np
import pytest
import torch
import xxhash
from toolchain import has_compiler

from floe.engine import copyhash


@pytest.fixture(params=["native", "python"])
def flavour(request, monkeypatch):
    if request.param == "native":
        if copyhash.library() is None:
            if has_compiler():  # a machine that can build it must: a broken build fails here
                pytest.fail(f"the native routine did not build: {copyhash.unavailable_reason()}")
            pytest.skip("no C++ compiler on this machine")
    else:
        monkeypatch.setattr(copyhash, "library", lambda: None)
    return request.param


def arrays():
    rng = np.random.default_rng(7)
    return [rng.integers(0, 256, n, dtype=np.uint8) for n in (0, 1, 31, 4096, 262_145, 5_000_001)]


def test_digests_are_xxh3_128_of_the_bytes(flavour):
    data = arrays()  # more than copyhash.SMALL bytes: hashed by the threads; the first few: here
    assert copyhash.digests(data) == [xxhash.xxh3_128_hexdigest(a) for a in data]
    assert copyhash.digests(data[:4]) == [xxhash.xxh3_128_hexdigest(a) for a in data[:4]]
    t = torch.arange(1000, dtype=torch.float32).to(torch.bfloat16)
    assert copyhash.digests([t]) == [xxhash.xxh3_128_hexdigest(t.view(torch.uint8).numpy())]


def test_pieces_are_copied_exactly_and_hashed_as_one_tensor(flavour):
    data = arrays()
    out = [np.zeros_like(a) for a in data]
    pieces = [[(a[:len(a) // 3], o[:len(a) // 3]), (a[len(a) // 3:], o[len(a) // 3:])]
              for a, o in zip(data, out, strict=True)]
    job = copyhash.Job(pieces)
    for t in range(len(data)):
        job.wait(t)
        assert np.array_equal(out[t], data[t])  # in place once its flag is up
    assert job.digests() == [xxhash.xxh3_128_hexdigest(a) for a in data]


@pytest.mark.parametrize("total_mb", [5, 9])
def test_copies_are_exact_with_plain_and_with_streaming_stores(flavour, total_mb):
    """A job of at most 8 MB copies with plain stores (its destination left in the caches), a larger one
    with non-temporal stores: both land every byte, at any alignment of source and destination."""
    rng = np.random.default_rng(total_mb)
    n = total_mb * 2**20 // 3
    data = [rng.integers(0, 256, n + k, dtype=np.uint8)[k:] for k in (0, 1, 7)]  # (unaligned starts)
    out = [np.zeros(len(a) + 5, np.uint8)[3:3 + len(a)] for a in data]
    assert copyhash.Job([[(a, o)] for a, o in zip(data, out, strict=True)]).digests() == [
        xxhash.xxh3_128_hexdigest(a) for a in data]
    assert all(np.array_equal(o, a) for o, a in zip(out, data, strict=True))


def test_pieces_that_do_not_fit_are_refused():
    a = np.zeros(10, np.uint8)
    with pytest.raises(ValueError, match="contiguous uint8"):
        copyhash.Job([[(a, np.zeros(9, np.uint8))]])
    with pytest.raises(ValueError, match="contiguous uint8"):
        copyhash.Job([[(np.zeros((4, 4), np.uint8)[:, :2], None)]])


def test_two_jobs_at_once_both_finish_exactly(flavour):
    data = arrays()
    outs = [[np.zeros_like(a) for a in data] for _ in range(2)]
    # the second starts while the first (probably) still runs: it gets threads of its own
    jobs = [copyhash.Job([[(a, o)] for a, o in zip(data, out, strict=True)]) for out in outs]
    want = [xxhash.xxh3_128_hexdigest(a) for a in data]
    assert [job.digests() for job in reversed(jobs)] == [want, want]
    assert all(np.array_equal(o, a) for out in outs for o, a in zip(out, data, strict=True))


def test_heads_copy_into_a_strided_cache_slot_as_piece_by_piece_does(flavour):
    # A CPU KV cache's slot: [layers, slots, heads, positions, dim]; a snapshot's tensor: [heads, n, dim]
    # contiguous. Job.heads computes each head's addresses from the strides: the same bytes land, and
    # the same digests come out, as the piece-by-piece job's; nothing outside the slot's n positions
    # (or another slot) is written.
    rng = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        cache = torch.zeros(3, 2, 4, 16, 8, dtype=dtype)
        src = [torch.randn(4, 5, 8, generator=rng).to(dtype) for _ in range(3)]
        dst = [cache[i, 1, :, :5] for i in range(3)]
        digests = copyhash.Job.heads(src, dst).digests()
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(d, s)
        assert not cache[:, 0].any() and not cache[:, 1, :, 5:].any()
        again = [torch.zeros_like(cache[i, 1, :, :5]) for i in range(3)]  # (the pieces' own job: contiguous)
        pieces = [[(copyhash.as_bytes(s[h]), copyhash.as_bytes(a[h])) for h in range(4)]
                  for s, a in zip(src, again, strict=True)]
        assert digests == copyhash.Job(pieces).digests()
        assert digests == [xxhash.xxh3_128_hexdigest(s.contiguous().view(torch.uint8).numpy()) for s in src]
    assert copyhash.Job.heads([], []).digests() == []


def test_heads_that_do_not_fit_are_refused():
    cache = torch.zeros(2, 4, 16, 8)
    with pytest.raises(ValueError, match="one shape and dtype"):
        copyhash.Job.heads([torch.zeros(4, 6, 8)], [cache[0, :, :5]])  # more positions than the slot's part
    with pytest.raises(ValueError, match="one shape and dtype"):
        copyhash.Job.heads([torch.zeros(4, 5, 8, dtype=torch.bfloat16)], [cache[0, :, :5]])
    with pytest.raises(ValueError, match="one shape and dtype"):
        copyhash.Job.heads([torch.zeros(8, 5, 4).transpose(0, 2)], [cache[0, :, :5]])  # not contiguous
    with pytest.raises(ValueError, match="one shape and dtype"):
        copyhash.Job.heads([torch.zeros(4, 5, 4)], [cache[0, :, :5, :4]])  # a head's rows not contiguous
