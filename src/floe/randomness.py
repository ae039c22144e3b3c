"""Unguessable names and numbers without a system call each.

`secrets` and `uuid.uuid4` read the kernel's random source on every call (getrandom(2)), and each read
gives the GIL up: in a burst of 64 new sessions each request made three of them (its session's seed, its
lease's token, the lease file's temporary name), and each waited behind the other requests' threads and
the engine loop to take the GIL back. Here the kernel is read once per process (again after a fork, so
a child never repeats its parent's values) for a 32-byte key, and each value is BLAKE2b keyed with it
over a counter: a pseudorandom function, so a value tells nothing of the key or of any other value
(what `secrets` promises for session ids and tokens), and no two values of a process are alike.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import threading

_lock = threading.Lock()
_state: tuple[int, bytes, itertools.count] | None = None  # (pid, key, counter)


def _draw() -> bytes:
    """32 fresh bytes."""
    global _state
    state = _state
    if state is None or state[0] != os.getpid():  # (first use, or a forked child: a key of its own)
        with _lock:
            if _state is None or _state[0] != os.getpid():
                _state = (os.getpid(), os.urandom(32), itertools.count())
            state = _state
    n = next(state[2])  # (one C call: atomic under the GIL)
    return hashlib.blake2b(n.to_bytes(16, "little"), key=state[1], digest_size=32).digest()


def token_hex(nbytes: int) -> str:
    """As secrets.token_hex(nbytes), nbytes <= 32."""
    if not 0 < nbytes <= 32:
        raise ValueError(f"token_hex takes 1 to 32 bytes, not {nbytes}")
    return _draw()[:nbytes].hex()


def randbits(k: int) -> int:
    """As secrets.randbits(k), 0 < k <= 256."""
    if not 0 < k <= 256:
        raise ValueError(f"randbits takes 1 to 256 bits, not {k}")
    return int.from_bytes(_draw(), "little") >> (256 - k)
