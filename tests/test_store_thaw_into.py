"""A thaw into a spare actor (floe.snapshot.thaw's into=, as a server's SessionLifecycle._thaw makes
it) through a store whose object-store copy in the local cache was damaged in its KV bytes: the store
fetches the copy again and thaws once more (SnapshotStore._read), as a thaw without into= does. The
spare's restore refused the damaged bytes and closed it (its state is no longer a fresh actor's, its KV
slot is given back): the second try makes its own actor, and the engine holds exactly that one's slot."""

from pathlib import Path

from test_store import bucket, engine, frozen, make_store, spec  # noqa: F401 - (its fixtures)

from floe.actor import Actor
from floe.snapshot.file import Snapshot


def test_a_thaw_into_a_spare_refetches_a_cached_copy_damaged_in_its_kv(tmp_path, s3, bucket, engine, frozen):  # noqa: F811
    s = spec("s3", tmp_path, s3, bucket)
    store = make_store(s)
    store.put("k", frozen)
    store.release("k")
    reader = make_store({**s, "tmp": str(tmp_path / "reader")})
    cached: Path = reader.source("k")  # read from the object store, through the local cache
    snap = Snapshot(cached, contents=False)
    kv = snap.kv_names()[0]
    at = snap.header.data_offset + snap.header.tensors[kv].start + 1
    damaged = bytearray(frozen)
    damaged[at] ^= 0x10  # inside a KV tensor: found as the KV is loaded into the actor (its restore)
    cached.write_bytes(damaged)  # the object is unchanged: the same ETag
    plain = reader.thaw("k", engine)  # without into=: fetched again and thawed
    plain.close()
    cached.write_bytes(damaged)
    free = len(engine.slots.free)
    spare = Actor(engine)  # (a server's spare: made ahead, never sent anything, with its KV slot)
    try:
        actor = reader.thaw("k", engine, into=spare)
    except BaseException:
        spare.close()
        raise
    assert spare.closed and actor is not spare and not actor.closed
    assert len(engine.slots.free) == free - 1
    actor.close()
