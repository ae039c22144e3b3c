"""`floe serve`'s HTTP front (floe.server.app) with two moments of each chat request written down: when
its HTTP request reached the app (the ASGI call, after uvicorn parsed its head), when the front sent
it to the engine core (CoreClient.chat) and when the front handed uvicorn its first token's SSE event
(the first body with a "content" delta that is not the role's). One line a moment, appended to FILE at
once (`time.perf_counter`, one clock for every process of this machine): "<pid> request <t>" / "<pid>
to_core <t>" / "<pid> first_token <t>"; and each pass of the front's cyclic collector as it ends: "<pid>
gc<generation>:<seconds> <t>". What bench/probes/arrival_timeline.py starts as each front instead of
`python -m floe.server.app`.

    python bench/probes/front_stamps.py FILE -- --socket PATH --fd N [floe.server.app's arguments]

FLOE_FRONT_PROFILE=PATH: the front's event loop thread under cProfile (the process's CPU time) for its whole
life, written to PATH.<pid> as it is stopped (SIGTERM).
"""

from __future__ import annotations

import gc
import os
import sys
import time


def main() -> None:
    path, rest = sys.argv[1], sys.argv[3:]
    out = open(path, "a", buffering=1)  # noqa: SIM115 - open for the process's life, a line at a time
    pid = os.getpid()

    from floe.server import app
    from floe.server.client import CoreClient

    chat, create_front = CoreClient.chat, app.create_front

    def w_chat(self, request):
        out.write(f"{pid} to_core {time.perf_counter()}\n")
        return chat(self, request)

    def w_create_front(*a, **k):
        inner = create_front(*a, **k)

        async def stamped(scope, receive, send):
            if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
                return await inner(scope, receive, send)
            out.write(f"{pid} request {time.perf_counter()}\n")
            first = True

            async def stamped_send(message):
                nonlocal first
                body = message.get("body", b"") if first else b""
                if any(b'"content":' in e and b'"role"' not in e for e in body.split(b"\n\n")):
                    first = False
                    out.write(f"{pid} first_token {time.perf_counter()}\n")
                await send(message)

            await inner(scope, receive, stamped_send)

        return stamped

    CoreClient.chat, app.create_front = w_chat, w_create_front
    began = [0.0]

    def collected(phase: str, info: dict) -> None:  # each pass of the front's cyclic collector
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            now = time.perf_counter()
            out.write(f"{pid} gc{info['generation']}:{now - began[0]:.6f} {now}\n")

    gc.callbacks.append(collected)
    profile_to = os.environ.get("FLOE_FRONT_PROFILE")
    if profile_to is not None:  # its event loop thread (the intake, the SSE events) under cProfile
        import cProfile
        import signal

        profile = cProfile.Profile(time.process_time)

        def stop(signum, frame):  # (uvicorn re-raises the SIGTERM it caught, after its own shutdown)
            profile.disable()
            profile.dump_stats(f"{profile_to}.{pid}")
            os._exit(0)

        signal.signal(signal.SIGTERM, stop)
        profile.enable()
    app.main(rest)


if __name__ == "__main__":
    main()
