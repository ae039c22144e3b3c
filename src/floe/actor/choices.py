"""The host's choice for each turn's fresh logits (ABI v2's choice_at): what the step computed, else the
argmax or one batched draw (floe.actor.loop calls it for the turns whose step computed none)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from floe.engine.sampling import draw_uniforms, sample_rows, sample_token

if TYPE_CHECKING:
    from floe.actor.abi import HostABI


def host_choices(abis: list[HostABI], known: list[int | None]) -> list[int]:
    """v2: the host's choice for each turn's fresh logits, for guests that asked for it (choice_at):
    `known` where the step that made the logits computed it (its argmax for a greedy request, or the
    draw asked of it: Engine.launch_batch's draws), else the argmax, or a draw with the request's
    parameters from the actor's generator (one uniform) — every such draw in one batch, one readback.
    -3 for logits nothing can be drawn from (NaN, +inf, all -inf)."""
    tokens = list(known)
    draws = []
    for i, abi in enumerate(abis):
        params = abi.context.request.params
        if tokens[i] is not None:
            continue
        if params.greedy:
            tokens[i] = sample_token(abi.last_logits, params, abi.context.generator)
        else:
            draws.append(i)
    if draws:
        t = time.perf_counter()
        # On one device: a guest's own buffer (logits in its memory) is on the CPU, the engine's are not.
        device = abis[draws[0]].engine.device
        logits = torch.stack([abis[i].last_logits.to(device) for i in draws])
        drawn = sample_rows(logits, [abis[i].context.request.params for i in draws],
                            draw_uniforms([abis[i].context.generator for i in draws]))
        seconds = (time.perf_counter() - t) / len(draws)
        for i, token in zip(draws, drawn, strict=True):
            tokens[i] = token
            if logits.device.type != "cpu":
                abis[i].context.ledger.copy(f"sampled token {logits.device.type}→host (readback, with the "
                                            "step's other draws)", 8, seconds=seconds)
    return tokens
