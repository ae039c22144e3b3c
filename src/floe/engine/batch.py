"""The engine's batched decode step (Engine is a BatchedSteps): several slots' rows in one forward,
launched and finished in two halves (on CUDA the replay runs while the caller goes on), the prompts that
ride in it, rows fed from their slot's own choice before the step computing it is finished, and the
draws asked of its logits. It works on its engine's config, KV cache, device, step lock, batched
decoder (Engine._batch_decoder) and prefill."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np
import torch
from torch import Tensor

from floe.engine.int4 import DENSE_FROM_ROWS
from floe.engine.sampling import Draw, SamplingParams, finish_draw, host_argmax, start_draw, top_ks
from floe.errors import FloeError


@dataclass(eq=False)
class LaunchedStep:
    """A decode step launch_batch started; finish_batch completes it."""

    tokens: list[int]
    slots: list[int]
    results: list  # per row: its logits, or the FloeError that stopped it (None while running)
    rows: list[int] = field(default_factory=list)  # indices of the rows the batched forward runs
    logits: list[Tensor] | None = None  # the CPU's rows, computed at launch
    prompts: list[tuple[list[int], int]] = field(default_factory=list)  # (ids, slot) appended too
    prompt_results: list = field(default_factory=list)  # per prompt: its last logits, or its error
    chunks: list[tuple[int, int]] = field(default_factory=list)  # (prompt, first position) in the replay
    draw: tuple[list[int], Draw] | None = None  # (slots, their draw) asked of this step (launch_batch)
    # CUDA graphs: the rows of the graph's logits buffers (BatchGraphDecoder.rows) its decode rows and
    # then its riding prompts wrote, and those its draws read
    logit_rows: list[int] = field(default_factory=list)
    draw_rows: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # of the decode rows (step.rows), in their slots
    done: object = None  # CUDA: the replay's event; and its draw's
    draw_done: object = None



class BatchedSteps:
    """The batched decode step's state and methods, on an Engine (the module doc)."""

    def _init_batched_steps(self) -> None:
        self._greedy: dict[int, int] = {}  # slot -> argmax of its latest logits, where computed
        self._drawn: dict[int, int] = {}  # slot -> the draw asked of its latest decode step (launch_batch)
        self._unfinished: list[LaunchedStep] = []  # launched steps not yet finished, oldest first
        # slot -> its latest device-fed row: (position, token once known, source logits row, drawn there)
        self._fed: dict[int, tuple[int, int | None, int, bool]] = {}

    @property
    def batched_decode(self) -> bool:
        """Whether decode_batch runs several slots' steps as one forward (CUDA graphs of the fused
        Triton step; on the CPU the lean step over several rows); otherwise one after another."""
        fused = self._batch_graphs or (self.device.type == "cpu" and self.fused_kernels)
        return fused and self.cache.n_slots > 1

    @property
    def logits_outlive_next_step(self) -> bool:
        """Whether a decode row's logits stay valid while its slot's next step runs (the batched graph
        writes a slot's two logits rows in turn; the CPU's are new tensors), so that a caller can read
        them then without a copy."""
        return self._batch_graphs or self.device.type == "cpu"

    @property
    def feeds(self) -> bool:
        """Whether launch_batch takes fed tokens (None: the slot's own choice from its latest step, on
        CUDA read on the device), so a slot's next step can be launched before that one is finished:
        the batched CUDA graph, and the CPU (whose launch runs the step: the choice is known)."""
        return self._batch_graphs or self.device.type == "cpu"

    @property
    def overlaps(self) -> bool:
        """Whether launch_batch returns while its forward still runs on the device (a replay of the
        batched graph, for one row or many), so the caller can work before finish_batch waits."""
        return self._batch_graphs

    @torch.inference_mode()
    def decode_batch(self, tokens: list[int], slots: list[int]) -> list[Tensor | FloeError]:
        """One decode step for each of several distinct slots; per slot its float32 logits [vocab]
        (a device buffer valid until that slot's next step) or the FloeError that stopped it (a full
        context, a bad token): one slot's error does not stop the others.

        A single slot runs decode_step, so an actor alone gets exactly the batch-1 numbers. On the CPU
        every row gets them too where the weights are quantized (see floe.engine.cpu_decode).
        """
        return self.finish_batch(self.launch_batch(tokens, slots))

    @torch.inference_mode()
    def launch_batch(self, tokens: list[int], slots: list[int], prompts: list[tuple[list[int], int]] = (),
                     draws: list[tuple[int, SamplingParams, float]] = ()) -> LaunchedStep:
        """decode_batch in two halves: this one starts the step (on CUDA a graph replay it does not
        wait for: see `overlaps`; elsewhere the whole step runs now), finish_batch waits for it and
        gives the results. Until then the slots' greedy_token and logits are the previous step's.

        prompts: (ids, slot) chunks of prompts appended in the same step (each slot's rows at its
        next positions), their results in step.prompt_results (the last row's logits, or the error).
        On CUDA they ride in the decode rows' replay (ride_room: how many rows); elsewhere (and past
        that) each runs as its own prefill first.

        draws: (slot, parameters, uniform) of decode rows to draw a token for from their new logits
        (floe.engine.sampling.start_draw, right after the forward on its device: on CUDA the device
        goes on to it without waiting for the host); drawn_token(slot) once finished.

        A token None is *fed* (where `feeds`): the slot's choice from its latest logits — their argmax,
        or the draw asked of them (as first drawn) — so a slot's next step can be launched before the
        step computing its token is finished: on CUDA the token is read on the device; on the CPU
        (whose launch runs the step) it is taken from the step's results now. fed_token(slot) tells
        which token it was, once the step it came from is finished."""
        if len(set(slots)) != len(slots) or len(tokens) != len(slots):
            raise ValueError(f"decode_batch needs one token per distinct slot, got {tokens} for {slots}")
        if None in tokens and not self.feeds:
            raise ValueError("fed tokens (None) need the batched step (Engine.feeds)")
        sources = self._feed_sources(tokens, slots) if None in tokens else {}
        cpu_fed = {}
        if not self._batch_graphs and sources:  # the CPU's choices are known: the rows take them
            tokens = [sources[s][2] if t is None else t for t, s in zip(tokens, slots, strict=True)]
            cpu_fed = {s: (self.cache.lengths[s], token, None, drew)
                       for s, (_, drew, token) in sources.items()}
        step = self._launch(tokens, slots, prompts, draws, sources)
        self._fed.update(cpu_fed)  # (after the step: a one-row CPU step forgets the slot's choices)
        self._unfinished.append(step)
        return step

    def _launch(self, tokens: list[int | None], slots: list[int], prompts: list[tuple[list[int], int]],
                draws: list[tuple[int, SamplingParams, float]],
                sources: dict[int, tuple[int | None, bool, int | None]]) -> LaunchedStep:
        step = LaunchedStep(tokens, slots, [None] * len(slots), prompts=list(prompts))
        for forgotten in (self._drawn, self._fed):
            if forgotten:
                for slot in slots:
                    forgotten.pop(slot, None)
        mixed = self._ride_along(step, step.prompts)
        if not self._batch_graphs and (len(slots) == 1 or not self.batched_decode):
            step.results[:] = [self._step_or_error(t, s) for t, s in zip(tokens, slots, strict=True)]
            self._start_draws(step, draws)
            return step
        vocab = self.config.vocab_size
        for i, token in enumerate(tokens):  # (_check_ids' test and error, without a call a row)
            if token is None or 0 <= token < vocab:
                step.rows.append(i)
            else:
                step.results[i] = FloeError(f"token id {token} is out of range [0, {vocab})")
        with self._step_lock:
            starts = {}
            for i, start in zip(list(step.rows), self.cache.reserve_each([slots[i] for i in step.rows]),
                                strict=True):
                if start < 0:
                    step.results[i] = self.cache.overflow(slots[i], 1)
                    step.rows.remove(i)
                else:
                    starts[i] = start
            chunks = self._reserve_prompts(step, mixed)
            if len(step.rows) > 1 or ((step.rows or chunks) and self._batch_graphs):  # CUDA: one row too
                row_slots = [slots[i] for i in step.rows]
                row_tokens = [tokens[i] for i in step.rows]
                feeds = (self._feeds(row_tokens, row_slots, [starts[i] for i in step.rows], sources)
                         if self._batch_graphs else None)
                rows = ([0 if t is None else t for t in row_tokens], [starts[i] for i in step.rows],
                        list(row_slots), list(row_slots))  # tokens, positions, slots, logits rows
                try:
                    if chunks:
                        spare = self.cache.n_slots
                        for k, start in chunks:
                            ids, slot = prompts[k]
                            rows[0].extend(ids)
                            rows[1].extend(range(start, start + len(ids)))
                            rows[2].extend([slot] * len(ids))
                            rows[3].extend([*[spare] * (len(ids) - 1), slot])
                        dests = self._batch_decoder().mixed(*rows, feeds)
                        n = len(step.rows)  # then each prompt's last row: its logits
                        ends = accumulate(len(prompts[k][0]) for k, _ in chunks)
                        step.logit_rows = dests[:n] + [dests[n + end - 1] for end in ends]
                    elif self._batch_graphs:
                        step.logit_rows = self._batch_decoder().step(*rows[:3], feeds)
                    else:
                        step.logits = self._batch_decoder().step(*rows[:3])
                except BaseException:
                    for i in step.rows:
                        self.cache.truncate(slots[i], starts[i])
                        self._fed.pop(slots[i], None)
                    for k, start in chunks:
                        self.cache.truncate(prompts[k][1], start)
                    raise
                for i in step.rows:  # reserved and written (or being written): the cache holds them
                    # (a fed row's token is known once the step it is fed from has finished)
                    self.cache.tokens[slots[i]].append(-1 if tokens[i] is None else tokens[i])
                for k, _ in chunks:
                    self.cache.tokens[prompts[k][1]].extend(prompts[k][0])
                step.chunks = chunks
                step.positions = [starts[i] for i in step.rows]
                if self._batch_graphs:
                    step.done = self._batch.done
                self._start_draws(step, draws)
                return step
            for i in step.rows:
                self.cache.truncate(slots[i], starts[i])
        for i in step.rows:  # the others failed: the one left runs the batch-1 step, as decode_step does
            step.results[i] = self._step_or_error(tokens[i], slots[i])  # (never fed: not on CUDA)
        step.rows = []
        self._start_draws(step, draws)
        return step

    def _start_draws(self, step: LaunchedStep, draws: list[tuple[int, SamplingParams, float]]) -> None:
        """launch_batch's draws, started on the new logits of the rows that ran (see launch_batch)."""
        if not draws:
            return
        wanted = {slot: (params, u) for slot, params, u in draws}
        if step.rows:  # the batched forward's rows: CUDA's slot buffers, or the CPU's rows
            slots = [step.slots[i] for i in step.rows]
            rows = list(step.logits) if step.logits is not None else [None] * len(slots)
        else:
            slots = [s for s, r in zip(step.slots, step.results, strict=True) if isinstance(r, Tensor)]
            rows = [r for r in step.results if isinstance(r, Tensor)]
        picked = [(slot, logits) for slot, logits in zip(slots, rows, strict=True) if slot in wanted]
        if not picked:
            return
        slots = [slot for slot, _ in picked]
        params = [wanted[slot][0] for slot in slots]
        uniforms = torch.tensor([wanted[slot][1] for slot in slots], dtype=torch.float64)
        if step.rows and step.logits is None:  # CUDA graphs: the draw's own graph, after the step's
            latest = self._batch.rows(slots)
            temps, top_p = [p.temperature for p in params], [p.top_p for p in params]
            step.draw_done = self._batch.draw(latest, temps, top_p, top_ks(params, self.config.vocab_size),
                                              uniforms.tolist())
            step.draw, step.draw_rows = (slots, Draw(None, None, None, params, uniforms)), latest
        else:
            step.draw = (slots, start_draw(torch.stack([t for _, t in picked]), params, uniforms))

    def _feed_sources(self, tokens: list[int | None], slots: list[int]) -> dict[int, tuple]:
        """Per fed slot: the logits row of its latest step its token is read from on CUDA
        (BatchGraphDecoder.rows; None on the CPU), whether that step drew for it (else the token is
        the argmax), and on the CPU the token itself (taken from that step's results)."""
        sources = {}
        latest: dict[int, LaunchedStep] = {}  # each slot's newest unfinished step (one pass, not a search
        drawing: dict[LaunchedStep, set[int]] = {}  # a row: 64 rows made it 4,096 comparisons a step)
        for st in self._unfinished:
            latest.update(dict.fromkeys(st.slots, st))
            latest.update((p[1], st) for p in st.prompts)
            drawing[st] = set() if st.draw is None else set(st.draw[0])
        cpu, drawn = not self._batch_graphs, self._drawn
        rows = None if cpu else self._batch.rows(slots)  # (each slot's latest logits row, in one call)
        for k, (token, slot) in enumerate(zip(tokens, slots, strict=True)):
            if token is not None:
                continue
            source = latest.get(slot)
            drew = slot in drawn if source is None else slot in drawing[source]
            if cpu:
                sources[slot] = (None, drew, self._cpu_choice(slot, source, drew))
            else:
                sources[slot] = (rows[k], drew, None)
        return sources

    def _cpu_choice(self, slot: int, source: LaunchedStep | None, drew: bool) -> int:
        """The CPU's fed token of `slot`: the choice from its latest logits (those of `source`, the
        unfinished step that made them, if any; the draw as first drawn)."""
        if source is None:
            token = self._drawn.get(slot) if drew else self._greedy.get(slot)
        elif drew:
            slots, draw = source.draw
            token = int(draw.tokens[slots.index(slot)])
        elif slot in source.slots:
            i = source.slots.index(slot)
            result = (source.logits[source.rows.index(i)] if source.logits is not None and i in source.rows
                      else source.results[i])
            token = int(host_argmax(result)) if isinstance(result, Tensor) else None
        else:
            results = zip(source.prompts, source.prompt_results, strict=True)
            result = next(r for (_, s), r in results if s == slot)
            token = int(host_argmax(result)) if isinstance(result, Tensor) else None
        if token is None:
            raise FloeError(f"slot {slot} has no choice to feed (its latest step made no logits)")
        return min(max(token, 0), self.config.vocab_size - 1)

    def _feeds(self, tokens: list[int | None], slots: list[int], positions: list[int],
               sources: dict[int, tuple[int, bool]]) -> list[int] | None:
        """Per decode row, -1 or the logits row its device-fed token is read from (None: no row is
        fed). A fed row's token goes in the cache's ids once the step it is read from has finished
        (now, if it has)."""
        if not sources:
            return None
        waiting = {s for step in self._unfinished for s in (*step.slots, *(p[1] for p in step.prompts))}
        fed, known = self._fed, []
        for slot, position in zip(slots, positions, strict=True):
            if slot in sources:
                fed[slot] = (position, None, *sources[slot][:2])
                if slot not in waiting:
                    known.append(slot)
        if known:
            self._resolve_fed(known)
        return [sources[slot][0] if token is None else -1 for token, slot in zip(tokens, slots, strict=True)]

    def _resolve_fed(self, slots) -> None:
        """The fed rows of these slots (those with one whose token is not known yet), their source step
        finished: each token, as the device read it (the draw's own, not one finish_batch drew again),
        into the cache's ids and fed_token."""
        if not self._batch_graphs:  # (the CPU's fed rows take tokens known at their launch)
            return
        fed, batch, ids_of = self._fed, self._batch, self.cache.tokens
        drawn, argmax, last = batch.host_drawn_np, batch.host_argmax_np, self.config.vocab_size - 1
        for slot in slots:
            entry = fed.get(slot)
            if entry is None or entry[1] is not None:
                continue
            position, _, row, drew = entry
            token = min(max(int(drawn[row]), 0), last) if drew else int(argmax[row])
            fed[slot] = (position, token, row, drew)
            ids = ids_of[slot]
            if position < len(ids) and ids[position] == -1:
                ids[position] = token

    def fed_token(self, slot: int) -> int | None:
        """The token `slot`'s latest device-fed row took (launch_batch), once the step it was read
        from has finished; else None."""
        fed = self._fed.get(slot)
        return None if fed is None else fed[1]

    def fed_tokens(self, slots: list[int]) -> list[int | None]:
        """fed_token of each slot (the engine loop's fed rows of a step, at once)."""
        fed = self._fed
        return [None if (f := fed.get(slot)) is None else f[1] for slot in slots]

    def _ride_along(self, step: LaunchedStep, prompts: list[tuple[list[int], int]]) -> list[int]:
        """The prompts (indices) that ride in the decode step's replay (CUDA: as many rows as the largest
        mixed graph holds beside the decode rows; ride_room says how many to send); the others run now,
        each as its own prefill, their results in step.prompt_results."""
        step.prompt_results = [None] * len(prompts)
        # (every prompt row that fits the largest mixed graph beside the step's decode rows: a caller
        # that sends more than ride_room's did not ask for)
        mixed, room = [], self._batch_decoder().mixed_sizes[-1] - len(step.slots) if self._batch_graphs else 0
        together = []  # (the CPU) prompts of one forward
        for k, (ids, _) in enumerate(prompts):
            if 0 < len(ids) <= room:
                mixed.append(k)
                room -= len(ids)
            elif self.prompts_together and len(ids) >= DENSE_FROM_ROWS:
                together.append(k)
        if len(together) > 1:
            results = self._prefill_together([prompts[k] for k in together])
            for k, result in zip(together, results, strict=True):
                step.prompt_results[k] = result
        for k, (ids, slot) in enumerate(prompts):
            if k in mixed or (len(together) > 1 and k in together):
                continue
            try:
                step.prompt_results[k] = self.prefill(ids, slot)
            except FloeError as e:
                step.prompt_results[k] = e
        return mixed

    def ride_room(self, decode_rows: int) -> int | None:
        """Prompt rows a CUDA decode step of `decode_rows` rows should take along: the rows of the graph
        it replays with MIXED_ROWS of them (its size padded to a captured one: the padding costs as
        much as real rows) less its decode rows, so a burst's prompts fill the padding instead of
        waiting for later steps (64 decode rows: 448, not 256, in the same 512-row graph). None
        without batch graphs (the CPU: the caller's own bound). Every size it leads to is captured at
        warm-up (Engine._warm_up_graphs)."""
        if not self._batch_graphs:
            return None
        batch = self._batch_decoder()
        want = decode_rows + batch.MIXED_ROWS
        size = next((s for s in (*batch.sizes, *batch.mixed_sizes) if s >= want), batch.mixed_sizes[-1])
        return max(0, size - decode_rows)

    @property
    def prompts_together(self) -> bool:
        """Whether launch_batch runs the prompts that do not ride in its decode rows (see there) as
        one forward over all their rows (the CPU: each quantized weight dequantized once for all of
        them), rather than one by one. Each prompt's products are still its own (project's splits),
        so it gets the bits of its own prefill; only prompts of DENSE_FROM_ROWS tokens or more (a
        shorter one alone runs the quantized kernel, not the dense product)."""
        return self.backend == "cpu" and not self._batch_graphs  # (not WebGPU, whose host tensors are on
        # the CPU too; nor the CPU's reference of CUDA's graphs, whose prompts run as CUDA's do)

    @torch.inference_mode()
    def _prefill_together(self, prompts: list[tuple[list[int], int]]) -> list[Tensor | FloeError]:
        """Prefill each (ids, slot) in one forward (Transformer.forward_segments); per prompt its last
        logits, or the FloeError (a bad id, a full context) that left it out."""
        results: list[Tensor | FloeError] = [None] * len(prompts)
        segments, taken = [], []
        with self._step_lock:
            for k, (ids, slot) in enumerate(prompts):
                try:
                    self._check_ids(ids)
                    self._forget(slot)
                    start = self.cache.reserve(slot, len(ids))
                except FloeError as e:
                    results[k] = e
                    continue
                segments.append((len(ids), start, slot))
                taken.append(k)
            if not segments:
                return results
            tokens = torch.from_numpy(np.concatenate([np.asarray(prompts[k][0], dtype=np.int64)
                                                      for k in taken]))
            try:
                logits = self.model.forward_segments(tokens.to(self.device), segments, self.cache)
            except BaseException:
                for _, start, slot in segments:
                    self.cache.truncate(slot, start)
                raise
            for k, (_, _, slot), row in zip(taken, segments, logits, strict=True):
                self.cache.tokens[slot].extend(prompts[k][0])
                results[k] = row
        return results

    def _reserve_prompts(self, step: LaunchedStep, mixed: list[int]) -> list[tuple[int, int]]:
        """Positions for the riding prompts (under the step lock): (index, first position) of each
        that fits; one with a bad id or a full context gets its error instead."""
        chunks = []
        for k in mixed:
            ids, slot = step.prompts[k]
            try:
                self._check_ids(ids)
                chunks.append((k, self.cache.reserve(slot, len(ids))))
                self._forget(slot)
            except FloeError as e:
                step.prompt_results[k] = e
        return chunks

    @torch.inference_mode()
    def finish_batch(self, step: LaunchedStep) -> list[Tensor | FloeError]:
        """Wait for a launched step; per slot its logits or the FloeError that stopped it (see
        decode_batch). On CUDA each row's greedy choice is on the host now (greedy_token). Steps are
        finished in launch order. A row whose position was truncated away while it ran (kv_truncate:
        its caller undid it) leaves no greedy or drawn choice."""
        if step in self._unfinished:
            self._unfinished.remove(step)
        void = set()
        if step.rows or step.chunks:
            row_slots = [step.slots[i] for i in step.rows]
            logits = step.logits
            if not self._batch_graphs:  # the CPU: one argmax for every row (greedy sampling needs no pass)
                self._greedy.update(zip(row_slots, host_argmax(logits).tolist(), strict=True))
            else:
                chunk_slots = [step.prompts[k][1] for k, _ in step.chunks]
                with self._step_lock:
                    self._batch.wait(step.done)  # every row's greedy choice is on the host now
                argmax = self._batch.host_argmax_np[step.logit_rows].tolist()
                lengths = self.cache.lengths
                void = {s for s, p in zip(row_slots, step.positions, strict=True) if lengths[s] <= p}
                kept = zip(row_slots, argmax, strict=False)
                self._greedy.update(kept if not void else ((s, a) for s, a in kept if s not in void))
                self._greedy.update(zip(chunk_slots, argmax[len(row_slots):], strict=True))
                views = self._batch.slot_logit_rows
                logits = [views[r] for r in step.logit_rows[:len(row_slots)]]
                for (k, _), r in zip(step.chunks, step.logit_rows[len(row_slots):], strict=True):
                    step.prompt_results[k] = views[r]
            for i, row in zip(step.rows, logits, strict=True):
                step.results[i] = row
            step.rows, step.chunks = [], []
        if step.draw is not None:
            slots, draw = step.draw
            step.draw = None
            if draw.tokens is None:  # the draw graph's: its results are in pinned host memory
                self._batch.wait(step.draw_done)
                wider = self._batch.host_wider[step.draw_rows]
                again = self._batch.slot_logits[step.draw_rows] if bool(wider.any()) else None  # drawn again
                draw = draw._replace(tokens=self._batch.host_drawn[step.draw_rows], wider=wider, logits=again)
            tokens = finish_draw(draw)
            self._drawn.update((s, t) for s, t in zip(slots, tokens, strict=True) if s not in void)
        if self._fed:  # a row launched since reads this step's choice: it is known now
            self._resolve_fed((*step.slots, *(p[1] for p in step.prompts)))
        return step.results

    def _forget(self, slot: int) -> None:
        """The slot's latest logits are no longer its context's: forget what was chosen from them."""
        self._greedy.pop(slot, None)
        self._drawn.pop(slot, None)
        self._fed.pop(slot, None)

    def drawn_token(self, slot: int) -> int | None:
        """The token drawn from `slot`'s latest logits where its decode step was asked to draw
        (launch_batch's draws; -3 if its logits allowed none); else None."""
        return self._drawn.get(slot)

    def greedy_token(self, slot: int) -> int | None:
        """The argmax of `slot`'s latest logits if the forward that made them computed it (a batched
        decode step does, on the device, so greedy sampling needs no launch or sync); else None."""
        return self._greedy.get(slot)

    def choices(self, slots: list[int], draws: list[bool]) -> list[int | None]:
        """Each slot's drawn_token where draws, else its greedy_token (the engine loop's fresh rows)."""
        drawn, greedy = self._drawn, self._greedy
        return [drawn.get(s) if d else greedy.get(s) for s, d in zip(slots, draws, strict=True)]

    def _step_or_error(self, token: int, slot: int) -> Tensor | FloeError:
        try:
            return self.decode_step(token, slot)
        except FloeError as e:
            return e
