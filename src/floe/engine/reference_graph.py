"""The batched graph step's reference on the CPU (Engine(reference_graphs=True)): BatchGraphDecoder's
contract — two logits rows a slot written in turn, device-fed rows, prompt rows riding in a decode step,
a prompt's replay, the draws' step — with each step run at once by the model's own forward instead of
a captured CUDA graph of fused kernels. What the engine and its engine loop do around CUDA's steps
(launch before the last step is finished, speculation, feeding, undoing, riding prompts, the draws'
results in host buffers) then runs, and is tested, where there is no GPU. It is not a fast path: its
forward is the module's, a step's rows one slot's run at a time within one pass."""

from __future__ import annotations

import torch
from torch import Tensor

from floe.engine.cuda_graph import BatchGraphDecoder


class ReferenceGraphDecoder(BatchGraphDecoder):
    """BatchGraphDecoder on the CPU: its buffers in ordinary memory, no events (a step has finished
    when its launch returns), no graphs (each step runs as it is launched)."""

    @staticmethod
    def _host(*shape: int, dtype: torch.dtype = torch.long) -> Tensor:
        return torch.zeros(*shape, dtype=dtype)

    @staticmethod
    def _event() -> None:
        return None

    def _launcher(self) -> None:
        return None

    def _events(self, n: int) -> list[None]:
        return [None] * n

    def wait(self, event) -> None:
        """Nothing to wait for: a step is done when its launch returns."""

    def _enqueue(self, dev: Tensor, host: Tensor, copied, graphs: dict, key, run) -> None:
        dev.copy_(host)
        run()
        return None

    @torch.inference_mode()
    def _forward(self, size: int, bucket: int, prefill: bool) -> None:
        """BatchGraphDecoder._forward's step (the same inputs, the same buffers written) by the model's
        forward: each slot's rows, at consecutive positions, a segment of one pass."""
        long = prefill and size > self.PREFILL_ROWS
        tokens, pos, slots, rows, feed = (self.prompt_dev_in if long else self.dev_in)[:5, :size]
        tokens = torch.where(feed < 0, tokens, self.slot_fed.index_select(0, feed.clamp(min=0)))
        out = self._rows_logits(tokens, pos, slots)
        if prefill:  # only the last row's logits: rows[0] is its index, rows[1] its logits row
            out, rows = out.index_select(0, rows[:1]), rows[1:2]
        elif self._picks(size):  # a mixed step: only the rows that keep their logits
            take = self.dev_in[5, :self.pick]
            out, rows = out.index_select(0, take), rows.index_select(0, take)
        self.slot_logits.index_copy_(0, rows, out)
        argmax = out.argmax(-1)  # the first maximum, as the graph's
        self.slot_argmax.index_copy_(0, rows, argmax)
        self.slot_fed.index_copy_(0, rows, argmax)
        self.host_argmax.copy_(self.slot_argmax)

    def _rows_logits(self, tokens: Tensor, pos: Tensor, slots: Tensor) -> Tensor:
        """Float32 logits [size, vocab] of each row (padding rows, slot -1, last: zeros), the rows'
        tokens written into their slots' caches. A run of one slot's consecutive positions is one
        segment (a prompt's chunk attends to its own earlier rows); each row's logits as the model's
        forward gives a last row's (Transformer.forward_rows)."""
        size = tokens.shape[0]
        out = torch.zeros(size, self.slot_logits.shape[1], dtype=torch.float32)
        n = int((slots >= 0).sum())
        p, s = pos[:n].tolist(), slots[:n].tolist()
        segments, i = [], 0
        while i < n:
            j = i + 1
            while j < n and s[j] == s[i] and p[j] == p[j - 1] + 1:
                j += 1
            segments.append((j - i, p[i], s[i]))
            i = j
        if segments:
            out[:n] = self.model.forward_rows(tokens[:n], segments, self.cache)
        return out
