"""Small hand-written guests (WAT) that misbehave on purpose, each a complete ABI v1 module."""

import wasmtime


def guest(on_message_body: str, *, imports: str = "", memory_pages: int = 2, abi_version: int = 1,
          extra: str = "") -> bytes:
    return wasmtime.wat2wasm(f"""
(module
  (import "floe" "emit" (func $emit (param i32 i32) (result i32)))
  (import "floe" "prefill" (func $prefill (param i32 i32 i32) (result i32)))
  (import "floe" "vocab_size" (func $vocab_size (result i32)))
  {imports}
  (memory (export "memory") {memory_pages})
  (data (i32.const 16) "ok")
  (func (export "floe_abi_version") (result i32) (i32.const {abi_version}))
  (func (export "alloc") (param i32) (result i32) (i32.const 1024))
  (func (export "on_message") (param $ptr i32) (param $len i32) (result i32)
    {on_message_body})
  {extra}
)""")


EMITS_OK = guest("(drop (call $emit (i32.const 16) (i32.const 2))) (i32.const 0)")
BAD_POINTER = guest("(drop (call $emit (i32.const 0x7ffff000) (i32.const 64))) (i32.const 0)")
INFINITE_LOOP = guest("(loop $forever (br $forever)) (i32.const 0)")
TRAPS = guest("(unreachable)")
MEMORY_BOMB = guest(
    "(loop $more (br_if $more (i32.ne (memory.grow (i32.const 16)) (i32.const -1)))) (unreachable)"
)
WRONG_ABI = guest("(i32.const 0)", abi_version=7)
UNKNOWN_IMPORT = guest(
    "(i32.const 0)", imports='(import "env" "system" (func $sys (param i32) (result i32)))'
)
# Prefills token 17 asking for the logits at byte 65536 (the second page), then emits "ok".
LOGITS_IN_PLACE = guest(
    "(i32.store (i32.const 4096) (i32.const 17))"
    "(drop (call $prefill (i32.const 4096) (i32.const 1) (i32.const 65536)))"
    "(drop (call $emit (i32.const 16) (i32.const 2))) (i32.const 0)",
    memory_pages=8,
)
# Asks for logits at a misaligned address.
MISALIGNED_LOGITS = guest(
    "(i32.store (i32.const 4096) (i32.const 17))"
    "(drop (call $prefill (i32.const 4096) (i32.const 1) (i32.const 65537))) (i32.const 0)",
    memory_pages=8,
)


# Every import, named $name, for guests that call anything (choice_at, stream_tokens: v2 only).
ALL_IMPORTS = {
    "abi_version": (0, 1), "vocab_size": (0, 1), "context_length": (0, 1), "eos_ids": (2, 1),
    "tokenize": (4, 1), "detokenize": (4, 1), "chat_render": (5, 1), "prefill": (3, 1),
    "decode": (2, 1), "sample": (1, 1), "request": (1, 1), "system": (2, 1), "kv_len": (0, 1),
    "kv_truncate": (1, 1), "emit": (2, 1), "log": (2, 1), "choice_at": (1, 1), "stream_tokens": (1, 1),
    "tokenize_rest": (4, 1),
}


def import_decls(names=None, skip=("emit", "prefill", "vocab_size")) -> str:
    """WAT import declarations for `names` (default: all but those `guest()` always imports)."""
    out = []
    for name in names or ALL_IMPORTS:
        if name in skip:
            continue
        n, r = ALL_IMPORTS[name]
        params = " ".join(["i32"] * n)
        out.append(f'(import "floe" "{name}" (func ${name} (param {params}) (result i32)))'
                   if n else f'(import "floe" "{name}" (func ${name} (result i32)))')
    return "\n  ".join(out)


def calls_host(body: str, memory_pages: int = 2, extra: str = "") -> bytes:
    """A guest whose on_message runs `body` with every host function imported."""
    return guest(body, imports=import_decls(), memory_pages=memory_pages, extra=extra)


