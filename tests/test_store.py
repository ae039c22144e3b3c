"""The tiered snapshot store (floe.snapshot.store) against a real S3 API on loopback (moto's threaded
server, s3fs): bytes through every tier are the bytes frozen; sessions move down as they idle and up
on use, within each tier's budget and TTL; a writer killed mid-write leaves the previous object; a
second process is refused while a lease runs and takes over once it expires; damaged objects are
refused; export and import round-trip; a thaw through the store continues an actor bit-identically."""

import json
import math
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import s3fs
import torch
from models import VOCAB

from floe import snapshot
from floe.actor import Actor
from floe.engine import SamplingParams
from floe.snapshot import SnapshotCorrupt
from floe.snapshot.errors import LeaseHeld, LeaseLost, SnapshotKeyInvalid, SnapshotNotFound
from floe.snapshot.store import DiskTier, PinnedTier, RemoteTier, SnapshotStore

SAMPLED = SamplingParams(0.8, 0, 0.95, 11)
PART = 5 << 20  # the smallest multipart part S3 takes


# ---- a real S3 API on loopback ------------------------------------------------------------------

@pytest.fixture
def bucket(s3, request):
    words = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()[5:45]).strip("-")
    name = f"floe-{secrets.token_hex(4)}-{words}"
    fs = s3fs.S3FileSystem(**s3)
    fs.call_s3("create_bucket", Bucket=name)
    return name


def spec(kind: str, tmp: Path, s3: dict, bucket: str, **kw) -> dict:
    """A store's description, as JSON (a subprocess builds the same store from it)."""
    return {"kind": kind, "tmp": str(tmp), "s3": s3, "bucket": bucket, **kw}


def make_store(s: dict) -> SnapshotStore:
    """pinned RAM + disk + S3 ("s3"), or pinned RAM + a disk home ("disk")."""
    tmp = Path(s["tmp"])
    tiers: list = [PinnedTier(s.get("pinned_bytes", 64 << 20), s.get("pinned_ttl_s"))]
    if s["kind"] == "s3":
        tiers.append(DiskTier(tmp / "disk", s.get("disk_bytes"), s.get("disk_ttl_s")))
        tiers.append(RemoteTier(f"s3://{s['bucket']}/sessions", tmp / "s3-cache", s.get("home_bytes"),
                                s.get("home_ttl_s"), part_bytes=PART, **s["s3"]))
    else:
        tiers.append(DiskTier(tmp / "home", s.get("home_bytes"), s.get("home_ttl_s")))
    return SnapshotStore(tiers, owner=s.get("owner"), lease_s=s.get("lease_s", 30.0))


# ---- actors --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine():
    from models import tiny_engine

    return tiny_engine(n_slots=4, max_seq_len=512)


@pytest.fixture(scope="module")
def frozen(engine) -> bytes:
    with Actor(engine, seed=5) as actor:
        actor.send("The lighthouse keeper wrote", max_tokens=8)
        return snapshot.encode(actor)


def second_turn(actor: Actor) -> list[int]:
    return actor.send("And then?", max_tokens=12, params=SAMPLED).stats.token_ids


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    """A snapshot file over two multipart parts (~7 MB): ~900 tokens of a 4-layer model, 4 KV heads of 64."""
    from floe.engine import Engine
    from floe.model import default_model_path
    from floe.model.config import ModelConfig
    from floe.model.gguf_file import GGUFFile
    from floe.model.gguf_tokenizer import tokenizer_from_gguf
    from floe.model.synthetic import random_checkpoint

    config = ModelConfig("llama", 256, 4, 4, 4, 512, VOCAB, 1024, name="store-test")
    checkpoint = random_checkpoint(config, tokenizer_from_gguf(GGUFFile(default_model_path()).fields),
                                   dtype=torch.float32, scale=0.5)
    engine = Engine(checkpoint, max_seq_len=1024, n_slots=1)
    path = tmp_path_factory.mktemp("big") / "big.safetensors"
    with Actor(engine) as actor:
        actor.send("the sea " * 430, max_tokens=1)
        snapshot.freeze(actor, path)
    assert path.stat().st_size > PART + (1 << 20)
    return path


