"""Making a server's actors: its guest on its engine, one at a time."""

from __future__ import annotations

import threading

from floe.actor import Actor, DecodeScheduler, EngineLoop, builtin_guest, complete_message
from floe.engine import Engine, SamplingParams


class ActorMaker:
    """Actors of one guest on one engine (batched by `scheduler` for v1 guests, stepped by `loop` for
    v2 guests), made one at a time: creating an actor is ~1 ms of short calls into Wasmtime, each a GIL
    hand-off; 16 arrivals creating theirs at once thrash the GIL (~45 ms each, measured) where taking
    turns costs each ~1 ms plus its wait."""

    def __init__(self, engine: Engine, guest: str | None, scheduler: DecodeScheduler | None,
                 loop: EngineLoop | None) -> None:
        self.engine, self.guest, self.scheduler, self.loop = engine, guest, scheduler, loop
        self.one_at_a_time = threading.Lock()

    @property
    def chats(self) -> bool:
        """Whether its actors can hold chats: a guest of the server's own, or the built-in chat guest on
        a model with a chat template (a base model has none: text completions only)."""
        return self.guest is not None or bool(self.engine.tokenizer.chat_template)

    def new(self, seed: int = 0, kv_slot: bool | str = True) -> Actor:
        """A fresh actor (kv_slot "later": without a KV slot, floe.actor.Actor.attach_slot)."""
        with self.one_at_a_time:
            return Actor(self.engine, self.guest, seed=seed, scheduler=self.scheduler, loop=self.loop,
                         kv_slot=kv_slot)

    def with_history(self, messages: list[dict], seed: int, slot_of: Actor | None = None) -> Actor:
        """A new actor holding a conversation (prefilled in full by its next message), in a fresh KV slot
        or in the one it takes over from `slot_of` (closed by this; Actor.adopt_slot: the next message
        prefills only what differs from what that slot held). The slot comes first: a guest may use its
        KV cache while it takes the conversation (kv_len; a v1 guest's prefill)."""
        actor = self.new(seed, True if slot_of is None else "later")
        try:
            if slot_of is not None and slot_of.slot is not None:
                actor.adopt_slot(slot_of)
            elif slot_of is not None:
                actor.attach_slot()
            for m in messages:
                actor.add_history(m["role"], m["content"])
        except BaseException:
            actor.close()
            raise
        return actor

    def warm_up(self) -> None:
        """Throwaway two-token turns in a fresh actor, greedy and sampled: compile the guest module and
        the chat template, start the engine loop and load the sampling kernels, which a server's first
        request would otherwise wait for (~0.3 s on the H200 host), and which the loop's bound on a
        warm guest call (floe.actor.loop.STEP_CALL_S) leaves no room for."""
        guest, message, raw = self.guest, "Hello.", False
        if not self.chats:  # a base model: text completions only (the chat guest could render no chat)
            guest, raw = builtin_guest("complete"), True
            message = complete_message(self.engine.tokenizer, message)
        with Actor(self.engine, guest, scheduler=self.scheduler, loop=self.loop, continues_text=raw) as actor:
            for params in (SamplingParams(), SamplingParams(temperature=0.7, top_k=40, top_p=0.9)):
                actor.send(message, max_tokens=2, params=params)
        self.engine.tokenizer.fill_reply_bytes()  # (the engine loop streams each token's in one lookup)
