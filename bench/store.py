"""Thaw time per tier of floe.snapshot.store — pinned RAM, local disk, S3 on loopback — by context
length, beside a plain s3fs get of the same object (the peer) in the same run.

    python bench/store.py [--lengths 128 512 1024 2048 4096] [--repeats 5] [--threads 2]
    python bench/store.py --device cuda --shape llama-3.2-1b --tokenizer DIR [--tiers pinned disk]

The actor is the default chat guest on the default model (CPU, native weights), or on CUDA a real shape with
seeded random bf16 weights. Each row also measures the floor for its KV bytes: on CUDA the host→device copy
(one pinned buffer of that size copied to the device, synchronised), on the CPU one copy of that many bytes
between two buffers: issue 19's goals are a thaw from pinned RAM ≤ 1.3× that floor and from disk ≤ 1.5×.
"Thaw" is SnapshotStore.thaw end to end: the tier's read, every byte checked, a new guest instance, memory,
globals, KV and RNG restored; "new actor" is the fixed part of that, a guest instance created and closed;
"spare" is the pinned tier's thaw into an actor made beforehand (as a server thaws a session, into a spare
actor: its making off the thaw's path). The disk tier's file is in the page cache (just written). S3 is
moto's server in its own process on 127.0.0.1; "s3 (fetch)" drops the local cache first (HEAD, one GET
checked as it streams into the cache, then the thaw), "s3 (cached)" finds the cached copy current (HEAD,
then the thaw). Goal (issue 19): s3 (fetch) within 2x of the plain get. Prints a table; writes
bench/results/store.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from smoke import results, shrink

from floe.actor import Actor
from floe.engine import Engine, copyhash
from floe.model import load_checkpoint
from floe.snapshot import encode
from floe.snapshot.store import DiskTier, PinnedTier, RemoteTier, SnapshotStore

SENTENCE = "The keeper wrote down the weather, the ships that passed, and the colour of the sea. "
CREDENTIALS = {"key": "bench", "secret": "bench"}


def text_of_tokens(engine: Engine, n: int) -> str:
    ids = engine.tokenizer.encode(SENTENCE * (n // 10 + 10))
    return engine.tokenizer.decode(ids[: max(1, n - 40)])  # the chat template adds ~35 tokens


def median_ms(fn, repeats: int, before=lambda: None) -> float:
    times = []
    for _ in range(repeats):
        before()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def start_moto() -> tuple[subprocess.Popen, dict]:
    """moto's S3 server in its own process (not a thread of this one: it would share our GIL)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    options = {**CREDENTIALS, "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}",
                                                "region_name": "us-east-1"}}
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), 0.1).close()
            return server, options
        except OSError:
            time.sleep(0.05)
    server.kill()
    raise SystemExit("moto's server did not start")


def cpu_flags() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            wanted = ("avx", "avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "fma", "sse4_2")
            return " ".join(f for f in line.split(":", 1)[1].split() if f in wanted)
    return ""


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return ""


def kv_bytes(engine: Engine, tokens: int) -> int:
    """Bytes of K and V that `tokens` positions hold in the engine's cache (what crosses the bus)."""
    k = engine.cache.k  # [layers, slots, n_kv, seq, head_dim]
    return 2 * k.shape[0] * k.shape[2] * tokens * k.shape[4] * k.element_size()


def h2d_floor_ms(nbytes: int, repeats: int) -> float:
    """One pinned host buffer of nbytes copied to the device, synchronised: the bus's floor."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def copy() -> None:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

    copy()
    return median_ms(copy, max(repeats, 9))


def copy_floor_ms(nbytes: int, repeats: int) -> float:
    """The CPU's floor: one buffer of nbytes copied into another (a thaw's KV bytes into the cache, at
    the least), with the engine's threads."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    return median_ms(lambda: dst.copy_(src), max(repeats, 9))


