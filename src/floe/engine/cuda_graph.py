"""Decode on CUDA as captured graphs: one replay per step.

BatchGraphDecoder is the fused step (Triton kernels) for one row or many; GraphDecoder is the eager
reference step of one slot in a graph (fused_kernels=False), optionally through torch.compile.

The step reads its token and position from device buffers fed from pinned host memory inside the
graph, so a replay needs no argument and allocates nothing. One graph per KV-length bucket keeps
attention from reading the whole static cache at short contexts.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from floe.engine.cuda_launch import created, driver_launch
from floe.engine.transformer import Transformer, apply_rotary, qk_norm_weight


def kv_buckets(max_seq_len: int, smallest: int = 256) -> list[int]:
    """KV lengths a graph is captured for: powers of two from `smallest`, then the whole cache."""
    buckets, b = [], min(smallest, max_seq_len)
    while b < max_seq_len:
        buckets.append(b)
        b *= 2
    return [*buckets, max_seq_len]


def logits(model: Transformer, h: Tensor) -> Tensor:
    """Float32 logits of h [B, dim]: through the model's head where it has one (bf16 weights: the
    LogitsHead (floe.engine.weights), fp32 out of cuBLAS), else the fp32 projection; soft-capped where
    the model caps them (Gemma 2), as Transformer._logits does."""
    out = model.head(h) if model.head is not None else F.linear(h, model.output_weight()).float()
    cap = model.config.logit_softcap
    return out if cap is None else torch.tanh(out / cap) * cap


def capture(run, device: torch.device, pool=None) -> torch.cuda.CUDAGraph:
    """A CUDA graph of run(). It is warmed up first on a side stream (cuBLAS handles, workspaces);
    warm-up and capture both run the step for real, writing what the first replay will write. Other
    threads go on meanwhile (thread_local: only this thread's unsafe calls would break the capture):
    another engine's loop on the same device, or this engine's waiting for its step in flight while a
    graph is captured beside its sessions (Engine.warm_up_graphs_later)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        run()
    return graph


def record(event: torch.cuda.Event, device: torch.device) -> None:
    """event.record() on `device`'s current stream, asked for by its index: Event.record() without a
    stream asks torch.cuda.current_stream() for the current device's through torch's device-index
    helpers (a chain of Python calls, twice a step of the engine loop's host time)."""
    event.record(torch.cuda.current_stream(device.index))


class GraphDecoder:
    """Decode steps of one KV cache slot, replayed from CUDA graphs."""

    def __init__(self, model: Transformer, cache, slot: int, min_bucket: int = 256,
                 compile: bool = False) -> None:
        self.model, self.cache, self.slot = model, cache, slot
        dev = model.tok_embeddings.weight.device
        c = model.config
        self.device = dev
        # Host-side inputs and outputs live in pinned memory; the graph copies them in and out.
        self.host_in = torch.zeros(2, dtype=torch.long, pin_memory=True)  # token, position
        self.dev_in = torch.zeros(2, dtype=torch.long, device=dev)
        self.logits = torch.zeros(c.vocab_size, dtype=torch.float32, device=dev)
        self.positions = torch.arange(cache.max_seq_len, device=dev)
        self.buckets = kv_buckets(cache.max_seq_len, min_bucket)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.done = torch.cuda.Event()  # the last replay finished reading host_in
        # Inductor fuses the step's elementwise ops (norms, rotary, residuals) into fewer kernels;
        # the graph below is still ours, so replay and I/O are the same either way.
        core = self._core_eager
        self._core = torch.compile(core, fullgraph=True, dynamic=False) if compile else core

    def bucket_for(self, length: int) -> int:
        return next(b for b in self.buckets if b >= length)

    @torch.inference_mode()
    def _forward(self, bucket: int) -> None:
        self.dev_in.copy_(self.host_in, non_blocking=True)
        self.logits.copy_(self._core(self.dev_in, bucket))

    def _core_eager(self, dev_in: Tensor, bucket: int) -> Tensor:
        m, c, slot = self.model, self.model.config, self.slot
        token, pos = dev_in[:1], dev_in[1:]
        x = m.tok_embeddings(token)  # [1, dim]
        cos, sin = m.cos.index_select(0, pos), m.sin.index_select(0, pos)
        group = c.n_heads // c.n_kv_heads
        mask = self.positions[:bucket] > pos  # True where not yet written
        q_size, kv_size = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        for i, layer in enumerate(m.layers):
            att = layer.attention
            q, k, v = att.wqkv(layer.attention_norm(x)).split([q_size, kv_size, kv_size], dim=-1)
            q, k = q.view(c.n_heads, 1, c.head_dim), k.view(c.n_kv_heads, 1, c.head_dim)
            if att.q_norm is not None:  # Qwen3: each head's q and k normalised before rotary
                q, k = att.q_norm(q), att.k_norm(k)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            k_cache, v_cache = self.cache.k[i, slot], self.cache.v[i, slot]
            k_cache.index_copy_(1, pos, k)
            v_cache.index_copy_(1, pos, v.view(c.n_kv_heads, 1, c.head_dim))
            keys, values = k_cache[:, :bucket], v_cache[:, :bucket]
            scores = torch.matmul(q.view(c.n_kv_heads, group, c.head_dim), keys.transpose(1, 2)).float()
            scores = (scores * c.head_dim**-0.5).masked_fill(mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(values.dtype)
            y = torch.matmul(probs, values).reshape(1, q_size)
            x = x + att.wo(y)
            x = x + layer.feed_forward(layer.ffn_norm(x))
        return logits(m, m.norm(x))[0]

    def _capture(self, bucket: int) -> torch.cuda.CUDAGraph:
        graph = capture(lambda: self._forward(bucket), self.device, self.pool)
        self.pool = graph.pool()
        return graph

    def step(self, token: int, position: int) -> Tensor:
        """Write `token` at `position` of the slot's cache and compute the next logits.

        Returns the graph's logits buffer (device, float32): valid until the next step.
        """
        bucket = self.bucket_for(position + 1)
        self.done.synchronize()  # the previous replay has read host_in
        self.host_in[0], self.host_in[1] = token, position
        graph = self.graphs.get(bucket)
        if graph is None:
            graph = self.graphs[bucket] = self._capture(bucket)
        graph.replay()
        record(self.done, self.device)
        return self.logits


def fill_rows(host, size: int, tokens: list[int], positions: list[int], slots: list[int],
              rows: list[int], spare: int, feeds: list[int] | None = None, pick: int = 0) -> None:
    """Write a batched step's inputs into the first `size` columns of host [5 or 6, top] (int64): token,
    position, KV slot, logits row and feed per row (feeds: -1 for the token column, else the logits
    row whose choice is the token; None: every row -1); padding rows get token 0, position 0, slot -1
    (no cache write), the spare logits row and no feed. pick > 0: host[5, :pick] lists the rows whose
    logits are kept (a logits row not the spare), then a row whose is not, repeated (a mixed step's
    head computes only these: BatchGraphDecoder.PICK_LOGITS); at most pick - 1 rows may keep theirs."""
    n = len(tokens)
    host[0, :n], host[1, :n], host[2, :n] = tokens, positions, slots
    host[:2, n:size] = 0
    host[2, n:size] = -1
    host[3, :len(rows)] = rows
    host[3, len(rows):size] = spare
    if feeds is None:
        host[4, :size] = -1
    else:
        host[4, :n] = feeds
        host[4, n:size] = -1
    if pick:
        kept = host[3, :size] != spare
        keep = np.flatnonzero(kept)
        if len(keep) >= pick or len(keep) == size:
            raise ValueError(f"{len(keep)} of {size} rows keep logits: a mixed step keeps fewer than {pick}")
        host[5, :len(keep)] = keep
        host[5, len(keep):pick] = int(np.argmin(kept))  # (the first row whose logits go to the spare)


class BatchGraphDecoder:
    """Continuous batching: one graph replay advances the decode of several KV cache slots, each at
    its own position. The weights are read once for all rows, so B rows cost little more than one.

    The same step is a prefill when its rows are one slot's consecutive positions: every row's K and
    V are written before any row attends, and row b sees positions up to its own. A short prompt then
    costs one replay instead of a few hundred eager launches (each a GIL hand-off under load).

    Graphs are captured per (padded row count, KV bucket, prefill or decode). Padding rows carry slot
    -1: the kernels write no cache for them, and their logits land in a spare row of `slot_logits`.

    Each slot has two logits rows, written in turn (`rows([slot])`: the latest): a step's logits stay
    valid while the slot's next step runs, so a caller reads them then without copying them first.

    A row can be *device-fed*: its token is the choice made from one of the slot's earlier logits rows
    (`slot_fed`: the row's argmax, or its draw where one ran) instead of a token from the host, so a
    caller launches a slot's next step before the step computing its token has ended. Inputs go over
    from two pinned buffers taken in turn, and each replay has its own done event, so two launched
    steps can be in flight at once.
    """

    PREFILL_ROWS = 256  # longer prompts: prompt graphs (per-row attention re-reads the prefix per row)
    PROMPT_STEP = 256  # a prompt graph's rows: a multiple of this (padding rows cost at most this)
    MIXED_ROWS = 256  # prompt rows a decode step takes along (see mixed)
    # A mixed step's head (vocabulary-wide logits, float32) only for the rows that keep their logits (a
    # slot's at most: n_slots + 1 rows, gathered by fill_rows' pick), not for every prompt row beside them
    # (512 rows at the 1B shape: 269 GFLOP and 263 MB of logits written, copied and read for argmax, of
    # which the spare row keeps nothing). FLOE_MIXED_PICK=0 turns it off (an H100, 128 actors: +2-3 %).
    PICK_LOGITS = os.environ.get("FLOE_MIXED_PICK", "1") != "0"

    def __init__(self, model: Transformer, cache, min_bucket: int = 256) -> None:
        self.model, self.cache = model, cache
        dev = model.tok_embeddings.weight.device
        self.device = dev
        n_slots = self.n_slots = cache.n_slots  # (fixed; kept: a property read ~5 times a row a step)
        powers = range(1, max(1, n_slots - 1).bit_length() + 1)
        self.sizes = sorted({1} | {min(2**i, n_slots) for i in powers})  # padded row counts
        # Decode rows plus prompt rows riding along (mixed): powers of two past n_slots.
        most = n_slots + self.MIXED_ROWS
        self.mixed_sizes = [2**i for i in range(1, most.bit_length() + 1) if self.sizes[-1] < 2**i < 2 * most]
        self.prefill_sizes = [2**i for i in range(1, self.PREFILL_ROWS.bit_length())]
        step = self.PROMPT_STEP
        self.prompt_sizes = list(range(self.PREFILL_ROWS + step, cache.max_seq_len + step, step))
        top = max(self.mixed_sizes[-1] if self.mixed_sizes else self.sizes[-1], self.PREFILL_ROWS)
        # Rows: token, position, KV slot (-1: padding), logits row (n_slots: the spare one), feed (-1:
        # the token column; else a logits row whose choice is the token). Two pinned buffers taken in
        # turn (a step is filled while the one before may still be copying from the other), each with
        # the event of its last copy to the device; the copy is outside the graphs.
        # A sixth row, with PICK_LOGITS: a mixed step's rows that keep their logits (fill_rows' pick).
        self.pick = n_slots + 1 if self.PICK_LOGITS else 0
        width = 6 if self.pick else 5
        self.host_in = self._host(2, width, top)
        self.host_rows = self.host_in.numpy()  # the same pinned memory, written without a tensor op
        self.dev_in = torch.zeros(width, top, dtype=torch.long, device=dev)
        self._driver = self._launcher()
        self._in_copied, self._in_turn = self._events(2), 0
        # Prompt graphs' rows (prompt_sizes: up to the cache's length) in buffers of their own, so a
        # decode step copies no more than its rows' block.
        longest = self.prompt_sizes[-1] if self.prompt_sizes else 0
        self.prompt_host_in = self._host(2, 5, longest)
        self.prompt_host_rows = self.prompt_host_in.numpy()
        self.prompt_dev_in = torch.zeros(5, longest, dtype=torch.long, device=dev)
        # Two rows a slot (slot s: s and n_slots + 1 + s; see rows()), and the spare row n_slots.
        n_rows = 2 * (n_slots + 1)
        self.slot_logits = torch.zeros(n_rows, model.config.vocab_size, dtype=torch.float32, device=dev)
        self.slot_logit_rows = list(self.slot_logits.unbind(0))  # its rows' views, made once (a view a row
        # a step cost ~1-2 us of the engine loop's host time each)
        self.half = [0] * n_slots  # per slot, which of its two rows holds its latest logits (rows())
        # Each row's greedy choice, computed in the graph and copied to pinned host memory, so an actor
        # that samples greedily needs no kernel launch or sync of its own.
        self.slot_argmax = torch.zeros(n_rows, dtype=torch.long, device=dev)
        self.host_argmax = self._host(n_rows)
        self.host_argmax_np = self.host_argmax.numpy()  # (read a row at a time: numpy's indexing is cheap)
        # Each row's choice as a later step is fed it: its argmax, or its draw (within the vocabulary).
        self.slot_fed = torch.zeros(n_rows, dtype=torch.long, device=dev)
        self.buckets = kv_buckets(cache.max_seq_len, min_bucket)
        # Per layer its q/k norm weights as rope_kv_write takes them (None: the architecture has none).
        self.qk_norms = [qk_norm_weight(layer.attention) for layer in model.layers]
        # Per layer what its attention takes beyond Llama's (Mistral's window; Gemma's query scale,
        # window on some layers, soft-capping, its windowed layers' own rotary tables): None where not.
        c = model.config
        self.attend_args = [{"scale": layer.attention.scale, "window": layer.attention.window,
                             "softcap": layer.attention.softcap} for layer in model.layers]
        self.rope = [(model.cos_local, model.sin_local) if layer.attention.local_rope
                     else (model.cos, model.sin) for layer in model.layers]
        self.gelu = c.activation != "silu"  # Gemma's GeGLU
        self.post_norms = [(None, None) if layer.post_attention_norm is None
                           else (layer.post_attention_norm.weight, layer.post_ffn_norm.weight)
                           for layer in model.layers]
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.done = self._event()  # the latest replay's (each replay records a new one)
        # Draws (floe.engine.sampling.draw_rows) for decode rows, a graph per padded row count, replayed
        # after the step's: per row its logits row, temperature, top_p, top_k, uniform (two pinned
        # buffers taken in turn, as host_in); out, per logits row, its token and whether to draw it
        # again (pinned host memory, read once the draw's event has completed: a row's stay valid
        # while its slot's next step runs, as its logits do).
        self.draw_in = self._host(2, 5, self.sizes[-1], dtype=torch.float64)
        self.dev_draw_in = torch.zeros(5, self.sizes[-1], dtype=torch.float64, device=dev)
        self._draw_copied, self._draw_turn = self._events(2), 0
        self.slot_drawn = torch.zeros(n_rows, dtype=torch.long, device=dev)
        self.slot_wider = torch.zeros(n_rows, dtype=torch.bool, device=dev)
        self.host_drawn = self._host(n_rows)
        self.host_drawn_np = self.host_drawn.numpy()
        self.host_wider = self._host(n_rows, dtype=torch.bool)
        self.draw_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.draw_done = self._event()  # the latest draw's (each draw records a new one)

    @torch.inference_mode()
    def _forward(self, size: int, bucket: int, prefill: bool) -> None:
        long = prefill and size > self.PREFILL_ROWS  # a prompt graph
        tokens, pos, slots, rows, feed = (self.prompt_dev_in if long else self.dev_in)[:5, :size]
        # A device-fed row's token: the choice its feed row holds (written by an earlier step or draw).
        tokens = torch.where(feed < 0, tokens, self.slot_fed.index_select(0, feed.clamp(min=0)))
        attend = None
        if long:  # a flash pass per block of rows
            from floe.engine import triton_kernels as tk

            def attend(i: int, q: Tensor) -> Tensor:
                return tk.flash_prompt_attention(q, self.cache.k[i], self.cache.v[i], pos, slots,
                                                 self.model.config.n_kv_heads, **self.attend_args[i])
        h = self._core(tokens, pos, slots, bucket, attend)
        if prefill:  # only the last row's logits: rows[0] is its index, rows[1] its slot
            h, rows = h.index_select(0, rows[:1]), rows[1:2]
        elif self._picks(size):  # a mixed step: only the rows that keep their logits (fill_rows' pick)
            take = self.dev_in[5, :self.pick]
            h, rows = h.index_select(0, take), rows.index_select(0, take)
        out = logits(self.model, h)
        self.slot_logits.index_copy_(0, rows, out)
        argmax = out.argmax(-1)  # the first maximum, as torch.argmax
        self.slot_argmax.index_copy_(0, rows, argmax)
        self.slot_fed.index_copy_(0, rows, argmax)
        self.host_argmax.copy_(self.slot_argmax, non_blocking=True)

    def _core(self, tokens: Tensor, pos: Tensor, slots: Tensor, bucket: int, attend=None) -> Tensor:
        """The fused layers over rows (token, position, KV slot); attend(i, q [B, H, hd]) -> [B, H * hd]
        is layer i's attention (default: each row's own over its slot's cache, up to `bucket`)."""
        from floe.engine import triton_kernels as tk

        m, c = self.model, self.model.config
        layers = m.layers
        x = m.tok_embeddings(tokens)  # [B, dim], the residual stream
        if c.embedding_scale != 1.0:  # (Gemma) rounded to x's dtype first, as Transformer._layers
            x = x * torch.tensor(c.embedding_scale, dtype=x.dtype)
        h, _ = tk.rmsnorm(x, layers[0].attention_norm.weight, c.norm_eps)
        for i, layer in enumerate(layers):
            k_cache, v_cache = self.cache.k[i], self.cache.v[i]  # every slot: rows pick theirs
            qkv = layer.attention.wqkv(h)
            cos, sin = self.rope[i]
            q = tk.rope_kv_write(qkv, cos, sin, pos, k_cache, v_cache,  # (with Qwen3's q/k norm first)
                                 c.n_heads, c.n_kv_heads, c.head_dim, slots=slots, norm=self.qk_norms[i],
                                 eps=c.norm_eps)
            y = (tk.decode_attention(q, k_cache, v_cache, pos, c.n_kv_heads, bucket, slots=slots,
                                     **self.attend_args[i])
                 if attend is None else attend(i, q))
            # (Gemma: each sub-layer's output normed again before it joins the residual stream, in the
            # residual's norm kernel)
            post_attention, post_ffn = self.post_norms[i]
            h, x = tk.rmsnorm(layer.attention.wo(y), layer.ffn_norm.weight, c.norm_eps, residual=x,
                              pre_weight=post_attention)
            d = layer.feed_forward.w2(tk.swiglu(layer.feed_forward.w13(h), gelu=self.gelu))
            next_norm = layers[i + 1].attention_norm if i + 1 < len(layers) else m.norm
            h, x = tk.rmsnorm(d, next_norm.weight, c.norm_eps, residual=x, pre_weight=post_ffn)
        return h  # final-normed rows [B, dim]

    @torch.inference_mode()
    def _draw(self, size: int) -> None:
        from floe.engine.sampling import draw_rows

        rows, temps, top_p, k, u = self.dev_draw_in[:, :size]
        rows = rows.long()
        tokens, wider = draw_rows(self.slot_logits.index_select(0, rows), temps, top_p, k.long(), u)
        self.slot_drawn.index_copy_(0, rows, tokens)
        self.slot_wider.index_copy_(0, rows, wider)
        self.slot_fed.index_copy_(0, rows, tokens.clamp(0, self.slot_logits.shape[1] - 1))
        self.host_drawn.copy_(self.slot_drawn, non_blocking=True)
        self.host_wider.copy_(self.slot_wider, non_blocking=True)

    def draw(self, rows: list[int], temps: list[float], top_p: list[float], ks: list[int],
             uniforms: list[float]) -> torch.cuda.Event:
        """Draw a token from each of slot_logits' `rows` (rows() of slots, after the step that wrote them,
        in the same stream: the host does not wait) with its row's parameters (ks: the vocabulary for
        no top_k); host_drawn / host_wider [row] once the event returned has completed."""
        n = len(rows)
        size = next(s for s in self.sizes if s >= n)
        turn, self._draw_turn = self._draw_turn, self._draw_turn ^ 1
        self.wait(self._draw_copied[turn])  # the copy out of this buffer, two draws ago: done, nearly always
        host = self.draw_in[turn].numpy()
        host[:, :n] = rows, temps, top_p, ks, uniforms
        # Padding rows: the spare logits row, drawn plainly; nobody reads them.
        host[:, n:size] = [[self.n_slots], [1.0], [1.0], [self.slot_logits.shape[1]], [0.5]]
        self.draw_done = self._enqueue(self.dev_draw_in, self.draw_in[turn], self._draw_copied[turn],
                                       self.draw_graphs, size, lambda: self._draw(size))
        return self.draw_done

    def wait(self, event: torch.cuda.Event) -> None:
        """Wait for `event` (a replay's done, a copy's): asked first through the driver where it launches
        (floe.engine.cuda_launch): an event already reached costs no hand-off of the GIL."""
        driver = self._driver
        if driver is None or not driver.usable() or not driver.done(event):
            event.synchronize()

    def _enqueue(self, dev: Tensor, host: Tensor, copied: torch.cuda.Event, graphs: dict, key, run
                 ) -> torch.cuda.Event:
        """Copy the (pinned) inputs `host` to `dev` and record `copied`, then replay graphs[key] (captured
        now by running `run` if it is new): the event recorded after it, returned. Through the driver
        with the GIL held (floe.engine.cuda_launch; unless FLOE_GIL_LAUNCH=0), else PyTorch's calls."""
        driver = self._driver if self._driver is not None and self._driver.usable() else None
        stream = None if driver is None else driver.stream()
        if driver is None:
            dev.copy_(host, non_blocking=True)
            record(copied, self.device)
        else:
            driver.copy(dev, host, stream)
            driver.record(copied, stream)
        graph = graphs.get(key)
        if graph is None:  # capturing runs the step for real, twice first: a fed row reads a row it
            # does not write (a slot's earlier row), so each run computes the same thing
            graph = capture(run, self.device, self.pool)
            self.pool = graph.pool()
            graphs[key] = graph
        if driver is not None:
            driver.launch(graph, stream)
            return driver.next_done(stream)
        graph.replay()
        done = torch.cuda.Event()
        record(done, self.device)
        return done

    # The device's own parts, made by these (floe.engine.reference_graph's CPU reference makes its own)
    @staticmethod
    def _host(*shape: int, dtype: torch.dtype = torch.long) -> Tensor:
        """A zeroed host buffer the device copies from or into without staging (pinned memory)."""
        return torch.zeros(*shape, dtype=dtype, pin_memory=True)

    @staticmethod
    def _event() -> torch.cuda.Event:
        return torch.cuda.Event()

    def _launcher(self):
        """The launch's CUDA calls through the driver, the GIL held (None with FLOE_GIL_LAUNCH=0)."""
        return driver_launch(self.device)

    def _events(self, n: int) -> list[torch.cuda.Event]:
        """n events for the copies' records (made now where the driver records them: created)."""
        return [torch.cuda.Event() if self._driver is None else created(torch.cuda.Event(), self.device)
                for _ in range(n)]

    def _picks(self, size: int) -> bool:
        """Whether a (not prefill) step of `size` rows computes its head for fill_rows' pick only: a mixed
        step's, with PICK_LOGITS (more rows than keep logits: a slot's at most, and the spare)."""
        return 0 < self.pick < size

    def rows(self, slots) -> list[int]:
        """The row of slot_logits / host_argmax holding each slot's latest logits (n_slots: the spare), for
        all of them in one call (a call a row cost a step's rows more than the rest of their bookkeeping)."""
        spare, half = self.n_slots, self.half
        return [slot if slot == spare else slot + half[slot] * (spare + 1) for slot in slots]

    def _next_rows(self, dests: list[int]) -> list[int]:
        """The rows a step writes for these slots' logits: each slot's other row (which becomes its
        latest); the spare row stays."""
        half, spare = self.half, self.n_slots
        for slot in dests:
            if slot != spare:
                half[slot] ^= 1
        return self.rows(dests)

    def step(self, tokens: list[int], positions: list[int], slots: list[int],
             feeds: list[int] | None = None) -> list[int]:
        """Write tokens[b] at positions[b] of slots[b] (distinct) and compute each slot's next logits
        and their argmax; the rows of slot_logits / host_argmax they go to (each slot's rows(): valid
        until the step after that slot's next one; host_argmax once `done` has completed).
        feeds[b] >= 0: row b's token is instead the choice of logits row feeds[b] (see the class doc)."""
        size = next(s for s in self.sizes if s >= len(slots))
        return self._replay(size, False, tokens, positions, slots, self._next_rows(slots), feeds)

    def mixed(self, tokens: list[int], positions: list[int], slots: list[int], dests: list[int],
              feeds: list[int] | None = None) -> list[int]:
        """A step of any rows: tokens[b] written at positions[b] of slots[b] (a slot's rows at
        consecutive positions: a prompt's chunk, which attends to itself as prefill does), row b's
        logits and argmax for slot dests[b] (the spare, n_slots, for rows whose logits nobody reads);
        the rows they go to, as step(); feeds as step()'s (for the first len(feeds) rows)."""
        size = next(s for s in (*self.sizes, *self.mixed_sizes) if s >= len(tokens))
        if feeds is not None:
            feeds = [*feeds, *[-1] * (len(tokens) - len(feeds))]
        return self._replay(size, False, tokens, positions, slots, self._next_rows(dests), feeds)

    def prefill(self, tokens: list[int], start: int, slot: int) -> int:
        """Append tokens (at most PREFILL_ROWS) at positions start.. of `slot`; the last one's logits
        and argmax to the row returned, as step() does."""
        n = len(tokens)
        size = next(s for s in self.prefill_sizes if s >= n)
        row = self._next_rows([slot])[0]
        self._replay(size, True, tokens, list(range(start, start + n)), [slot] * n, [n - 1, row])
        return row

    def prompt(self, tokens: Tensor, start: int, slot: int) -> int:
        """Append a prompt longer than PREFILL_ROWS tokens (int64 [n] on the host) at positions start..
        of `slot`, as one replay of a prompt graph (padded to the next of prompt_sizes: multiples of
        PROMPT_STEP rows): the same layers, each layer's attention one flash pass over the slot's
        prefix per block of rows (triton_kernels.flash_prompt_attention). The last token's logits and
        argmax to the row returned, as prefill() does."""
        n = len(tokens)
        size = next(s for s in self.prompt_sizes if s >= n)
        row = self._next_rows([slot])[0]
        positions = np.arange(start, start + n)
        self._replay(size, True, tokens.numpy(), positions, np.full(n, slot), [n - 1, row])
        return row

    @torch.inference_mode()  # its buffers may have been made in inference mode
    def _replay(self, size: int, prefill: bool, tokens: list[int], positions: list[int],
                slots: list[int], rows: list[int], feeds: list[int] | None = None) -> list[int]:
        long = prefill and size > self.PREFILL_ROWS  # a prompt graph: its attention reads the
        # positions it needs, so one graph serves every KV length
        bucket = 0 if long else next(b for b in self.buckets if b > max(positions))
        host, dev = (self.prompt_host_in, self.prompt_dev_in) if long else (self.host_in, self.dev_in)
        host_rows = self.prompt_host_rows if long else self.host_rows
        turn, self._in_turn = self._in_turn, self._in_turn ^ 1
        self.wait(self._in_copied[turn])  # the copy out of this buffer, two replays ago: done, nearly always
        fill_rows(host_rows[turn], size, tokens, positions, slots, rows, self.n_slots, feeds,
                  self.pick if not prefill and self._picks(size) else 0)
        self.done = self._enqueue(dev, host[turn], self._in_copied[turn], self.graphs,
                                  (size, bucket, prefill), lambda: self._forward(size, bucket, prefill))
        return rows