# ---- bytes through every tier --------------------------------------------------------------------

def test_bytes_through_each_tier_are_the_bytes_frozen(tmp_path, s3, bucket, frozen):
    store = make_store(spec("s3", tmp_path, s3, bucket, pinned_ttl_s=10, disk_ttl_s=100))
    store.put("alice/chat", frozen)
    assert store.where("alice/chat") == ["pinned", "remote"]  # RAM, and written through to the home
    seen = {"pinned": bytes(store.get("alice/chat").buffer)}
    moved = store.sweep(time.time() + 50)  # idle past RAM's TTL: down to the disk
    assert moved["moved"] == ["alice/chat"] and store.where("alice/chat") == ["disk", "remote"]
    seen["disk"] = bytes(store.get("alice/chat").buffer)
    store.sweep(time.time() + 500)  # past the disk's TTL too: the object store only
    assert store.where("alice/chat") == ["remote"]
    seen["remote"] = bytes(store.get("alice/chat").buffer)
    seen["export"] = b"".join(store.export("alice/chat"))
    assert all(b == frozen for b in seen.values()), [k for k, b in seen.items() if b != frozen]
    raw = s3fs.S3FileSystem(**s3).cat_file(f"{bucket}/sessions/alice/chat.safetensors")
    assert raw == frozen


def test_pinned_tier_keeps_its_budget_least_recently_used_out(tmp_path, s3, bucket, frozen):
    n = len(frozen)
    store = make_store(spec("s3", tmp_path, s3, bucket, pinned_bytes=n * 5 // 2))
    assert store.pinned.pinned == torch.cuda.is_available()  # page-locked only where CUDA exists
    store.put("a", frozen)
    store.put("b", frozen)
    store.get("a")  # a is used after b
    store.put("c", frozen)
    assert {e.key for e in store.pinned.entries()} == {"a", "c"}
    assert store.pinned.nbytes <= n * 5 // 2
    assert store.where("b") == ["disk", "remote"]  # pushed out of RAM: down a tier, not lost
    assert all(bytes(store.get(k).buffer) == frozen for k in "abc")


def test_a_session_moves_down_as_it_idles_and_up_on_its_next_use(tmp_path, s3, bucket, engine):
    store = make_store(spec("s3", tmp_path, s3, bucket, pinned_ttl_s=10, disk_ttl_s=10))
    with Actor(engine, seed=3) as actor:
        actor.send("One", max_tokens=6)
        store.freeze("s", actor)
        expected = second_turn(actor)
    store.sweep(time.time() + 100)
    assert store.where("s") == ["remote"]
    with store.thaw("s", engine) as thawed:  # from the object store, through its local cache
        assert second_turn(thawed) == expected
        store.freeze("s", thawed)
    assert store.where("s") == ["pinned", "remote"]  # its next freeze lands in RAM again


@pytest.mark.parametrize("tier", ["pinned", "disk", "remote"])
def test_thaw_through_the_store_continues_bit_identically(tmp_path, s3, bucket, engine, tier):
    store = make_store(spec("s3", tmp_path, s3, bucket))
    with Actor(engine, seed=9) as actor:
        actor.send("Tell me about the sea.", max_tokens=10, params=SAMPLED)
        store.freeze("t", actor)
        reference = actor.capture_state()
        ref_k = [k.clone() for k in reference.k]
        expected = second_turn(actor)
    if tier != "pinned":
        data = bytes(store.get("t").buffer)
        store.pinned.remove("t")
        if tier == "disk":
            store.tiers[1].put("t", data)
    assert store.where("t")[0] == tier
    with store.thaw("t", engine) as thawed:
        state = thawed.capture_state()
        assert all(torch.equal(a, b) for a, b in zip(state.k, ref_k, strict=True))
        assert second_turn(thawed) == expected


# ---- crashes, leases ------------------------------------------------------------------------------

WRITER = """
import json, sys
sys.path.insert(0, "tests")
from test_store import make_store
s = json.loads(sys.argv[1])
store = make_store(s)
data = open(s["file"], "rb").read()
if s["mode"] == "hold":
    store.put(s["key"], data)
    print(json.dumps({"expires_at": store.acquire(s["key"]).expires_at}), flush=True)
    sys.stdin.read()
else:
    def chunks():
        yield data[: 6 << 20]
        print("mid-write", flush=True)
        sys.stdin.read()  # never returns: the test kills this process here
        yield data[6 << 20:]
    store.import_(s["key"], chunks())
"""


def start_writer(s: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WRITER, json.dumps(s)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent)


@pytest.mark.parametrize("kind", ["disk", "s3"])
def test_a_writer_killed_mid_write_leaves_the_previous_object(tmp_path, s3, bucket, frozen, big, kind):
    s = spec(kind, tmp_path, s3, bucket, owner="parent")
    store = make_store(s)
    store.put("k", frozen)
    store.release("k")  # the writer below takes the session over
    writer = start_writer({**s, "owner": "writer", "mode": "import", "key": "k", "file": str(big)})
    try:
        assert writer.stdout.readline().strip() == "mid-write"
        if kind == "s3":  # the upload is under way: one part of the new object is in the bucket
            fs = s3fs.S3FileSystem(**s3)
            uploads = fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])
            assert [u["Key"] for u in uploads] == ["sessions/k.safetensors"]
        else:  # the new file is half written into its temporary folder
            assert any(p.name.endswith(".floe-tmp") for p in (tmp_path / "home").iterdir())
        writer.send_signal(signal.SIGKILL)
        writer.wait(60)
    finally:
        writer.kill()
    fresh = make_store({**s, "owner": "after"})
    assert bytes(fresh.get("k").buffer) == frozen  # checked in full on the way up
    assert fresh.home.entries()[0].nbytes == len(frozen)


