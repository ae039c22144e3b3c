"""Snapshots: an actor frozen to one safetensors file continues bit-for-bit, elsewhere; bad files are
refused with their specific error and nothing half-loaded; hostile files (checksums recomputed over
inconsistent contents, FIFOs, huge header lengths, appended bytes) are SnapshotErrors, never other
exceptions or hangs; a killed writer damages nothing and its temporaries are cleaned; concurrent
writers of one path take turns. The mutation fuzz is tests/test_snapshot_fuzz.py."""

import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import wasmtime
from gguf import GGMLQuantizationType as Q
from models import write_gguf
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from test_snapshot_fuzz import FUZZ_GUEST, join, reseal, same_state, split, tiny_engine, tiny_snapshot

from floe import snapshot
from floe.actor import Actor, ActorState, builtin_guest
from floe.cli import main
from floe.engine import Engine, SamplingParams
from floe.engine.kvcache import KVDigestMismatch
from floe.model import load_checkpoint
from floe.snapshot import (
    Snapshot,
    SnapshotCorrupt,
    SnapshotGuestMismatch,
    SnapshotModelMismatch,
    SnapshotRestoreFailed,
    SnapshotShapeMismatch,
    SnapshotVersionMismatch,
    checksum_v1,
    clean_stale,
    header,
    path_lock,
    seal,
    thaw,
    write,
)
from floe.snapshot.atomic import TEMP_SUFFIX, lock_path
from floe.wasm import GuestLoadError, GuestMemoryLimit, default_runtime

TURNS = ["What is the capital of France?", "And of Italy?", "Which of the two is larger?"]


@pytest.fixture(scope="module")
def engine(default_checkpoint):
    # Native weights, as `floe run` uses by default on the CPU.
    return Engine(default_checkpoint, max_seq_len=1024, n_slots=6, weights="native")


def floe_run(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "floe.cli", "run", *args, "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [[], ["--temperature", "0.8", "--top-p", "0.95", "--seed", "42"]],
                         ids=["greedy", "seeded"])
def test_three_turns_thawed_in_fresh_processes_equal_straight_through(engine, tmp_path, sampling):
    params = SamplingParams(0.8, 0, 0.95, 42) if sampling else SamplingParams()
    with Actor(engine, seed=42 if sampling else 0) as actor:
        straight = [actor.send(t, max_tokens=24, params=params).stats.token_ids for t in TURNS]
    thawed = []
    previous = None
    for i, turn in enumerate(TURNS):
        path = tmp_path / f"turn{i}.safetensors"
        args = [turn, "--max-tokens", "24", *sampling, "--freeze", str(path)]
        if previous:
            args += ["--thaw", str(previous)]
        thawed.append(floe_run(*args)["token_ids"])
        previous = path
    assert thawed == straight
    assert all(len(t) > 2 for t in straight)


def test_snapshot_is_plain_safetensors_with_documented_contents(engine, tmp_path):
    with Actor(engine) as actor:
        actor.send(TURNS[0], max_tokens=8)
        kv_len = engine.kv_len(actor.slot)
        snapshot.freeze(actor, tmp_path / "a.safetensors")  # written straight from the cache's strided views
        k3, v4 = engine.cache.export(actor.slot)[0][3].clone(), engine.cache.export(actor.slot)[1][4].clone()
    plain = load_file(str(tmp_path / "a.safetensors"))  # the library reads every tensor back exactly
    assert torch.equal(plain["kv.3.k"], k3) and torch.equal(plain["kv.4.v"], v4)
    with safe_open(str(tmp_path / "a.safetensors"), framework="np") as f:
        keys, meta = set(f.keys()), f.metadata()
        assert f.get_tensor("kv.0.k").shape == (3, kv_len, 64)
        assert f.get_tensor("tokens").shape == (kv_len,)
    c = engine.config
    assert {f"kv.{i}.{n}" for i in range(c.n_layers) for n in "kv"} <= keys
    assert {"guest.memory", "guest.memory.pages", "guest.globals", "tokens", "sampler.rng"} <= keys
    for field in ("format", "format_version", "abi_version", "model_fingerprint", "guest_sha256",
                  "engine_dtype", "engine_weights", "kv_dtype", "kv_len", "checksum", "checksums",
                  "created_at"):
        assert field in meta
    assert set(json.loads(meta["checksums"])) == keys  # one digest per tensor
    assert meta["format"] == "floe-snapshot" and meta["model_fingerprint"] == engine.fingerprint
    assert int(meta["kv_len"]) == kv_len


@pytest.fixture(scope="module")
def frozen(engine, tmp_path_factory):
    path = tmp_path_factory.mktemp("snap") / "good.safetensors"
    with Actor(engine) as actor:
        actor.send(TURNS[0], max_tokens=8)
        snapshot.freeze(actor, path)
    return path


