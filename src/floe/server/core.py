"""The engine core of `floe serve`: the engine, its loop, the session store, their metrics, served to
the HTTP front over a Unix socket (floe.server.core_socket, floe.server.protocol; docs/SERVER.md).

`floe serve` runs this in its main process and the front (floe.server.front) in a child: the engine
loop's thread then shares this process's GIL only with the socket's threads, which hand streamed text
over in one frame per flush for every stream, not with the event loop's HTTP and SSE work.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from floe import randomness
from floe.actor.stream import TokenStream
from floe.engine import Engine, SamplingParams
from floe.errors import FloeError, InvalidSamplingParams
from floe.model.template_vars import TemplateKwargsError, check_template_kwargs
from floe.model.tokenizer import ChatTemplateError, Hint
from floe.server import hints, protocol
from floe.server.completions import Completion, TextCompletions
from floe.server.limits import check_text
from floe.server.protocol import CALLS, ROLES, ServeError
from floe.server.sessions import Answer, Session, SessionError, SessionStore, snapshot_store
from floe.server.stops import checked_stops
from floe.server.structured import Constraint, check_nesting, outcome
from floe.server.structured_turns import StructuredTurns
from floe.snapshot.layout import KV_DTYPES
from floe.snapshot.store import SnapshotStore
from floe.wasm import GuestError

log = logging.getLogger("floe.serve")


class Metrics:
    """The core's Prometheus metrics (the front adds its HTTP request counts)."""

    def __init__(self, store: SessionStore) -> None:
        self.registry = r = CollectorRegistry()
        self.prompt_tokens = Counter("floe_prompt_tokens", "Prompt tokens of chat requests", registry=r)
        self.prefilled_tokens = Counter("floe_prefilled_tokens",
                                        "Prompt tokens actually prefilled (the rest was cached)", registry=r)
        self.generated_tokens = Counter("floe_generated_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("floe_ttft_seconds", "Time to first token", registry=r,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.decode_rate = Histogram("floe_decode_tokens_per_second", "Decode speed of a reply",
                                     registry=r, buckets=(5, 10, 20, 50, 100, 200, 500, 1000, 2000))
        self.thaw = Histogram("floe_thaw_seconds", "Thawing a frozen session", registry=r,
                              buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5))
        self.freeze = Histogram("floe_freeze_seconds", "Freezing a session", registry=r,
                                buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5))
        self.hints = Counter("floe_prompt_hints", "Chats whose conversation the HTTP front rendered and "
                             "tokenized (floe.server.hints), by whether the guest's render and tokenize used "
                             "it", ["used"], registry=r)
        self.batch_rows = Histogram("floe_decode_batch_rows", "Sessions advanced by one batched decode "
                                    "forward", registry=r, buckets=(1, 2, 4, 8, 16, 32, 64))
        Gauge("floe_waiting_requests", "Requests waiting for a KV slot (every slot runs one)",
              registry=r).set_function(lambda: store.waiting)
        turns = Gauge("floe_engine_loop_turns", "Turns in the engine loop: stepping, or arrived and "
                      "waiting for the next step", ["state"], registry=r)
        turns.labels("active").set_function(lambda: store.loop.stats()["active"] if store.loop else 0)
        turns.labels("waiting").set_function(lambda: store.loop.stats()["waiting"] if store.loop else 0)
        sessions = Gauge("floe_sessions", "Sessions by state", ["state"], registry=r)
        sessions.labels("live").set_function(lambda: store.counts()["live"])
        sessions.labels("frozen").set_function(lambda: store.counts()["frozen"])
        Gauge("floe_spare_actors", "Actors made ahead for new sessions (in free KV slots)",
              registry=r).set_function(lambda: store.counts()["spare_actors"])
        pinned = store.snapshots.pinned
        Gauge("floe_store_pinned_bytes", "Bytes of frozen sessions' snapshots in this server's RAM tier",
              registry=r).set_function(lambda: pinned.nbytes if pinned is not None else 0)
        Gauge("floe_store_leases", "Sessions whose lease this server holds", registry=r).set_function(
            lambda: len(store.snapshots.leased()))
        Gauge("floe_session_rollbacks", "Conversations branched from an earlier turn (a regenerated or "
              "edited turn: the session rolled back to the common start)", registry=r).set_function(
            lambda: store.rollbacks)