@pytest.mark.parametrize("kind", ["disk", "s3"])
def test_a_second_process_is_refused_while_the_lease_runs_then_takes_over(tmp_path, s3, bucket, engine,
                                                                           kind):
    path = tmp_path / "a.safetensors"
    with Actor(engine, seed=4) as actor:
        actor.send("Where were we?", max_tokens=6)
        snapshot.freeze(actor, path)
        expected = second_turn(actor)
    s = spec(kind, tmp_path, s3, bucket, lease_s=3.0)
    holder = start_writer({**s, "owner": "server-a", "mode": "hold", "key": "k", "file": str(path)})
    try:
        until = json.loads(holder.stdout.readline())["expires_at"]
        b = make_store({**s, "owner": "server-b"})
        with pytest.raises(LeaseHeld) as refused:
            b.thaw("k", engine)
        assert (refused.value.owner, refused.value.expires_at) == ("server-a", until)
        assert "server-a" in str(refused.value)
        with pytest.raises(LeaseHeld):
            b.put("k", path.read_bytes())
        holder.send_signal(signal.SIGKILL)  # a crashed owner's lease runs on until it expires
        holder.wait(60)
    finally:
        holder.kill()
    if time.time() < until:
        with pytest.raises(LeaseHeld):
            b.acquire("k")
    while time.time() <= until:
        time.sleep(0.1)
    with b.thaw("k", engine) as thawed:  # taken over: A's last freeze continues
        assert second_turn(thawed) == expected
    assert b.holder("k")[0] == "server-b"


def test_a_lease_is_renewed_released_and_lost_once_taken_over(tmp_path, s3, bucket, frozen):
    s = spec("s3", tmp_path, s3, bucket, lease_s=1.0)
    a, b = make_store({**s, "owner": "a"}), make_store({**s, "owner": "b"})
    first = a.acquire("k")
    assert a.renew("k").expires_at > first.expires_at
    a.release("k")
    assert b.holder("k") is None
    b.put("k", frozen)  # free at once after a release
    until = b.acquire("k").expires_at
    while time.time() <= until:
        time.sleep(0.1)
    a.acquire("k")  # b's lease expired: taken over
    with pytest.raises(LeaseLost):
        b.renew("k")
    assert b.where("k") == ["remote"]  # b's own RAM copy is no longer trusted: dropped


