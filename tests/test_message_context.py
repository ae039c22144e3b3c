"""The host ABI sees an actor only through its MessageContext (floe.actor.host): the request, KV slot,
guest memory, RNG, ledger and stats of the message it runs, and where a host call's failure waits."""

import torch

from floe.actor import Actor
from floe.actor.abi import OK, REQUEST, HostABI
from floe.actor.budget import HostBudget
from floe.actor.host import MessageContext, Request
from floe.engine import SamplingParams
from floe.memory import Region
from floe.wasm import GuestHostCallError


class _NeverExpires:
    def expired(self) -> None:
        return None


def test_the_host_abi_holds_the_actors_context_not_the_actor(tiny_engine):
    with Actor(tiny_engine) as actor:
        assert not hasattr(actor.abi, "actor")
        assert actor.abi.context is actor.context
        assert actor.context.region is actor.region and actor.context.slot == actor.slot
        params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=3)
        reply = actor.send("hello", max_tokens=4, params=params)
        # What the message asked and recorded is the context's (the actor's attributes read it).
        assert actor.context.request.max_tokens == 4 and actor.context.request.params == params
        assert actor.request is actor.context.request
        assert reply.stats is actor.context.stats and reply.ledger is actor.context.ledger
        assert reply.stats.forwards >= 1
        # The reply's token ids are Python ints, whichever way they came (the loop's int64 row words,
        # its int32 decoded buffer, the host's draws).
        assert reply.stats.token_ids and all(type(t) is int for t in reply.stats.token_ids)


def test_the_host_abi_answers_from_a_context_without_an_actor(tiny_engine):
    region = Region(1 << 16)
    slot = tiny_engine.claim_slot()
    try:
        request = Request(7, SamplingParams(temperature=0.5, top_k=3, top_p=0.9, seed=11))
        context = MessageContext(torch.Generator(), "be brief", slot=slot, region=region, request=request)
        abi = HostABI(tiny_engine, context)
        abi.budget = HostBudget(_NeverExpires(), 1 << 20)
        calls = {f.name: f.fn for f in abi.functions()}
        raw = [64, 0]  # request(out_ptr): args at even words, the result in word 0
        assert calls["request"](raw) == 0 and raw[0] == OK
        max_tokens, _, top_k, _, seed = REQUEST.unpack(region.read(64, REQUEST.size))
        assert (max_tokens, top_k, seed) == (7, 3, 11)
        raw = [256, 0, 64, 0]  # system(out_ptr, cap)
        assert calls["system"](raw) == 0 and raw[0] == len("be brief")
        assert region.read(256, raw[0]) == b"be brief"
        raw = [0, 0]
        assert calls["kv_len"](raw) == 0 and raw[0] == tiny_engine.kv_len(slot)
        assert context.ledger.boundaries["host→guest request"].bytes_copied == REQUEST.size
        assert context.error is None
    finally:
        tiny_engine.release_slot(slot)


def test_a_host_call_failure_waits_in_the_context_until_the_actor_takes_it(tiny_engine):
    with Actor(tiny_engine) as actor:
        kv_len = {f.name: f.fn for f in actor.abi.functions()}["kv_len"]
        kv_len([0, 0])  # outside a message: no budget, so the call fails (a trap for a guest)
        assert actor.pending_error is actor.context.error is not None
        error = actor.take_pending()
        assert isinstance(error, GuestHostCallError) and "outside a message" in str(error)
        assert actor.context.error is None