@dataclass
class Chat:
    """A chat request that holds its session (ServeCore.open), until ServeCore.run returns."""

    session: Session
    history: list[dict]  # earlier messages the session has not seen yet
    text: str  # the last (user) message
    max_tokens: int
    params: SamplingParams
    seed: int | None  # the request's own seed (its session's generator restarts from it), or None
    stops: tuple[str, ...]  # the reply ends before the first of these
    constraint: Constraint | None = None  # a structured reply (response_format, tools): StructuredTurns
    hint: Hint | None = None  # its conversation rendered and tokenized by the front (floe.server.hints)
    template_kwargs: dict | None = None  # the chat template's variables it gives (chat_template_kwargs)


class ServeCore:
    """What `floe serve` does with an engine, transport aside: chats and the session calls.

    batching: concurrent sessions' decode steps run as one batched forward (default: where the engine
    has one, i.e. CUDA graphs of the fused step); off, they take turns. aliases: other model names
    requests may use (many tools hard-code one), "*" for any. max_anonymous: sessions made without an
    id kept per owner (SessionStore).
    """

    def __init__(self, engine: Engine, *, snapshots: Path | str | SnapshotStore, model_id: str,
                 idle_seconds: float = 300.0, guest: str | None = None, batching: bool | None = None,
                 aliases: tuple[str, ...] = (), max_anonymous: int = 64, kv_dtype: str | None = None,
                 persist_anonymous: bool = False, freeze_every_turn: bool = False,
                 sweep_seconds: float = 10.0, max_waiting: int = 8, wait_seconds: float = 30.0) -> None:
        if batching and not engine.batched_decode:
            raise FloeError("decode batching needs the CUDA engine with graphs and fused kernels and "
                            "more than one slot; on the CPU, sessions take turns")
        from floe.actor import DecodeScheduler, EngineLoop

        self.engine, self.model_id, self.idle_seconds = engine, model_id, idle_seconds
        self.aliases = tuple(a for a in aliases if a != model_id)  # other names clients may use; "*": any
        batched = engine.batched_decode if batching is None else batching
        # ABI v2 guests (floe's own) are stepped by one engine loop; v1 guests batch through the scheduler.
        self.scheduler = DecodeScheduler(engine) if batched else None
        self.loop = EngineLoop(engine, batch=batched)
        if kv_dtype is not None and kv_dtype not in KV_DTYPES:
            raise FloeError(f"kv dtype {kv_dtype!r}: snapshots store one of {', '.join(KV_DTYPES)}")
        if not isinstance(snapshots, SnapshotStore):
            snapshots = snapshot_store(snapshots, idle_seconds=idle_seconds)
        self.snapshots = snapshots
        self.store = SessionStore(engine, snapshots, idle_seconds=idle_seconds, guest=guest,
                                  scheduler=self.scheduler, loop=self.loop, max_anonymous=max_anonymous,
                                  kv_dtype=kv_dtype, persist_anonymous=persist_anonymous,
                                  freeze_every_turn=freeze_every_turn, sweep_seconds=sweep_seconds,
                                  max_waiting=max_waiting, wait_seconds=wait_seconds)
        self.turns = StructuredTurns(self.store)
        self.completions = TextCompletions(self.store)
        self.metrics = Metrics(self.store)
        self.loop.on_step = self.metrics.batch_rows.observe
        if self.scheduler is not None:
            self.scheduler.on_batch = self.metrics.batch_rows.observe
        self.store.on_thaw, self.store.on_freeze = self.metrics.thaw.observe, self.metrics.freeze.observe
        self.store.load_store()
        self.store.warm_up()
        _ = self.max_text_bytes  # (a pass over the vocabulary: ~0.1 s on the H200 host, which the first
        # request's front call paid while a burst of arrivals waited behind it for the GIL)
        self.started = time.time()
        self._closed = threading.Event()
        self._warming: threading.Thread | None = None  # warm_graphs_later's
        self._evictor = threading.Thread(target=self._evict_loop, name="floe-evict", daemon=True)
        self._evictor.start()

    # ---- chats -------------------------------------------------------------------------------------

    def open(self, request: dict, gone: Callable[[], bool] = lambda: False) -> Chat | Completion:
        """Check a chat request against the engine and take its session (locked for it); a text
        completion's (a request with a `prompt`, no `messages`) takes nothing until it runs. gone(): the
        client left (a wait for its session or a KV slot ends: ClientLeft)."""
        if "prompt" in request:
            return self._open_completion(request)
        if not self.store.actors.chats:
            raise ServeError(400, "this model has no chat template (a base model, not tuned for chat): send "
                             "its text to /v1/completions instead", code="no_chat_template")
        structured = request.get("structured")
        constraint = None if structured is None else Constraint.from_wire(structured)
        kwargs = _template_kwargs(request.get("chat_template_kwargs"))
        messages, max_tokens, params, sid, hint = self._validate(request, constraint, kwargs)
        stops = checked_stops(request.get("stop"))
        if constraint is not None and stops:
            raise ServeError(400, "stop cannot end a structured reply", param="stop")
        owner = _owner(request.get("owner"))
        if constraint is not None:  # a schema that cannot be used is a 400 before it waits for a slot
            try:
                self.turns.check(constraint, max_tokens)
            except (GuestError, FloeError) as e:
                raise failure(e, sid) from None
        seed = None if request.get("seed") in (None, -1) else params.seed  # -1: random, as llama.cpp
        try:  # a new session's generator starts from the request's seed, or a random one (as OpenAI)
            session = self.store.acquire(sid, messages, randomness.randbits(63) if seed is None else seed,
                                         owner=owner, gone=gone)
        except SessionError as e:
            raise failure(e, sid) from None
        try:  # live before the reply starts: a busy server is a 503, not a 200 stream with an error
            self.store.go_live(session, gone)
            history = self.store.pending(session, messages)
        except BaseException as e:  # whatever failed, the session's lock is not kept
            self.store.release(session)
            if isinstance(e, (GuestError, FloeError)):
                raise failure(e, session.id) from None
            raise
        return Chat(session, history, messages[-1]["content"], max_tokens, params, seed, stops, constraint,
                    hint, kwargs)

    def _open_completion(self, request: dict) -> Completion:
        prompt, max_tokens = request.get("prompt"), request.get("max_tokens")
        if not isinstance(prompt, str) or not (max_tokens is None or _int(max_tokens) > 0):
            raise ServeError(400, "prompt must be a string and max_tokens a positive integer")
        params = _sampling(request)
        check_text([{"role": "user", "content": prompt}], self.max_text_bytes)  # before the tokenizer
        seed = None if request.get("seed") in (None, -1) else params.seed
        return self.completions.open(prompt, max_tokens, params, seed, checked_stops(request.get("stop")),
                                     _owner(request.get("owner")))

    def run(self, chat: Chat | Completion, on_text=None, should_stop=lambda: False,
            tokens: TokenStream | None = None) -> dict:
        """Run an opened chat to its end (the session is released whatever happens): its text, why it
        ended and its usage. on_text(piece): each piece of streamed text (in the engine loop's thread);
        should_stop(): the client left (the session keeps nothing of the turn). tokens: the reply
        streamed as token ids instead (floe.actor.stream: a chat without stop strings or a constraint;
        its reader stops it when its client leaves)."""
        if isinstance(chat, Completion):
            try:
                reply = self.completions.run(chat, on_text, should_stop, tokens)
            except SessionError as e:  # no slot
                raise failure(e, None) from None
            except (GuestError, FloeError) as e:
                raise ServeError(500, f"the text completion failed ({type(e).__name__}: {e})", "server_error",
                                 "guest_error" if isinstance(e, GuestError) else "engine_error") from None
            return self._result(reply, chat.max_tokens)
        try:  # (its guest renders the conversation in this thread, with the request's template variables)
            with self.engine.tokenizer.rendering_with(chat.template_kwargs):
                reply = self._reply(chat, on_text, should_stop, tokens)
        except (GuestError, FloeError) as e:
            raise failure(e, chat.session.id) from None
        finally:
            self.store.release(chat.session)
        return self._result(reply, chat.max_tokens, chat.constraint)

    def _reply(self, chat: Chat, on_text, should_stop, tokens: TokenStream | None) -> Answer:
        """A chat's answer: a structured turn's (StructuredTurns), or its session's own guest's."""
        if chat.constraint is not None:
            return self.turns.run(chat.session, chat.history, chat.text, chat.constraint,
                                  max_tokens=chat.max_tokens, params=chat.params, seed=chat.seed,
                                  on_text=on_text, should_stop=should_stop)
        with self.engine.tokenizer.hinted(chat.hint):  # (its guest renders, tokenizes in this thread)
            reply = self.store.run(chat.session, chat.history, chat.text, max_tokens=chat.max_tokens,
                                   params=chat.params, on_text=on_text, should_stop=should_stop,
                                   reseed=chat.seed, stops=chat.stops, tokens=tokens)
        if chat.hint is not None:  # (a render and a tokenize of it: used)
            self.metrics.hints.labels(str(chat.hint.used >= 2).lower()).inc()
        return reply

    def _result(self, reply: Answer, max_tokens: int, constraint: Constraint | None = None) -> dict:
        """A run's answer (its text, why it ended, its usage), counted in the metrics."""
        s, m = reply.stats, self.metrics
        generated = s.generated_tokens
        m.prompt_tokens.inc(s.context_tokens)
        m.prefilled_tokens.inc(s.first_forward_tokens)
        m.generated_tokens.inc(generated)
        if s.ttft_s:
            m.ttft.observe(s.ttft_s)
        if s.decode_tokens_per_s:
            m.decode_rate.observe(s.decode_tokens_per_s)
        usage = {"prompt_tokens": s.context_tokens, "completion_tokens": generated,
                 "total_tokens": s.context_tokens + generated,
                 "prompt_tokens_details": {"cached_tokens": s.context_tokens - s.first_forward_tokens},
                 "prefilled_tokens": s.first_forward_tokens}
        length = generated >= max_tokens and not reply.stopped
        reason = "length" if length else "stop"
        if constraint is not None:  # a value the guest completed ended it; a call: tool_calls
            reason = outcome(constraint, reply.text).finish_reason
        return {"text": reply.text, "finish_reason": reason, "usage": usage}

    # Calls whose answer never changes while it serves (the socket encodes each once: CoreServer)
    fixed_calls = ("vocab", "tokenizer")
    reads_stores = ()  # (inline calls of its answered in the socket's reading thread: see ModelRouter's)

    @property
    def pool_threads(self) -> int:
        """Threads the core's socket needs for chats and calls: running chats (each holds a thread for its
        whole reply), the ones waiting for a slot (the store's queue), as many waiting for busy sessions
        (floe.server.sessions.waits) and a few being refused."""
        return self.engine.cache.n_slots + 2 * self.store.max_waiting + 8

    def streams_ids(self, chat: Chat | Completion) -> bool:
        """Whether a chat's reply may go to the front as token ids (its table is this engine's)."""
        return True

    def warm_graphs_later(self, done: Callable[[int, float], None] = lambda graphs, seconds: None) -> None:
        """Capture the engine's CUDA graphs that its warm_up(graphs="first") left out, in a thread of
        their own while sessions run (Engine.warm_up_graphs_later); stopped by close(). done(graphs,
        seconds): once they are captured."""
        self._warming = threading.Thread(target=self._warm_graphs, args=(done,), name="floe-warm-graphs",
                                         daemon=True)
        self._warming.start()

    def _warm_graphs(self, done: Callable[[int, float], None]) -> None:
        t = time.perf_counter()
        try:
            made = self.engine.warm_up_graphs_later(self._closed, self.store.admission.spare)
        except Exception:  # noqa: BLE001 - each graph left is captured when a step first needs it
            log.exception("capturing the engine's graphs beside its sessions failed")
            return
        done(made, time.perf_counter() - t)

    def keep_spares(self) -> None:
        """Keep actors made ahead in free KV slots (SessionStore.keep_spares): new sessions find theirs."""
        self.store.keep_spares(self.engine.cache.n_slots)

    def _validate(self, request: dict, constraint: Constraint | None = None, kwargs: dict | None = None
                  ) -> tuple[list[dict], int, SamplingParams, str | None, Hint | None]:
        """The fields the front checked, checked again for type (the core trusts no peer), then
        against the engine: sampling parameters and the context (a structured turn's with what it
        adds: the schema shown, the tools; the conversation rendered with the template's variables
        `kwargs`); and the front's hint of a plain chat's conversation, whose ids count its prompt
        exactly (floe.server.hints)."""
        messages = request.get("messages")
        if not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
                for m in messages)):
            raise ServeError(400, "messages: a list of role and text content messages", param="messages")
        if messages[-1]["role"] != "user":
            raise ServeError(400, "the last message must be from the user", param="messages")
        sid, max_tokens = request.get("session_id"), request.get("max_tokens")
        if not (sid is None or isinstance(sid, str)) or not (max_tokens is None or _int(max_tokens) > 0):
            raise ServeError(400, "session_id must be a string and max_tokens a positive integer")
        params = _sampling(request)
        check_text(messages, self.max_text_bytes, self.engine.max_seq_len)  # before the template or tokenizer
        shown = messages if constraint is None else self.turns.prompt(messages, constraint)
        tokenizer = self.engine.tokenizer
        hint = None if constraint is not None else hints.from_wire(request.get("hint"), messages,
                                                                   tokenizer.vocab_size, kwargs)
        offered = None if constraint is None else self.turns.offered(constraint)
        if constraint is not None:  # the schema or tools shown, by floe or by the template, count too (a
            # 3 MB tools list was tokenized whole, 2.6 s of the core's CPU, to be refused)
            listed = [{"content": json.dumps(offered, ensure_ascii=False)}] if offered else []
            check_text([*shown, *listed], self.max_text_bytes)
        try:  # tools counted as the template shows them
            with tokenizer.offering_tools(offered), tokenizer.rendering_with(kwargs):
                prompt = len(hint.ids) if hint is not None else self._prompt_bound(shown)
                if hint is None and prompt + (max_tokens or 1024) > self.engine.max_seq_len:  # count exactly
                    prompt = len(tokenizer.encode_chat(shown))
        except TemplateKwargsError as e:  # a name of this tokenizer's special tokens
            raise ServeError(400, f"chat_template_kwargs: {e}", param="chat_template_kwargs") from None
        except ChatTemplateError as e:  # e.g. a template that demands alternating roles
            raise ServeError(400, f"messages: {e}", param="messages") from None
        room = self.engine.max_seq_len - prompt
        if room < 1:
            raise ServeError(400, f"the conversation is {prompt} tokens; this server's context holds "
                             f"{self.engine.max_seq_len}", code="context_length_exceeded", param="messages")
        max_tokens = max_tokens or min(room, 1024)
        if max_tokens > room:
            raise ServeError(400, f"max_tokens {max_tokens} + the conversation's {prompt} tokens exceed "
                             f"this server's context of {self.engine.max_seq_len}",
                             code="context_length_exceeded", param="max_tokens")
        return messages, max_tokens, params, sid, hint

    @cached_property
    def max_text_bytes(self) -> int:
        """The most bytes of text a conversation that fits the context can have (floe.server.limits)."""
        return self.engine.max_seq_len * self.engine.tokenizer.most_text_bytes_per_token

    @cached_property
    def _vocab(self) -> dict:
        """The "vocab" call's answer: each token's reply bytes (floe.server.protocol), for the fronts to
        make the text of replies streamed as token ids, and whether a chat's reply drops the space its
        text starts with (Tokenizer.strips_leading_space; Actor.send's text drops it too)."""
        tokenizer = self.engine.tokenizer
        pieces = [tokenizer.reply_bytes(i) for i in range(tokenizer.vocab_size)]
        return {"bytes": base64.b64encode(b"".join(pieces)).decode(), "lengths": [len(p) for p in pieces],
                "strips_leading_space": tokenizer.strips_leading_space}

    @cached_property
    def _tokenizer_wire(self) -> dict:
        """The "tokenizer" call's answer: the engine's tokenizer, for the fronts' prompt hints."""
        return self.engine.tokenizer.wire()

    def _prompt_bound(self, messages: list[dict]) -> int:
        """At least the conversation's prompt tokens, without tokenizing it (the guest will, and each
        tokenization is core GIL time that the engine loop waits behind): a token stands for at least
        one byte of the rendered text, plus a few the tokenizer may add."""
        return len(self.engine.tokenizer.render_chat(messages).encode()) + 16

    # ---- calls (floe.server.protocol.CALLS) ----------------------------------------------------------

    def call(self, name: str, arg=None, owner=None):
        """A call's answer; the session calls see only `owner`'s sessions (protocol.OWNER)."""
        if name not in CALLS:
            raise ServeError(400, f"no call {name!r}")
        if name == "hello":
            return {"model_id": self.model_id, "aliases": list(self.aliases), "started": self.started,
                    "max_text_bytes": self.max_text_bytes, "context": self.engine.max_seq_len}
        if name == "vocab":
            return self._vocab
        if name == "tokenizer":  # (the fronts' prompt hints: floe.server.hints)
            return self._tokenizer_wire
        if name == "health" and isinstance(arg, dict) and not arg.get("full", True):  # a key's own view
            return {"status": "ok", "model": self.model_id, "device": str(self.engine.device),
                    "uptime_s": time.time() - self.started, "sessions": self.store.counts(_owner(owner))}
        if name == "health":
            return {"status": "ok", "model": self.model_id, "device": str(self.engine.device),
                    "decode_batching": self.scheduler is not None, "uptime_s": time.time() - self.started,
                    "sessions": self.store.counts(),
                    # how many files were skipped (named in the server's log: they name owners)
                    "skipped_snapshots": len(self.store.skipped),
                    "engine_loop": self.loop.stats()}
        if name == "metrics":
            return generate_latest(self.metrics.registry).decode()
        owner = _owner(owner)
        if name == "sessions":
            return [s.describe() for s in self.store.sessions.owned(owner)]
        if name == "fork":  # arg: {"id": the source's id, "new_id": the fork's, or None for a fresh one}
            if not (isinstance(arg, dict) and isinstance(arg.get("id"), str)
                    and (arg.get("new_id") is None or isinstance(arg["new_id"], str))):
                raise ServeError(400, "fork needs a session id and the new session's id (a string or null)")
            try:
                return self.store.fork(arg["id"], owner, arg.get("new_id"))
            except (SessionError, GuestError, FloeError) as e:
                raise failure(e, arg["id"]) from None
        if not isinstance(arg, str):
            raise ServeError(400, f"{name} needs a session id")
        try:
            if name == "session":
                return self.store.get(arg, owner).describe()
            if name == "freeze":
                return self.store.freeze(arg, owner)
            if name == "thaw":
                return self.store.thaw(arg, owner)
            if name == "let_go":
                return self.store.let_go(arg, owner)
            self.store.delete(arg, owner)
            return {"id": arg, "object": "session", "deleted": True}
        except SessionError as e:
            raise failure(e, arg) from None

    def export(self, sid, owner) -> Iterator[memoryview]:
        """`owner`'s session `sid` as its snapshot file's bytes (SessionStore.export)."""
        owner = _owner(owner)
        try:
            return self.store.export(sid, owner)
        except SessionError as e:
            raise failure(e, sid if isinstance(sid, str) else None) from None

    def import_(self, sid, owner, chunks: Iterable) -> dict:
        """Make or replace `owner`'s session `sid` from a snapshot file's bytes (SessionStore.import_)."""
        owner = _owner(owner)
        try:
            return self.store.import_(sid, owner, chunks)
        except SessionError as e:
            raise failure(e, sid if isinstance(sid, str) else None) from None

    # ---- lifetime ----------------------------------------------------------------------------------

    def _evict_loop(self) -> None:
        while not self._closed.wait(max(0.05, min(1.0, self.idle_seconds / 4))):
            try:
                frozen = self.store.evict_idle()
                if frozen:
                    log.info("froze idle sessions %s", frozen)
                kept = self.store.maintain()
                if kept["lost"] or kept["deleted"]:
                    log.info("sessions taken over by another server %s; past the store's lifetime or "
                             "budget %s", kept["lost"], kept["deleted"])
            except Exception:  # noqa: BLE001 - keep evicting; the error is logged
                log.exception("idle eviction or the store's upkeep failed")

    def close(self) -> None:
        """Stop evicting and freeze every live session (a restart serves them again)."""
        if not self._closed.is_set():
            self._closed.set()
            self._evictor.join(30)
            if self._warming is not None:  # (it stops at its next graph)
                self._warming.join(30)
            self.store.close()
            self.turns.close()


