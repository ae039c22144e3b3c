"""Host imports answered in C (floe/wasm/csrc/host_imports.cpp): what a chat's arrival (on_message) and
its end (on_end) ask of the host — request, system, eos_ids, choice_at, stream_tokens, kv_truncate,
prefill, detokenize, and chat_render and tokenize of a conversation whose render and ids floe serve's
front made ahead (its prompt hint: floe.model.tokenizer.Hint). Each answers the plain case exactly as
HostABI's Python method does and hands every other case to that method (its Python twin), so a bad
pointer, an exceeded budget or a past deadline gets the same error as before from the same code.

An actor's NativeImports is staged around each of its guest calls that may ask them (stage / unstage:
an arrival's on_message, its history, a turn's on_end; never on the main thread, where a signal must be
able to interrupt a host call): the message's budget room, its request record, its hint, its KV slot's
length, whether ABI v2 options may be set. What the native answers did — the budget's bytes, the
ledger's copies, choice_at's and stream_tokens' settings, the hint's use, a truncation of the slot and
the ids queued — is taken into the Python objects (fold) before any Python import runs and when the call
returns, so everything reads as it would have.

The one difference: a cancellation (Watchdog.cancel) stops the guest at its next epoch tick or Python
host call, not at a native answer (a native answer takes well under a microsecond).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
import time
import weakref
from array import array
from itertools import accumulate
from pathlib import Path

import numpy as np
import torch

from floe.actor.abi import REQUEST, HostABI
from floe.model.tokenizer import Hint, Tokenizer
from floe.wasm import HostFunction
from floe.wasm.raw import signals

log = logging.getLogger("floe.actor")
SOURCE = Path(__file__).parent.parent / "wasm" / "csrc" / "host_imports.cpp"
# The ledger's boundaries the native answers cross (csrc/host_imports.cpp's Boundary, in order): the
# names HostABI's Python methods record.
BOUNDARIES = ("host→guest request", "host→guest system prompt", "host→guest eos ids", "guest→host token ids",
              "host→guest text", "guest→host message table", "guest→host message role", "guest→host message",
              "host→guest prompt text", "guest→host text", "host→guest token ids", "guest→engine prompt ids")
_SHARED_AT = BOUNDARIES.index("guest→engine prompt ids")  # (crossed without a copy: Ledger.shared)
NATIVE = ("request", "system", "eos_ids", "choice_at", "stream_tokens", "detokenize", "chat_render",
          "tokenize", "kv_truncate", "prefill")
PREFILL_CAP = 4096  # ids a native prefill queues at most (a longer prompt is queued in Python)
# Whether calls are staged for native answers (FLOE_NATIVE_IMPORTS=0: every import in Python, as before;
# bench/probes/request_cpu.py --native-imports alternate compares the two in one process).
enabled = os.environ.get("FLOE_NATIVE_IMPORTS", "1") != "0"


class W:
    """The words of csrc/host_imports.cpp's State, in its order."""

    ON, BASE, SIZE_AT, WHEN_AT, ROOM, CHARGED, PREPARING_V2 = 0, 1, 2, 3, 4, 5, 6
    REQUEST, REQUEST_LEN, SYSTEM, SYSTEM_LEN, EOS, EOS_N = 7, 8, 9, 10, 11, 12
    TOKEN_END, TOKEN_BYTES, VOCAB = 13, 14, 15
    CHOICE_SET, CHOICE_PTR, STREAMS_SET, STREAMS = 16, 17, 18, 19
    PYTHON, FORGET = 20, 21
    TEXT_CAP, MAX_SEQ = 22, 23
    HINT_N, HINT_ENDS, HINT_TEXT, RENDERED, RENDERED_LEN, HINT_IDS, HINT_IDS_N = 24, 25, 26, 27, 28, 29, 30
    RENDERED_SET, HINT_USED = 31, 32
    KV_LEN, KV_HOLDS, QUEUED, PREFILL_AT, PREFILL_CAP, PREFILL_N, PREFILL_LOGITS, TRUNCATE_N = range(33, 41)
    TOUCHED = 41  # bit i: BOUNDARIES[i] counts something
    LEDGER = 42  # calls and bytes of each of BOUNDARIES
    WORDS = LEDGER + 2 * len(BOUNDARIES) + 1  # (and the imports' count, the C side's own)


_lock = threading.Lock()
_library: ctypes.PyDLL | None = None
_tried = False


