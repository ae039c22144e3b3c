"""Snapshot mutation fuzz: hostile or broken files are refused with a SnapshotError, never anything else.

One small snapshot (a tiny random model, a guest whose state is in memory pages, globals of every
type and the KV cache) is made once; 600 seeded mutants of it cover the header-length field, the
header's JSON structure (types swapped, keys dropped, lists and objects swapped, huge, negative and
non-numeric numbers, dtype, shape and offset edits), the metadata's structure, and the data bytes.
For half of them the checksums are recomputed after the mutation, so the format's checks, not the
checksum, must catch them. Each mutant is read by `header`, `Snapshot` and `thaw`: every outcome is
a SnapshotError or a thaw whose restored state equals the original's, and whatever floe accepts the
safetensors library accepts too. The mutants run in a fresh process, so a crash or a hang fails
the test (with the last mutant's description) instead of taking the test run down with it.

Run alone: python tests/test_snapshot_fuzz.py [--seed N] [--count N]
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import struct
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import xxhash
from guests_wat import guest

SEED = 14
COUNT = 600
# All four global types (a permutation of the globals' names cannot then pass as another valid state).
FUZZ_GUEST = guest(
    "(global.set $a (i32.sub (global.get $a) (i32.const 1)))"
    "(global.set $d (f64.mul (global.get $d) (f64.const 3)))"
    "(i32.store (i32.const 4096) (i32.const 17)) (i32.store (i32.const 4100) (i32.const 18))"
    "(i32.store (i32.const 4104) (i32.const 19))"
    "(drop (call $prefill (i32.const 4096) (i32.const 3) (i32.const 0)))"
    "(i32.store (i32.const 70000) (i32.const 0x5eed))"
    "(drop (call $emit (i32.const 16) (i32.const 2))) (i32.const 0)",
    extra='(global $a (export "a") (mut i32) (i32.const -5))'
          '(global $b (export "b") (mut i64) (i64.const -1234567890123))'
          '(global $c (export "c") (mut f32) (f32.const -2.5))'
          '(global $d (export "d") (mut f64) (f64.const -0.125))',
)


# ---- one small snapshot -------------------------------------------------------------------------

def tiny_engine(max_seq_len: int = 64):
    """tests/models.py's tiny engine with a short context: a small KV cache to mutate."""
    from models import tiny_engine as make

    return make(n_slots=2, max_seq_len=max_seq_len)


def tiny_snapshot(engine, module, path: Path):
    """Freeze an actor of `module` after two messages to `path`; returns its state (copied)."""
    from floe import snapshot
    from floe.actor import Actor

    with Actor(engine, module, seed=7) as actor:
        actor.send("one")
        actor.send("two")
        snapshot.freeze(actor, path)
        return own_copy(actor.capture_state())


def own_copy(state):
    state.k, state.v = [t.clone() for t in state.k], [t.clone() for t in state.v]
    state.memory_pages, state.memory_data = state.memory_pages.copy(), state.memory_data.copy()
    state.rng = state.rng.clone()
    return state


def same_state(a, b) -> bool:
    """The parts of two actor states that a thaw restores, compared exactly."""
    kv = len(a.k) == len(b.k) and all(torch.equal(x, y) for x, y in zip(a.k + a.v, b.k + b.v, strict=True))
    memory = (a.memory_size == b.memory_size and np.array_equal(a.memory_pages, b.memory_pages)
              and np.array_equal(a.memory_data, b.memory_data))
    return (kv and memory and a.tokens == b.tokens and a.globals == b.globals and torch.equal(a.rng, b.rng)
            and a.system_prompt == b.system_prompt)


# ---- a file as header + data -------------------------------------------------------------------