def row(engine: Engine, n: int, tmp: Path, s3: dict | None, bucket: str, repeats: int,
        tiers: list[str]) -> dict:
    with Actor(engine) as actor:
        actor.send(text_of_tokens(engine, n), max_tokens=1)
        tokens = engine.kv_len(actor.slot)
        data = encode(actor)
    key = f"bench-{n}"
    cuda = engine.device.type == "cuda"
    stores = {"pinned": SnapshotStore([PinnedTier(1 << 31), DiskTier(tmp / "pinned-home")], owner="bench"),
              "disk": SnapshotStore([DiskTier(tmp / "disk")], owner="bench")}
    if "s3" in tiers:
        remote_tier = RemoteTier(f"s3://{bucket}/sessions", tmp / "s3-cache", **s3)
        stores["s3"] = SnapshotStore([remote_tier], owner="bench")
    for store in stores.values():
        store.put(key, data)
    assert stores["pinned"].where(key)[0] == "pinned" and stores["disk"].where(key) == ["disk"]

    def thaw(store: SnapshotStore):
        def once() -> None:
            actor = store.thaw(key, engine)
            if cuda:
                torch.cuda.synchronize()  # the KV on the device, not only enqueued
            actor.close()
        return once

    out = {"tokens": tokens, "bytes": len(data), "kv_bytes": kv_bytes(engine, tokens)}
    # The fixed part of every thaw: a new guest instance (and its KV slot), created and closed.
    Actor(engine).close()
    out["new_actor_ms"] = median_ms(lambda: Actor(engine).close(), repeats)
    for tier in ("pinned", "disk"):
        thaw(stores[tier])()  # its first thaw at this size: allocations, the guest module
        out[f"{tier}_ms"] = median_ms(thaw(stores[tier]), repeats)
    # As a server thaws a session: into a spare actor made ahead (floe.server.sessions.spares), its
    # making off the thaw's path.
    spare: list[Actor] = []

    def into_spare() -> None:
        actor = stores["pinned"].thaw(key, engine, into=spare.pop())
        if cuda:
            torch.cuda.synchronize()
        actor.close()

    out["pinned_spare_ms"] = median_ms(into_spare, repeats, before=lambda: spare.append(Actor(engine)))
    floor = "h2d_floor_ms" if cuda else "copy_floor_ms"  # (the KV bytes' way into the cache, at the least)
    out[floor] = (h2d_floor_ms if cuda else copy_floor_ms)(out["kv_bytes"], repeats)
    out["pinned_vs_floor"] = out["pinned_ms"] / out[floor]
    out["spare_vs_floor"] = out["pinned_spare_ms"] / out[floor]
    out["disk_vs_floor"] = out["disk_ms"] / out[floor]
    if "s3" in tiers:
        import s3fs

        fs = s3fs.S3FileSystem(**s3)
        remote = stores["s3"]
        out["s3_fetch_ms"] = median_ms(thaw(remote), repeats, before=lambda: remote_tier.drop_cached(key))
        out["s3_cached_ms"] = median_ms(thaw(remote), repeats)
        out["s3fs_get_ms"] = median_ms(lambda: fs.cat_file(f"{bucket}/sessions/{key}.safetensors"), repeats)
        out["s3_fetch_vs_get"] = out["s3_fetch_ms"] / out["s3fs_get_ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048, 4096])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/store.json")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default=None, help="seeded random bf16 weights at this shape (CUDA runs)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder for --shape")
    ap.add_argument("--tiers", nargs="+", default=["pinned", "disk", "s3"], choices=["pinned", "disk", "s3"])
    args = shrink(ap.parse_args(), lengths=[64], repeats=1)
    args.out = results(args.out)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    seq = max(args.lengths) + 64
    if args.shape:
        from floe.cli import _tokenizer
        from floe.model.synthetic import random_checkpoint

        checkpoint = random_checkpoint(args.shape, _tokenizer(args.tokenizer), dtype=torch.bfloat16,
                                       device=device)
        engine = Engine(checkpoint, device=device, dtype="bfloat16", max_seq_len=seq, n_slots=2,
                        weights="dense")
    else:
        engine = Engine(load_checkpoint(), device=device, max_seq_len=seq, n_slots=2,
                        weights="native" if device.type == "cpu" else "dense")
    server, s3 = start_moto() if "s3" in args.tiers else (None, None)
    tmp = Path(tempfile.mkdtemp(prefix="floe-store-bench-"))
    try:
        bucket = "floe-bench"
        if server is not None:
            import s3fs

            s3fs.S3FileSystem(**s3).call_s3("create_bucket", Bucket=bucket)
        rows = [row(engine, n, tmp, s3, bucket, args.repeats, args.tiers) for n in args.lengths]
    finally:
        if server is not None:
            server.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    columns = [("tokens", "tokens", "{:d}"), ("MB", "bytes", "{:.1f}"), ("pinned ms", "pinned_ms", "{:.2f}"),
               ("disk ms", "disk_ms", "{:.2f}"), ("spare ms", "pinned_spare_ms", "{:.2f}"),
               ("new actor ms", "new_actor_ms", "{:.2f}"),
               ("h2d floor ms", "h2d_floor_ms", "{:.2f}"), ("copy floor ms", "copy_floor_ms", "{:.2f}"),
               ("pinned/floor", "pinned_vs_floor", "{:.2f}x"), ("disk/floor", "disk_vs_floor", "{:.2f}x"),
               ("spare/floor", "spare_vs_floor", "{:.2f}x"),
               ("s3 fetch ms", "s3_fetch_ms", "{:.1f}"), ("s3 cached ms", "s3_cached_ms", "{:.1f}"),
               ("s3fs get ms", "s3fs_get_ms", "{:.1f}"), ("fetch/get", "s3_fetch_vs_get", "{:.2f}x")]
    columns = [c for c in columns if c[1] in rows[0]]
    print(" ".join(f"{title:>13}" for title, _, _ in columns))
    for r in rows:
        cells = [fmt.format(r[key] / 1e6 if key == "bytes" else r[key]) for _, key, fmt in columns]
        print(" ".join(f"{cell:>13}" for cell in cells))
    result = {"model": engine.checkpoint.name, "dtype": str(engine.dtype), "threads": args.threads,
              "repeats": args.repeats, "cpu": cpu_model(), "cpu_flags": cpu_flags(),
              "cuda": torch.cuda.is_available(), "device": str(device), "shape": args.shape,
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
              "torch": torch.__version__, "cpu_count": os.cpu_count(), "tiers": args.tiers,
              "copy_hash_native": copyhash.library() is not None,
              "command": " ".join(["python", *sys.argv]), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
