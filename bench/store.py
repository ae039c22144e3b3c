"""Thaw time per tier of floe.snapshot.store — pinned RAM, local disk, S3 on loopback — by context
length, beside a plain s3fs get of the same object (the peer) in the same run.

    python bench/store.py [--lengths 128 512 1024 2048 4096] [--repeats 5] [--threads 2]

The actor is the default chat guest on the default model (CPU, native weights). "Thaw" is
SnapshotStore.thaw end to end: the tier's read, every byte checked, a new guest instance, memory,
globals, KV and RNG restored. S3 is moto's server in its own process on 127.0.0.1; "s3 (fetch)" drops
the local cache first (HEAD, one GET checked as it streams into the cache, then the thaw), "s3
(cached)" finds the cached copy current (HEAD, then the thaw). Goal (issue 19): s3 (fetch) within 2x
of the plain get. Prints a table; writes bench/results/store.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import s3fs
import torch

from floe.actor import Actor
from floe.engine import Engine
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


def row(engine: Engine, n: int, tmp: Path, s3: dict, bucket: str, repeats: int) -> dict:
    with Actor(engine) as actor:
        actor.send(text_of_tokens(engine, n), max_tokens=1)
        tokens = engine.kv_len(actor.slot)
        data = encode(actor)
    key = f"bench-{n}"
    pinned = SnapshotStore([PinnedTier(1 << 31), DiskTier(tmp / "pinned-home")], owner="bench")
    disk = SnapshotStore([DiskTier(tmp / "disk")], owner="bench")
    remote_tier = RemoteTier(f"s3://{bucket}/sessions", tmp / "s3-cache", **s3)
    remote = SnapshotStore([remote_tier], owner="bench")
    for store in (pinned, disk, remote):
        store.put(key, data)
    assert pinned.where(key)[0] == "pinned" and disk.where(key) == ["disk"]

    def thaw(store: SnapshotStore):
        return lambda: store.thaw(key, engine).close()

    fs = s3fs.S3FileSystem(**s3)
    out = {"tokens": tokens, "bytes": len(data)}
    out["pinned_ms"] = median_ms(thaw(pinned), repeats)
    out["disk_ms"] = median_ms(thaw(disk), repeats)
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
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(load_checkpoint(), max_seq_len=max(args.lengths) + 64, n_slots=2, weights="native")
    server, s3 = start_moto()
    tmp = Path(tempfile.mkdtemp(prefix="floe-store-bench-"))
    try:
        bucket = "floe-bench"
        s3fs.S3FileSystem(**s3).call_s3("create_bucket", Bucket=bucket)
        rows = [row(engine, n, tmp, s3, bucket, args.repeats) for n in args.lengths]
    finally:
        server.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{'tokens':>6} {'MB':>7} {'pinned ms':>10} {'disk ms':>8} {'s3 fetch ms':>12} "
          f"{'s3 cached ms':>13} {'s3fs get ms':>12} {'fetch/get':>9}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['bytes'] / 1e6:>7.1f} {r['pinned_ms']:>10.1f} {r['disk_ms']:>8.1f} "
              f"{r['s3_fetch_ms']:>12.1f} {r['s3_cached_ms']:>13.1f} {r['s3fs_get_ms']:>12.1f} "
              f"{r['s3_fetch_vs_get']:>8.2f}x")
    result = {"model": engine.checkpoint.name, "dtype": str(engine.dtype), "threads": args.threads,
              "repeats": args.repeats, "cpu": cpu_model(), "cpu_flags": cpu_flags(),
              "cuda": torch.cuda.is_available(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
