"""Actors: a guest instance + KV slot + RNG, and the host ABI connecting guest calls to the engine."""

from floe.actor.abi import ABI_VERSION, SUPPORTED_ABI_VERSIONS
from floe.actor.actor import (
    Actor,
    ActorClosed,
    ActorReentrantCall,
    ActorState,
    MessageStats,
    Reply,
    Request,
    builtin_guest,
    complete_message,
)
from floe.actor.grammar import IncompleteJSON, SchemaUnsupported, StructuredReply, grammar_actor, send_json
from floe.actor.loop import EngineLoop
from floe.actor.scheduler import DecodeScheduler

__all__ = ["ABI_VERSION", "Actor", "ActorClosed", "ActorReentrantCall", "ActorState", "DecodeScheduler",
           "EngineLoop", "IncompleteJSON", "MessageStats", "Reply", "Request", "SUPPORTED_ABI_VERSIONS",
           "SchemaUnsupported", "StructuredReply", "builtin_guest", "complete_message", "grammar_actor",
           "send_json"]
