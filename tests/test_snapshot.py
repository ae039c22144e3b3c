"""Snapshots: an actor frozen to one safetensors file continues bit-for-bit, elsewhere; bad files are
refused with their specific error and nothing half-loaded; a killed writer damages nothing."""

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import wasmtime
from gguf import GGMLQuantizationType as Q
from models import write_gguf
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from floe.actor import Actor, builtin_guest
from floe.engine import Engine, SamplingParams
from floe.engine.kvcache import KVDigestMismatch
from floe.model import load_checkpoint
from floe.snapshot import (
    Snapshot,
    SnapshotCorrupt,
    SnapshotGuestMismatch,
    SnapshotModelMismatch,
    SnapshotShapeMismatch,
    SnapshotVersionMismatch,
    checksum_v1,
    seal,
)

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
        actor.freeze(tmp_path / "a.safetensors")  # written straight from the cache's strided views
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
        actor.freeze(path)
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
    free = list(engine._free_slots)
    with pytest.raises(error, match=match):
        Actor.thaw(engine, path, **kwargs)
    assert engine._free_slots == free  # nothing was created or loaded half-way


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
    with Actor.thaw(engine, frozen) as actor:
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
    with Actor.thaw(engine, frozen) as a, Actor.thaw(engine, old) as b:
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
    thaw_fails(engine, rewrite(frozen, tmp_path / "a.safetensors", meta={"abi_version": "2"}),
               SnapshotVersionMismatch, "ABI 2")


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
        full = actor.freeze(tmp_path / "f32.safetensors")
        actor.freeze(tmp_path / "i8.safetensors", kv_dtype="int8")
    i8 = Snapshot(tmp_path / "i8.safetensors")
    kv_bytes = sum(t.numel() * t.element_size() for n, t in i8.tensors.items() if n.startswith("kv."))
    bf16_bytes = sum(t.numel() * 2 for n, t in i8.tensors.items() if n.startswith("kv.") and "scale" not in n)
    assert kv_bytes <= 0.55 * bf16_bytes
    assert i8.summary()["file_bytes"] < 0.3 * full["bytes"]
    k32, _ = Snapshot(tmp_path / "f32.safetensors").kv(torch.float32)
    k8, _ = i8.kv(torch.float32)
    rel = max(float((a - b).abs().max() / a.abs().max()) for a, b in zip(k32, k8, strict=True))
    assert rel < 0.01  # half a quantisation step of absmax/127
    a, b = (Actor.thaw(engine, tmp_path / f) for f in ("f32.safetensors", "i8.safetensors"))
    with a, b:
        assert a.send("Go on.", max_tokens=6).text == b.send("Go on.", max_tokens=6).text


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
        actor.freeze(tmp_path / "g.safetensors")
        globals_before = actor.guest.capture_globals()
    with Actor.thaw(engine, tmp_path / "g.safetensors", guest=STATEFUL) as thawed:
        assert thawed.guest.capture_globals() == globals_before
        assert thawed.send("x").text == "36"


WRITER = """
import sys, numpy as np, torch
from floe.snapshot import ActorState, write
k, v = ([torch.randn(3, 4096, 64) for _ in range(30)] for _ in range(2))
state = ActorState(k=k, v=v, tokens=[1] * 4096, memory_size=65536, memory_pages=np.zeros(0, np.int32),
                   memory_data=np.zeros(0, np.uint8), globals=[], rng=torch.Generator().get_state(),
                   system_prompt="", model_fingerprint="f" * 64, model_name="m", guest_sha256="g" * 64,
                   guest_name="chat.wasm", engine_dtype="float32", abi_version=1)
print("ready", flush=True)
while True:
    write(state, sys.argv[1])
"""


def test_writer_killed_mid_freeze_leaves_the_earlier_snapshot(tmp_path):
    path = tmp_path / "live.safetensors"
    mid_write = 0
    for delay in (0.05, 0.13, 0.21, 0.37):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        while not path.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the writer died before writing"
            time.sleep(0.01)
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        leftovers = [p for p in tmp_path.iterdir() if p != path]  # temp files of an interrupted write
        mid_write += bool(leftovers)
        snap = Snapshot(path)  # complete and checksummed, whatever the kill interrupted
        assert snap.kv_len == 4096
        for p in leftovers:
            p.unlink()
    assert mid_write >= 1  # at least one kill really landed inside a write
