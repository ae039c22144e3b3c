"""A server's start over a store that holds many sessions: SessionRegistry.load (every session's header
read and checked, as `floe serve` does before it listens) over N snapshots, in a local folder and in a
bucket of a real S3 API on loopback (moto's threaded server, through s3fs). Each snapshot is a real
frozen session of a one-layer 64-wide engine, written N times under N keys.

    python bench/probes/store_load.py [--sessions 500] [--rounds 3] [--tokenizer DIR] [--where disk s3]
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


if __name__ == "__main__":
    main()