def split(raw: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack_from("<Q", raw)
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def join(header: object, data: bytes, text_edit: Callable[[str], str] | None = None) -> bytes:
    text = json.dumps(header, separators=(",", ":"))
    text = text_edit(text) if text_edit else text
    body = text.encode("utf-8", "surrogatepass")
    body += b" " * (-(8 + len(body)) % 8)  # as safetensors pads it
    return struct.pack("<Q", len(body)) + body + data


_TORCH = {"F32": "torch.float32", "BF16": "torch.bfloat16", "F16": "torch.float16", "I64": "torch.int64",
          "I32": "torch.int32", "I8": "torch.int8", "U8": "torch.uint8"}


def reseal(header: object, data: bytes, digests: bool = True) -> None:
    """Recompute a (mutated) header's checksums as a writer would: the per-tensor digests over the
    bytes its offsets name, and the checksum over names, dtypes, shapes and metadata."""
    from floe.snapshot import checksum

    m = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(m, dict):
        return  # the mutation broke the metadata itself: nothing to seal
    entries, sums = {}, {}
    for name, e in header.items():
        try:
            start, end = e["data_offsets"]
            sums[name] = xxhash.xxh3_128(data[start:end]).hexdigest()
            entries[name] = SimpleNamespace(dtype=_TORCH.get(e["dtype"], e["dtype"]), shape=tuple(e["shape"]))
        except (KeyError, TypeError, ValueError):
            continue
    sums.pop("__metadata__", None)
    entries.pop("__metadata__", None)
    if digests and isinstance(m.get("checksums"), str):  # a mutation to another type stays
        m["checksums"] = json.dumps(dict(sorted(sums.items())))
    if isinstance(m.get("checksum"), str):
        m["checksum"] = checksum(entries, m)


# ---- mutations ----------------------------------------------------------------------------------

@dataclass
class Mutant:
    category: str
    desc: str
    header: object = None
    data: bytes = b""
    text_edit: Callable[[str], str] | None = None
    reseal_digests: bool = True  # False where the mutation is of the digests themselves
    raw: bytes | None = None  # a whole file, for mutations below the header's structure
    resealed: bool = field(default=False)


JUNK = [None, True, False, -1, 0, 1.5, 1e300, 2**63, 2**64, 10**30, "", "3", "F32", [], [1], [0, 8], {},
        {"0": 3}, [[1]]]
NUMBERS = ["-1", "", " 3", "+3", "3.0", "1e3", "0x10", "abc", "\u0663", str(2**64), str(10**30), "00",
           str(2**31), "4097", "999999999999999999999"]


def tensor_names(h: dict) -> list[str]:
    return [k for k in h if k != "__metadata__"]


def mut_field_type(rng, h, data):
    name, key = rng.choice(tensor_names(h)), rng.choice(["dtype", "shape", "data_offsets"])
    if rng.random() < 0.3:
        del h[name][key]
        return f"drop {name}.{key}"
    h[name][key] = value = copy.deepcopy(rng.choice(JUNK))
    return f"{name}.{key} = {value!r}"


def mut_numbers(rng, h, data):
    name, key = rng.choice(tensor_names(h)), rng.choice(["shape", "data_offsets"])
    values = h[name][key]
    if not values:
        values.append(rng.choice([1, -1, 2**64]))
        return f"{name}.{key} gains a value"
    i = rng.randrange(len(values))
    values[i] = rng.choice([-1, -2**63, 2**63, 2**64, 2**64 - 1, 10**30, 0.5, 1e300, "7", True, None,
                            values[i] + 1, values[i] - 1, values[i] * 2 + 1, values[i] + 4096])
    return f"{name}.{key}[{i}] = {values[i]!r}"


def mut_dtype(rng, h, data):
    name = rng.choice(tensor_names(h))
    h[name]["dtype"] = dtype = rng.choice(["F16", "BF16", "F32", "F64", "I8", "U8", "I16", "I32", "I64",
                                           "U64", "BOOL", "f32", "Q4_K", "", "F8_E4M3"])
    return f"{name}.dtype = {dtype}"


def mut_shape(rng, h, data):
    name = rng.choice(tensor_names(h))
    shape = h[name]["shape"]
    how = rng.choice(["reverse", "append 1", "prepend 1", "drop last", "empty", "flatten"])
    h[name]["shape"] = {"reverse": shape[::-1], "append 1": shape + [1], "prepend 1": [1] + shape,
                        "drop last": shape[:-1], "empty": [],
                        "flatten": [int(np.prod(shape))]}[how]
    return f"{name}.shape {shape} -> {h[name]['shape']} ({how})"


def mut_offsets(rng, h, data):
    names = tensor_names(h)
    a = rng.choice(names)
    size = _nbytes(h, a)
    # Swapping equal-sized tensors would be a valid file of another state: a forgery, not damage.
    b = rng.choice([n for n in names if _nbytes(h, n) != size])
    how = rng.choice(["swap", "shift start", "shift end", "shift both", "copy", "zero"])
    oa, ob = h[a]["data_offsets"], h[b]["data_offsets"]
    delta = rng.choice([-8, -4, -1, 1, 4, 8, 4096])
    h[a]["data_offsets"] = {"swap": ob, "shift start": [oa[0] + delta, oa[1]],
                            "shift end": [oa[0], oa[1] + delta], "shift both": [oa[0] + delta, oa[1] + delta],
                            "copy": list(ob), "zero": [0, oa[1] - oa[0]]}[how]
    if how == "swap":
        h[b]["data_offsets"] = oa
    return f"{a}.data_offsets {oa} -> {h[a]['data_offsets']} ({how}, other {b})"


def mut_tensor_set(rng, h, data):
    names = tensor_names(h)
    name = rng.choice(names)
    how = rng.choice(["drop", "rename", "extra empty", "unknown key", "alias"])
    if how == "drop":
        del h[name]
    elif how == "rename":
        new = rng.choice([name.upper(), name + ".x", "kv.9.k", "kv.-1.v", "tokens2", "__metadata__x"])
        h[new] = h.pop(name)
    elif how == "extra empty":
        end = len(data)
        h[rng.choice(["extra", "kv.2.k", "kv.0.k.scale"])] = {"dtype": "U8", "shape": [0],
                                                             "data_offsets": [end, end]}
    elif how == "unknown key":
        h[name]["offsets"] = h[name]["data_offsets"]
    else:
        h[name + ".alias"] = copy.deepcopy(h[name])
    return f"{how} {name}"


def mut_top_level(rng, h, data):
    how = rng.choice(["list", "number", "string", "null", "nested"])
    value = {"list": list(h.items()), "number": 42, "string": "floe", "null": None, "nested": {"x": h}}[how]
    return value, f"the header is a JSON {how}"


def mut_json_text(rng, h, data):
    """Edits only JSON text can express: duplicate keys, NaN, deep nesting, unpaired surrogates."""
    how = rng.choice(["duplicate", "nan", "infinity", "deep", "surrogate", "trailing", "bom"])
    name = rng.choice(tensor_names(h))
    dup = json.dumps({name: h[name]})[1:-1]
    edits = {"duplicate": lambda t: "{" + dup + "," + t[1:],
             "nan": lambda t: t.replace('"shape"', '"nan":NaN,"shape"', 1),
             "infinity": lambda t: t.replace('"shape"', '"inf":-Infinity,"shape"', 1),
             "deep": lambda t: '{"deep":' + "[" * 100_000 + "]" * 100_000 + "," + t[1:],
             "surrogate": lambda t: t.replace(json.dumps(name), json.dumps(name)[:-1] + '\\ud800"', 1),
             "trailing": lambda t: t + "{}",
             "bom": lambda t: "\ufeff" + t}
    return edits[how], f"JSON text: {how} ({name})"


def mut_metadata(rng, h, data):
    m = h["__metadata__"]
    how = rng.choice(["type", "drop", "value type", "number", "enum", "identity"])
    if how == "type":
        h["__metadata__"] = value = rng.choice([list(m.items()), 42, "x", None, [m], {"nested": m}, True])
        return f"__metadata__ is a {type(value).__name__}"
    key = rng.choice(sorted(m))
    if how == "drop":
        del m[key]
        return f"metadata lacks {key}"
    if how == "value type":
        m[key] = copy.deepcopy(rng.choice([1, None, True, [], {}, 1.5, ["x"], {"a": "b"}]))
        return f"metadata {key} = {m[key]!r}"
    if how == "number":
        key = rng.choice(["kv_len", "n_layers", "n_kv_heads", "head_dim", "guest_memory_bytes", "abi_version",
                          "format_version", "guest_page_size"])
        m[key] = rng.choice(NUMBERS + [str(int(m[key]) + 1), str(max(int(m[key]) - 1, 0))])
        return f"metadata {key} = {m[key]!r}"
    if how == "enum":
        key = rng.choice(["kv_dtype", "format", "format_version", "engine_weights"])
        m[key] = rng.choice(["int8", "bfloat16", "float16", "int4", "", "floe-snapshot2", "3", "0", "1"])
        return f"metadata {key} = {m[key]!r}"
    key = rng.choice(["model_fingerprint", "guest_sha256", "abi_version"])
    m[key] = {"abi_version": "2"}.get(key, "0" * 64)
    return f"metadata {key} = {m[key]!r}"


def mut_metadata_json(rng, h, data):
    m = h["__metadata__"]
    key = rng.choice(["globals", "app", "checksums"])
    kinds = json.loads(m["globals"])
    other = {"i32": "i64", "i64": "i32", "f32": "f64", "f64": "f32"}
    options = ["", "[", "{}", "[]", "null", "1", '"x"', '[["a","v128"]]', '[["a","i32"],["a","i32"]]',
               "[" * 50_000 + "]" * 50_000, '[[1,"i32"]]', '[["a"]]', '[["a","i32",3]]', "[NaN]",
               json.dumps(kinds[::-1]), json.dumps(kinds[1:]), json.dumps([[n + "x", k] for n, k in kinds]),
               json.dumps([[n, other[k]] for n, k in kinds]),
               json.dumps({"x": 1}), '{"a":1,"a":2}']
    m[key] = rng.choice(options)
    return f"metadata {key} = {m[key][:60]!r}"


def _nbytes(h: dict, name: str) -> int:
    start, end = h[name]["data_offsets"]
    return end - start


def _tensor_bytes(h: dict, data: bytes, name: str) -> tuple[int, int]:
    return tuple(h[name]["data_offsets"])


def mut_values(rng, h, data):
    """Data the checksums would not catch once resealed, but the format forbids."""
    out = bytearray(data)
    m = h["__metadata__"]
    what = rng.choice(["page", "global", "token", "rng"])
    if what == "page":
        start, end = _tensor_bytes(h, data, "guest.memory.pages")
        pages = np.frombuffer(data[start:end], np.int32).copy()
        i = rng.randrange(len(pages))
        how = rng.choice(["-1", "past the end", "repeat", "swap"])
        if how == "swap" and len(pages) > 1:
            j = (i + 1) % len(pages)
            pages[i], pages[j] = pages[j], pages[i]
        elif how == "repeat" and len(pages) > 1:
            pages[i] = pages[i - 1] if i else pages[1]
        else:
            pages[i] = -1 if how == "-1" else int(m["guest_memory_bytes"]) // 4096 + rng.choice([0, 5])
        out[start:end] = pages.tobytes()
        desc = f"guest page {i} {how}: {pages.tolist()}"
    elif what == "global":
        start, end = _tensor_bytes(h, data, "guest.globals")
        bits = np.frombuffer(data[start:end], np.int64).copy()
        kinds = [k for _, k in json.loads(m["globals"])]
        i = rng.choice([j for j, k in enumerate(kinds) if k in ("i32", "f32")])
        bits[i] = rng.choice([2**32, -(2**31) - 1, 2**40, -(2**40)])  # no 32-bit pattern
        out[start:end] = bits.tobytes()
        desc = f"global {i} ({kinds[i]}) bits = {bits[i]}"
    elif what == "token":
        start, end = _tensor_bytes(h, data, "tokens")
        tokens = np.frombuffer(data[start:end], np.int32).copy()
        i = rng.randrange(len(tokens))
        tokens[i] = rng.choice([-1, 49152, 2**31 - 1, -(2**31)])
        out[start:end] = tokens.tobytes()
        desc = f"token {i} = {tokens[i]}"
    else:
        start, end = _tensor_bytes(h, data, "sampler.rng")
        out[start:end] = bytes([rng.choice([0, 255])]) * (end - start)
        desc = "sampler.rng all " + str(out[start])
    return bytes(out), desc


def mut_neutral(rng, h, data):
    """Valid rewrites of the same state: key order, tensor order in the data section."""
    names = tensor_names(h)
    if rng.random() < 0.5:
        items = list(h.items())
        rng.shuffle(items)
        return dict(items), data, "JSON keys shuffled"
    order = names[:]
    rng.shuffle(order)
    out, at = bytearray(), 0
    for name in order:
        start, end = h[name]["data_offsets"]
        h[name]["data_offsets"] = [at, at + end - start]
        out += data[start:end]
        at += end - start
    return h, bytes(out), "tensors reordered in the data section"


def mut_data(rng, raw: bytes, n: int) -> tuple[bytes, str]:
    out = bytearray(raw)
    flips = [rng.randrange(8 + n, len(raw)) for _ in range(rng.choice([1, 1, 2, 8]))]
    for i in flips:
        out[i] ^= 1 << rng.randrange(8)
    return bytes(out), f"data bits flipped at {flips[:3]}"


def mut_length(rng, raw: bytes, n: int) -> tuple[bytes, str]:
    size = len(raw)
    value = rng.choice([0, 1, 7, n - 1, n + 1, n - 8, n + 8, size - 8, size, size + 1, 2**63, 2**64 - 1,
                        100_000_000, 100_000_001, 256 << 20, rng.randrange(2**64)])
    return struct.pack("<Q", value) + raw[8:], f"header length {n} -> {value}"


def mut_bytes(rng, raw: bytes, n: int) -> tuple[bytes, str]:
    how = rng.choice(["header byte", "truncate", "append", "insert", "empty", "zeros", "not utf-8"])
    out = bytearray(raw)
    if how == "header byte":
        i = rng.randrange(8, 8 + n)
        out[i] = rng.randrange(256)
    elif how == "truncate":
        out = out[:rng.randrange(len(raw))]
    elif how == "append":
        out += bytes(rng.randrange(256) for _ in range(rng.choice([1, 7, 8, 64, 4096])))
    elif how == "insert":
        i = rng.randrange(8 + n, len(raw))
        out[i:i] = bytes(rng.choice([1, 8]))
    elif how == "empty":
        out = bytearray()
    elif how == "zeros":
        out = bytearray(len(raw))
    else:
        out[8:8 + n] = b"\xff" * n
    return bytes(out), f"file bytes: {how}"


STRUCTURED = {"json": [mut_field_type, mut_numbers, mut_dtype, mut_shape, mut_offsets, mut_tensor_set,
                       mut_top_level, mut_json_text, mut_neutral],
              "metadata": [mut_metadata, mut_metadata_json], "values": [mut_values]}
RAW = {"length": mut_length, "bytes": mut_bytes, "data": mut_data}


def structured(rng, category: str, raw: bytes) -> Mutant:
    h, data = split(raw)
    fn = rng.choice(STRUCTURED[category])
    result = fn(rng, h, data)
    mutant = Mutant(category, fn.__name__, header=h, data=data)
    if fn is mut_top_level:
        mutant.header, desc = result
    elif fn is mut_json_text:
        mutant.text_edit, desc = result
    elif fn is mut_values:
        mutant.data, desc = result
    elif fn is mut_neutral:
        mutant.header, mutant.data, desc = result
    else:
        desc = result
        mutant.reseal_digests = "checksums" not in desc
    mutant.desc = f"{category}: {desc}"
    return mutant


def mutants(raw: bytes, seed: int, count: int):
    """`count` mutants of `raw`; even ones structured and resealed, odd ones drawn from everything."""
    rng = random.Random(seed)
    (n,) = struct.unpack_from("<Q", raw)
    for i in range(count):
        resealed = i % 2 == 0
        category = rng.choice(list(STRUCTURED) + ([] if resealed else list(RAW) * 2))
        if category in RAW:
            data, desc = RAW[category](rng, raw, n)
            yield Mutant(category, f"{category}: {desc}", raw=data)
            continue
        mutant = structured(rng, category, raw)
        if resealed:
            reseal(mutant.header, mutant.data, mutant.reseal_digests)
        mutant.resealed = resealed
        mutant.raw = join(mutant.header, mutant.data, mutant.text_edit)
        yield mutant


# ---- running the mutants ------------------------------------------------------------------------

def outcome(path: Path, engine, module, original) -> tuple[str, list[str]]:
    """(the thaw's outcome: an error class name or "identical"/"DIFFERENT STATE", problems found)."""
    from safetensors import safe_open

    from floe.snapshot import Snapshot, SnapshotError, header, thaw

    problems, accepted = [], {}
    for reader, fn in (("header", lambda: header(path)), ("Snapshot", lambda: Snapshot(path).summary())):
        try:
            fn()
            accepted[reader] = True
        except SnapshotError:
            accepted[reader] = False
        except Exception as e:  # noqa: BLE001 - the point is to see every other type
            problems.append(f"{reader} leaked {type(e).__name__}: {str(e)[:200]}")
    try:
        with thaw(engine, path, module) as actor:
            result = "identical" if same_state(actor.capture_state(), original) else "DIFFERENT STATE"
    except SnapshotError as e:
        result = type(e).__name__
    except Exception as e:  # noqa: BLE001
        result = "leak"
        problems.append(f"thaw leaked {type(e).__name__}: {str(e)[:200]}")
    if result == "DIFFERENT STATE":
        problems.append("thawed into a state that is not the original's")
    if result == "identical" and not all(accepted.values()):
        problems.append(f"thaw loaded what the readers refused: {accepted}")
    if accepted.get("header"):
        try:
            with safe_open(str(path), framework="pt") as f:
                list(f.keys())
        except Exception as e:  # noqa: BLE001
            problems.append(f"floe accepted a file safetensors refuses: {str(e)[:200]}")
    return result, problems


def run(seed: int, count: int, folder: Path) -> dict:
    from floe.wasm import default_runtime

    engine, module = tiny_engine(), default_runtime().compile(FUZZ_GUEST)
    original_path = folder / "original.safetensors"
    original = tiny_snapshot(engine, module, original_path)
    raw = original_path.read_bytes()
    base, problems = outcome(original_path, engine, module, original)
    report = {"seed": seed, "original": base, "mutants": 0, "resealed": 0, "outcomes": Counter(),
              "categories": Counter(), "identical": Counter(),
              "problems": [f"original: {p}" for p in problems]}
    t0 = time.perf_counter()
    for i, mutant in enumerate(mutants(raw, seed, count)):
        print(f"mutant {i}: {mutant.desc}", file=sys.stderr, flush=True)  # the last line names a crash
        path = folder / f"m{i}.safetensors"
        path.write_bytes(mutant.raw)
        result, problems = outcome(path, engine, module, original)
        path.unlink()
        report["mutants"] += 1
        report["resealed"] += mutant.resealed
        report["outcomes"][result] += 1
        report["categories"][mutant.category] += 1
        report["identical"][mutant.category] += result == "identical"
        report["problems"] += [f"mutant {i} ({mutant.desc}): {p}" for p in problems]
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report


def test_no_mutant_of_a_snapshot_crashes_hangs_or_leaks_an_error_that_is_not_a_snapshot_error(tmp_path):
    proc = subprocess.run([sys.executable, __file__, "--seed", str(SEED), "--count", str(COUNT),
                           "--folder", str(tmp_path)], capture_output=True, text=True, timeout=150)
    last = proc.stderr.strip().splitlines()[-5:]
    assert proc.returncode == 0, f"the fuzz process died (rc {proc.returncode}); its last lines: {last}"
    report = json.loads(proc.stdout)
    assert report["problems"] == []
    assert report["original"] == "identical"
    assert report["mutants"] == COUNT and report["resealed"] == COUNT // 2
    for category in ("length", "bytes", "json", "metadata", "values", "data"):
        assert report["categories"][category] >= 30, report["categories"]
    outcomes = report["outcomes"]  # the valid rewrites (key or tensor order) thaw; the rest is refused
    assert outcomes["identical"] >= 10 and outcomes["SnapshotCorrupt"] >= COUNT // 2, outcomes


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--count", type=int, default=COUNT)
    parser.add_argument("--folder", type=Path, required=True)
    args = parser.parse_args()
    print(json.dumps(run(args.seed, args.count, args.folder)))
