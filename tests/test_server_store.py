"""`floe serve` keeping its sessions in the tiered store (floe.snapshot.store) over a real S3 API on
loopback (moto's threaded server, s3fs), driven by the official `openai` client: a session moves to a
second server sharing the bucket when the first is killed, and is refused while the first holds it; a
damaged object is refused; an exported snapshot continues identically in a fresh server; one-shot
requests leave nothing in the bucket, and the store's budget and lifetime hold."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time

import fsspec.config
import httpx
import openai
import pytest
import s3fs
from test_server import (
    CONTEXT,
    MODEL_ID,
    TURNS,
    ThreadServer,
    ask,
    client,
    conversation,
    free_port,
    serving,
)

from floe.engine import Engine
from floe.server.app import create_app
from floe.server.sessions import snapshot_store
from floe.snapshot import header


@pytest.fixture
def bucket(s3, request, monkeypatch):
    """A fresh bucket; s3fs in this process (fsspec's config) and in `floe serve` processes (FSSPEC_S3)
    reach moto with it."""
    monkeypatch.setitem(fsspec.config.conf, "s3", s3)
    words = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()[5:40]).strip("-")
    name = f"floe-{secrets.token_hex(4)}-{words}"
    s3fs.S3FileSystem(**s3).call_s3("create_bucket", Bucket=name)
    return name


def objects(s3: dict, bucket: str) -> dict[str, int]:
    """The snapshots in the bucket: key -> bytes."""
    fs = s3fs.S3FileSystem(use_listings_cache=False, **s3)
    found = fs.find(f"{bucket}/sessions", detail=True)
    return {path.split("/sessions/", 1)[1].removesuffix(".safetensors"): info["size"]
            for path, info in found.items() if path.endswith(".safetensors")}


@pytest.fixture(scope="module")
def engine(default_checkpoint):
    return Engine(default_checkpoint, max_seq_len=CONTEXT, n_slots=4, weights="native")


def in_process(engine, url: str, **options) -> ThreadServer:
    """`floe serve`'s front and core in this process, its sessions in the store at `url`."""
    store = {k: options.pop(k) for k in ("pinned_bytes", "ttl_s", "budget_bytes", "lease_s") if k in options}
    idle = options.pop("idle_seconds", 3600)
    return ThreadServer(create_app(engine, snapshots=snapshot_store(url, idle_seconds=idle, **store),
                                   model_id=MODEL_ID, idle_seconds=idle, **options))


def serve(url: str, port: int, s3: dict, *flags: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "floe.cli", "serve", "--port", str(port), "--snapshots", url,
         "--context", str(CONTEXT), "--max-sessions", "4", *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env=os.environ | {"FSSPEC_S3": json.dumps(s3)})
    return serving(proc, port)


def follow_up(first_reply: str) -> list[dict]:
    return [{"role": "user", "content": TURNS[0]}, {"role": "assistant", "content": first_reply},
            {"role": "user", "content": TURNS[1]}]


def test_a_session_continues_on_a_second_server_after_the_first_is_killed(s3, bucket):
    """Turn 1 on A (frozen into the bucket as it is answered); B refuses the session while A holds
    it; A killed with SIGKILL; turn 2 on B is the text one uninterrupted server gives (greedy)."""
    url = f"s3://{bucket}/sessions"
    ports = free_port(), free_port()
    a = serve(url, ports[0], s3, "--freeze-every-turn")
    b = None
    try:
        b = serve(url, ports[1], s3)
        on_a, on_b = client(f"http://127.0.0.1:{ports[0]}"), client(f"http://127.0.0.1:{ports[1]}")
        reference, _ = conversation(on_a, "uninterrupted", TURNS[:2])
        first, _ = conversation(on_a, "moved", TURNS[:1])
        assert "moved" in objects(s3, bucket)  # written through before turn 1's answer ended
        with pytest.raises(openai.ConflictError) as refused:
            ask(on_b, follow_up(first[0]), extra_body={"session_id": "moved"})
        assert refused.value.body["code"] == "session_leased"
        assert "held by another server" in str(refused.value)
        assert refused.value.response.headers["x-should-retry"] == "false"
        a.send_signal(signal.SIGKILL)
        a.wait(60)
        r = ask(on_b, follow_up(first[0]), extra_body={"session_id": "moved"})
        assert r.usage.prompt_tokens_details.cached_tokens > 0  # thawed from the bucket, not prefilled
        assert [first[0], r.choices[0].message.content] == reference
        assert httpx.get(f"http://127.0.0.1:{ports[1]}/v1/sessions/moved").json()["messages"] == 4
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)


