"""Actors: a guest instance + KV slot + RNG, and the host ABI connecting guest calls to the engine."""

from floe.actor.abi import ABI_VERSION
from floe.actor.actor import (
    Actor,
    ActorClosed,
    ActorReentrantCall,
    ActorState,
    MessageStats,
    Reply,
    Request,
    builtin_guest,
)
from floe.actor.scheduler import DecodeScheduler

__all__ = ["ABI_VERSION", "Actor", "ActorClosed", "ActorReentrantCall", "ActorState", "DecodeScheduler",
           "MessageStats", "Reply", "Request", "builtin_guest"]
