"""Random guests against the host: random sequences of host calls with random pointers, lengths,
token ids, globals and memory shapes, from every export the host calls (ABI v1's on_message; v2's
on_message, on_token at each token and on_end; on_history), with mostly valid and sometimes hostile
results. Every failure must be a GuestError subclass, the process must
not crash or hang, and the host must go on serving a well-behaved actor afterwards.

    python tests/guest_fuzz.py --min-calls 200000 --seed 7   # a longer campaign than CI's

Prints one JSON line: guests, messages, host calls made, outcomes by ABI version and error type, and
any failure that was not a GuestError (with its traceback) under "unexpected".

`--mutants N` instead loads N modules whose section headers were mutated (ids, sizes, counts, element
kinds, table limits, body sizes, locals; cut short), from floe's guests and one declaring every kind of
table and element segment: each is refused by floe's bounds, refused by Wasmtime, or compiles; any
other outcome is "unexpected".
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from guests_wat import ALL_IMPORTS, import_decls  # noqa: E402

PAGE = 65536
ODD = [0, 1, 2, 3, 4, 8, 16, 17, 255, 4095, 4096, 65535, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xFFFFFFFD]


class GuestGenerator:
    """WAT text of one random guest: a memory of random shape, random exported globals, a random
    alloc, and an on_message that makes `n_calls` random host calls, counting them in `calls`."""

    def __init__(self, rng: random.Random, vocab: int) -> None:
        self.rng, self.vocab = rng, vocab

    # Most arguments are plausible, so a message gets deep into its sequence; a few percent are
    # hostile (out of bounds, misaligned, negative, huge), each of which ends its message.
    def pointer(self, memory: int) -> int:
        r = self.rng.random()
        if r < 0.985:
            return self.rng.randrange(0, memory - 8192, 4)
        if r < 0.99:
            return self.rng.randrange(0, memory)
        if r < 0.995:
            return memory - self.rng.choice([0, 1, 4, 16, 64])
        return self.rng.choice(ODD)

    def length(self) -> int:
        r = self.rng.random()
        if r < 0.8:
            return self.rng.randrange(0, 64)
        if r < 0.99:
            return self.rng.randrange(0, 2048)
        return self.rng.choice(ODD + [PAGE, 3 * PAGE, 1 << 20])

    def token(self) -> int:
        return self.rng.randrange(0, self.vocab) if self.rng.random() < 0.8 else self.rng.choice(
            [-1, self.vocab, self.vocab + 1, 0x7FFFFFFF, 0x80000000])

    def argument(self, name: str, i: int, memory: int) -> int:
        kinds = {
            "tokenize": "plpl", "detokenize": "plpl", "chat_render": "plbpl", "prefill": "plL",
            "decode": "tL", "sample": "p", "request": "p", "system": "pl", "eos_ids": "pl",
            "kv_truncate": "l", "emit": "pl", "log": "pl", "choice_at": "p", "stream_tokens": "b",
            "tokenize_rest": "plpl",
        }[name]
        kind = kinds[i]
        if kind == "L":  # a logits buffer: vocab_size floats
            fits, r = memory - 4 * self.vocab, self.rng.random()
            if r < 0.6 or fits <= 0:
                return 0
            return self.rng.randrange(0, fits, 4) if r < 0.97 else self.pointer(memory)
        if kind == "p":
            return 0 if self.rng.random() < 0.15 else self.pointer(memory)
        if kind == "t":
            return self.token()
        if kind == "b":
            return self.rng.choice([0, 1, 2, -1])
        return self.length()

    def call(self, memory: int, avoid: tuple[str, ...] = ()) -> str:
        """One random host call; those in `avoid` (calls that always fail where this one is made) only
        one time in fifty."""
        names = [n for n in ALL_IMPORTS if n not in avoid] if self.rng.random() < 0.98 else list(ALL_IMPORTS)
        name = self.rng.choice(names)
        n, _ = ALL_IMPORTS[name]
        args = " ".join(f"(i32.const {self.argument(name, i, memory) & 0xFFFFFFFF})" for i in range(n))
        count = "(global.set $calls (i32.add (global.get $calls) (i32.const 1)))"
        call = f"(call ${name} {args})"
        if self.rng.random() < 0.05:  # keep the result in memory (rarely out of bounds: a trap)
            return f"{count} (i32.store (i32.const {self.pointer(memory) & ~3}) {call})"
        return f"{count} (drop {call})"

    def calls(self, n: int, memory: int, avoid: tuple[str, ...] = ()) -> list[str]:
        """`n` random host calls (and now and then a memory.grow), as WAT statements."""
        body = []
        for _ in range(n):
            if self.rng.random() < 0.03:
                body.append(f"(drop (memory.grow (i32.const {self.rng.choice([0, 1, 4, 64, 40000])})))")
            body.append(self.call(memory, avoid))
        return body

    def ending(self, valid: str) -> str:
        """A function's last expression: mostly `valid`, sometimes a hostile result, a trap or a loop."""
        odd = f"(i32.const {self.rng.choice([-2, 3, self.vocab, 0x7FFFFFFF, 0x80000000 - (1 << 32)])})"
        return self.rng.choices([valid, odd, "(unreachable)", "(loop $f (br $f)) (i32.const 0)"],
                                weights=[84, 8, 5, 3])[0]

    def module(self, n_calls: int) -> tuple[str, int]:
        """A v1 guest (on_message makes the calls) or, one time in three, a v2 guest: on_message makes
        some and queues a prompt; on_token (each token) and on_end make a few each and return mostly
        valid results. Either may export on_history, which makes a few too."""
        rng = self.rng
        pages = rng.randint(1, 8)
        maximum = f" {pages + rng.randint(0, 8)}" if rng.random() < 0.5 else ""
        memory = pages * PAGE
        globals_ = []
        for g in range(rng.randint(0, 3)):
            kind = rng.choice(["i32", "i64", "f32", "f64"])
            value = rng.choice(["0", "-1", "7", "nan:0x1" if kind[0] == "f" else "123"])
            globals_.append(f'(global (export "g{g}") (mut {kind}) ({kind}.const {value}))')
        junk = "".join(f"\\{rng.randrange(256):02x}" for _ in range(rng.randint(0, 256)))
        count = "(global.set $calls (i32.add (global.get $calls) (i32.const 1)))"
        prompt = "(i32.store (i32.const 4096) (i32.const 17))"
        v2 = rng.random() < 1 / 3
        if v2:  # a prompt queued last (and the host's choice asked for at 64, maybe), so a turn runs
            choice = f"{count} (drop (call $choice_at (i32.const 64)))" if rng.random() < 0.5 else ""
            stream = f"{count} (drop (call $stream_tokens (i32.const 1)))" if rng.random() < 0.5 else ""
            logits = 0 if rng.random() < 0.7 else self.argument("prefill", 2, memory)
            # (v2: decode traps everywhere, sample before the turn's first forward, prefill after on_message)
            body = [choice, stream, *self.calls(n_calls // 3, memory, ("decode", "sample")), count, prompt]
            on_message = " ".join(body) + self.ending(
                f"(call $prefill (i32.const 4096) (i32.const 1) (i32.const {logits}))")
            take = "(i32.load (i32.const 64))" if choice else "(call $sample (i32.const 0))"
            per_token = self.calls(rng.randint(0, 3), memory, ("decode", "prefill"))
            exports = f"""(func (export "on_token") (result i32)
    {" ".join(per_token)} {self.ending(take)})"""
            if rng.random() < 0.7:
                at_end = self.calls(rng.randint(0, 4), memory, ("decode", "prefill"))
                exports += f"""(func (export "on_end") (param i32) (result i32)
    {" ".join(at_end)} {self.ending("(i32.const 0)")})"""
        else:  # first a valid prefill, so that sample() and decode() have logits to work on
            body = [f"{count} {prompt} (drop (call $prefill (i32.const 4096) (i32.const 1) (i32.const 0)))",
                    *self.calls(n_calls, memory)]
            on_message = " ".join(body) + self.ending("(i32.const 0)")
            exports = ""
        if rng.random() < 0.3:
            exports += f"""(func (export "on_history") (param i32 i32 i32) (result i32)
    {" ".join(self.calls(rng.randint(0, 4), memory))} {self.ending("(i32.const 0)")})"""
        alloc = rng.choices([1024, memory - 8, 0, 0x7FFF0000], weights=[90, 4, 3, 3])[0]
        wat = f"""(module
  {import_decls(skip=())}
  (memory (export "memory") {pages}{maximum})
  (global $calls (export "calls") (mut i32) (i32.const 0))
  {" ".join(globals_)}
  (data (i32.const 16) "ok")
  (data (i32.const 2048) "{junk}")
  (func (export "floe_abi_version") (result i32) (i32.const {2 if v2 else 1}))
  (func (export "alloc") (param i32) (result i32) (i32.const {alloc}))
  (func (export "on_message") (param i32 i32) (result i32)
    {on_message})
  {exports})"""
        return wat, len(body)


def run(min_calls: int, seed: int, calls_per_message: int = 60, deadline_s: float = 0.5,
        max_guests: int = 100_000) -> dict:
    """Random guests until `min_calls` host calls were made (or max_guests were tried)."""
    import wasmtime
    from models import tiny_engine

    from floe.actor import Actor, EngineLoop
    from floe.engine import SamplingParams
    from floe.wasm import GuestError

    engine = tiny_engine(n_slots=4)
    # v2 turns in the engine's own loop, or in one that speculates and feeds rows (forced on here, where
    # the CPU's step does not run on its own): a guest's hostile token must undo a speculated row.
    loops = [None, EngineLoop(engine, overlap=True, feed=True)]
    rng = random.Random(seed)
    gen = GuestGenerator(rng, engine.config.vocab_size)
    outcomes: collections.Counter = collections.Counter()
    unexpected: list[str] = []
    calls = messages = guests = 0
    # A bystander: a well-behaved actor that holds a conversation all along; nothing may change it.
    bystander = Actor(engine)
    bystander.send("Hi", max_tokens=4)
    before = _fingerprint(bystander)
    start = time.monotonic()
    while calls < min_calls and guests < max_guests:
        guests += 1
        wat, _ = gen.module(calls_per_message)
        wasm = wasmtime.wat2wasm(wat)
        cap = rng.choice([1, 4, 16]) << 20
        try:
            actor = Actor(engine, wasm, memory_cap=cap, deadline_s=deadline_s, seed=rng.randrange(1 << 30),
                          loop=rng.choice(loops))
        except GuestError as e:
            outcomes[f"load:{type(e).__name__}"] += 1
            continue
        except Exception:  # noqa: BLE001 - what the fuzz is for
            unexpected.append(traceback.format_exc())
            continue
        with actor:
            version = f"v{actor.abi_version}"
            for _ in range(2):
                messages += 1
                params = SamplingParams(temperature=rng.choice([0.0, 0.7, 1.5]), top_k=rng.choice([0, 5]))
                history = actor.guest.has_function("on_history") and rng.random() < 0.5
                try:
                    if history:
                        actor.add_history(rng.choice(actor.HISTORY_ROLES), "Hi " * rng.randint(0, 9))
                    actor.send("Hi " * rng.randint(0, 30), max_tokens=rng.randint(1, 32), params=params)
                    outcomes[f"{version}:ok"] += 1
                except GuestError as e:
                    outcomes[f"{version}:{type(e).__name__}"] += 1
                except Exception:  # noqa: BLE001
                    unexpected.append(traceback.format_exc())
            calls += dict((n, b) for n, _, b in actor.capture_state().globals)["calls"]
    intact = _fingerprint(bystander) == before
    bystander.close()
    with Actor(engine) as actor:  # the host still serves a well-behaved guest
        healthy = actor.send("Hi", max_tokens=3).stats.generated_tokens == 3
    return {"guests": guests, "messages": messages, "host_calls": calls, "outcomes": dict(outcomes),
            "unexpected": unexpected, "healthy_after": healthy, "bystander_intact": intact,
            "seconds": round(time.monotonic() - start, 1)}


SECTIONS_SEED = """(module
  (table 4 8 funcref) (table $u 2 externref)
  (memory (export "memory") 1)
  (global i32 (i32.const 0))
  (func $f (local i32 i64 f32 f64) (local.set 0 (i32.const 1)))
  (elem (i32.const 0) $f $f) (elem func $f) (elem (table 0) (i32.const 1) func $f) (elem declare func $f)
  (elem (i32.const 2) funcref (ref.func $f)) (elem funcref (ref.null func))
  (elem (table 0) (i32.const 3) funcref (ref.func $f)) (elem declare funcref (ref.func $f))
  (data (i32.const 0) "x"))"""


def _headers(data: bytes) -> list[int]:
    """Offsets worth mutating: each section's id, size and first bytes (counts, kinds, limits, the first
    body's size and locals), found by walking the sections as far as they go."""
    from floe.wasm import shape

    spots = []
    try:
        for _, r in shape._sections(data):
            spots += range(max(8, r.at - 6), min(r.end, r.at + 12))  # (id and size: at most 6 bytes)
    except Exception:  # noqa: BLE001 - a seed module reads; only what follows a mutation may not
        pass
    return spots or list(range(8, len(data)))


def mutate(rng: random.Random, data: bytes) -> bytes:
    """One to three mutations at header offsets: a random, extreme or continuation byte, a byte
    inserted or removed, or the module cut short."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        at = rng.choice(_headers(bytes(out)) or [8])
        if at >= len(out):
            continue
        kind = rng.randrange(6)
        if kind == 0:
            out[at] = rng.randrange(256)
        elif kind == 1:
            out[at] = rng.choice([0x00, 0x7F, 0x80, 0xFF, 0x40, 0x09, 0x0B])
        elif kind == 2:
            out[at] |= 0x80  # a LEB128 that goes on
        elif kind == 3:
            out[at:at] = bytes([rng.choice([0x80, 0xFF, 0x01, 0x7F])])
        elif kind == 4:
            del out[at]
        else:
            del out[rng.randrange(8, len(out)):]
    return bytes(out)


def run_mutants(mutants: int, seed: int) -> dict:
    """Load `mutants` mutated modules: outcomes by who refused them, and anything unexpected."""
    import wasmtime

    from floe.guests import __file__ as guests_init
    from floe.wasm import GuestLoadError, runtime, shape

    shipped = sorted(Path(guests_init).parent.glob("*.wasm"))
    seeds = [p.read_bytes() for p in shipped if p.stat().st_size < 8192]  # small: each compiles in ms
    seeds.append(wasmtime.wat2wasm(SECTIONS_SEED))
    rng = random.Random(seed)
    outcomes: collections.Counter = collections.Counter()
    unexpected: list[str] = []
    start = time.monotonic()
    for _ in range(mutants):
        data = mutate(rng, rng.choice(seeds))
        try:
            why = shape.refusal(data)
            if why is not None:  # then loading raises GuestLoadError with it (test_module_limits.py)
                assert why.startswith(("is ", "declares ")), why
                outcomes["refused: " + ("malformed" if why.startswith("is malformed") else "a bound")] += 1
                continue
            try:
                runtime.GuestModule(runtime.default_runtime(), data, "mutant.wasm")
                outcomes["compiled"] += 1
            except GuestLoadError:
                outcomes["refused by Wasmtime"] += 1
        except Exception:  # noqa: BLE001 - what the fuzz is for
            unexpected.append(f"{data.hex()}\n{traceback.format_exc()}")
    return {"mutants": mutants, "outcomes": dict(outcomes), "unexpected": unexpected,
            "seconds": round(time.monotonic() - start, 1)}


def _fingerprint(actor) -> tuple:
    """An actor's whole state, comparably: KV cache tokens and bytes, guest memory and globals, RNG."""
    state = actor.capture_state()
    kv = b"".join(t.cpu().numpy().tobytes() for t in (*state.k, *state.v))
    return (state.tokens, kv, state.memory_size, state.memory_pages.tobytes(), state.memory_data.tobytes(),
            state.globals, state.rng.numpy().tobytes())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-calls", type=int, default=10_000, help="stop after this many host calls")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--calls", type=int, default=60, help="host calls per message")
    parser.add_argument("--mutants", type=int, default=0, help="load this many mutated modules instead")
    args = parser.parse_args()
    if args.mutants:
        print(json.dumps(run_mutants(args.mutants, args.seed)))
    else:
        print(json.dumps(run(args.min_calls, args.seed, args.calls)))


if __name__ == "__main__":
    main()
