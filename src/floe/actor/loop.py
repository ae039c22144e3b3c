"""The engine loop: one thread per engine steps every active turn of ABI v2 actors.

An actor's caller thread runs the guest's on_message (it renders, tokenizes and queues its prompt),
then hands the turn to the loop and waits. Each step of the loop:
  1. prefill: one chunk of each queued prompt (a long prompt does not stall the others' decoding);
  2. the previous decode forward's results: each of its turns has fresh logits;
  3. guests: each turn whose logits are fresh calls its guest's on_token, which chooses the next
     token (or stop); the host appends it in the next forward and counts max_tokens;
  4. decode: one batched forward (Engine.launch_batch) for every turn that has a next token;
  5. ended turns call on_end and wake their caller.
A guest that traps, overruns or passes a bad pointer fails its own turn; the others go on. One turn
waits at most one step for its next forward, whatever the others do (no turn starves).

Overlap and feeding (Engine.overlaps, Engine.feeds): floe.actor.speculation.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from floe.actor.abi import LOGITS_COPIED, LOGITS_IN_PLACE, OK
from floe.actor.calls import GuestCalls
from floe.actor.speculation import Speculation
from floe.actor.turn import END_CANCELLED, END_CONTEXT_FULL, FED, Roster, Turn, TurnTable
from floe.actor.watchers import stepped
from floe.engine import Engine
from floe.engine.batch import LaunchedStep
from floe.engine.sampling import draw_uniforms
from floe.errors import ContextOverflow
from floe.wasm import (
    GuestDeadlineExceeded,
    guest_calls_running,
    start_guest_thread,
    stop_all_guests,
)
from floe.wasm.rows import NONE, Col

if TYPE_CHECKING:
    from floe.actor.host import GuestHost

log = logging.getLogger("floe.actor")

PREFILL_CHUNK = 512  # prompt tokens one turn prefills per step
# With overlap (CUDA): whole queued prompts of up to this many tokens in all ride in the
# next decode step's replay instead of a prefill of their own (Engine.launch_batch's prompts).
RIDE_ROWS = 256
# The most one guest call from the loop (on_token, on_end) may take: every other turn waits for it. Its
# host calls count too. Until the loop has seen one on_token through (cold: the first sample on a fresh
# CUDA context loads kernels, ~1 s) it is TOKEN_CALL_S; then STEP_CALL_S: a guest that kept each call
# just under 5 s held every other session for 5 s a token (13.6 s for a 0.15 s reply). A real guest's
# on_token takes ~10-30 us (the grammar guest's, masking a vocabulary: ~1 ms).
TOKEN_CALL_S = 5.0
STEP_CALL_S = 0.25
ARRIVAL_WAIT_S = 0.05  # the most an arriving turn waits for the one before it (EngineLoop.arriving)
# Arriving turns' on_message at once (EngineLoop.arriving): their GIL-free parts (the guest's code, the
# tokenizer) overlap where there are cores for them, and the next starts without waiting for a hand-off.
# A burst of 64 (bench/probes/arrival_cost.py): the H200 host (16 cores) on_message p50 61 ms with 4, 87
# with 1, TTFT p50 90 vs 105-118 ms; a 2-core VM the last on_message 22-30 ms with 4 vs 47-58 with 1.
ARRIVALS = min(4, max(2, (os.cpu_count() or 1) // 4))
IDLE_EXIT_S = 5.0  # the loop's thread ends after this long without turns (the next turn starts one)


class Launched(NamedTuple):
    """A forward the loop launched: the engine's step, its decode turns and riding prompts' turns."""

    step: LaunchedStep
    turns: Sequence[Turn]
    riding: list[Turn]
    started: float  # time.perf_counter()
    positions: list[int]  # each decode row's position in its turn's slot
    void: set[Turn]  # turns whose row here was undone while it ran (its results are not theirs)
    slots: np.ndarray  # each decode row's slot (int64): its turn's row of the table


class EngineLoop(Speculation):
    """Steps the turns of every v2 actor of `engine` in one thread (see the module docstring).

    on_step(rows): called after each decode forward with its number of rows (metrics).
    batch: run the turns' decode steps as one forward (Engine.decode_batch); False: one by one.
    token_call_s: the most one guest call from the loop may take while it is cold (seconds);
    step_call_s: once one on_token has returned (warm). native_rows: a step's on_token calls in one
    native loop where it can run (floe.wasm.rows); False: one by one through GuestInstance.call.
    """

    def __init__(self, engine: Engine, prefill_chunk: int = PREFILL_CHUNK, on_step=lambda rows: None,
                 batch: bool = True, token_call_s: float = TOKEN_CALL_S, overlap: bool | None = None,
                 feed: bool | None = None, step_call_s: float = STEP_CALL_S,
                 native_rows: bool = True) -> None:
        self.engine, self.prefill_chunk, self.on_step, self.batch = engine, prefill_chunk, on_step, batch
        # Speculate greedy rows (module doc) where the engine's forward runs while Python goes on.
        self.overlap = (engine.overlaps and batch) if overlap is None else overlap
        if self.overlap and not engine.logits_outlive_next_step:  # guests read them during the next one
            raise ValueError("overlap needs an engine whose step logits outlive the next step")
        # And launch a forward before finishing the one in flight (fed rows) where the engine can.
        self.feed = (self.overlap and engine.feeds) if feed is None else bool(feed)
        if self.feed and not (self.overlap and engine.feeds):
            raise ValueError("feeding needs overlap and an engine that takes fed tokens (Engine.feeds)")
        self._launched: list[Launched] = []  # forwards in flight, oldest first (two when fed)
        self.table = TurnTable(engine.cache.n_slots)  # its turns' per-token state (floe.actor.turn)
        self.calls = GuestCalls(self.table, token_call_s, step_call_s, native_rows, self._refuse)
        self._cond = threading.Condition()
        self._arrived: list[Turn] = []
        self._active: list[Turn] = []
        self._roster: Roster | None = None  # its live turns, as _live() found them last
        self._left = 0  # the table's changes when those done last left _active
        # A step looks for turns to cancel (a deadline passed, a stop asked, a caller gone, an actor
        # closed) only when one may be there: a stop or a departure pokes the loop (poke()), and no
        # active turn's deadline is before `_soonest` (not a scan of every turn every step).
        self._poked = False
        self._soonest = math.inf
        self._thread: threading.Thread | None = None
        self.steps = 0  # decode forwards run
        self.rows = 0  # decode rows run in them
        self.undone = 0  # speculated rows whose guest chose otherwise (their forward undone)
        self.fed = 0  # rows launched with a fed token (before the forward computing it was finished)
        self.fed_past_prompts = 0  # of those, rows fed while prompts rode in the forward in flight
        self.step_s = 0.0  # time in steps (the loop's thread busy or waiting for the device)
        self.wait_s = 0.0  # of which waiting for launched forwards (the rest: the host's work)
        self.launch_s = 0.0  # of which in Engine.launch_batch (on the CPU: the forward itself)
        self.phase_s = dict.fromkeys(("prefill", "results", "launch", "guests", "end"), 0.0)  # of step_s
        self._arrival = threading.BoundedSemaphore(ARRIVALS)  # see arriving()
        self.arriving_now = 0  # arriving turns holding it
        self._arrivals_counted = threading.Lock()
        _ALL_LOOPS.add(self)

    # ---- the caller's side ------------------------------------------------------------------------

    def run(self, actor: GuestHost, max_tokens: int, deadline: float,
            deliver: tuple[threading.Event, Callable[[], None]] | None = None) -> int:
        """Run the turn `actor`'s on_message has just queued, until it ends; why it ended (END_*).
        Raises what failed it (a GuestError of its guest, an engine error). deliver: (an event, a
        function): each time the event is set (by whoever has something for the caller, and at the
        turn's end) the function runs here, in the caller's thread, not the loop's (the caller's own
        callbacks: a slow one never holds the other turns); what it raises ends the turn and is raised."""
        turn = Turn(actor, max_tokens, deadline, woken=None if deliver is None else deliver[0])
        with self._cond:
            self._arrived.append(turn)
            self._start()
            self._cond.notify()
        try:
            if deliver is None:
                turn.done.wait()
            else:
                woken, handed = deliver
                while True:
                    woken.wait()
                    woken.clear()
                    ended = turn.done.is_set()
                    handed()
                    if ended:
                        break
        except BaseException:  # Ctrl-C (or the caller's callback failed): the guest and its memory
            turn.abandoned = True  # must outlive the turn
            self.poke()
            self._wait_out(turn)
            raise
        if turn.error is None and turn.calls_on_end:
            turn.error = self.calls.on_end(turn)
        if turn.error is not None:
            raise turn.error
        return turn.end

    @contextlib.contextmanager
    def arriving(self):
        """Held around an arriving turn's on_message (its caller's thread, Actor._turn): arrivals take
        turns (ARRIVALS at once), so that 16 of them at once do not each hand the GIL to the others at
        every call into Wasmtime (each call releases it), which made every arrival wait for all.
        Bounded: a turn waits at most ARRIVAL_WAIT_S for the one before it (a slow guest delays
        others' arrival no longer)."""
        held = self._arrival.acquire(timeout=ARRIVAL_WAIT_S)
        if held:
            with self._arrivals_counted:
                self.arriving_now += 1
        try:
            yield
        finally:
            if held:
                with self._arrivals_counted:
                    self.arriving_now -= 1
                self._arrival.release()

    @property
    def warm(self) -> bool:
        """Whether an on_token call has returned (guest calls are then bound by step_call_s)."""
        return self.calls.warm

    @property
    def native_calls(self) -> int:
        """on_token calls made in the native loop so far."""
        return self.calls.native_calls

    @property
    def busy(self) -> bool:
        """Whether any turn is running or arriving (a racy read: for deciding when to do idle work)."""
        return bool(self._active or self._arrived)

    def stats(self) -> dict:
        with self._cond:
            return {"active": len(self._active), "waiting": len(self._arrived), "steps": self.steps,
                    "rows": self.rows, "undone": self.undone, "fed": self.fed,
                    "fed_past_prompts": self.fed_past_prompts, "step_s": self.step_s,
                    "wait_s": self.wait_s, "launch_s": self.launch_s,
                    "phase_s": dict(self.phase_s)}

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():  # (a thread that died is replaced)
            self._thread = threading.Thread(target=self._loop, name="floe-engine-loop", daemon=True)
            self._thread.floe_engine_loop = True  # actors refuse blocking calls from this thread
            start_guest_thread(self._thread)  # guests run on its stack: sized for them, not inherited

    # ---- the loop -----------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._arrived and not self._active:
                    if not self._cond.wait(IDLE_EXIT_S) and not self._arrived:
                        self._thread = None  # nothing holds the engine alive through this thread
                        return
                if self._arrived:
                    for turn in self._arrived:  # (the turn that held its slot's row before is gone)
                        turn.bind(self.table)
                    self._poked = True  # (a stop asked before it arrived poked an earlier step, not this one)
                    self._active.extend(self._arrived)
                    self._arrived.clear()
                    self._roster = None  # (the live turns are more)
            t0 = time.perf_counter()
            try:
                self._step()
            except BaseException as e:  # noqa: BLE001 - a bug here must fail turns, not hang callers
                try:
                    self._abort(e)
                except BaseException:  # noqa: BLE001 - the clean-up failed too: the loop goes on
                    log.exception("the engine loop's clean-up after a failed step failed")
                finally:  # whatever _abort did, no caller waits on for ever
                    for turn in self._active:
                        if not turn.over:
                            turn.error = turn.error or e
                            turn.set_done()
            self.step_s += time.perf_counter() - t0
            if self.table.changes != self._left:  # (a turn ended or is done: those done leave)
                self._active = [t for t in self._active if not t.over]
                self._left = self.table.changes
                self._roster = None  # (nor does the roster hold them)

    def _wait_out(self, turn: Turn) -> None:
        """Wait for an abandoned turn to end, through further interrupts: until it has, the loop may
        still step it (call its guest, write its memory, run or undo its row in its KV slot), so its
        actor must not be freed, nor its slot given to another. The loop ends it at its next step (a
        step is bounded: each guest call in it by token_call_s), unless the loop's thread is gone."""
        while not turn.done.is_set():
            thread = self._thread
            if thread is None or not thread.is_alive():
                return
            try:
                turn.done.wait(0.05)
            except KeyboardInterrupt:
                continue

    def _abort(self, error: BaseException) -> None:
        """Fail every turn (a bug in the loop, or the engine failed): the forward in flight is waited
        for first, so that no turn ends while the device still writes its rows."""
        launched, self._launched = self._launched, []
        for flight in launched:
            try:
                self.engine.finish_batch(flight.step)
            except BaseException:  # noqa: BLE001 - already failing
                pass
            for turn in (*flight.turns, *flight.riding):
                turn.flying = 0
        for turn in self._active:
            turn.finish(END_CANCELLED, error)

    def poke(self) -> None:
        """A turn may have to be cancelled (its actor asked to stop or closed, its caller gone): the next
        step looks (from any thread)."""
        self._poked = True

    def _cancel(self, now: float) -> None:
        """End (cancelled) the turns past their deadline, asked to stop, abandoned or of a closed actor,
        where one may be (poke(), _soonest)."""
        if not self._poked and now <= self._soonest:
            return
        self._poked = False  # (before looking: a poke from now on is seen at the next step)
        soonest = math.inf
        for turn in self._active:
            if turn.end is None:
                if now > turn.deadline or turn.abandoned or turn.context.stop_requested or turn.actor.closed:
                    turn.end = END_CANCELLED
                else:
                    soonest = min(soonest, turn.deadline)
        self._soonest = soonest

    def _step(self) -> None:
        t0 = time.perf_counter()
        self._cancel(time.monotonic())
        # Prompts ride in the next decode step's launch where the engine runs them with it (CUDA: in its
        # replay) or together (the CPU: one forward for several, before the decode rows; a prompt
        # alone is prefilled with its logits computed where its guest asked).
        roster = self._roster_now()
        prompts = [] if roster.prompted() else [t for t in roster.turns if t.prompt and not t.flying]
        for turn in prompts:
            turn.prompt = bool(turn.abi.queued_tokens)
        prompts = [t for t in prompts if t.prompt]
        rides = self.overlap or (self.engine.prompts_together and len(prompts) > 1)
        riding, room = [], 0
        if rides:  # CUDA: the prompt rows that fill the padded graph beside (at most) the live turns'
            # decode rows (Engine.ride_room); the CPU: RIDE_ROWS in all
            room = self.engine.ride_room(len(self._active) - len(prompts))
            room = RIDE_ROWS if room is None else room
        for turn in prompts:
            queued = turn.abi.queued_tokens
            if queued <= room:  # rides in the next decode step
                riding.append(turn)
                room -= queued
            elif not rides or queued > RIDE_ROWS:
                self._prefill(turn)  # (a prompt that could ride waits for room in a later step instead
                # of a forward of its own that every other turn would wait for)
        t1 = time.perf_counter()
        fed = self._feedable()
        if fed is not None:  # the next forward now, before the one in flight is finished
            more = self._with_next_token()
            self._launch([*fed, *more] if more else fed, riding)
        self._take_results()
        fresh, slots = self._fresh()
        # A fed step launched already: a fresh turn without a row in it (a prompt that rode in the
        # forward just taken, a fed row undone above) is asked first, and its token joins the next launch.
        ahead = self._speculate(slots) if fed is None else self.table.array[slots, Col.SPECULATED] != NONE
        if not ahead.any():  # (every fresh turn asked now, or after the launch: the roster's turns where
            speculated = []  # they are every live turn)
            self.calls.ask(fresh, self._roster_of(fresh))
        elif ahead.all():
            speculated = fresh
        else:
            speculated = [fresh[k] for k in np.flatnonzero(ahead).tolist()]
            self.calls.ask([fresh[k] for k in np.flatnonzero(~ahead).tolist()])
        t2 = time.perf_counter()
        # The device idles from the end of the last forward to this launch: only what the launch
        # needs comes before it; speculated turns' bookkeeping and guests come after.
        if fed is None:
            self._launch(self._with_next_token(), riding)
        t3 = time.perf_counter()
        self.calls.ask(speculated, self._roster_of(speculated))  # while the device computes their logits
        t4 = time.perf_counter()
        for turn in self._active if len(self._live()) != len(self._active) else ():  # (one has ended)
            if turn.end is None or turn.over or turn.flying:
                continue
            if turn.error is not None:  # failed while a forward had its row: wake its caller now
                turn.set_done()
            else:
                self._end(turn)
        for turn in self._roster_now().handing:  # (their callers make their text: woken where it grew)
            turn.wake()
        stepped()  # (what this step streamed, taken in this thread: floe.actor.watchers)
        phase = self.phase_s
        phase["prefill"] += t1 - t0
        phase["results"] += t2 - t1  # waiting for the forward (wait_s), and guests asked before the launch
        phase["launch"] += t3 - t2
        phase["guests"] += t4 - t3  # speculated rows' guests, while the device computes
        phase["end"] += time.perf_counter() - t4

    def _live(self) -> tuple[Turn, ...]:
        """The turns that have not ended, in order (the roster's list: not to be changed)."""
        return self._roster_now().turns

    def _roster_now(self) -> Roster:
        """The live turns' roster, made again once a turn has ended or arrived since it was made."""
        roster = self._roster
        if roster is None or roster.key != self.table.changes:
            live = tuple(t for t in self._active if t.end is None)
            roster = self._roster = Roster(live, self.table.changes)
        return roster

    def _roster_of(self, turns: Sequence[Turn]) -> Roster | None:
        """The roster whose list `turns` is, if every turn of it is still live; else None."""
        roster = self._roster
        if roster is not None and turns is roster.turns and roster.key == self.table.changes:
            return roster
        return None

    def _with_next_token(self) -> Sequence[Turn]:
        """The live turns with a next token to append."""
        roster = self._roster_now()
        ks = np.flatnonzero(self.table.array[roster.slots, Col.NEXT_TOKEN] != NONE)
        if len(ks) == len(roster.turns):
            return roster.turns
        return [roster.turns[k] for k in ks.tolist()]

    def _prefill(self, turn: Turn) -> None:
        abi = turn.abi
        try:
            status = abi.run_queued(self.prefill_chunk)
        except BaseException as e:  # noqa: BLE001 - fails this turn only
            turn.finish(END_CANCELLED, e)
            return
        if status != OK:
            turn.end = END_CONTEXT_FULL
        elif not abi.queued_tokens:
            turn.fresh = True

    def _launch(self, turns: Sequence[Turn], riding: list[Turn] = ()) -> None:
        """Launch one forward for every turn with a next token and the whole queued prompt of each
        `riding` turn (the rows' steps one by one if not batching). Speculated turns' guests read their
        logits during it (they outlive it: see __init__)."""
        if not turns and not riding:
            return
        if not self.batch and len(turns) + len(riding) > 1:
            for turn in turns:
                self._launch([turn])
                self._take_results()
            for turn in riding:
                self._launch([], [turn])
                self._take_results()
            return
        # A fed turn's token is its slot's own choice from the forward in flight (None: Engine.feeds).
        table = self.table.array
        roster = self._roster_of(turns)
        if roster is not None:
            at, slots, drawing = roster.slots, roster.slot_list, roster.drawing
        else:
            at = np.array([t.slot for t in turns], np.int64)
            slots, drawing = at.tolist(), [t for t in turns if t.draws]
        speculated = table[at, Col.SPECULATED]
        tokens = table[at, Col.NEXT_TOKEN].tolist()
        for k in np.flatnonzero(speculated == FED).tolist():
            tokens[k] = None
        lengths = self.engine.cache.lengths
        positions = [lengths[slot] for slot in slots]
        prompts = [(t.abi.take_queued(), t.slot) for t in riding]
        # The next host choice of rows whose guest takes it with sampling parameters: drawn by the
        # step itself (on CUDA right after the forward, on the device), one uniform of each actor's.
        for turn in drawing:  # a speculated row may be undone: its draw is then given back too
            turn.rng_before = turn.context.generator.get_state() if turn.speculated is not None else None
        uniforms = draw_uniforms([t.context.generator for t in drawing]).tolist() if drawing else []
        draws = [(t.slot, t.context.request.params, u) for t, u in zip(drawing, uniforms, strict=True)]
        t0 = time.perf_counter()
        step = self.engine.launch_batch(tokens, slots, prompts, draws)
        self.launch_s += time.perf_counter() - t0
        self._launched.append(Launched(step, turns, riding, t0, positions, set(), at))
        self.fed += tokens.count(None)
        for k in np.flatnonzero(speculated != NONE).tolist():
            turns[k].speculated_at = positions[k]
        table[at, Col.NEXT_TOKEN] = NONE
        table[at, Col.FLYING] += 1
        for turn in riding:
            turn.next_token, turn.prompt = None, False
            turn.flying += 1

    def _take_results(self) -> None:
        """Wait for the oldest launched forward; each row's turn has fresh logits, or its error. A row
        undone while it ran (its guest refused the token it was speculated with: _undo) is skipped;
        one of a turn that ended meanwhile is undone now (its guest keeps only the tokens the cache
        held before)."""
        if not self._launched:
            return
        launched, turns, riding, t0, positions, void, slots = self._launched.pop(0)
        t1 = time.perf_counter()
        results = self.engine.finish_batch(launched)
        self.wait_s += time.perf_counter() - t1
        seconds = time.perf_counter() - t0
        if turns:
            self.steps += 1
            self.rows += len(turns)
            self.on_step(len(turns))
        for turn, (ids, _), result in zip(riding, launched.prompts, launched.prompt_results, strict=True):
            turn.flying -= 1
            if turn.end is not None:
                continue  # its prompt stays in the cache, as a prefill before a cancellation leaves it
            try:
                status = turn.abi.took_prompt(len(ids), result, seconds, len(ids) + len(turns))
            except BaseException as e:  # noqa: BLE001 - fails this turn only
                turn.finish(END_CANCELLED, e)
                continue
            if status != OK:
                turn.end = END_CONTEXT_FULL
            else:
                turn.fresh = True
        n = len(turns)
        moved = self._moved(n) if n else []
        roster = self._roster_of(turns)
        if n and not void and (roster.targetless() if roster is not None else all(
                [t.end is None and t.target is None for t in turns])) and not any(
                [isinstance(r, BaseException) for r in results]):  # the common case, in the table at once
            for turn, result in zip(turns, results, strict=True):
                turn.abi.last_logits = result  # (HostABI.keep_logits of a turn that asked for none)
            table = self.table.array
            table[slots, Col.FLYING] -= 1
            table[slots, Col.ROWS] += 1
            self.table.doubles[slots, Col.ROWS_S] += seconds
            for calls, nbytes, size in moved:
                table[slots, calls] += 1
                table[slots, nbytes] += size
            table[slots, Col.FRESH] = 1
            return
        for turn, position, result in zip(turns, positions, results, strict=True):
            turn.flying -= 1
            if turn in void:
                continue
            failed = isinstance(result, BaseException)
            if turn.end is not None and not failed:
                self._truncate(turn, position)
            elif isinstance(result, ContextOverflow):
                turn.end = END_CONTEXT_FULL
            elif failed:
                turn.finish(END_CANCELLED, result)
            else:
                try:  # the logits now (the next forward overwrites the engine's buffer)
                    if turn.target is False:
                        turn.target = turn.abi.step_target()
                    kept = turn.abi.keep_logits(result, turn.target, record=False)
                except BaseException as e:  # noqa: BLE001 - a bad logits buffer fails this turn only
                    turn.finish(END_CANCELLED, e)
                    continue
                if kept == LOGITS_IN_PLACE:  # (counted: Turn.record)
                    turn.in_place += 1
                elif kept == LOGITS_COPIED:
                    turn.copied += 1
                turn.rows += 1
                turn.rows_s += seconds
                turn.count_moved(moved)
                turn.fresh = True

    def _moved(self, n: int) -> list[tuple[int, int, int]]:
        """What one decode row of an n-row step moved: (calls word, bytes word, bytes) of each
        transfer (Engine.input_transfer / output_transfer), their names kept in the table."""
        e, out = self.engine, []
        transfers = ((e.input_transfer(1, n), Col.IN_CALLS, Col.IN_BYTES),
                     (e.output_transfer(1, n), Col.OUT_CALLS, Col.OUT_BYTES))
        for i, (transfer, calls, nbytes) in enumerate(transfers):
            if transfer is not None:
                self.table.moved_names[i] = transfer[0]
                out.append((calls, nbytes, transfer[1]))
        return out

    def _end(self, turn: Turn) -> None:
        """The turn's end, its rows all taken: its caller is woken, and calls its guest's on_end
        (_on_end) in its own thread: the other turns' next step does not wait for it (the chat
        guest's, which detokenizes the whole reply, held every other row ~1.5 ms a turn on the H200
        host)."""
        actor = turn.actor
        error = None
        if actor.closed:
            from floe.wasm import GuestCancelled

            error = GuestCancelled("the actor was closed during its message")
        elif turn.end == END_CANCELLED and time.monotonic() > turn.deadline and not actor.stop_requested:
            error = GuestDeadlineExceeded(f"the message ran past its {actor.deadline_s:g} s deadline")
        else:
            turn.calls_on_end = actor.guest.has_function("on_end")
        turn.finish(turn.end, error)


_LOOPS: weakref.WeakKeyDictionary[Engine, EngineLoop] = weakref.WeakKeyDictionary()
_LOOPS_LOCK = threading.Lock()


def engine_loop(engine: Engine) -> EngineLoop:
    """The engine loop of `engine` (one per engine, made on first use)."""
    with _LOOPS_LOCK:
        loop = _LOOPS.get(engine)
        if loop is None:
            loop = _LOOPS[engine] = EngineLoop(engine)
        return loop


def in_engine_loop() -> bool:
    """Whether the calling thread is an engine loop's (where blocking on an actor would deadlock)."""
    return getattr(threading.current_thread(), "floe_engine_loop", False)


_ALL_LOOPS: weakref.WeakSet[EngineLoop] = weakref.WeakSet()


EXIT_WAIT_S = 10.0  # the most the interpreter's exit waits for guests and loops to stop


@atexit.register
def _stop_at_exit() -> None:
    """At the interpreter's exit (after its non-daemon threads, before it stops the daemon ones): stop
    every guest call and refuse new ones, then wait for each loop's turns to end. A loop thread Python
    stops inside a guest call, or a forward, aborts the process ("terminate called without an active
    exception"); waited for, each turn ends with GuestCancelled and its thread idles."""
    stop_all_guests("the process is exiting")
    end = time.monotonic() + EXIT_WAIT_S
    while (guest_calls_running() or any(loop.busy for loop in list(_ALL_LOOPS))) and time.monotonic() < end:
        time.sleep(0.01)
