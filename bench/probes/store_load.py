"""A server's start over a store that holds many sessions: SessionRegistry.load (every session's header
read and checked, as `floe serve` does before it listens) over N snapshots, in a local folder and in a
bucket of a real S3 API on loopback (moto's threaded server, through s3fs). Each snapshot is a real
frozen session of a one-layer 64-wide engine, written N times under N keys.

    python bench/probes/store_load.py [--sessions 500] [--rounds 3] [--tokenizer DIR] [--where disk s3]
        [--leases 300] [--rtt-ms MS]

Then the leases of --leases of them held by one store and renewed (SnapshotStore.renew_all, which a
server runs every lease_s / 3): a round that takes longer than that leaves leases to expire.
--rtt-ms delays each S3 request by a network round trip (moto on loopback answers at once, its own
Python the only cost), as a bucket in another zone or region would.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))
from tiny import tiny_engine, tokenizer  # noqa: E402

from floe.actor import Actor  # noqa: E402
from floe.server.records import make_record  # noqa: E402
from floe.server.sessions.registry import SessionRegistry  # noqa: E402
from floe.server.sessions.store import snapshot_store  # noqa: E402
from floe.snapshot.file import encode  # noqa: E402


def fill(url: str, data: bytes, n: int) -> None:
    store = snapshot_store(url, pinned_bytes=0)
    for i in range(n):
        store.home.put(f"s{i}", data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--where", nargs="+", default=["disk", "s3"], choices=["disk", "s3"])
    ap.add_argument("--leases", type=int, default=300, help="leases held, then renewed (renew_all)")
    ap.add_argument("--rtt-ms", type=float, default=0.0,
                    help="each S3 request delayed this long first (a remote bucket's round trip)")
    args = ap.parse_args()
    engine = tiny_engine(tokenizer(args.tokenizer), 2)
    messages = [{"role": "user", "content": "Name a colour."}]
    with Actor(engine) as actor:
        actor.send(messages[0]["content"], max_tokens=4)
        messages.append({"role": "assistant", "content": "blue"})
        data = bytes(encode(actor, None, make_record("s", "", False, messages, 0)))
    urls = {}
    if "disk" in args.where:
        urls["disk"] = tempfile.mkdtemp(prefix="floe-store-load-")
    if "s3" in args.where:
        import fsspec
        import s3fs
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # (a line per request otherwise)

        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        options = {"key": "test", "secret": "test",
                   "client_kwargs": {"endpoint_url": f"http://{host}:{port}", "region_name": "us-east-1"}}
        fsspec.config.conf["s3"] = options
        if args.rtt_ms:  # every request of s3fs's goes through its _error_wrapper
            import asyncio

            import s3fs.core

            wrapper = s3fs.core._error_wrapper

            async def far(*a, **k):
                await asyncio.sleep(args.rtt_ms / 1e3)
                return await wrapper(*a, **k)

            s3fs.core._error_wrapper = far
        s3fs.S3FileSystem(**options).call_s3("create_bucket", Bucket="floe-load")
        urls["s3"] = "s3://floe-load/sessions"
    for where, url in urls.items():
        t = time.perf_counter()
        fill(url, data, args.sessions)
        took = time.perf_counter() - t
        print(f"{where}: {args.sessions} snapshots of {len(data)} bytes written in {took:.1f} s", flush=True)
    for where, url in urls.items():
        took = []
        for _ in range(args.rounds):
            registry = SessionRegistry(snapshot_store(url, pinned_bytes=0))  # (a fresh start: cold cache)
            t = time.perf_counter()
            loaded = registry.load()
            took.append(time.perf_counter() - t)
            assert loaded == args.sessions and not registry.skipped, (loaded, registry.skipped[:3])
        median = statistics.median(took)
        print(f"{where}: load of {args.sessions} sessions {', '.join(f'{s:.2f}' for s in took)} s "
              f"(median {median:.2f} s, {1e3 * median / args.sessions:.2f} ms a session)", flush=True)
        store = snapshot_store(url, pinned_bytes=0)
        for i in range(args.leases):
            store.acquire(f"s{i}")
        took = []
        for _ in range(args.rounds):
            t = time.perf_counter()
            assert store.renew_all() == []
            took.append(time.perf_counter() - t)
        for i in range(args.leases):
            store.release(f"s{i}")
        print(f"{where}: renewing {args.leases} leases (every lease_s / 3, 10 s by default) "
              f"{', '.join(f'{s:.2f}' for s in took)} s", flush=True)


if __name__ == "__main__":
    main()