# ---- refusing damage -----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["disk", "s3"])
def test_a_corrupted_object_is_refused(tmp_path, s3, bucket, engine, frozen, kind):
    s = spec(kind, tmp_path, s3, bucket, owner="w")
    writer = make_store(s)
    writer.put("k", frozen)
    writer.release("k")
    damaged = bytearray(frozen)
    damaged[len(damaged) - 200] ^= 0x10  # one bit in the last tensor
    if kind == "s3":
        s3fs.S3FileSystem(**s3).pipe_file(f"{bucket}/sessions/k.safetensors", bytes(damaged))
    else:
        (tmp_path / "home" / "k.safetensors").write_bytes(damaged)
    store = make_store({**s, "owner": "r"})
    for read in (lambda: store.get("k"), lambda: store.export("k"), lambda: store.thaw("k", engine)):
        with pytest.raises(SnapshotCorrupt, match="checksum mismatch in tensor"):
            read()
    with pytest.raises(SnapshotCorrupt):  # nor is a damaged one taken in
        store.put("other", bytes(damaged))
    with pytest.raises(SnapshotCorrupt):
        store.import_("other", [bytes(damaged)])
    with pytest.raises(SnapshotCorrupt, match="cut short"):
        store.import_("other", [frozen[: len(frozen) // 2]])
    with pytest.raises(SnapshotNotFound):
        store.get("other")


def test_a_damaged_local_cache_copy_is_fetched_again(tmp_path, s3, bucket, engine, frozen):
    s = spec("s3", tmp_path, s3, bucket)
    store = make_store(s)
    store.put("k", frozen)
    store.release("k")
    reader = make_store({**s, "tmp": str(tmp_path / "reader")})
    cached = reader.source("k")  # no lease: read from the object store, through the local cache
    assert cached.read_bytes() == frozen
    damaged = bytearray(frozen)
    damaged[len(damaged) - 200] ^= 0x10
    cached.write_bytes(damaged)  # the object is unchanged: the same ETag
    assert bytes(reader.get("k").buffer) == frozen
    assert cached.read_bytes() == frozen


def test_keys_are_refused_unless_they_name_an_entry(tmp_path, s3, bucket, frozen):
    store = make_store(spec("disk", tmp_path, s3, bucket))
    for key in ("../x", "/x", "a//b", ".hidden", "a/b/c/d/e", "x.lease", ""):
        with pytest.raises(SnapshotKeyInvalid):
            store.put(key, frozen)


# ---- lifecycle ------------------------------------------------------------------------------------

def test_ttl_and_budgets_hold_after_200_entries(tmp_path, s3, bucket, frozen):
    n = len(frozen)
    store = make_store(spec("s3", tmp_path, s3, bucket, pinned_bytes=8 * n, pinned_ttl_s=60,
                            disk_bytes=20 * n, disk_ttl_s=100, home_bytes=50 * n, home_ttl_s=1000))
    for i in range(200):
        one_shot = i % 2 == 0
        store.put(f"{'once' if one_shot else 'named'}-{i:03d}", frozen, persist=not one_shot)
        assert store.pinned.nbytes <= 8 * n
    durable = {e.key for tier in store.tiers[1:] for e in tier.entries()}
    assert len(durable) == 100 and all(k.startswith("named") for k in durable)  # one-shots: RAM only
    report = store.sweep()
    home = [e.key for e in store.home.entries()]
    assert store.pinned.nbytes <= 8 * n and store.tiers[1].nbytes <= 20 * n and len(home) == 50
    assert all(k.startswith("named") for k in home) and "named-199" in home
    assert len(report["deleted"]) == 50 and store.holder(report["deleted"][0]) is None
    store.sweep(time.time() + 2000)  # past every TTL
    assert store.keys() == [] and store.holder("named-199") is None


def test_one_shot_entries_are_not_persisted(tmp_path, s3, bucket, frozen):
    store = make_store(spec("s3", tmp_path, s3, bucket, pinned_ttl_s=10))
    store.put("once", frozen, persist=False)
    assert store.where("once") == ["pinned"] and store.holder("once") is None and store.has("once")
    assert store.sweep(time.time() + 60)["dropped"] == ["once"]
    assert store.keys() == [] and not store.has("once")
    with pytest.raises(SnapshotNotFound):
        store.get("once")


# ---- export, import -------------------------------------------------------------------------------

def test_export_then_import_into_a_fresh_store_continues_identically(tmp_path, s3, bucket, engine):
    source = make_store(spec("s3", tmp_path / "a", s3, bucket))
    with Actor(engine, seed=8) as actor:
        actor.send("Carry this conversation.", max_tokens=8, params=SAMPLED)
        source.freeze("c", actor)
        expected = second_turn(actor)
    exported = b"".join(source.export("c"))
    target = make_store(spec("disk", tmp_path / "b", s3, bucket))
    info = target.import_("c", source.export("c", chunk_bytes=4096))
    assert info["bytes"] == len(exported)
    assert bytes(target.get("c").buffer) == exported == bytes(source.get("c").buffer)
    with target.thaw("c", engine) as thawed:
        assert second_turn(thawed) == expected


def test_a_disk_lease_is_not_flushed_and_one_a_crash_emptied_is_taken_over(tmp_path, monkeypatch):
    """A lease record needs its atomic replace (every process sees the old record or the new), not
    fsync: two of them were most of what opening a new session cost `floe serve`. What a machine's
    crash can leave of such a record, an empty file, is an expired lease; anything else that is not
    a record is still refused."""
    import os

    from floe.snapshot.errors import StoreUnavailable
    from floe.snapshot.lease import FileLeases

    leases = FileLeases(tmp_path)
    synced = []
    monkeypatch.setattr(os, "fsync", synced.append)
    first, _ = leases.acquire("k", "server-a", 60)
    assert synced == [] and leases.holder("k")[0] == "server-a"
    with pytest.raises(LeaseHeld):
        leases.acquire("k", "server-b", 60)
    (tmp_path / "k.lease").write_bytes(b"")  # the machine crashed before the record reached the disk
    taken, continues = leases.acquire("k", "server-b", 60)
    assert leases.holder("k")[0] == "server-b" and not continues and taken.token != first.token
    (tmp_path / "k.lease").write_bytes(b"not a lease")
    with pytest.raises(StoreUnavailable, match="not a lease record"):
        leases.acquire("k", "server-c", 60)


def test_a_disk_lease_write_leaves_no_temporary_and_a_dead_writers_is_cleaned(tmp_path):
    """A lease record goes in place through one temporary file (no folder, no second lock): none is
    left beside the record; one a writer killed mid-write left is removed by clean_stale, and never
    while a live writer holds the lease's turn."""
    from floe.snapshot.atomic import clean_stale, path_lock, temp_name
    from floe.snapshot.lease import FileLeases

    leases = FileLeases(tmp_path)
    lease, _ = leases.acquire("k", "server-a", 60)
    leases.renew(lease, 60)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".floe-lock")) == ["k.lease"]
    turn = tmp_path / "k.lease.cas"
    dead = tmp_path / temp_name(turn)
    dead.write_bytes(b"half a rec")  # what a writer killed before its rename leaves
    with path_lock(turn):  # a live writer's turn: its temporary is not stale
        assert clean_stale(tmp_path) == [] and dead.exists()
    assert clean_stale(tmp_path) == [dead] and not dead.exists()
    assert leases.holder("k")[0] == "server-a"


def test_a_removed_entry_and_a_released_lease_leave_no_lock_sidecar(tmp_path):
    """A store's folder holds a writers'-lock sidecar only beside a file it guards: one left per session
    ever saved (deleted, evicted, refused at upload) piled up empty files without bound, each read by
    every later write's scan of the folder."""
    from floe.snapshot.lease import FileLeases

    tier = DiskTier(tmp_path / "home")
    tier.put("a", b"x" * 100)
    with pytest.raises(ValueError, match="refused"):
        tier.write("refused", iter([b"y"]), RefuseAll())
    names = sorted(p.name for p in (tmp_path / "home").iterdir())
    assert names == [".a.safetensors.floe-lock", "a.safetensors"]
    tier.remove("a")
    leases = FileLeases(tmp_path / "leases")
    lease, _ = leases.acquire("k", "server-a", 60)
    assert leases.release(lease)
    assert list((tmp_path / "home").iterdir()) == [] and list((tmp_path / "leases").iterdir()) == []


class RefuseAll:
    """A stream check that refuses what it is given (an upload found invalid on its way in)."""

    def update(self, chunk: bytes) -> None:
        raise ValueError("refused")

    def finish(self) -> None:
        raise AssertionError("never reached")


def test_a_home_budget_per_group_deletes_only_the_group_that_grew(tmp_path, s3, bucket, frozen):
    """A server's budget is each owner's (group = the key's owner): Alice's fourth session deletes her
    own oldest, never Bob's; without groups the budget is shared and Bob's oldest goes first."""
    n = len(frozen)
    for grouped in (True, False):
        store = make_store(spec("disk", tmp_path / str(grouped), s3, bucket, home_bytes=3 * n))
        store.put("bob/b0", frozen, persist=True)
        for i in range(4):
            store.put(f"alice/a{i}", frozen, persist=True)
            time.sleep(0.01)  # (their last use orders them)
        report = store.sweep(group=(lambda key: key.split("/")[0]) if grouped else None)
        left = sorted(e.key for e in store.home.entries())
        if grouped:
            assert report["deleted"] == ["alice/a0"]
            assert left == ["alice/a1", "alice/a2", "alice/a3", "bob/b0"]
        else:
            assert report["deleted"] == ["bob/b0", "alice/a0"]


def test_a_disk_tiers_listing_passes_over_a_writers_temporary_folder_that_vanishes(tmp_path, frozen,
                                                                                   monkeypatch):
    """The server's upkeep listed the home while a writer's temporary folder went away: rglob raised
    FileNotFoundError and the upkeep failed with a traceback. Dot-folders are not entered now."""
    import os

    tier = DiskTier(tmp_path / "home")
    (tmp_path / "home" / "alice").mkdir(parents=True, exist_ok=True)
    (tmp_path / "home" / "alice" / "a0.safetensors").write_bytes(frozen)
    temporary = tmp_path / "home" / "alice" / ".a1.safetensors.123-floe-tmp"
    temporary.mkdir()
    (temporary / "part.safetensors").write_bytes(b"partial")
    scandir = os.scandir

    def vanishing(path="."):
        if str(path).endswith("floe-tmp"):
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", vanishing)
    assert [e.key for e in tier.entries()] == ["alice/a0"]


@pytest.mark.parametrize("record_bytes", [0, 200 << 10])  # (a header shorter and longer than one read)
def test_a_header_from_the_object_store_is_read_whole_in_one_request_or_two(tmp_path, s3, bucket, engine,
                                                                            record_bytes):
    """RemoteTier.header asks for the first HEADER_READ bytes and reads the rest of a longer header
    (a long conversation's record) with a second request; either way the header is the file's."""
    from floe.snapshot.layout import read_header_buffer
    from floe.snapshot.remote import HEADER_READ

    with Actor(engine, seed=5) as actor:
        actor.send("The lighthouse keeper wrote", max_tokens=4)
        data = bytes(snapshot.encode(actor, app={"note": "x" * record_bytes}))
    header_end = 8 + int.from_bytes(data[:8], "little")
    assert (header_end > HEADER_READ) == bool(record_bytes)
    store = make_store(spec("s3", tmp_path, s3, bucket))
    store.put("k", data)
    tier = store.home
    got = tier.header("k")
    assert got is not None and got.metadata == read_header_buffer(data, tmp_path / "k").metadata
    assert json.loads(got.metadata["app"]) == {"note": "x" * record_bytes}
    assert tier.header("absent") is None


def test_renew_all_extends_every_lease_held_and_names_the_ones_taken_over(tmp_path, s3, bucket, frozen):
    """SnapshotStore.renew_all (the server's upkeep, every lease_s / 3; on an object store several at
    once): every lease this store still holds runs lease_s from now; one another store took over once
    it expired is reported lost, and this store stops trusting its copies of it."""
    a = make_store(spec("s3", tmp_path / "a", s3, bucket, owner="server-a", lease_s=1.0))
    b = make_store(spec("s3", tmp_path / "b", s3, bucket, owner="server-b", lease_s=30.0))
    keys = [f"k{i}" for i in range(6)]
    for key in keys:
        a.put(key, frozen)
    first = {key: a.holder(key)[1] for key in keys}
    time.sleep(1.2)  # every lease of a's has expired (none renewed meanwhile)
    b.acquire("k0")
    assert a.renew_all() == ["k0"]
    assert a.holder("k0")[0] == "server-b" and "k0" not in a.leased()
    for key in keys[1:]:
        owner, expires = a.holder(key)
        assert owner == "server-a" and expires > first[key] + 1.0, key
    assert sorted(a.leased()) == keys[1:]


def test_a_sweep_past_its_time_stops_says_so_and_the_next_goes_on(tmp_path, s3, bucket, frozen):
    """SnapshotStore.sweep(budget_s=): from an object store each deletion is several requests; a sweep
    takes nothing more out once its time has passed since its first (which it always takes: every
    sweep gets on), reports `unfinished`, and the next sweep goes on."""
    store = make_store(spec("s3", tmp_path, s3, bucket, home_ttl_s=10))
    keys = [f"k{i}" for i in range(5)]
    for key in keys:
        store.put(key, frozen)
        store.release(key)
    later = time.time() + 100  # past the home's TTL
    first = store.sweep(later, budget_s=0)  # no time at all: its first deletion only
    assert first["unfinished"] and len(first["deleted"]) == 1 and len(store.keys()) == 4
    delete = store.delete

    def slow_delete(key):  # (each deletion outlasts the sweep's time)
        delete(key)
        time.sleep(0.3)

    store.delete = slow_delete
    second = store.sweep(later, budget_s=0.1)
    assert second["unfinished"] and len(second["deleted"]) == 1
    rest = store.sweep(later)
    assert not rest["unfinished"] and sorted(first["deleted"] + second["deleted"] + rest["deleted"]) == keys
    assert store.keys() == []


def test_a_sweep_tries_an_entry_another_owner_holds_again_only_once_its_lease_ends(tmp_path):
    """Expired home entries another server's lease keeps (sessions live there) are often the oldest:
    each refusal costs the lease's round trips, and a sweep in slices retried them first every time,
    never reaching the expired entry behind them (review of 61071c1)."""
    home = DiskTier(tmp_path / "home", ttl_s=10)
    a = SnapshotStore([home], owner="a", lease_s=30)
    b = SnapshotStore([DiskTier(tmp_path / "home", ttl_s=10)], owner="b", lease_s=30)

    def stored(key: str, age_s: float) -> None:
        path = home.path(key)
        path.write_bytes(b"x" * 64)
        os.utime(path, (time.time() - age_s, time.time() - age_s))

    for i in range(6):
        stored(f"held{i}", 1000 - i)
        b.acquire(f"held{i}")
    stored("free", 500)
    tried, acquire = [], home.leases.acquire

    def round_trip(key, *args):  # (an object store's conditional request)
        tried.append(key)
        time.sleep(0.05)
        return acquire(key, *args)

    home.leases.acquire = round_trip
    reports = [a.sweep(budget_s=0.1) for _ in range(4)]
    assert not home.has("free") and "free" in [k for r in reports for k in r["deleted"]]
    assert sorted(tried) == sorted([f"held{i}" for i in range(6)] + ["free"])  # each held one tried once
    assert all(home.has(f"held{i}") for i in range(6)) and "held0" in reports[-1]["leased"]


def test_the_servers_upkeep_sweeps_a_slice_at_a_time_and_goes_on_at_its_next_round(tmp_path, engine, frozen):
    """The upkeep (floe.server.sessions.upkeep) gives a sweep a sixth of a lease; one it left unfinished
    goes on at the next round (a second later in a server), not a whole sweep_seconds later."""
    from floe.server.sessions import SessionStore, snapshot_store

    snapshots = snapshot_store(tmp_path / "home", ttl_s=0.5, lease_s=0.6)  # a sweep's slice: 0.1 s
    store = SessionStore(engine, snapshots, sweep_seconds=3600)
    try:
        keys = [f"k{i}" for i in range(4)]
        for key in keys:
            snapshots.put(key, frozen)
            snapshots.release(key)
        time.sleep(0.6)  # past the home's TTL
        delete = snapshots.delete

        def slow_delete(key):
            delete(key)
            time.sleep(0.15)

        snapshots.delete = slow_delete
        store.upkeep._swept = -math.inf  # (due now)
        rounds = []
        while snapshots.keys() and len(rounds) < 10:
            rounds.append(store.maintain()["deleted"])
        assert sorted(k for done in rounds for k in done) == keys and len(rounds) == 4, rounds
        assert store.maintain()["deleted"] == []  # done: the next sweep a whole sweep_seconds later
    finally:
        store.close(freeze=False)


def test_renew_all_reports_a_lost_lease_even_where_another_renewal_failed(tmp_path, s3, bucket, caplog):
    """A lost lease is dropped from the store's leases as it is found: renew_all reports it in the same
    round whatever else failed (a store error on another key is logged and that key tried again at the
    next round; the first version of the parallel renew_all raised it and lost the report)."""
    from floe.snapshot.errors import StoreUnavailable

    a = make_store(spec("s3", tmp_path / "a", s3, bucket, owner="server-a", lease_s=1.0))
    b = make_store(spec("s3", tmp_path / "b", s3, bucket, owner="server-b", lease_s=30.0))
    keys = [f"k{i}" for i in range(4)]
    for key in keys:
        a.acquire(key)
    time.sleep(1.2)  # a's leases expired
    b.acquire("k3")  # taken over
    renew = a.home.leases.renew

    def flaky(lease, seconds):  # a transient store error on k0
        if lease.key == "k0":
            raise StoreUnavailable("s3: 503 slow down")
        return renew(lease, seconds)

    a.home.leases.renew = flaky
    with caplog.at_level("WARNING", logger="floe.snapshot"):
        assert a.renew_all() == ["k3"]
    assert "1 of 4 leases were not renewed" in caplog.text and "503 slow down" in caplog.text
    a.home.leases.renew = renew
    assert a.renew_all() == [] and sorted(a.leased()) == ["k0", "k1", "k2"]


def test_an_object_cut_short_at_exactly_one_header_read_is_corrupt(tmp_path, s3, bucket):
    """An object of exactly HEADER_READ bytes whose header claims more is cut short inside its header:
    SnapshotCorrupt, not the store unavailable (a second GET from just past its end was answered 416)."""
    from floe.snapshot.remote import HEADER_READ

    tier = RemoteTier(f"s3://{bucket}/sessions", tmp_path / "cache", **s3)
    data = (100_000).to_bytes(8, "little") + b"{" + b" " * (HEADER_READ - 9)
    tier.fs.pipe_file(f"{bucket}/sessions/k.safetensors", data)
    with pytest.raises(SnapshotCorrupt, match="cut short inside its header"):
        tier.header("k")