def rewrite(src: Path, dst: Path, *, meta=None, tensors=None) -> Path:
    """A copy of a snapshot with changed metadata/tensors and a *valid* checksum."""
    with safe_open(str(src), framework="pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
        m = dict(f.metadata())
    m.update(meta or {})
    t.update(tensors or {})
    seal(t, m)
    save_file(t, str(dst), metadata=m)
    return dst


def thaw_fails(engine, path, error, match, **kwargs):
    free = engine.slots.free
    with pytest.raises(error, match=match):
        snapshot.thaw(engine, path, **kwargs)
    assert engine.slots.free == free  # nothing was created or loaded half-way


def test_a_thaw_into_a_fresh_actor_continues_as_a_thaw_into_its_own(engine, frozen, tmp_path):
    """thaw(into=): the snapshot restored into an actor made ahead (a server's spare) continues as a
    thaw that makes its own; an actor of another guest is refused as a programming error; a snapshot
    refused before its state is restored leaves the actor open (the caller's, for a retry), as it was."""
    with snapshot.thaw(engine, frozen) as own:
        expected = own.send(TURNS[1], max_tokens=8).text
    made = Actor(engine)
    with snapshot.thaw(engine, frozen, into=made) as into:
        assert into is made
        assert into.send(TURNS[1], max_tokens=8).text == expected
    assert made.closed
    with Actor(engine, builtin_guest("constrained")) as other:
        with pytest.raises(ValueError, match="fresh, open actor of the snapshot's guest"):
            snapshot.thaw(engine, frozen, into=other)
        assert not other.closed
    data = bytearray(frozen.read_bytes())
    data[-1000] ^= 0x40
    bad = tmp_path / "flipped.safetensors"
    bad.write_bytes(bytes(data))
    with Actor(engine) as spare:
        with pytest.raises(SnapshotCorrupt):
            snapshot.thaw(engine, bad, into=spare)
        assert not spare.closed and spare.send(TURNS[0], max_tokens=2).text is not None


def test_truncated_file(engine, frozen, tmp_path):
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(frozen.read_bytes()[: frozen.stat().st_size // 2])
    thaw_fails(engine, cut, SnapshotCorrupt, "truncated or corrupt")


def test_flipped_byte_fails_the_checksum(engine, frozen, tmp_path):
    data = bytearray(frozen.read_bytes())
    data[-1000] ^= 0x40
    bad = tmp_path / "flipped.safetensors"
    bad.write_bytes(bytes(data))
    thaw_fails(engine, bad, SnapshotCorrupt, "checksum mismatch")


def flip_byte_of(src: Path, dst: Path, tensor: str) -> Path:
    """A copy of src with one byte in the middle of `tensor` flipped (the header left as it was)."""
    data = bytearray(src.read_bytes())
    (n,) = struct.unpack_from("<Q", data, 0)
    start, end = json.loads(data[8:8 + n])[tensor]["data_offsets"]
    data[8 + n + (start + end) // 2] ^= 0x10
    dst.write_bytes(bytes(data))
    return dst


@pytest.mark.parametrize("tensor", ["kv.3.v", "guest.memory", "tokens"])
def test_a_damaged_byte_is_named_by_its_tensor_and_nothing_loads(engine, frozen, tmp_path, tensor):
    bad = flip_byte_of(frozen, tmp_path / "bad.safetensors", tensor)
    thaw_fails(engine, bad, SnapshotCorrupt, f"checksum mismatch in tensor {tensor}")


def test_a_checked_load_hashes_each_kv_tensor_as_landed_and_a_mismatch_leaves_the_slot_empty(engine, frozen):
    snap = Snapshot(frozen, contents=False)
    assert snap.loads_checked(engine.dtype)
    state, names, digests = snap.state(engine.dtype), snap.kv_names(), snap.kv_digests()
    slot = engine.claim_slot()
    try:
        engine.cache.load(slot, state.k, state.v, state.tokens, digests)
        assert engine.kv_len(slot) == snap.kv_len
        k, v = engine.cache.export(slot)
        assert all(torch.equal(a, snap.tensors[n]) for a, n in zip(k + v, names, strict=True))
        wrong = list(digests)
        wrong[names.index("kv.5.v")] = "0" * 32
        with pytest.raises(KVDigestMismatch) as caught:
            engine.cache.load(slot, state.k, state.v, state.tokens, wrong)
        j = names.index("kv.5.v")
        assert caught.value.index == j and caught.value.actual == digests[j]
        assert engine.kv_len(slot) == 0 and engine.cache.tokens[slot] == []
    finally:
        engine.release_slot(slot)


def test_a_thawed_actor_shows_the_kv_copy_it_made(engine, frozen):
    with snapshot.thaw(engine, frozen) as actor:
        snap = Snapshot(frozen)
        kv_bytes = sum(snap.tensors[n].numel() * snap.tensors[n].element_size() for n in snap.kv_names())
        row = actor.ledger.boundaries["KV host→cache slot (hashed in the same pass)"]
        assert (row.copies, row.bytes_copied) == (1, kv_bytes)


def test_format_1_snapshots_are_still_read(engine, frozen, tmp_path):
    with safe_open(str(frozen), framework="pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
        m = dict(f.metadata())
    del m["checksums"]
    m["format_version"] = "1"
    m["checksum"] = checksum_v1(t, m)
    old = tmp_path / "v1.safetensors"
    save_file(t, str(old), metadata=m)
    with snapshot.thaw(engine, frozen) as a, snapshot.thaw(engine, old) as b:
        assert (b.send(TURNS[1], max_tokens=8).stats.token_ids
                == a.send(TURNS[1], max_tokens=8).stats.token_ids)
    data = bytearray(old.read_bytes())
    data[-1000] ^= 0x40
    damaged = tmp_path / "v1-bad.safetensors"
    damaged.write_bytes(bytes(data))
    thaw_fails(engine, damaged, SnapshotCorrupt, "checksum mismatch")


def test_not_a_snapshot(engine, tmp_path):
    other = tmp_path / "weights.safetensors"
    save_file({"w": torch.zeros(3)}, str(other))
    thaw_fails(engine, other, SnapshotCorrupt, "not a floe snapshot")


def test_other_format_and_abi_versions(engine, frozen, tmp_path):
    thaw_fails(engine, rewrite(frozen, tmp_path / "f.safetensors", meta={"format_version": "9"}),
               SnapshotVersionMismatch, "format version 9")
    thaw_fails(engine, rewrite(frozen, tmp_path / "a.safetensors", meta={"abi_version": "7"}),
               SnapshotVersionMismatch, "ABI 7")
    # A version this host speaks, but not the one the (same) module speaks: the file was altered.
    thaw_fails(engine, rewrite(frozen, tmp_path / "b.safetensors", meta={"abi_version": "1"}),
               SnapshotVersionMismatch, "the module speaks ABI 2")


def test_other_model(frozen, tmp_path):
    other = Engine(load_checkpoint(write_gguf(tmp_path / "m.gguf", [Q.Q8_0])), max_seq_len=256)
    thaw_fails(other, frozen, SnapshotModelMismatch, "snapshot was made with model")


def test_other_guest(engine, frozen):
    thaw_fails(engine, frozen, SnapshotGuestMismatch, "made with guest chat.wasm",
               guest=builtin_guest("constrained"))


def test_context_too_small(default_checkpoint, frozen):
    small = Engine(default_checkpoint, max_seq_len=16)
    thaw_fails(small, frozen, SnapshotShapeMismatch, "context holds 16")


def test_inconsistent_shapes(engine, frozen, tmp_path):
    bad = rewrite(frozen, tmp_path / "s.safetensors", tensors={"kv.3.v": torch.zeros(3, 2, 64)})
    thaw_fails(engine, bad, SnapshotCorrupt, "kv.3.v has shape")


def test_int8_kv_is_small_and_close(engine, tmp_path):
    with Actor(engine) as actor:
        actor.send("Tell me a long story about a lighthouse keeper.", max_tokens=64)
        full = snapshot.freeze(actor, tmp_path / "f32.safetensors")
        snapshot.freeze(actor, tmp_path / "i8.safetensors", kv_dtype="int8")
    i8 = Snapshot(tmp_path / "i8.safetensors")
    kv_bytes = sum(t.numel() * t.element_size() for n, t in i8.tensors.items() if n.startswith("kv."))
    bf16_bytes = sum(t.numel() * 2 for n, t in i8.tensors.items() if n.startswith("kv.") and "scale" not in n)
    assert kv_bytes <= 0.55 * bf16_bytes
    assert i8.summary()["file_bytes"] < 0.3 * full["bytes"]
    k32, _ = Snapshot(tmp_path / "f32.safetensors").kv(torch.float32)
    k8, _ = i8.kv(torch.float32)
    rel = max(float((a - b).abs().max() / a.abs().max()) for a, b in zip(k32, k8, strict=True))
    assert rel < 0.01  # half a quantisation step of absmax/127
    # Thawed, each continues from its K and V: the same next tokens' logits within a small part of their
    # range, and the same choice but where float32's top two are nearer than that (a greedy reply's
    # text would compare near-ties: K and V moved by int8 flipped one of this conversation's, a00362c).
    a, b = (snapshot.thaw(engine, tmp_path / f) for f in ("f32.safetensors", "i8.safetensors"))
    with a, b:
        ids = engine.tokenizer.encode(" Go on, tell me what the keeper saw that night.")
        la, lb = (engine.prefill(ids, actor.slot, all_logits=True).clone() for actor in (a, b))
    diff = (la - lb).abs().amax(-1)
    assert bool((diff < 0.05 * (la.amax(-1) - la.amin(-1))).all()), diff
    top = la.topk(2, dim=-1).values
    assert bool(((la.argmax(-1) == lb.argmax(-1)) | (top[:, 0] - top[:, 1] < 2 * diff)).all())


STATEFUL = wasmtime.wat2wasm("""
(module
  (import "floe" "emit" (func $emit (param i32 i32) (result i32)))
  (memory (export "memory") 1)
  (global $turns (export "turns") (mut i32) (i32.const 0))
  (global $scale (export "scale") (mut f64) (f64.const 0.5))
  (global $hidden (mut i32) (i32.const 7))
  (func (export "floe_abi_version") (result i32) (i32.const 1))
  (func (export "alloc") (param i32) (result i32) (i32.const 1024))
  ;; emits "<turns><memory counter>" as two digits: state in a global and in memory
  (func (export "on_message") (param i32 i32) (result i32)
    (global.set $turns (i32.add (global.get $turns) (i32.const 1)))
    (global.set $scale (f64.mul (global.get $scale) (f64.const 3)))
    (i32.store (i32.const 512) (i32.add (i32.load (i32.const 512)) (i32.const 2)))
    (i32.store8 (i32.const 600) (i32.add (i32.const 48) (global.get $turns)))
    (i32.store8 (i32.const 601) (i32.add (i32.const 48) (i32.load (i32.const 512))))
    (drop (call $emit (i32.const 600) (i32.const 2)))
    (i32.const 0)))
""")


def test_guest_state_in_globals_and_memory_round_trips(engine, tmp_path):
    with Actor(engine, STATEFUL) as actor:
        assert [actor.send("x").text for _ in range(2)] == ["12", "24"]
        snapshot.freeze(actor, tmp_path / "g.safetensors")
        globals_before = actor.guest.capture_globals()
    with snapshot.thaw(engine, tmp_path / "g.safetensors", guest=STATEFUL) as thawed:
        assert thawed.guest.capture_globals() == globals_before
        assert thawed.send("x").text == "36"


def synthetic_state(tag: int = 0, *, n_layers: int = 2, kv_len: int = 4, n_kv_heads: int = 1,
                    head_dim: int = 8) -> ActorState:
    """An actor state made up without a model or guest, for the writer's tests: every KV value and
    token is `tag`."""
    shape = (n_kv_heads, kv_len, head_dim)
    k, v = ([torch.full(shape, float(tag)) for _ in range(n_layers)] for _ in range(2))
    return ActorState(k=k, v=v, tokens=[tag] * kv_len, memory_size=65536, memory_pages=np.zeros(0, np.int32),
                      memory_data=np.zeros(0, np.uint8), globals=[], rng=torch.Generator().get_state(),
                      system_prompt="", model_fingerprint="f" * 64, model_name="m", guest_sha256="g" * 64,
                      guest_name="chat.wasm", engine_dtype="float32", abi_version=1)


def in_subprocess(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `script` in a fresh interpreter that imports this folder's modules; a hang fails the test."""
    return subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent), *args],
                          capture_output=True, text=True, timeout=timeout)


WRITER = """
import sys
sys.path.insert(0, sys.argv[1])
from test_snapshot import synthetic_state
from floe.snapshot import write
state = synthetic_state(1, n_layers=30, kv_len=4096, n_kv_heads=3, head_dim=64)
print("ready", flush=True)
while True:
    write(state, sys.argv[2])
"""


def test_writer_killed_mid_freeze_leaves_the_earlier_snapshot_and_its_temporaries_are_cleaned(tmp_path):
    path = tmp_path / "live.safetensors"
    mid_write = 0
    for delay in (0.0, 0.03, 0.1, 0.2):  # after its temporary appears: inside serializing, fsync, rename
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(Path(__file__).parent), str(path)],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        while not (path.exists() and any(p.name.endswith(TEMP_SUFFIX) for p in tmp_path.iterdir())):
            assert proc.poll() is None and time.monotonic() < deadline, "the writer died before writing"
            time.sleep(0.002)
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        leftovers = {p for p in tmp_path.iterdir() if p not in (path, lock_path(path))}
        mid_write += bool(leftovers)
        # Only floe's own names (the library's temporary file lies inside floe's folder), so a later
        # writer or scan can tell them from anything else.
        assert all(p.name.startswith(f".{path.name}.") and p.name.endswith(TEMP_SUFFIX) for p in leftovers)
        assert Snapshot(path).kv_len == 4096  # complete and checksummed, whatever the kill interrupted
        assert set(clean_stale(tmp_path)) == leftovers
        assert set(tmp_path.iterdir()) == {path, lock_path(path)}
    assert mid_write >= 1  # at least one kill really landed inside a write


def test_a_writer_removes_stale_temporaries_of_its_path_and_a_scan_keeps_a_live_writers(tmp_path):
    path = tmp_path / "s.safetensors"
    stale = tmp_path / f".s.safetensors.999999999-1-0badf00d{TEMP_SUFFIX}"  # no such process
    stale.mkdir()
    (stale / ".tmpAbC123").write_bytes(b"x" * 4096)  # what the library's own writer leaves inside
    legacy = tmp_path / ".s.safetensors.999999999.tmp"  # an older floe's name
    legacy.write_bytes(b"x")
    other = tmp_path / f".t.safetensors.{os.getpid()}-1-0badf00d{TEMP_SUFFIX}"
    other.mkdir()
    write(synthetic_state(), path)
    assert not stale.exists() and not legacy.exists() and other.exists()
    with path_lock(tmp_path / "t.safetensors"):  # as a live writer of t.safetensors holds it
        assert clean_stale(tmp_path) == [] and other.exists()
    assert clean_stale(tmp_path) == [other] and not other.exists()


def test_a_write_looks_at_its_own_temporary_name_only_after_a_folders_first_scan(tmp_path, monkeypatch):
    """A server's folder of thousands of sessions: each freeze scanned every name in it for stale
    temporaries (20,000 files: 8.8 ms a write); under a real flock a writer's temporary has one name,
    which a killed writer leaves and the next writer of that path removes with one look."""
    from floe.snapshot import atomic

    for k in range(50):
        (tmp_path / f"other{k}.safetensors").touch()
    path = tmp_path / "s.safetensors"
    write(synthetic_state(), path)  # the folder's first write in this process: the scan
    scans = []
    scandir = os.scandir
    monkeypatch.setattr(atomic.os, "scandir", lambda where: scans.append(where) or scandir(where))
    dead = tmp_path / atomic.held_temp_name(path)  # what a writer killed mid-write leaves
    dead.mkdir()
    (dead / "s.safetensors").write_bytes(b"x" * 4096)
    write(synthetic_state(1), path)
    assert tmp_path not in scans and str(tmp_path) not in scans and not dead.exists()  # (rmtree's: fds)
    assert Snapshot(path).tensors["tokens"][0].item() == 1
    assert clean_stale(tmp_path) == []  # (clean_stale scans always)
    other = tmp_path / f".s.safetensors.{os.getpid()}-1-0badf00d{TEMP_SUFFIX}"  # a no-flock writer's
    other.mkdir()
    assert clean_stale(tmp_path) == [other] and not other.exists()


def test_writers_of_one_path_take_turns_and_each_success_installed_its_own_state(tmp_path, monkeypatch):
    path = tmp_path / "shared.safetensors"
    installed = []  # (writer, the tag of the file it renamed into place), in rename order
    replace = os.replace

    def recording_replace(src, dst):
        installed.append((threading.current_thread().name, Snapshot(src).tensors["tokens"][0].item()))
        replace(src, dst)

    monkeypatch.setattr(os, "replace", recording_replace)
    for _ in range(5):
        installed.clear()
        start, errors = threading.Barrier(6), []

        def writer(tag: int, start=start, errors=errors) -> None:
            start.wait()
            try:
                write(synthetic_state(tag), path)
            except Exception as e:  # noqa: BLE001 - any failure of a writer fails the test
                errors.append(e)

        threads = [threading.Thread(target=writer, args=(tag,), name=str(tag)) for tag in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert errors == []
        assert sorted(installed) == [(str(tag), tag) for tag in range(6)]  # each installed its own state
        assert Snapshot(path).tensors["tokens"][0].item() == installed[-1][1]  # the last one stays
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(TEMP_SUFFIX)] == []


LOCKED_WRITER = """
import sys
sys.path.insert(0, sys.argv[1])
from test_snapshot import synthetic_state
from floe.snapshot import write
print("ready", flush=True)
write(synthetic_state(2), sys.argv[2])
print("written", flush=True)
"""


def test_a_writer_in_another_process_waits_while_the_path_is_locked(tmp_path):
    path = tmp_path / "p.safetensors"
    write(synthetic_state(1), path)
    with path_lock(path):
        proc = subprocess.Popen([sys.executable, "-c", LOCKED_WRITER, str(Path(__file__).parent), str(path)],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "ready\n"
        time.sleep(1.5)  # a tiny write takes milliseconds: it is waiting for the lock
        assert proc.poll() is None and Snapshot(path).tensors["tokens"][0].item() == 1
    assert proc.stdout.readline() == "written\n" and proc.wait(timeout=60) == 0
    assert Snapshot(path).tensors["tokens"][0].item() == 2


def test_a_lock_sidecar_lives_while_its_file_does_and_a_waiter_takes_the_new_one(tmp_path):
    """The holder of a path that leaves no file there removes the lock's sidecar before letting go; a
    writer in another process that waited on that sidecar takes the one made after it (and never
    holds a removed one beside a new holder), then writes."""
    path = tmp_path / "p.safetensors"
    with path_lock(path):
        assert lock_path(path).exists()
    assert list(tmp_path.iterdir()) == []
    with path_lock(path):  # no file at the path: this holder removes the sidecar the waiter waits on
        proc = subprocess.Popen([sys.executable, "-c", LOCKED_WRITER, str(Path(__file__).parent), str(path)],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "ready\n"
        time.sleep(1.5)  # waiting for the lock
        assert proc.poll() is None and not path.exists()
    assert proc.stdout.readline() == "written\n" and proc.wait(timeout=60) == 0
    assert Snapshot(path).tensors["tokens"][0].item() == 2
    assert sorted(tmp_path.iterdir()) == sorted([path, lock_path(path)])  # (a new sidecar: the file lives)
    with path_lock(path):  # a writer's turn that removes the file removes its sidecar too
        path.unlink()
    assert list(tmp_path.iterdir()) == []


# ---- hostile files: one small snapshot of a tiny model, forged with recomputed checksums ----------

@pytest.fixture(scope="module")
def tiny():
    return tiny_engine(), default_runtime().compile(FUZZ_GUEST)


@pytest.fixture(scope="module")
def small(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("small") / "small.safetensors"
    return path, tiny_snapshot(*tiny, path)


def forge(src: Path, dst: Path, edit, *, digests: bool = True) -> Path:
    """A copy of `src` that `edit(header, data)` changed (in place, or returning new data), with its
    checksums recomputed: only the format's own checks can refuse it."""
    h, data = split(src.read_bytes())
    data = edit(h, data) or data
    reseal(h, data, digests)
    dst.write_bytes(join(h, data))
    return dst


def slots_all_free(engine) -> None:
    slots = [engine.claim_slot() for _ in range(engine.cache.n_slots)]  # raises if one leaked
    for slot in slots:
        engine.release_slot(slot)


def refused(tiny, path: Path, error=SnapshotCorrupt, match: str | None = None, *,
            by_header: bool = True) -> None:
    """`thaw`, `Snapshot` and (`by_header`) `header` all raise `error`; no slot stays taken."""
    engine, module = tiny
    readers = [lambda: Snapshot(path), lambda: thaw(engine, path, module)]
    for read in readers + ([lambda: header(path)] if by_header else []):
        with pytest.raises(error, match=match):
            read()
    slots_all_free(engine)


@pytest.mark.parametrize("metadata", [["format", "floe-snapshot"], 7, "floe-snapshot", None],
                         ids=["list", "number", "string", "null"])
def test_metadata_that_is_not_an_object_of_strings_is_a_one_line_error_in_the_cli(small, tmp_path, capsys,
                                                                                    metadata):
    path = forge(small[0], tmp_path / "m.safetensors", lambda h, d: h.update(__metadata__=metadata))
    for command in ("inspect", "verify"):
        assert main(["snapshot", command, str(path)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("floe: error:") and err.count("\n") == 1 and "Traceback" not in err


MALFORMED = [("kv_len", None), ("n_layers", "3.0"), ("head_dim", "-1"), ("n_kv_heads", str(2**40)),
             ("guest_memory_bytes", "1e6"), ("guest_memory_bytes", "65537"), ("guest_page_size", "8192"),
             ("kv_dtype", "int4"), ("globals", "not json"), ("globals", '[["a"]]'),
             ("globals", '[["a","i32"],["a","i32"]]'), ("app", "[]"), ("app", "[" * 100_000),
             ("checksums", None), ("checksums", '{"tokens": "00"}'), ("created_at", None),
             ("model_fingerprint", None), ("abi_version", "one"), ("guest_name", None)]


@pytest.mark.parametrize("key, value", MALFORMED, ids=[f"{k}={str(v)[:12]}" for k, v in MALFORMED])
def test_missing_or_malformed_metadata_is_refused_though_its_checksums_match(tiny, small, tmp_path, key,
                                                                             value):
    def edit(h, data):
        if value is None:
            del h["__metadata__"][key]
        else:
            h["__metadata__"][key] = value

    path = forge(small[0], tmp_path / "m.safetensors", edit, digests=key != "checksums")
    refused(tiny, path, SnapshotCorrupt, "truncated or corrupt")


INCONSISTENT = {
    "tokens stored as float32": lambda h, d: h["tokens"].update(dtype="F32"),
    "a KV tensor transposed": lambda h, d: h["kv.0.k"].update(shape=h["kv.0.k"]["shape"][::-1]),
    "page numbers in two dimensions": lambda h, d: h["guest.memory.pages"]["shape"].append(1),
    "an extra tensor": lambda h, d: h.update(extra={"dtype": "U8", "shape": [0],
                                                    "data_offsets": [len(d), len(d)]}),
    "a layer renamed": lambda h, d: h.update({"kv.7.k": h.pop("kv.1.k")}),
    "an entry with an unknown key": lambda h, d: h["tokens"].update(offsets=[0, 0]),
    "a duplicate of a tensor's bytes": lambda h, d: h.update(alias=h["tokens"]),
}


@pytest.mark.parametrize("edit", INCONSISTENT.values(), ids=INCONSISTENT.keys())
def test_tensor_dtypes_shapes_and_names_must_be_those_the_metadata_describes(tiny, small, tmp_path, edit):
    refused(tiny, forge(small[0], tmp_path / "t.safetensors", edit), SnapshotCorrupt)


@pytest.mark.parametrize("extra", [b"\0" * 8, b"garbage!" * 100], ids=["zeros", "text"])
def test_bytes_after_the_last_tensor_are_refused_as_safetensors_refuses_them(tiny, small, tmp_path, extra):
    path = tmp_path / "appended.safetensors"
    path.write_bytes(small[0].read_bytes() + extra)
    with pytest.raises(SafetensorError), safe_open(str(path), framework="pt"):
        pass
    refused(tiny, path, SnapshotCorrupt, "bytes after its last tensor")


@pytest.mark.parametrize("pages", [[0, 1, -1], [0, 1, 1], [0, 17, 1], "past the end", [0, 1]],
                         ids=["minus one", "repeated", "unordered", "past the end", "fewer than the data"])
def test_guest_page_numbers_are_in_range_strictly_increasing_and_one_per_stored_page(tiny, small, tmp_path,
                                                                                     pages):
    if pages == "past the end":
        pages = [0, 1, int(header(small[0])["guest_memory_bytes"]) // 4096]
    bad = rewrite(small[0], tmp_path / "p.safetensors",
                  tensors={"guest.memory.pages": torch.tensor(pages, dtype=torch.int32)})
    refused(tiny, bad, SnapshotCorrupt, "guest.memory.pages", by_header=len(pages) != 3)


def test_globals_of_every_type_round_trip_negative_values_included(tiny, small):
    engine, module = tiny
    path, state = small
    assert {kind for _, kind, _ in state.globals} == {"i32", "i64", "f32", "f64"}
    assert dict((name, bits) for name, _, bits in state.globals)["d"] >= 1 << 63  # f64 -1.125: sign bit set
    with thaw(engine, path, module) as actor:
        assert same_state(actor.capture_state(), state)


def test_what_the_guest_refuses_while_restoring_is_a_snapshot_error_with_its_cause(tiny, small, tmp_path):
    engine, module = tiny
    too_big = forge(small[0], tmp_path / "big.safetensors",
                    lambda h, d: h["__metadata__"].update(guest_memory_bytes=str(512 << 20)))
    with pytest.raises(SnapshotRestoreFailed, match="over the cap") as caught:
        thaw(engine, too_big, module)
    assert isinstance(caught.value.__cause__, GuestMemoryLimit)
    renamed = forge(small[0], tmp_path / "renamed.safetensors", lambda h, d: h["__metadata__"].update(
        globals=json.dumps([[name + "x", kind] for name, kind in json.loads(h["__metadata__"]["globals"])])))
    with pytest.raises(SnapshotRestoreFailed, match="no mutable global") as caught:
        thaw(engine, renamed, module)
    assert isinstance(caught.value.__cause__, GuestLoadError)
    slots_all_free(engine)


BOUNDED = wasmtime.wat2wasm("""
(module
  (memory (export "memory") 2 3)
  (func (export "floe_abi_version") (result i32) (i32.const 1))
  (func (export "alloc") (param i32) (result i32) (i32.const 1024))
  (func (export "on_message") (param i32 i32) (result i32) (i32.const 0)))
""")


def test_guest_memory_past_the_modules_maximum_is_refused_as_a_snapshot_error(tiny, tmp_path):
    engine = tiny[0]
    module = default_runtime().compile(BOUNDED)
    with Actor(engine, module) as actor:
        actor.send("x")
        snapshot.freeze(actor, tmp_path / "b.safetensors")
    grown = forge(tmp_path / "b.safetensors", tmp_path / "grown.safetensors",
                  lambda h, d: h["__metadata__"].update(guest_memory_bytes=str(8 * 65536)))
    with pytest.raises(SnapshotRestoreFailed, match="grow memory") as caught:
        thaw(engine, grown, module)
    assert caught.value.__cause__ is not None
    slots_all_free(engine)


def test_a_snapshot_naming_no_built_in_guest_is_a_guest_mismatch(tiny, small, tmp_path):
    path = forge(small[0], tmp_path / "g.safetensors",
                 lambda h, d: h["__metadata__"].update(guest_name="../../../etc/passwd"))
    with pytest.raises(SnapshotGuestMismatch, match="not built into floe"):
        thaw(tiny[0], path)


HUGE_HEADER = """
import resource, sys
from floe.snapshot import Snapshot, SnapshotCorrupt, header
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for read in (header, Snapshot):
    try:
        read(sys.argv[2])
    except SnapshotCorrupt as e:
        print(e)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10)
"""


def test_a_header_length_over_the_safetensors_cap_is_refused_before_anything_is_read(tmp_path):
    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", 256 << 20) + b'{"a":')
        f.truncate(300 << 20)  # sparse: the claimed 256 MiB header "exists"
    proc = in_subprocess(HUGE_HEADER, str(path))
    refusals, grown_mib = proc.stdout.splitlines()[:2], int(proc.stdout.splitlines()[2])
    assert all("over the limit of 100000000 bytes" in line for line in refusals), proc.stdout + proc.stderr
    assert grown_mib < 16


SCAN = """
import logging, sys
from pathlib import Path
from floe.cli import main
from floe.server.sessions import SessionStore
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
folder = Path(sys.argv[2])
print("cli", main(["snapshot", "inspect", str(folder / "fifo.safetensors")]), flush=True)
store = SessionStore(None, folder)  # the scan at start reads headers only: no engine is used
print(store.load_store(), sorted(store.sessions), flush=True)
"""


def test_a_fifo_is_refused_at_once_by_the_cli_and_skipped_by_the_server_scan(tmp_path):
    record = {"floe_server": {"id": "alive", "messages": [{"role": "user", "content": "hi"}], "seed": 0}}
    write(synthetic_state(), tmp_path / "alive.safetensors", app=record)
    os.mkfifo(tmp_path / "fifo.safetensors")
    (tmp_path / "folder.safetensors").mkdir()
    (tmp_path / "broken.safetensors").write_bytes(b"\0" * 16)
    stale = tmp_path / f".alive.safetensors.999999999-1-0badf00d{TEMP_SUFFIX}"
    stale.mkdir()
    proc = in_subprocess(SCAN, str(tmp_path), timeout=60)  # a reader that opens the FIFO blocks here
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["cli 1", "1 ['alive']"]
    assert "fifo.safetensors is a FIFO, not a regular file" in proc.stderr  # the CLI's line
    for name in ("fifo", "folder", "broken"):
        assert f"skipping {name}.safetensors" in proc.stderr  # the server's log lines
    assert not stale.exists()


def test_a_header_checked_once_is_kept_by_its_bytes_and_each_reader_gets_its_own(monkeypatch, tmp_path):
    """encode() checks the header it wrote, as a thaw will (layout.parse_header keeps it by its bytes and
    the file's size): the thaw checks nothing again, each reader gets its own Header (one's change is
    no other's), a damaged header is refused every time and never kept, and no more than HEADERS_KEPT
    are kept."""
    from floe.snapshot import encode, layout
    from floe.snapshot.store import DiskTier, PinnedTier, SnapshotStore

    monkeypatch.setattr(layout, "_checked", type(layout._checked)())
    parsed = []
    monkeypatch.setattr(layout, "_parse_header",
                        lambda *a, parse=layout._parse_header: parsed.append(1) or parse(*a))
    engine = tiny_engine()
    with Actor(engine, seed=3) as actor:
        actor.send("one")
        data = encode(actor)
    assert len(parsed) == 1
    store = SnapshotStore([PinnedTier(1 << 26), DiskTier(tmp_path)], owner="t")
    store.put("k", data)
    store.thaw("k", engine).close()
    first = layout.read_header_buffer(data, Path("x"))
    first.metadata["kv_len"] = "0"
    first.tensors.clear()
    again = layout.read_header_buffer(data, Path("x"))
    assert len(parsed) == 1 and again.metadata["kv_len"] != "0" and again.tensors
    assert again == layout._parse_header(data[8:again.data_offset], len(data), Path("x"))
    n = struct.unpack("<Q", data[:8])[0]
    assert data[8:8 + n].count(b'"dtype":"F32"')
    bad = data[:8] + data[8:8 + n].replace(b'"dtype":"F32"', b'"dtype":"X32"', 1) + data[8 + n:]
    for _ in range(2):
        with pytest.raises(SnapshotCorrupt):
            layout.read_header_buffer(bad, Path("x"))
    assert len(layout._checked) == 1
    with pytest.raises(SnapshotCorrupt, match="bytes after its last tensor"):  # its header kept, not its size
        layout.read_header_buffer(data + bytes(8), Path("x"))
    monkeypatch.setattr(layout, "HEADERS_KEPT", 2)
    for text in ("two", "three", "four"):
        with Actor(engine, seed=3) as actor:
            actor.send(text)
            encode(actor)
    assert len(layout._checked) == 2
