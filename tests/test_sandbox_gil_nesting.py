"""A guest call that holds the GIL throughout (hold_gil=True: an ABI v2 turn's on_end, in its caller's
thread) made from inside an actor's message (an on_text callback of a v1 guest's emit) must not let
the GIL go at a tick: the outer call's HOLD_TO_A_TICK state is not its own."""

import sys

import pytest
from isolated import run_isolated


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="native epoch ticks: Linux")
def test_a_v2_actors_on_end_called_from_inside_another_actors_message_keeps_the_gil():
    out = run_isolated("""
        import threading
        from guests_wat import EMITS_OK, v2_guest
        from models import tiny_engine
        from floe.actor import Actor
        from floe.wasm import rows, start_guest_thread

        if rows.native() is None:
            print("skip")
            raise SystemExit(0)
        SLOW_ON_END = v2_guest(on_end='''
            (local.set $i (i32.const 100000000))  (; well past an epoch tick ;)
            (loop $l (local.set $i (i32.sub (local.get $i) (i32.const 1))) (br_if $l (local.get $i)))
            (i32.const 0)''')
        engine = tiny_engine()
        outer, inner = Actor(engine, EMITS_OK), Actor(engine, SLOW_ON_END)
        out = {}

        def run():
            for _ in range(3):
                out["outer"] = outer.send("Hi", on_text=lambda piece: out.setdefault(
                    "inner", []).append(inner.send("Hi", max_tokens=2).text)).text

        thread = threading.Thread(target=run)
        start_guest_thread(thread)
        thread.join(120)
        print(out.get("outer"), len(out.get("inner", [])))
    """)
    if out.split() == ["skip"]:
        pytest.skip("no C++ compiler: an actor's calls release the GIL from their start")
    assert out.split()[-2:] == ["ok", "3"], out  # (before: the child died of SIGSEGV)
