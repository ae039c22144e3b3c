"""The compute plane: a transformer, its KV cache slots, prefill and decode on one device."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np
import torch
from torch import Tensor

from floe.engine.int4 import DENSE_FROM_ROWS
from floe.engine.kvcache import KVCache
from floe.engine.sampling import Draw, SamplingParams, finish_draw, start_draw, top_ks
from floe.engine.slots import SlotPool
from floe.engine.weights import check_backend, load_model
from floe.errors import ContextOverflow, FloeError
from floe.model.checkpoint import Checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise FloeError(f"dtype {name!r} is not supported; choose one of: {', '.join(DTYPES)}")
    return DTYPES[name]


ONEDNN_PRIMITIVES = 64  # kernels oneDNN keeps per shape in a server (bound_kernel_caches)


def bound_kernel_caches() -> None:
    """For a long-running server, before its first CPU matmul: oneDNN (PyTorch's CPU matmuls) keeps the
    kernels it made for each shape, 1,024 by default, and every new prompt length makes a new set: a
    serving process grew ~95 MB of RSS per 32 new prompt lengths, ~33 MB capped at 64 (the default model,
    2-core VM). Shapes a server runs every step stay in the cache (it is least recently used first). An
    ONEDNN_PRIMITIVE_CACHE_CAPACITY the environment sets is kept."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_PRIMITIVES))


def parse_device(name: str | torch.device) -> torch.device:
    if str(name) == "webgpu":  # not a torch device: Engine takes the name itself (see Engine.backend)
        raise FloeError("device 'webgpu' runs an Engine, `floe run` and `floe bench dispatch`; this command "
                        "runs on cpu or cuda")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise FloeError(f"unknown device {name!r}: {e}") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FloeError("device 'cuda' was asked for, but this machine has no usable CUDA device")
    if device.type not in ("cpu", "cuda"):
        raise FloeError(f"device {device.type!r} is not supported (cpu or cuda)")
    return device


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


class FairLock:
    """A lock granted in arrival order (threading.Lock is not): concurrent actors' steps take turns."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = self._serving = 0

    def __enter__(self) -> None:
        with self._cond:
            ticket = self._next
            self._next += 1
            while ticket != self._serving:
                self._cond.wait()

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()


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
    # CUDA graphs: the rows of the graph's logits buffers (BatchGraphDecoder.row) its decode rows and
    # then its riding prompts wrote, and those its draws read
    logit_rows: list[int] = field(default_factory=list)
    draw_rows: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # of the decode rows (step.rows), in their slots
    done: object = None  # CUDA: the replay's event; and its draw's
    draw_done: object = None


class Engine:
    """Owns the model weights and the KV cache on `device`; prefill and decode per slot."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = torch.float32,
        max_seq_len: int | None = None,
        n_slots: int = 1,
        cuda_graphs: bool | None = None,
        compile_decode: bool = False,
        fused_kernels: bool | None = None,
        weights: str = "dense",
        native_kernel: str = "auto",
        prefill_copy: bool = False,
    ) -> None:
        # A file's checkpoint is lazy: holding it pins the file's mapping, no dequantized tensor.
        self.checkpoint = checkpoint
        self.config = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        # Where the forward runs: cpu, cuda, or webgpu (WGSL shaders through wgpu; the engine's own
        # tensors, logits included, are then host tensors: `device` is the CPU).
        webgpu = str(device) == "webgpu"
        self.device = torch.device("cpu") if webgpu else parse_device(device)
        self.backend = "webgpu" if webgpu else self.device.type
        self.dtype = parse_dtype(dtype)
        self.max_seq_len = min(max_seq_len or self.config.context_length, self.config.context_length)
        self.weights, self.prefill_copy = weights, prefill_copy
        if webgpu and (self.dtype != torch.float32 or weights not in ("dense", "f16")):
            raise FloeError("device 'webgpu' runs float32 or float16 dense weights (--weights fp32 or f16)")
        if weights == "f16" and not webgpu:
            raise FloeError("--weights f16 is WebGPU's storage (--device webgpu); on cuda choose bf16")
        check_backend(self.config, self.backend, self.max_seq_len)  # before any weight is read
        # WebGPU: the host model is float32; the decoder stores its matrices as f16 where asked.
        loaded = load_model(checkpoint, self.max_seq_len, self.device, self.dtype,
                            "dense" if webgpu else weights, native_kernel, prefill_copy)
        self.model, self.native_kernel, self.packed = loaded.model, loaded.native_kernel, loaded.packed
        if webgpu:
            from floe.engine.webgpu import webgpu_cache

            self.cache = webgpu_cache(self.config, self.max_seq_len, n_slots)
        else:
            self.cache = KVCache(self.config, self.max_seq_len, n_slots, self.dtype, self.device)
        self.slots = SlotPool(n_slots)
        self._step_lock = FairLock()  # one forward at a time, in arrival order, across threads
        # On CUDA, decode steps replay captured graphs unless asked not to (eager is the reference).
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.compile_decode = compile_decode
        # Fused decode: on CUDA Triton's kernels (by default wherever graphs run and Triton is
        # installed); on the CPU the lean TorchScript step (by default, every architecture's layer;
        # off: the module forward).
        if fused_kernels is None:
            fused_kernels = self.device.type == "cpu" or (self.cuda_graphs and _has_triton())
        self.fused_kernels = fused_kernels
        self._decoders: dict[int, object] = {}
        self._batch = None  # the batched decode step (CUDA graphs; the CPU's lean step), made on first use
        self._greedy: dict[int, int] = {}  # slot -> argmax of its latest logits, where computed
        self._drawn: dict[int, int] = {}  # slot -> the draw asked of its latest decode step (launch_batch)
        self._unfinished: list[LaunchedStep] = []  # launched steps not yet finished, oldest first
        # slot -> its latest device-fed row: (position, token once known, source logits row, drawn there)
        self._fed: dict[int, tuple[int, int | None, int, bool]] = {}
        self._row_transfers: dict[int, tuple[str, int] | None] = {}  # input_transfer(1, rows), by rows

    def input_transfer(self, n_tokens: int, batch_rows: int = 1) -> tuple[str, int] | None:
        """(boundary name, bytes) of what a forward of n_tokens copies host→device, None on the CPU:
        the int64 ids of a prefill, or a decode graph's token and position (from pinned memory); for
        one row of a batched decode step (`batch_rows` rows), its share of the step's input block.
        A decode row's is worked out once per batch size (the engine loop asks for every row)."""
        if n_tokens != 1:
            return self._input_transfer(n_tokens, batch_rows)
        known = self._row_transfers.get(batch_rows, self)
        if known is self:
            known = self._row_transfers[batch_rows] = self._input_transfer(1, batch_rows)
        return known

    def _input_transfer(self, n_tokens: int, batch_rows: int) -> tuple[str, int] | None:
        if self.backend == "webgpu":  # the step's rows (token, position, slot) and their count
            from floe.engine.webgpu.decoder import input_bytes

            return "step rows host→webgpu (queue.write_buffer)", input_bytes(n_tokens, batch_rows)
        if self.device.type == "cpu":
            return None
        if n_tokens == 1 and self._batch_graphs:
            share = -(-self._batch_decoder().host_in[0].nbytes // batch_rows)
            return f"batched step inputs host→{self.device.type} (pinned, in the graph; a row's share)", share
        if n_tokens == 1 and self.cuda_graphs:
            return f"token + position host→{self.device.type} (pinned, in the graph)", 16
        if self._graph_prefill(n_tokens):  # the replay's whole input block (a prefill or a prompt graph's)
            batch = self._batch_decoder()
            block = batch.host_in[0] if n_tokens <= batch.PREFILL_ROWS else batch.prompt_host_in[0]
            where = f"host→{self.device.type} (pinned, before the replay)"
            return f"token ids, positions, slots {where}", block.nbytes
        return f"token ids host→{self.device.type}", 8 * n_tokens

    @property
    def logits_in_place(self) -> bool:
        """Whether logits asked for in a caller's buffer (logits_out) are computed straight into it;
        otherwise they are converted or transferred into it (one copy)."""
        return self.backend == "cpu" and self.dtype == torch.float32 and self.model.head is None

    def output_transfer(self, n_tokens: int, batch_rows: int = 1) -> tuple[str, int] | None:
        """(boundary name, bytes) of what a forward copies device→host besides what it returns into a
        caller's buffer: on WebGPU the logits row read back from the mapped buffer into a host tensor
        (a caller's buffer then gets them by a copy of its own); None elsewhere."""
        if self.backend != "webgpu":
            return None
        return "logits webgpu→host (mapped readback buffer)", 4 * self.config.vocab_size

    @property
    def fingerprint(self) -> str:
        return self.checkpoint.fingerprint

    def kv_len(self, slot: int = 0) -> int:
        return self.cache.lengths[slot]

    def kv_truncate(self, n: int, slot: int = 0) -> None:
        self.cache.truncate(slot, n)
        self._forget(slot)  # the logits it was the choice of are not the context's now

    def claim_slot(self) -> int:
        """A free KV cache slot, emptied, for a new conversation."""
        slot = self.slots.claim()
        self.cache.truncate(slot, 0)
        self._forget(slot)
        return slot

    def release_slot(self, slot: int) -> None:
        self.slots.release(slot)

    @torch.inference_mode()
    def prefill(
        self,
        ids: list[int] | Tensor,
        slot: int = 0,
        all_logits: bool = False,
        logits_out: Tensor | None = None,
    ) -> Tensor:
        """Append token ids to `slot`'s context; float32 logits of the last one ([T, vocab] if all).

        With `logits_out` (float32 [vocab], e.g. a view of guest memory) they are written there.
        """
        if isinstance(ids, Tensor):
            tokens = ids.to("cpu", torch.long)
            ids = tokens.tolist()
        else:  # through numpy: a third of torch.as_tensor's time on a long list (~40 µs per 2,048)
            ids = list(ids)
            try:
                tokens = torch.from_numpy(np.asarray(ids, dtype=np.int64))
            except (TypeError, ValueError, OverflowError) as e:
                raise FloeError(f"token ids must be integers: {e}") from None
        if tokens.ndim != 1 or tokens.numel() == 0:
            raise ValueError("prefill needs a non-empty 1-D list of token ids")
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size:
            self._check_ids(ids)
        if self._graph_prefill(len(ids), all_logits):
            return self._append(slot, ids,
                                lambda start: self._replay_prefill(tokens, ids, start, slot, logits_out))
        if self.backend == "webgpu":
            return self._append(slot, ids, lambda start: _into(
                self._batch_decoder().prefill(ids, start, slot, all_logits), logits_out))
        tokens = tokens.to(self.device)
        return self._append(
            slot, ids,
            lambda start: self.model(tokens, start, self.cache, slot, all_logits=all_logits, out=logits_out),
        )

    def _graph_prefill(self, n_tokens: int, all_logits: bool = False) -> bool:
        """Whether a prompt of n_tokens runs through the fused step's layers (BatchGraphDecoder): on
        CUDA with graphs and fused kernels, as one replay up to PREFILL_ROWS tokens, eagerly past."""
        return self._batch_graphs and not all_logits

    def _replay_prefill(self, tokens: Tensor, ids: list[int], start: int, slot: int,
                        logits_out: Tensor | None) -> Tensor:
        batch = self._batch_decoder()
        short = len(ids) <= batch.PREFILL_ROWS
        row = batch.prefill(ids, start, slot) if short else batch.prompt(tokens, start, slot)
        batch.done.synchronize()  # its greedy choice is on the host now (the caller samples next)
        self._greedy[slot] = int(batch.host_argmax[row])
        logits = batch.slot_logits[row]
        return logits if logits_out is None else logits_out.copy_(logits)

    def _append(self, slot: int, ids: list[int], run) -> Tensor:
        """Reserve len(ids) positions of `slot`, run(start) the step, record the ids; a failed step
        leaves the context as it was."""
        with self._step_lock:
            self._forget(slot)  # this forward makes new logits
            start = self.cache.reserve(slot, len(ids))
            try:
                logits = run(start)
            except BaseException:
                self.cache.truncate(slot, start)
                raise
            self.cache.tokens[slot].extend(ids)
            return logits

    @torch.inference_mode()
    def decode_step(self, token: int, slot: int = 0, logits_out: Tensor | None = None) -> Tensor:
        """Append one token to `slot`'s context; float32 logits [vocab] of the next position.

        On the CPU a lean decoder runs the step; on CUDA a replayed graph (its returned tensor is
        the graph's buffer, valid until the next step); with cuda_graphs=False (CUDA) or
        fused_kernels=False (CPU) the module forward, as prefill runs it.
        """
        if not (self.cuda_graphs if self.device.type == "cuda" else self.fused_kernels):
            return self.prefill([token], slot, logits_out=logits_out)
        self._check_ids([token])
        if self._batch_graphs:  # the batched graph's step for one row: one step for B = 1 and B = N
            result = self.finish_batch(self.launch_batch([token], [slot]))[0]
            if isinstance(result, FloeError):
                raise result
            return result if logits_out is None else logits_out.copy_(result)
        if self.backend == "webgpu":  # read back into a host tensor, then into logits_out (output_transfer)
            return _into(self._append(slot, [token], lambda position: self._batch_decoder().step(
                [token], [position], [slot])[0]), logits_out)
        if self.device.type == "cpu":
            out = None if logits_out is None else logits_out.unsqueeze(0)
            return self._append(slot, [token], lambda position: self._batch_decoder().step(
                [token], [position], [slot], out)[0])
        logits = self._append(slot, [token], lambda position: self._decoder(slot).step(token, position))
        if logits_out is not None:
            logits_out.copy_(logits)
        return logits

    @property
    def _batch_graphs(self) -> bool:
        """Whether the batched graph of the fused Triton step (BatchGraphDecoder) runs here."""
        return (self.device.type == "cuda" and self.cuda_graphs and self.fused_kernels
                and not self.compile_decode)

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
        On CUDA they ride in the decode rows' replay, up to MIXED_ROWS rows in all; elsewhere (and past
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
        if self.device.type == "cpu" and sources:  # the CPU's choices are known: the rows take them
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
        for slot in slots:
            self._drawn.pop(slot, None)
            self._fed.pop(slot, None)
        mixed = self._ride_along(step, step.prompts)
        if not self._batch_graphs and (len(slots) == 1 or not self.batched_decode):
            step.results[:] = [self._step_or_error(t, s) for t, s in zip(tokens, slots, strict=True)]
            self._start_draws(step, draws)
            return step
        for i, token in enumerate(tokens):
            try:
                if token is not None:
                    self._check_ids([token])
                step.rows.append(i)
            except FloeError as e:
                step.results[i] = e
        with self._step_lock:
            starts = {}
            for i in list(step.rows):
                try:
                    starts[i] = self.cache.reserve(slots[i], 1)
                except ContextOverflow as e:
                    step.results[i] = e
                    step.rows.remove(i)
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
            latest = [self._batch.row(slot) for slot in slots]
            temps, top_p = [p.temperature for p in params], [p.top_p for p in params]
            step.draw_done = self._batch.draw(latest, temps, top_p, top_ks(params, self.config.vocab_size),
                                              uniforms.tolist())
            step.draw, step.draw_rows = (slots, Draw(None, None, None, params, uniforms)), latest
        else:
            step.draw = (slots, start_draw(torch.stack([t for _, t in picked]), params, uniforms))

    def _feed_sources(self, tokens: list[int | None], slots: list[int]) -> dict[int, tuple]:
        """Per fed slot: the logits row of its latest step its token is read from on CUDA
        (BatchGraphDecoder.row; None on the CPU), whether that step drew for it (else the token is
        the argmax), and on the CPU the token itself (taken from that step's results)."""
        sources = {}
        latest: dict[int, LaunchedStep] = {}  # each slot's newest unfinished step (one pass, not a search
        drawing: dict[LaunchedStep, set[int]] = {}  # a row: 64 rows made it 4,096 comparisons a step)
        for st in self._unfinished:
            latest.update(dict.fromkeys(st.slots, st))
            latest.update((p[1], st) for p in st.prompts)
            drawing[st] = set() if st.draw is None else set(st.draw[0])
        for token, slot in zip(tokens, slots, strict=True):
            if token is not None:
                continue
            source = latest.get(slot)
            drew = slot in self._drawn if source is None else slot in drawing[source]
            if self.device.type == "cpu":
                sources[slot] = (None, drew, self._cpu_choice(slot, source, drew))
            else:
                sources[slot] = (self._batch.row(slot), drew, None)
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
            token = int(result.argmax()) if isinstance(result, Tensor) else None
        else:
            results = zip(source.prompts, source.prompt_results, strict=True)
            result = next(r for (_, s), r in results if s == slot)
            token = int(result.argmax()) if isinstance(result, Tensor) else None
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
        for slot, position in zip(slots, positions, strict=True):
            if slot in sources:
                self._fed[slot] = (position, None, *sources[slot][:2])
                if slot not in waiting:
                    self._resolve_fed(slot)
        return [sources[slot][0] if token is None else -1 for token, slot in zip(tokens, slots, strict=True)]

    def _resolve_fed(self, slot: int) -> None:
        """`slot`'s fed row, its source step finished: its token, as the device read it (the draw's
        own, not one finish_batch drew again), into the cache's ids and fed_token."""
        position, token, row, drew = self._fed[slot]
        if token is not None:
            return
        batch = self._batch
        token = (min(max(int(batch.host_drawn_np[row]), 0), self.config.vocab_size - 1) if drew
                 else int(batch.host_argmax_np[row]))
        self._fed[slot] = (position, token, row, drew)
        ids = self.cache.tokens[slot]
        if position < len(ids) and ids[position] == -1:
            ids[position] = token

    def fed_token(self, slot: int) -> int | None:
        """The token `slot`'s latest device-fed row took (launch_batch), once the step it was read
        from has finished; else None."""
        fed = self._fed.get(slot)
        return None if fed is None else fed[1]

    def _ride_along(self, step: LaunchedStep, prompts: list[tuple[list[int], int]]) -> list[int]:
        """The prompts (indices) that ride in the decode step's replay (CUDA, MIXED_ROWS rows in all);
        the others run now, each as its own prefill, their results in step.prompt_results."""
        from floe.engine.cuda_graph import BatchGraphDecoder

        step.prompt_results = [None] * len(prompts)
        mixed, room = [], BatchGraphDecoder.MIXED_ROWS if self._batch_graphs else 0
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

    @property
    def prompts_together(self) -> bool:
        """Whether launch_batch runs the prompts that do not ride in its decode rows (see there) as
        one forward over all their rows (the CPU: each quantized weight dequantized once for all of
        them), rather than one by one. Each prompt's products are still its own (project's splits),
        so it gets the bits of its own prefill; only prompts of DENSE_FROM_ROWS tokens or more (a
        shorter one alone runs the quantized kernel, not the dense product)."""
        return self.backend == "cpu"  # (not WebGPU, whose host tensors are on the CPU too)

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
            if self.device.type == "cpu":  # one argmax for every row: greedy sampling needs no pass
                self._greedy.update(zip(row_slots, logits.argmax(-1).tolist(), strict=True))
            else:
                chunk_slots = [step.prompts[k][1] for k, _ in step.chunks]
                with self._step_lock:
                    step.done.synchronize()  # every row's greedy choice is on the host now
                argmax = self._batch.host_argmax_np[step.logit_rows].tolist()
                lengths = self.cache.lengths
                void = {s for s, p in zip(row_slots, step.positions, strict=True) if lengths[s] <= p}
                self._greedy.update((s, a) for s, a in zip(row_slots, argmax, strict=False) if s not in void)
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
                step.draw_done.synchronize()
                wider = self._batch.host_wider[step.draw_rows]
                again = self._batch.slot_logits[step.draw_rows] if bool(wider.any()) else None  # drawn again
                draw = draw._replace(tokens=self._batch.host_drawn[step.draw_rows], wider=wider, logits=again)
            tokens = finish_draw(draw)
            self._drawn.update((s, t) for s, t in zip(slots, tokens, strict=True) if s not in void)
        for slot in (*step.slots, *(p[1] for p in step.prompts)):
            if slot in self._fed:  # a row launched since reads this step's choice: it is known now
                self._resolve_fed(slot)
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

    def _step_or_error(self, token: int, slot: int) -> Tensor | FloeError:
        try:
            return self.decode_step(token, slot)
        except FloeError as e:
            return e

    def _batch_decoder(self):
        """The step over several slots' rows: CUDA graphs of the fused Triton step, or the CPU's lean
        step (which also runs decode_step's single row)."""
        if self._batch is None:
            if self.backend == "webgpu":
                from floe.engine.webgpu.decoder import WebGPUDecoder

                self._batch = WebGPUDecoder(self.model, self.cache, fused=self.fused_kernels,
                                            weights="f16" if self.weights == "f16" else "f32")
            elif self.device.type == "cpu":
                from floe.engine.cpu_decode import CpuDecoder

                self._batch = CpuDecoder(self.model, self.cache)
            else:
                from floe.engine.cuda_graph import BatchGraphDecoder

                self._batch = BatchGraphDecoder(self.model, self.cache)
        return self._batch

    def _decoder(self, slot: int):
        decoder = self._decoders.get(slot)
        if decoder is not None:
            return decoder
        from floe.engine.cuda_graph import GraphDecoder

        decoder = GraphDecoder(self.model, self.cache, slot, compile=self.compile_decode)
        self._decoders[slot] = decoder
        return decoder

    def _check_ids(self, ids: list[int]) -> None:
        bad = [i for i in ids if not 0 <= i < self.config.vocab_size]
        if bad:
            raise FloeError(f"token id {bad[0]} is out of range [0, {self.config.vocab_size})")

    def warm_up(self, progress=lambda done, total: None) -> None:
        """Run a short prefill and a few decode steps in every free slot, then empty it: captures
        each slot's first CUDA graphs and runs TorchScript's profiling passes before a user waits
        for them (a server calls this at start)."""
        slots = self.slots.free
        for done, slot in enumerate(slots, 1):
            if not self.slots.claim_free([slot]):
                continue
            try:
                self.cache.truncate(slot, 0)
                self.prefill(list(range(8)), slot)
                for token in range(3):
                    logits = self.decode_step(token, slot)
                if done == 1:
                    self._warm_up_sampling(logits)
            finally:
                self.cache.truncate(slot, 0)
                self.release_slot(slot)
            progress(done, len(slots))
        if self._graph_prefill(1):
            self._warm_up_graphs(slots)

    @staticmethod
    def _warm_up_sampling(logits: Tensor) -> None:
        """Draw once greedily and once with temperature, top-k and top-p: on CUDA the first draw
        compiles the Triton argmax and loads the sampling kernels (~0.3 s), which the first request of
        a server would otherwise wait for."""
        from floe.engine.sampling import sample_token

        for params in (SamplingParams(), SamplingParams(temperature=1.0, top_k=40, top_p=0.9)):
            sample_token(logits, params, torch.Generator())

    @torch.inference_mode()
    def _warm_up_graphs(self, slots: list[int]) -> None:
        """Capture every graph of the batched step (prefill row counts and, with several slots,
        decode batch sizes, each at every KV bucket; the draw of each batch size) by running it on
        free slots at the bucket's last positions; the slots are emptied after. Without this, a capture
        (tens of ms, under the step lock) would stall every session the first time a new shape is met."""
        free = self.slots.claim_free(slots)
        batch = self._batch_decoder()
        try:
            with self._step_lock:
                for bucket in batch.buckets:
                    for size in batch.prefill_sizes:
                        if free and size <= bucket:
                            batch.prefill([0] * size, bucket - size, free[0])
                    for size in batch.sizes:
                        if size <= len(free):
                            batch.step([0] * size, [bucket - 1] * size, free[:size])
                    for size in batch.mixed_sizes:  # decode rows with prompts along: one slot's rows here
                        if free and size <= bucket:
                            batch.mixed([0] * size, list(range(bucket - size, bucket)), [free[0]] * size,
                                        [self.cache.n_slots] * size)
                if free and batch.prompt_sizes:  # the smallest prompt graph (compiles its attention);
                    # larger ones are captured when a prompt first needs them
                    batch.prompt(torch.zeros(batch.PREFILL_ROWS + 1, dtype=torch.long), 0, free[0])
                for size in batch.sizes:  # the draws of sampled rows (on the spare logits row)
                    spare = [self.cache.n_slots] * size
                    vocab = self.config.vocab_size
                    batch.draw(spare, [1.0] * size, [0.9] * size, [vocab] * size, [0.5] * size)
                batch.draw_done.synchronize()
        finally:
            for s in free:
                self.cache.truncate(s, 0)
                self._forget(s)
                self.release_slot(s)

    def room(self, slot: int = 0) -> int:
        """Positions still free in `slot`'s context."""
        return self.max_seq_len - self.cache.lengths[slot]


def _into(logits: Tensor, out: Tensor | None) -> Tensor:
    """logits, or copied into `out` if given (out is returned)."""
    return logits if out is None else out.copy_(logits)


__all__ = ["DTYPES", "ContextOverflow", "Engine", "parse_device", "parse_dtype"]
