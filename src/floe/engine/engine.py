"""The compute plane: a transformer, its KV cache slots, prefill and decode on one device."""

from __future__ import annotations

import contextlib
import os
import threading
import time

import numpy as np
import torch
from torch import Tensor

from floe.engine.batch import BatchedSteps, LaunchedStep  # noqa: F401 - (LaunchedStep: its callers')
from floe.engine.kvcache import KVCache
from floe.engine.sampling import SamplingParams
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
MATMUL_DESCRIPTORS = 64  # matmul descriptors PyTorch's ideep layer keeps per shape (bound_kernel_caches)


def bound_kernel_caches() -> None:
    """For a long-running server, before its first CPU matmul: two caches keyed by shape sit under
    PyTorch's CPU matmuls, 1,024 entries each by default, and every new prompt length fills a set of
    entries in both (5 matmul shapes a prompt on the default model, ~0.26 MB an entry): oneDNN's kernels
    (ONEDNN_PRIMITIVE_CACHE_CAPACITY) and, above them, ideep's matmul descriptors (LRU_CACHE_CAPACITY,
    each holding its own kernels' descriptions). Uncapped, a serving process grew ~95 MB of RSS per 32 new
    prompt lengths; with oneDNN's capped alone ~33 MB (~1 MB a length, ideep's); with both capped at 64
    it stays within ~20 MB of its first prompts (2-core VM; tests/test_core_memory.py). Shapes a server
    runs every step stay cached (least recently used go first); a length evicted costs, when it returns,
    what its first prompt did. Capacities the environment sets are kept, except LRU_CACHE_CAPACITY=0,
    which crashes ideep at its first matmul (torch 2.13): it becomes 1."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_PRIMITIVES))
    if os.environ.get("LRU_CACHE_CAPACITY", "").strip() == "0":
        os.environ["LRU_CACHE_CAPACITY"] = "1"
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(MATMUL_DESCRIPTORS))


def parse_device(name: str | torch.device) -> torch.device:
    if str(name) == "webgpu":  # not a torch device: Engine takes the name itself (see Engine.backend)
        raise FloeError("device 'webgpu' runs an Engine, `floe run`, `serve`, `profile` and `bench "
                        "dispatch`; this command runs on cpu or cuda")
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


class Engine(BatchedSteps):
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
        reference_graphs: bool = False,
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
        # On CUDA, decode steps replay captured graphs unless asked not to (eager is the reference).
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.compile_decode = compile_decode
        # The CPU running the batched graph step's host side as CUDA does, each step eagerly by the model's
        # own forward (floe.engine.reference_graph): for tests of that side where there is no GPU
        if reference_graphs and (webgpu or self.device.type != "cpu"):
            raise FloeError("reference_graphs is the CPU's stand-in for CUDA's batched graphs: device 'cpu'")
        self.reference_graphs = reference_graphs
        # Fused decode: on CUDA Triton's kernels (by default wherever graphs run and Triton is
        # installed); on the CPU the lean TorchScript step (by default, every architecture's layer;
        # off: the module forward).
        if fused_kernels is None:
            fused_kernels = self.device.type == "cpu" or (self.cuda_graphs and _has_triton())
        self.fused_kernels = fused_kernels
        # Before any weight is read. (CUDA's reference graph of one slot, where graphs run without the
        # fused step, is Llama's layer.)
        reference = self.backend == "cuda" and self.cuda_graphs and not self._batch_graphs
        check_backend(self.config, "cuda-graph" if reference else self.backend, self.max_seq_len)
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
        self._decoders: dict[int, object] = {}
        self._batch = None  # the batched decode step (CUDA graphs; the CPU's lean step), made on first use
        self._init_batched_steps()
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

    def kv_hold(self, slot: int = 0) -> None:
        """Empty `slot`, keeping what it held for kv_reuse until anything writes it (KVCache.hold)."""
        self.cache.hold(slot)
        self._forget(slot)

    def kv_holds(self, slot: int = 0) -> bool:
        """Whether the emptied `slot` still holds ids for kv_reuse (KVCache.hold)."""
        return self.cache.held[slot] is not None

    def kv_drop_held(self, slot: int = 0) -> None:
        """Forget what the emptied `slot` held (KVCache.drop_held)."""
        self.cache.drop_held(slot)

    def kv_reuse(self, ids, slot: int = 0) -> int:
        """How many of prompt `ids`' first tokens the emptied `slot` holds again (KVCache.reuse)."""
        return self.cache.reuse(slot, ids)

    def claim_slot(self) -> int:
        """A free KV cache slot, emptied, for a new conversation."""
        slot = self.slots.claim()
        self.cache.truncate(slot, 0)
        self.cache.drop_held(slot)
        self._forget(slot)
        return slot

    def release_slot(self, slot: int) -> None:
        self.cache.drop_held(slot)
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
        batch.wait(batch.done)  # its greedy choice is on the host now (the caller samples next)
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
        """Whether the batched graph of the fused Triton step (BatchGraphDecoder) runs here (or, on the
        CPU, its reference: reference_graphs)."""
        return self.reference_graphs or (self.device.type == "cuda" and self.cuda_graphs
                                         and self.fused_kernels and not self.compile_decode)

    def _batch_decoder(self):
        """The step over several slots' rows: CUDA graphs of the fused Triton step, or the CPU's lean
        step (which also runs decode_step's single row)."""
        if self._batch is None:
            if self.reference_graphs:
                from floe.engine.reference_graph import ReferenceGraphDecoder

                self._batch = ReferenceGraphDecoder(self.model, self.cache)
            elif self.backend == "webgpu":
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

    def warm_up(self, progress=lambda done, total: None, graphs: str = "all") -> None:
        """Run a short prefill and a few decode steps in a free slot, then empty it; in every free
        slot where each slot has CUDA graphs of its own (cuda_graphs without the batched step's); then
        capture every graph of the batched step (CUDA): the first draws, TorchScript's profiling passes
        and the graphs' captures happen before a user waits for them (a server calls this at start).
        progress(done, total): after each slot warmed. (Every slot warmed alike cost `floe serve`
        ~0.1-0.3 s a slot on a 2-core CPU, ~3 s at its default 16 slots, for nothing a slot holds.)
        graphs="first": only the smallest KV bucket's graphs of the batched step (a model loaded on
        demand answers sooner: capturing every bucket's was half of a 1B model's load on an H100);
        warm_up_graphs_later captures the others."""
        slots = self.slots.free
        own_graphs = self.device.type == "cuda" and self.cuda_graphs and not self._batch_graphs
        warmed = slots if own_graphs else slots[:1]
        for done, slot in enumerate(warmed, 1):
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
            progress(done, len(warmed))
        if graphs not in ("all", "first"):
            raise ValueError(f"graphs must be 'all' or 'first', not {graphs!r}")
        if self._graph_prefill(1) and not self.reference_graphs:  # (the reference captures nothing)
            buckets = self._batch_decoder().buckets
            self._warm_up_graphs(slots, buckets if graphs == "all" else buckets[:1])

    @torch.inference_mode()
    def warm_up_graphs_later(self, stop: threading.Event | None = None, spare=None, retry_s: float = 0.5,
                             give_up_s: float = 120.0) -> int:
        """Capture the batched step's graphs that warm_up(graphs="first") left out (every KV bucket's
        past the first) while sessions run: one graph at a time, each under the step lock (a session's
        step waits for one capture) in slots free at that moment, claimed for it alone. spare(n): a
        context manager yielding whether n slots may be taken now (a server's admission counts them, so
        that no arriving session finds its slot taken); default: any free slot may. A graph whose slots
        are busy is tried again every `retry_s` (a step that needs it first captures it itself), for
        at most `give_up_s`. Stops once `stop` is set. Returns the graphs captured."""
        if not self._graph_prefill(1) or self.reference_graphs:
            return 0
        stop = threading.Event() if stop is None else stop
        spare = spare or (lambda n: contextlib.nullcontext(True))
        batch, made = self._batch_decoder(), 0
        left = [c for bucket in batch.buckets[1:] for c in self._captures(batch, bucket)]
        end = time.monotonic() + give_up_s
        while left and not stop.is_set():
            busy = []
            for key, need, run in left:
                if stop.is_set() or key in batch.graphs:  # (met by a step meanwhile)
                    continue
                with spare(need) as may:
                    free = self.slots.claim_free(self.slots.free[:need]) if may else []
                    try:
                        if len(free) == need:
                            with self._step_lock:
                                run(free)
                            made += 1
                        else:
                            busy.append((key, need, run))
                    finally:
                        self._empty(free)
            left = busy
            if left and (time.monotonic() > end or stop.wait(retry_s)):
                break
        return made

    @staticmethod
    def _warm_up_sampling(logits: Tensor) -> None:
        """Draw once greedily and once with temperature, top-k and top-p: on CUDA the first draw
        compiles the Triton argmax and loads the sampling kernels (~0.3 s), which the first request of
        a server would otherwise wait for."""
        from floe.engine.sampling import sample_token

        for params in (SamplingParams(), SamplingParams(temperature=1.0, top_k=40, top_p=0.9)):
            sample_token(logits, params, torch.Generator())

    @torch.inference_mode()
    def _warm_up_graphs(self, slots: list[int], buckets: list[int]) -> None:
        """Capture every graph of the batched step at `buckets` (prefill row counts and, with several
        slots, decode batch sizes, each at every KV bucket; the draw of each batch size) by running it on
        free slots at the bucket's last positions; the slots are emptied after. Without this, a capture
        (tens of ms, under the step lock) would stall every session the first time a new shape is met."""
        free = self.slots.claim_free(slots)
        batch = self._batch_decoder()
        try:
            with self._step_lock:
                for bucket in buckets:
                    for _, need, run in self._captures(batch, bucket):
                        if need <= len(free):
                            run(free)
                if free and batch.prompt_sizes:  # the smallest prompt graph (compiles its attention);
                    # larger ones are captured when a prompt first needs them
                    batch.prompt(torch.zeros(batch.PREFILL_ROWS + 1, dtype=torch.long), 0, free[0])
                for size in batch.sizes:  # the draws of sampled rows (on the spare logits row)
                    spare = [self.cache.n_slots] * size
                    vocab = self.config.vocab_size
                    batch.draw(spare, [1.0] * size, [0.9] * size, [vocab] * size, [0.5] * size)
                batch.draw_done.synchronize()
        finally:
            self._empty(free)

    def _captures(self, batch, bucket: int):
        """The batched step's graphs at KV `bucket`: (its key in batch.graphs, the free slots it needs,
        run(free): capture it by running it there at the bucket's last positions)."""
        for size in batch.prefill_sizes:
            if size <= bucket:
                yield (size, bucket, True), 1, lambda free, n=size: batch.prefill(
                    [0] * n, bucket - n, free[0])
        for size in batch.sizes:
            yield (size, bucket, False), size, lambda free, n=size: batch.step(
                [0] * n, [bucket - 1] * n, free[:n])
        for size in batch.mixed_sizes:  # decode rows with prompts along: each slot's rows at the bucket's
            # last positions, as many slots as the rows need (a burst's prompts at short contexts ride
            # in more rows than one slot's bucket holds)
            per = min(size, bucket)
            yield (size, bucket, False), -(-size // per), lambda free, n=size, per=per: batch.mixed(
                [0] * n, [bucket - per + k % per for k in range(n)], [free[k // per] for k in range(n)],
                [self.cache.n_slots] * n)

    def _empty(self, slots: list[int]) -> None:
        """Empty and free slots a warm-up claimed."""
        for s in slots:
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
