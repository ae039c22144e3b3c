"""The engine loop's calls of its turns' guests (floe.actor.loop): each step's on_token of the turns
with fresh logits — the host's choice written where a guest asked for it, the calls made in one
native loop where it can run (floe.wasm.rows: a plain token is taken into its turn's row there) or
one by one — what each returned taken into its turn, and a turn's on_end. Every call is bound: every
other turn waits for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from floe.actor.choices import host_choices
from floe.actor.turn import END_CANCELLED, END_LENGTH, END_STOP, STOP, Roster, Turn, TurnTable
from floe.wasm import GuestDeadlineExceeded, GuestError, GuestReportedError, GuestResultError
from floe.wasm import rows as guest_rows
from floe.wasm.rows import NONE, PLAIN, Col


class GuestCalls:
    """The guest calls of one engine loop. token_call_s: the most one call may take while the loop
    is cold (no on_token has returned yet); step_call_s: once warm. native_rows: a step's on_token
    calls in one native loop where it can run; False: one by one through GuestInstance.call.
    refuse(turn): the loop undoes the row in flight of a turn whose guest chose otherwise."""

    def __init__(self, table: TurnTable, token_call_s: float, step_call_s: float, native_rows: bool,
                 refuse: Callable[[Turn], None]) -> None:
        self.table = table
        self.token_call_s, self.step_call_s = token_call_s, min(step_call_s, token_call_s)
        self.warm = False  # an on_token call has returned: calls are bound by step_call_s
        self.native_rows = native_rows
        if native_rows:  # loaded (built, once per machine) now, in the caller's thread: at the first step
            guest_rows.native()  # it held a server's first burst ~0.3 s (importing the build tools)
        self.native_calls = 0  # on_token calls made so
        self.refuse = refuse

    def give_choices(self, turns: Sequence[Turn], write: bool = True) -> None:
        """Write the host's choice into the memory of each of `turns`' guests that asked for it
        (choice_at): what its step computed (turn.choice), else drawn now, all in one batch (a
        prompt's first token). write=False: only turn.choice is set; floe.wasm.rows writes (and
        counts) it just before the guest's call."""
        asking = [t for t in turns if t.end is None and t.abi.choice is not None]
        if not asking:
            return
        known = self.table.array[[t.slot for t in asking], Col.CHOICE]
        if not write and not (known == NONE).any():
            return
        tokens = [None if c == NONE else c for c in known.tolist()]
        if None in tokens:  # (a prompt's first token, where its step computed none)
            try:
                tokens = host_choices([t.abi for t in asking], tokens)
            except BaseException as e:  # noqa: BLE001 - fails the turns it was for, not the engine's others
                for turn in asking:
                    turn.finish(END_CANCELLED, e)
                return
        for turn, token in zip(asking, tokens, strict=True):
            turn.choice = token
            if write:  # (else floe.wasm.rows writes and counts it)
                turn.abi.give_choice(token, record=False)
                turn.choices += 1  # (recorded by Turn.record, which charges its budget)

    def ask(self, turns: Sequence[Turn], roster: Roster | None = None) -> None:
        """Give each of `turns` still running its host choice and ask its guest (ask_one): the
        guests' calls in one native loop (floe.wasm.rows) where it can run, else one by one.
        roster: the loop's roster whose list `turns` is, every turn of it live (its slots and guests)."""
        if roster is not None and (turns is not roster.turns or roster.key != self.table.changes):
            roster = None  # (not the roster of these turns as they are now)
        asking = turns if roster is not None else [t for t in turns if t.end is None]
        if not asking:
            return
        headed = roster is not None and roster.headed()
        # (a turn's guest checked at its first on_token here: Turn.head)
        if not (self.native_rows and guest_rows.usable(
                [] if headed else [t.guest for t in asking if not t.headed])):
            self.give_choices(asking)
            for turn in asking:
                if turn.end is None:
                    self.ask_one(turn)
            return
        table = self.table.array
        if headed:  # every turn's choice address in its row: those that asked one, all known?
            rows = table[roster.slots]
            if ((rows[:, Col.CHOICE_AT] != 0) & (rows[:, Col.CHOICE] == NONE)).any():
                headed = False
        if not headed:
            changes = self.table.changes
            self.give_choices(asking, write=False)
            if self.table.changes != changes:
                roster = None
                asking = [t for t in asking if t.end is None]  # (a choice that failed ended its turn)
            for turn in asking:
                if not turn.headed:  # its first on_token here (its choice's address is fixed for the turn)
                    turn.head()
        bound = self.step_call_s if self.warm else self.token_call_s
        if roster is not None:
            slots, guests = roster.slots, roster.guests
        else:
            slots, guests = np.array([t.slot for t in asking], np.int64), [t.guest for t in asking]
        failed = guest_rows.call_slots(table, slots, guests, "on_token", bound,
                                       lambda k: asking[k].actor.take_pending())
        self.native_calls += len(asking)
        if len(failed) < len(asking):
            self.warm = True
        rows = table[slots]
        judged = rows[:, Col.JUDGED]
        # A plain token was taken whole into its row natively (floe.wasm.rows): its decoded id, and its
        # stream where the reply streams ids (Turn.head). Python sees the rest: failures (judged 0),
        # other tokens, and plain ones whose text it streams.
        python = ((judged & PLAIN) == 0) | ((rows[:, Col.STREAMS] != 0) & (rows[:, Col.STREAM_N_AT] == 0))
        for k in np.flatnonzero(python).tolist():
            turn = asking[k]
            if failed and k in failed:  # (its row's words are not this call's)
                answer = failed[k]
                if isinstance(answer, GuestError):
                    turn.actor.name_last_log(answer)  # as Actor.guest_call does
                turn.finish(END_CANCELLED, self.failure(turn, "on_token", bound, answer))
            elif judged[k] & PLAIN:
                try:
                    turn.abi.stream(int(rows[k, Col.RESULT]))
                except BaseException as e:  # noqa: BLE001 - fails this turn only
                    turn.finish(END_CANCELLED, e)
            else:
                self.took(turn, int(rows[k, Col.RESULT]))

    def ask_one(self, turn: Turn) -> None:
        """Its guest's on_token: the next token (appended by the next forward, or confirming the
        speculated one), a stop, or a failure of this turn."""
        turn.fresh = turn.sampled = False
        try:
            token = self.call(turn, "on_token")
        except BaseException as e:  # noqa: BLE001 - fails this turn only
            turn.finish(END_CANCELLED, e)
            return
        self.took(turn, token)

    def took(self, turn: Turn, token: int) -> None:
        """What on_token returned: the next token, a stop, or a failure of this turn."""
        abi = turn.abi
        # A guest that also drew with sample() is not speculated: the next step's draw, made at its
        # launch, would come before that sample() call in the generator (not so without overlap).
        turn.takes_choice = token == turn.choice and not (turn.sampled and turn.draws)
        confirmed = False
        if turn.speculated is not None:  # its next row is in flight with the speculated token
            confirmed = token == turn.speculated and 0 <= token < abi.vocab and (
                turn.generated + 1 < turn.max_tokens)
            turn.refused = not confirmed
            if confirmed:  # the row is the guest's
                turn.speculated = turn.rng_before = None
            else:
                self.refuse(turn)
        if token == STOP:
            turn.end = END_STOP
        elif token < 0:
            turn.finish(END_CANCELLED, GuestResultError(
                f"on_token returned {token} (an error: a token is >= 0, and -1 stops)"))
        elif token >= abi.vocab:
            turn.finish(END_CANCELLED, GuestResultError(
                f"on_token returned token {token}, outside the vocabulary [0, {abi.vocab})"))
        else:
            turn.decode(token)
            if abi.streams:
                try:
                    abi.stream(token)
                except BaseException as e:  # noqa: BLE001 - fails this turn only
                    turn.finish(END_CANCELLED, e)
                    return
                if turn.streaming:  # (its stream may have grown: the native calls write where it is now)
                    turn.stream_moved()
            turn.generated += 1
            if turn.generated >= turn.max_tokens:
                turn.end = END_LENGTH
            elif not confirmed:  # else the forward in flight has it
                turn.next_token = token

    def on_end(self, turn: Turn) -> BaseException | None:
        """Its guest's on_end, in the caller's thread once the loop is done with the turn: what failed
        it, if anything. It keeps the loop's bound on a call (ABI.md), as when the loop made it."""
        try:
            status = self.call(turn, "on_end", turn.end)
        except BaseException as e:  # noqa: BLE001 - the message's failure
            return e
        if status != 0:
            return GuestReportedError(f"guest reported error {status} at the end of its turn", status)
        return None

    def call(self, turn: Turn, name: str, *args: int) -> int:
        """A guest export called for the loop (on_token; on_end, in the caller's thread): every other
        turn may wait for it, so it may take at most token_call_s while the loop is cold, step_call_s
        once warm (and no longer than its message's deadline)."""
        bound = self.step_call_s if self.warm else self.token_call_s
        seconds = min(turn.deadline - time.monotonic(), bound)
        try:
            result = turn.actor.guest_call(name, *args, seconds=max(0.0, seconds))
        except BaseException as e:
            raise self.failure(turn, name, bound, e) from None
        if name == "on_token":
            self.warm = True
        return result

    def failure(self, turn: Turn, name: str, bound: float, e: BaseException) -> BaseException:
        """What a failed guest call of the loop fails its turn with: past the loop's bound (not the
        message's deadline), a GuestDeadlineExceeded that says so; anything else as it is."""
        if not isinstance(e, GuestDeadlineExceeded) or time.monotonic() >= turn.deadline:
            return e
        logs = turn.context.logs  # its own bound, not the message's deadline
        return GuestDeadlineExceeded(
            f"guest {turn.actor.module.name}'s {name} ran past {bound:g} s, the most one "
            "call from the engine loop may take (every other turn waits for it)"
            + (f" (the guest's last log line: {logs[-1][:200]!r})" if logs else ""))