def test_a_corrupted_object_is_refused(engine, s3, bucket):
    url = f"s3://{bucket}/sessions"
    s = in_process(engine, url, pinned_bytes=0)  # no RAM copy: every thaw reads the bucket
    try:
        conversation(client(s.url), "damaged", TURNS[:1])
        assert httpx.post(f"{s.url}/v1/sessions/damaged/freeze").status_code == 200
        fs = s3fs.S3FileSystem(use_listings_cache=False, **s3)
        path = f"{bucket}/sessions/damaged.safetensors"
        data = bytearray(fs.cat_file(path))
        data[len(data) // 2] ^= 0x40  # one bit of a tensor's bytes
        fs.pipe_file(path, bytes(data))
        r = httpx.post(f"{s.url}/v1/sessions/damaged/thaw")
        assert r.status_code == 500 and r.json()["error"]["code"] == "thaw_failed"
        assert "SnapshotCorrupt" in r.json()["error"]["message"]
        refused = httpx.put(f"{s.url}/v1/sessions/again/snapshot", content=bytes(data))
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "snapshot_invalid"
        assert "checksum mismatch" in refused.json()["error"]["message"]
        assert "again" not in objects(s3, bucket)
    finally:
        s.stop()


def test_an_exported_snapshot_continues_identically_in_a_fresh_server(engine, s3, bucket, tmp_path):
    """Exported from a server on the bucket, streamed into a fresh server on a folder: turn 2 there is
    turn 2 on the first; a truncated upload is refused and stores nothing."""
    source = in_process(engine, f"s3://{bucket}/sessions")
    try:
        first, _ = conversation(client(source.url), "carry", TURNS[:1])
        exported = httpx.get(f"{source.url}/v1/sessions/carry/snapshot")
        assert exported.status_code == 200 and exported.headers["content-type"] == "application/octet-stream"
        expected = ask(client(source.url), follow_up(first[0]), extra_body={"session_id": "carry"})
    finally:
        source.stop()
    target = in_process(engine, str(tmp_path / "elsewhere"))
    try:
        cut = httpx.put(f"{target.url}/v1/sessions/carried/snapshot", content=exported.content[:-100])
        assert cut.status_code == 400 and "cut short" in cut.json()["error"]["message"]
        assert httpx.get(f"{target.url}/v1/sessions/carried").status_code == 404

        def chunks():
            for i in range(0, len(exported.content), 1 << 16):
                yield exported.content[i:i + (1 << 16)]

        put = httpx.put(f"{target.url}/v1/sessions/carried/snapshot", content=chunks())
        assert put.status_code == 200 and put.json()["bytes"] == len(exported.content)
        assert put.json()["messages"] == 2
        r = ask(client(target.url), follow_up(first[0]), extra_body={"session_id": "carried"})
        assert r.choices[0].message.content == expected.choices[0].message.content
        assert r.usage.prompt_tokens_details.cached_tokens > 0
    finally:
        target.stop()


def test_one_shot_requests_stay_out_of_the_bucket_and_the_budget_holds(engine, s3, bucket):
    """12 one-shot and 12 named requests on a server whose bucket may hold a few sessions: no
    one-shot session is ever written; once swept, the bucket is within its budget, holding the most
    recently used named sessions, and the server forgets the ones deleted."""
    probe = in_process(engine, f"s3://{bucket}/probe")
    try:
        conversation(client(probe.url), "probe", TURNS[:1])
        size = httpx.post(f"{probe.url}/v1/sessions/probe/freeze").json()["bytes"]
    finally:
        probe.stop()
    budget = int(4.5 * size)
    s = in_process(engine, f"s3://{bucket}/sessions", budget_bytes=budget, sweep_seconds=0.2,
                   idle_seconds=0.3)
    try:
        c = client(s.url)
        for i in range(12):
            ask(c, [{"role": "user", "content": f"Say the number {i}."}], max_tokens=4)
            ask(c, [{"role": "user", "content": f"Name a city, number {i}."}], max_tokens=4,
                extra_body={"session_id": f"named-{i:02d}"})
            assert all(k.startswith("named-") for k in objects(s3, bucket))
        def settled() -> bool:  # every session idle and frozen, and a sweep since
            live = [x for x in httpx.get(f"{s.url}/v1/sessions").json()["data"] if x["state"] == "live"]
            return not live and sum(objects(s3, bucket).values()) <= budget

        deadline = time.time() + 120
        while not settled():
            assert time.time() < deadline, objects(s3, bucket)
            time.sleep(0.1)
        kept = objects(s3, bucket)
        assert 1 <= len(kept) < 12  # the least recently used out first:
        assert sorted(kept) == [f"named-{i:02d}" for i in range(12 - len(kept), 12)]
        listed = {x["id"] for x in httpx.get(f"{s.url}/v1/sessions").json()["data"] if not x["anonymous"]}
        assert set(kept) <= listed and "named-00" not in listed  # deleted from the bucket, forgotten here
    finally:
        s.stop()


def test_sessions_past_their_lifetime_are_deleted(engine, s3, bucket):
    s = in_process(engine, f"s3://{bucket}/sessions", ttl_s=1.0, sweep_seconds=0.2, idle_seconds=0.3)
    try:
        conversation(client(s.url), "brief", TURNS[:1])
        assert httpx.post(f"{s.url}/v1/sessions/brief/freeze").status_code == 200
        assert "brief" in objects(s3, bucket)
        deadline = time.time() + 60
        while objects(s3, bucket):
            assert time.time() < deadline, "the session outlived its TTL"
            time.sleep(0.1)
        assert httpx.get(f"{s.url}/v1/sessions/brief").status_code == 404
    finally:
        s.stop()


def test_kv_int8_snapshots_are_smaller_and_continue(engine, tmp_path):
    """--kv-dtype int8: the served session's snapshot stores int8 KV (per-token scales), under a third of
    fp32's bytes, and the session goes on from it (close to, not bit-identical with, fp32)."""
    sizes = {}
    for dtype in ("float32", "int8"):
        s = in_process(engine, str(tmp_path / dtype), kv_dtype=dtype)
        try:
            first, _ = conversation(client(s.url), "small", TURNS[:1])
            sizes[dtype] = httpx.post(f"{s.url}/v1/sessions/small/freeze").json()["bytes"]
            assert header(tmp_path / dtype / "small.safetensors")["kv_dtype"] == dtype
            r = ask(client(s.url), follow_up(first[0]), extra_body={"session_id": "small"})
            assert r.usage.prompt_tokens_details.cached_tokens > 0 and r.choices[0].message.content
        finally:
            s.stop()
    assert sizes["int8"] < sizes["float32"] / 2, sizes  # KV: 1 byte + a 4-byte scale per 64 of fp32's 256


def test_a_session_id_that_ends_like_a_lease_is_refused(engine, tmp_path):
    s = in_process(engine, str(tmp_path))
    try:
        r = httpx.post(f"{s.url}/v1/chat/completions", json={
            "model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "session_id": "x.lease"})
        assert r.status_code == 400 and "session id" in r.json()["error"]["message"]
    finally:
        s.stop()
