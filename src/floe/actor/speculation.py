"""The engine loop's speculation (floe.actor.loop: EngineLoop is a Speculation).

Overlap. Where the engine's forward runs on its own (a CUDA graph replay: Engine.overlaps), the loop
does not leave the device idle while guests choose: a turn whose guest took the host's choice last
time (the argmax the graph computed, or, for a guest that takes the host's sample, the draw the step
made on the device right after its forward) is *speculated* to take it again. Its next forward
is launched with that token before its guest is asked, and the guest is asked while the device
computes; if it chooses otherwise (or stops), that row's forward is undone (its KV position
truncated, its logits dropped) and the guest's token runs in the next step. What the guest sees and
decides is the same either way (its logits stay valid while the next forward runs:
Engine.logits_outlive_next_step); only when the device works changes. The KV cache holds exactly
the tokens the guest returned, as without overlap.

Feeding (Engine.feeds, with overlap). Speculating one step ahead still leaves the device idle while
the host finishes a forward and launches the next. When every turn in the forward in flight would be
speculated again, the loop launches the next forward *before* finishing that one: each row's token is
fed from its slot's own choice (the forward in flight computes it; on CUDA it is read on the device),
and two forwards are in flight. The fed token is known once the earlier one is finished
(Engine.fed_token); the guest then confirms or refuses it exactly as a speculated one. Prompts that
rode in the forward in flight are not fed (their guests choose their first tokens once it is
finished, and those join the next launch); the decode rows beside them are.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from floe.actor.turn import FED, Turn
from floe.wasm.rows import NONE, Col


class Speculation:
    """Which rows run ahead of their guests, and undoing a row its guest refused: on an EngineLoop
    (its table, engine, forwards in flight, overlap and feed settings, counters)."""

    def _feedable(self) -> Sequence[Turn] | None:
        """The turns to launch fed before the forward in flight is finished (module doc), or None
        where that would not do: not feeding, not exactly one forward in flight, a prompt prefilled
        now (its guest chooses first), or a live turn in it its guest must see before its next row
        (a guest that chose otherwise than the host last time, or refused the last row it was
        speculated with — e.g. a draw the host made again; its last token). Prompts riding in the
        forward in flight are not fed: their guests choose their first tokens once it is taken, and
        those join the next launch; the decode rows beside them are (a burst of arrivals, one or
        two a step, would otherwise stop every other turn's feeding for as long as it lasts)."""
        if not (self.feed and len(self._launched) == 1):
            return None
        flight, table = self._launched[0], self.table.array
        if table[self._roster_now().slots, Col.FRESH].any():
            return None
        if self._roster_of(flight.turns) is not None:  # (every one live)
            fed = flight.turns
        else:
            fed = [t for t in flight.turns if t.end is None]
            live = self._roster_now().turns
            if len(fed) == len(live):  # every live turn, in another list: the roster's own instead (its
                fed = live  # slots and guests made once: this launch and the next ones skip a pass a row)
        if not fed or (flight.void and any(t in flight.void for t in fed)):
            return None
        slots = (flight.slots if len(fed) == len(flight.turns)
                 else np.array([t.slot for t in fed], np.int64))
        rows = table[slots]
        if not ((rows[:, Col.FLYING] == 1) & (rows[:, Col.TAKES_CHOICE] != 0) & (rows[:, Col.REFUSED] == 0)
                & (rows[:, Col.SPECULATED] == NONE) & (rows[:, Col.NEXT_TOKEN] == NONE)
                & (rows[:, Col.GENERATED] + 1 < rows[:, Col.MAX_TOKENS])).all():
            return None
        table[slots, Col.SPECULATED] = FED
        if flight.riding:
            self.fed_past_prompts += len(fed)
        return fed

    def _fresh(self) -> tuple[Sequence[Turn], np.ndarray]:
        """The live turns with fresh logits and their slots, each given its host choice: what its step
        computed (the argmax, or the draw its launch asked for); a fed row's token, now known, is its
        speculated one (a row whose fed token is not known is undone: its guest is asked as any)."""
        roster = self._roster_now()
        live = roster.turns
        if not live:
            return [], np.zeros(0, np.int64)
        table = self.table.array
        slots = roster.slots
        ks = np.flatnonzero(table[slots, Col.FRESH])
        if len(ks) == len(live):  # (every live turn: the roster's list, slots and draws)
            fresh, slot_list, draws = live, roster.slot_list, roster.draws
        else:
            fresh, slots = [live[k] for k in ks.tolist()], slots[ks]
            if not fresh:
                return fresh, slots
            slot_list, draws = slots.tolist(), [t.draws for t in fresh]
        choices = self.engine.choices(slot_list, draws)
        table[slots, Col.CHOICE] = [NONE if c is None else c for c in choices]
        ks = np.flatnonzero(table[slots, Col.SPECULATED] == FED)
        if len(ks):  # their next rows were fed the choices as the device made them: those tokens, at once
            at = slots[ks]
            tokens = self.engine.fed_tokens(at.tolist())
            if None in tokens:  # which token was fed is not known (an engine that kept no record of it)
                for k, token in zip(ks.tolist(), tokens, strict=True):
                    if token is None:
                        self._refuse(fresh[k])
                known = [k for k, token in enumerate(tokens) if token is not None]
                at, tokens = at[known], [tokens[k] for k in known]
            table[at, Col.FRESH] = 0
            table[at, Col.SPECULATED] = tokens
        return fresh, slots

    def _speculate(self, slots: np.ndarray) -> np.ndarray:
        """Which of these fresh rows have their next forward launched with the host's choice before
        their guest is asked (module doc): those speculated already, and those whose guest took the
        host's choice last time where the token would be appended (not its last one, which max_tokens
        ends unappended; not an end-of-sequence token, where the chat guests stop: no row to undo)."""
        table = self.table.array
        rows = table[slots]
        ahead = rows[:, Col.SPECULATED] != NONE
        if not self.overlap:
            return ahead
        choice = rows[:, Col.CHOICE]
        now = (~ahead & (rows[:, Col.TAKES_CHOICE] != 0)
               & (rows[:, Col.GENERATED] + 1 < rows[:, Col.MAX_TOKENS])
               & (choice >= 0) & (choice < self.engine.config.vocab_size)
               & ~np.isin(choice, self.engine.tokenizer.eos_ids))
        if now.any():
            going = slots[now]
            table[going, Col.FRESH] = 0
            table[going, Col.NEXT_TOKEN] = table[going, Col.SPECULATED] = choice[now]
        return ahead | now

    def _truncate(self, turn: Turn, position: int) -> None:
        """Undo `turn`'s rows from `position` on (a row in flight writes past the cache's end: the
        next row there overwrites it)."""
        slot = turn.slot
        self.engine.kv_truncate(min(position, self.engine.kv_len(slot)), slot)

    def _refuse(self, turn: Turn) -> None:
        """The row `turn` was speculated with is not its guest's (counted): undone."""
        self.undone += 1
        self._undo(turn)

    def _undo(self, turn: Turn) -> None:
        """The row `turn` was speculated with (in the newest forward) is not its guest's: undone now
        (so the guest's own token goes at its position in the next forward), its results skipped, and
        the uniform its draw took given back (the generator as if it never ran)."""
        self._truncate(turn, turn.speculated_at)
        self._launched[-1].void.add(turn)
        if turn.rng_before is not None:
            turn.context.generator.set_state(turn.rng_before)
        turn.speculated = turn.rng_before = None