def library() -> ctypes.PyDLL | None:
    """The native imports' library, built on first use (a second or two), or None where it cannot be
    built (no compiler: every import is answered in Python, as before)."""
    global _library, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                from floe.engine.cbuild import BuildError, build_plain

                lib = ctypes.PyDLL(str(build_plain("floe_host_imports", [SOURCE], [],
                                                   what="the host ABI's native imports")))
                lib.floe_import_state.restype = ctypes.c_void_p
                lib.floe_import_state.argtypes = []
                lib.floe_import_env.restype = ctypes.c_void_p
                lib.floe_import_env.argtypes = [ctypes.c_void_p, ctypes.c_int64]
                lib.floe_import_state_words.restype = ctypes.c_int64
                lib.floe_import_release.argtypes = [ctypes.c_void_p]
                if lib.floe_import_state_words() != W.WORDS:
                    raise BuildError(f"csrc/host_imports.cpp's State has {lib.floe_import_state_words()} "
                                     f"words, floe.actor.native_imports.W {W.WORDS}")
                _library = lib
            except (BuildError, OSError) as e:
                log.warning("host imports are answered in Python (the native ones are not available: %s)", e)
    return _library


class _TokenTable:
    """Each id's bytes (Tokenizer.ids_bytes of it alone) in one buffer, for the native detokenize:
    ends[i] is where id i's bytes end (its start: ends[i - 1], 0 for id 0)."""

    def __init__(self, tokenizer: Tokenizer, vocab: int) -> None:
        pieces = [tokenizer.ids_bytes([i]) for i in range(vocab)]
        self.ends = np.cumsum(np.fromiter(map(len, pieces), np.int64, count=vocab))
        self.data = np.frombuffer(b"".join(pieces) or b"\0", np.uint8)


_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {vocab: _TokenTable}


def _token_table(tokenizer: Tokenizer, vocab: int) -> _TokenTable:
    with _lock:
        kept = _tables.setdefault(tokenizer, {})
        table = kept.get(vocab)
    if table is None:  # (two threads may both make it: the same table)
        table = _TokenTable(tokenizer, vocab)
        with _lock:
            table = kept.setdefault(vocab, table)
    return table