def failure(e: BaseException, sid: str | None) -> ServeError:
    if isinstance(e, SessionError):
        return ServeError(e.status, str(e), "server_error" if e.status >= 500 else "invalid_request_error",
                          e.code, retry_after=e.retry_after)
    if isinstance(e, GuestError):
        return ServeError(500, f"session {sid!r}: the guest failed on this message ({type(e).__name__}: "
                               f"{e}); the session was returned to its last snapshot", "server_error",
                          "guest_error")
    return ServeError(500, f"session {sid!r}: {e}", "server_error", "engine_error")


def _sampling(request: dict) -> SamplingParams:
    """A request's sampling parameters, checked (a 400 naming the field)."""
    seed = request.get("seed")
    seed = 0 if seed in (None, -1) else seed
    try:
        return SamplingParams(float(request.get("temperature", 1.0)), _int(request.get("top_k", 0)),
                              float(request.get("top_p", 1.0)), _int(seed))
    except (InvalidSamplingParams, TypeError, ValueError, OverflowError) as e:
        # The message names its field (SamplingParams's checks do); else it was the seed's type.
        param = next((p for p in ("temperature", "top_k", "top_p", "seed") if p in str(e)), "seed")
        raise ServeError(400, str(e), param=param) from None


def _template_kwargs(value: object) -> dict | None:
    """A request's chat_template_kwargs, checked again (the core trusts no peer); None: none, or {}."""
    if value is None:
        return None
    try:
        kwargs = check_template_kwargs(value) or None
    except TemplateKwargsError as e:
        raise ServeError(400, f"chat_template_kwargs: {e}", param="chat_template_kwargs") from None
    check_nesting(kwargs, "chat_template_kwargs")  # (a lone surrogate: its rendered prompt cannot be encoded)
    return kwargs


def _owner(value) -> str:
    if not (isinstance(value, str) and protocol.OWNER.fullmatch(value)):
        raise ServeError(400, f"owner {str(value)[:40]!r} is not an owner id (protocol.OWNER)")
    return value


def _int(value) -> int:
    if type(value) is not int:
        raise ServeError(400, f"{value!r} is not an integer")
    return value


__all__ = ["Chat", "Metrics", "ServeCore", "failure"]  # the socket's side: floe.server.core_socket
