"""A turn: one message of one actor as the engine loop runs it (floe.actor.loop), and how a turn ends."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from floe.actor.abi import HostABI
    from floe.actor.actor import Actor
    from floe.wasm import GuestInstance

STOP = -1  # what on_token returns to end the turn
FED = -2  # Turn.speculated of a fed row whose token is not known yet (floe.actor.loop)
END_STOP, END_LENGTH, END_CONTEXT_FULL, END_CANCELLED = 0, 1, 2, 3
END_REASONS = {END_STOP: "stop", END_LENGTH: "length", END_CONTEXT_FULL: "context_full",
               END_CANCELLED: "cancelled"}


@dataclass(eq=False, slots=True)
class Turn:
    """One message of one actor, as the loop runs it (slots: the loop reads a dozen of its fields a
    row-token, right after a forward has evicted them from the CPU's caches)."""

    actor: Actor
    max_tokens: int
    deadline: float  # time.monotonic()
    generated: int = 0
    next_token: int | None = None  # to append in the next step
    fresh: bool = False  # logits of a forward the guest has not seen yet
    choice: int | None = None  # the host's choice for its fresh logits (argmax, or the draw asked of them)
    takes_choice: bool = False  # its guest's last token was the host's choice
    refused: bool = False  # its guest refused the last token its row was speculated with
    speculated: int | None = None  # the token in flight before its guest chose it (floe.actor.loop), or FED
    speculated_at: int = 0  # that row's position in its KV slot
    rng_before: torch.Tensor | None = None  # its generator before a speculated row's draw (restored on undo)
    flying: int = 0  # rows of this turn in launched forwards not yet finished (two when fed)
    prompt: bool = True  # its prompt may still be queued (HostABI.queued_tokens is asked only then)
    # What its decode rows crossed, counted and recorded once it ends (HostABI.record_rows): one-token
    # forwards and their seconds, transfers ({boundary: [calls, bytes]}), logits in place or copied into
    # the guest's buffer, host choices written to the guest.
    rows: int = 0
    rows_s: float = 0.0
    moved: dict[str, list[int]] = field(default_factory=dict)
    in_place: int = 0
    copied: int = 0
    choices: int = 0
    end: int | None = None  # why it ended (END_*), once it has
    error: BaseException | None = None
    abandoned: bool = False  # its caller stopped waiting (Ctrl-C): end it at the next step
    calls_on_end: bool = False  # ended well: its caller calls its guest's on_end (EngineLoop._on_end)
    done: threading.Event = field(default_factory=threading.Event)
    woken: threading.Event | None = None  # its caller's, set at its end too (run's `deliver`)
    abi: HostABI = field(init=False)
    guest: GuestInstance = field(init=False)
    draws: bool = field(init=False)
    target: torch.Tensor | None | bool = False  # its decode rows' logits buffer (False: not asked yet)
    head: tuple | None = None  # its on_token row's fixed part for floe.wasm.rows (made at its first)

    def __post_init__(self) -> None:
        self.abi = self.actor.abi
        self.guest = self.actor.guest
        # Its steps draw its host choice (a guest that asked for it, sampling parameters): fixed for the
        # turn (on_message asked, the request's parameters).
        self.draws = self.abi.choice is not None and not self.actor.request.params.greedy

    def record(self) -> None:
        """Record what its decode rows crossed (counted since the last record) in its actor's stats
        and ledger."""
        if self.rows or self.in_place or self.copied or self.choices:
            self.abi.record_rows(self.rows, self.rows_s, self.moved, self.in_place, self.copied, self.choices)
            self.rows, self.rows_s, self.moved, self.in_place, self.copied, self.choices = 0, 0.0, {}, 0, 0, 0

    def set_done(self) -> None:
        self.done.set()
        if self.woken is not None:
            self.woken.set()