class NativeImports:
    """An actor's State (csrc/host_imports.cpp) and its staging; `staged` while a guest call may have
    imports answered natively."""

    def __init__(self, lib: ctypes.PyDLL, abi: HostABI, python: tuple[int, int]) -> None:
        self.lib, self.abi = lib, abi
        self.state = lib.floe_import_state()
        if not self.state:
            raise MemoryError("no memory for an actor's native imports")
        # (held until this object goes: Wasmtime's finalizers may come before or after that)
        weakref.finalize(self, lib.floe_import_release, ctypes.c_void_p(self.state))
        self.words = memoryview((ctypes.c_int64 * W.WORDS).from_address(self.state)).cast("B").cast("q")
        w = self.words
        w[W.PYTHON], w[W.FORGET] = python
        tokenizer = abi.tokenizer
        self._eos = np.array(list(tokenizer.eos_ids), np.int32)
        w[W.EOS], w[W.EOS_N] = self._eos.ctypes.data, len(self._eos)
        w[W.MAX_SEQ] = abi.engine.max_seq_len
        w[W.HINT_N] = w[W.TRUNCATE_N] = -1
        self._table: _TokenTable | None = None  # (made at the first staging: never on the main thread)
        self._prefill: np.ndarray | None = None  # (likewise: room for the ids a native prefill queues)
        self._request = ctypes.create_string_buffer(REQUEST.size)
        self._request_at = ctypes.addressof(self._request)
        w[W.REQUEST_LEN] = REQUEST.size
        self._system: tuple[str, bytes] = ("", b"")
        self._hint: tuple[Hint | None, tuple | None, list] = (None, None, [])  # its render (abi.rendered's
        # pair) and the arrays staged for it
        self._region_bound = False
        self._staged_for: object = None  # the message (its budget) staged last: its later calls restage less
        self.staged = False

    def host(self, name: str):
        """The NativeHost of import `name` (floe.wasm.raw.HostFunctions.define_all): its env made for the
        Python twin's key, counted by the State (freed with the last of its imports)."""
        fn, finalize = _addresses(self.lib)[name], _addresses(self.lib)["finalize"]

        def make(key: int) -> tuple[int, int, int]:
            env = self.lib.floe_import_env(self.state, key)
            if not env:
                raise MemoryError("no memory for a native import")
            return fn, env, finalize
        return make

    def bind(self, watchdog, region) -> None:
        """The guest's memory and watchdog, once it is made; off the main thread (a spare actor, made
        ahead: each one-shot chat's is new) what its first staging would make too."""
        w = self.words
        w[W.BASE], w[W.SIZE_AT], w[W.WHEN_AT] = region.base, region.size_at, watchdog.when_at
        self._region_bound = True
        if threading.get_ident() != signals.main:
            self._made()

    def _made(self) -> None:
        """detokenize's table (each id's bytes, made once per tokenizer) and prefill's room."""
        w, abi = self.words, self.abi
        self._table = _token_table(abi.tokenizer, abi.vocab)
        w[W.TOKEN_END], w[W.TOKEN_BYTES] = self._table.ends.ctypes.data, self._table.data.ctypes.data
        w[W.VOCAB] = abi.vocab
        self._prefill = np.zeros(min(PREFILL_CAP, abi.engine.max_seq_len), np.int32)
        w[W.PREFILL_AT], w[W.PREFILL_CAP] = self._prefill.ctypes.data, len(self._prefill)

    def stage(self) -> None:
        """Before a guest call that may ask the native imports (an arrival's on_message, a turn's
        on_end): what they need of the message now. Not staged (everything in Python) on the main
        thread, outside a message's budget, or while the engine loop streams natively into it."""
        abi = self.abi
        budget = abi.budget
        if (not enabled or budget is None or budget._row is not None or not self._region_bound
                or threading.get_ident() == signals.main):
            return
        w = self.words
        if self._table is None:
            self._made()
        if budget is not self._staged_for or abi.tokenizer.plain_hint() is not self._hint[0]:
            self._stage_message(budget)  # (a later call of the same message, on_end after on_message,
            # restages only what its calls may have changed: below)
        self.room()
        w[W.PREPARING_V2] = int(abi.version >= 2 and abi.preparing)
        w[W.ON] = 1
        self.staged = True

    def _stage_message(self, budget) -> None:
        """What a message's calls do not change: its request, system prompt, prompt hint, text cap and
        whether its KV slot holds ids for reuse."""
        w, abi = self.words, self.abi
        self._staged_for = budget
        context = abi.context
        r = context.request
        try:
            p = r.params
            REQUEST.pack_into(self._request, 0, r.max_tokens, p.temperature, p.top_k, p.top_p, p.seed)
            w[W.REQUEST] = self._request_at
        except Exception:  # noqa: BLE001 - (a request the record cannot hold: Python's request() says why)
            w[W.REQUEST] = 0
        system = context.system_prompt
        if system is not self._system[0]:
            data = system.encode()
            self._system = (system, data)
            w[W.SYSTEM], w[W.SYSTEM_LEN] = ctypes.cast(data, ctypes.c_void_p).value or 0, len(data)
        self._stage_hint(abi.tokenizer.plain_hint())
        slot = context.slot
        w[W.KV_HOLDS] = 0 if slot is None else int(abi.engine.kv_holds(slot))
        w[W.TEXT_CAP] = abi.text_cap

    def _stage_hint(self, hint: Hint | None) -> None:
        """This thread's prompt hint for chat_render and tokenize: its messages' bytes, its render's and
        its ids (staged once a hint); none where a message is not plain text (render_chat_spans compares
        whole dicts)."""
        w = self.words
        if hint is not self._hint[0]:
            kept: list = []
            pair = None
            if hint is not None and all(type(m) is dict and m.keys() == {"role", "content"}
                                        and type(m["role"]) is str and type(m["content"]) is str
                                        for m in hint.messages):
                parts = [x.encode() for m in hint.messages for x in (m["role"], m["content"])]
                ends = array("q", accumulate(map(len, parts)))  # (array's, not numpy's: a few µs less)
                text = array("B", b"".join(parts) or b"\0")
                encoded = hint.rendered.text.encode()
                rendered = array("B", encoded or b"\0")
                ids = array("i", hint.ids or (0,))
                pair = (encoded, hint.rendered)
                kept = [ends, text, rendered, ids]
                w[W.HINT_ENDS], w[W.HINT_TEXT] = ends.buffer_info()[0], text.buffer_info()[0]
                w[W.RENDERED], w[W.RENDERED_LEN] = rendered.buffer_info()[0], len(encoded)
                w[W.HINT_IDS], w[W.HINT_IDS_N] = ids.buffer_info()[0], len(hint.ids)
                w[W.HINT_N] = len(hint.messages)
            else:
                w[W.HINT_N] = -1
            self._hint = (hint, pair, kept)
        w[W.RENDERED_SET] = int(self._hint[1] is not None and self.abi.rendered is self._hint[1])

    def unstage(self) -> None:
        """After the call: what the native answers did, taken (fold); nothing answered natively from here."""
        if self.staged:
            self.words[W.ON] = 0
            self.staged = False
            self.fold()

    def fold(self) -> None:
        """What the native answers did since the last fold, into the message's budget, ledger, KV slot,
        queue and turn options; the budget's room staged again."""
        w, abi = self.words, self.abi
        budget = abi.budget
        charged = w[W.CHARGED]
        if charged:
            w[W.CHARGED] = 0
            if budget is not None:
                budget.spent += charged
            ledger = abi.context.ledger
            touched, w[W.TOUCHED] = w[W.TOUCHED], 0
            while touched:
                i = (touched & -touched).bit_length() - 1
                touched &= touched - 1
                at = W.LEDGER + 2 * i
                calls, nbytes = w[at], w[at + 1]
                w[at] = w[at + 1] = 0
                if i == _SHARED_AT:
                    ledger.shared(BOUNDARIES[i], calls, nbytes)
                else:
                    ledger.copied(BOUNDARIES[i], calls, calls, nbytes)
        if w[W.CHOICE_SET]:
            w[W.CHOICE_SET] = 0
            ptr = w[W.CHOICE_PTR]
            if ptr:
                abi.choice = abi.context.region.numpy(ptr, 1, np.int32)
                abi.choice_address = abi.choice.ctypes.data
            else:
                abi.choice, abi.choice_address = None, 0
        if w[W.STREAMS_SET]:
            w[W.STREAMS_SET] = 0
            abi.streams = bool(w[W.STREAMS])
        if w[W.HINT_USED]:
            hint, pair, _ = self._hint
            hint.used += w[W.HINT_USED]
            w[W.HINT_USED] = 0
            if w[W.RENDERED_SET]:
                abi.rendered = pair
        if w[W.TRUNCATE_N] >= 0:  # (before the ids queued after it)
            abi.engine.kv_truncate(w[W.TRUNCATE_N], abi.context.slot)
            w[W.TRUNCATE_N] = -1
        n = w[W.PREFILL_N]
        if n:
            w[W.PREFILL_N] = 0
            t = time.perf_counter()
            abi.queued = torch.from_numpy(self._prefill[:n].astype(np.int64))
            abi.context.ledger.copy("prompt ids int32→int64", 8 * n, seconds=time.perf_counter() - t)
            abi.logits_ptr = w[W.PREFILL_LOGITS]
        if self.staged and budget is not None:
            self.room()

    def room(self) -> None:
        """What a Python import may have changed, staged again: the budget's room, the ids queued, the
        slot's length, whether the last render is the hint's."""
        abi, w = self.abi, self.words
        budget = abi.budget
        w[W.ROOM] = budget.limit - budget.spent
        w[W.QUEUED] = abi.queued.shape[0]
        slot = abi.context.slot
        w[W.KV_LEN] = -1 if slot is None else abi.engine.kv_len(slot)
        w[W.RENDERED_SET] = int(self._hint[1] is not None and abi.rendered is self._hint[1])


@functools.cache
def _addresses(lib: ctypes.PyDLL) -> dict[str, int]:
    """The library's import answers (and their finalizer) by name: their addresses, read once."""
    return {name: ctypes.cast(getattr(lib, f"floe_import_{name}"), ctypes.c_void_p).value
            for name in (*NATIVE, "finalize")}


def attach(abi: HostABI, functions: list[HostFunction], python: tuple[int, int]) -> list[HostFunction]:
    """`functions` with NATIVE's answered natively (each HostABI's own method, its Python twin), and
    abi.native set; unchanged where the library cannot be built."""
    lib = library()
    if lib is None:
        return functions
    native = NativeImports(lib, abi, python)
    abi.native = native
    return [HostFunction(f.name, f.n_params, f.n_results, f.fn, native.host(f.name)) if f.name in NATIVE
            else f for f in functions]