def v2_guest(on_token_extra: str = "", *, after: int = 3, on_end: str | None = None) -> bytes:
    """An ABI v2 guest: on_message queues token 17; on_token takes the host's sample, and from its
    `after`-th call on runs `on_token_extra` first (e.g. a trap or an endless loop); on_end: the body
    of an on_end export (param $status, local $i; its result an i32), if given."""
    end = ("" if on_end is None else
           f'(func (export "on_end") (param $status i32) (result i32) (local $i i32) {on_end})')
    return wasmtime.wat2wasm(f"""
(module
  (import "floe" "prefill" (func $prefill (param i32 i32 i32) (result i32)))
  (import "floe" "sample" (func $sample (param i32) (result i32)))
  (memory (export "memory") 2)
  (global $n (mut i32) (i32.const 0))
  (func (export "floe_abi_version") (result i32) (i32.const 2))
  (func (export "alloc") (param i32) (result i32) (i32.const 1024))
  (func (export "on_message") (param i32 i32) (result i32)
    (i32.store (i32.const 4096) (i32.const 17))
    (global.set $n (i32.const 0))
    (call $prefill (i32.const 4096) (i32.const 1) (i32.const 0)))
  (func (export "on_token") (result i32)
    (global.set $n (i32.add (global.get $n) (i32.const 1)))
    (if (i32.ge_u (global.get $n) (i32.const {after})) (then {on_token_extra}))
    (call $sample (i32.const 0)))
  {end})""")


def v2_chooser(*, choice: bool, stream: bool, choice_ptr: int = 64, prompt: int = 17,
               on_token_first: str = "", counter: bool = False) -> bytes:
    """An ABI v2 guest that queues `prompt`, then each token takes the host's choice: written at
    `choice_ptr` before on_token (choice=True, asked for with choice_at) or asked for with sample(0);
    its text streamed by the host (stream=True, stream_tokens) or by detokenize + emit. Token 0 stops.
    counter: a global $n for on_token_first to count with."""
    asks = f"(call $choice_at (i32.const {choice_ptr}))"
    setup = f"(if {asks} (then (return (i32.const 11))))" if choice else ""
    setup += "(if (call $stream_tokens (i32.const 1)) (then (return (i32.const 12))))" if stream else ""
    take = f"(i32.load (i32.const {choice_ptr}))" if choice else "(call $sample (i32.const 0))"
    emit = "" if stream else ("(drop (call $emit (i32.const 256) (call $detokenize (i32.const 128) "
                              "(i32.const 1) (i32.const 256) (i32.const 1024))))")
    return wasmtime.wat2wasm(f"""
(module
  (import "floe" "prefill" (func $prefill (param i32 i32 i32) (result i32)))
  (import "floe" "sample" (func $sample (param i32) (result i32)))
  (import "floe" "detokenize" (func $detokenize (param i32 i32 i32 i32) (result i32)))
  (import "floe" "emit" (func $emit (param i32 i32) (result i32)))
  (import "floe" "choice_at" (func $choice_at (param i32) (result i32)))
  (import "floe" "stream_tokens" (func $stream_tokens (param i32) (result i32)))
  (memory (export "memory") 2)
  {"(global $n (mut i32) (i32.const 0))" if counter else ""}
  (func (export "floe_abi_version") (result i32) (i32.const 2))
  (func (export "alloc") (param i32) (result i32) (i32.const 2048))
  (func (export "on_message") (param i32 i32) (result i32)
    {setup}
    (i32.store (i32.const 4096) (i32.const {prompt}))
    (call $prefill (i32.const 4096) (i32.const 1) (i32.const 0)))
  (func (export "on_token") (result i32)
    {on_token_first}
    (i32.store (i32.const 128) {take})
    (if (i32.eqz (i32.load (i32.const 128))) (then (return (i32.const -1))))
    {emit}
    (i32.load (i32.const 128))))""")
