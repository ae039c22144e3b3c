"""Token generation as generators that every caller (CLI, actors, server) reuses, as in mlx-lm."""

from __future__ import annotations

import codecs
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from floe.engine.engine import Engine
from floe.engine.sampling import Sampler, SamplingParams
from floe.model.tokenizer import Tokenizer


def generate_step(engine: Engine, prompt_ids: Sequence[int], sampler: Sampler,
                  slot: int = 0) -> Iterator[int]:
    """Prefill the prompt, then yield sampled tokens forever; each next() runs one decode step.

    The last yielded token is not yet in the KV cache: it is fed on the following next().
    """
    logits = engine.prefill(list(prompt_ids), slot)
    while True:
        token = sampler.sample(logits)
        yield token
        logits = engine.decode_step(token, slot)


class TextStream:
    """Turns token ids into text deltas: each token's exact bytes (Tokenizer.token_bytes) through an
    incremental UTF-8 decoder, which holds back a token that ends inside a character. O(1) a token,
    and right for every tokenizer: decoding ids one at a time dropped SentencePiece's word spaces
    (its decoder strips a leading one each time: "Hello world" streamed as "Helloworld")."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token: int) -> str:
        return self.utf8.decode(self.tokenizer.token_bytes(token))

    def flush(self) -> str:
        return self.utf8.decode(b"", final=True)


@dataclass
class Generation:
    """What one generate() call produced, and how fast."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int = 0
    finish_reason: str = ""  # "stop" (EOS), "length" (max_tokens or context full)
    ttft_s: float = 0.0  # prompt submitted -> first token chosen
    decode_s: float = 0.0  # first token -> last token

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.generated_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


def generate(engine: Engine, prompt_ids: Sequence[int], params: SamplingParams, max_tokens: int,
             slot: int = 0, result: Generation | None = None) -> Iterator[str]:
    """Yield text deltas until EOS, max_tokens or a full context; fills `result` as it goes.

    EOS ends generation and is neither shown nor counted. The KV cache of `slot` then holds the
    prompt and every token sampled but the last one (the EOS, or the max_tokens-th token).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    out = result if result is not None else Generation()
    out.prompt_tokens = len(prompt_ids)
    stream = TextStream(engine.tokenizer)
    eos = set(engine.tokenizer.eos_ids)
    t0 = time.perf_counter()
    steps = generate_step(engine, prompt_ids, Sampler(params), slot)
    first = None
    for token in steps:
        now = time.perf_counter()
        if first is None:
            first = now
            out.ttft_s = now - t0
        out.decode_s = now - first
        if token in eos:
            out.finish_reason = "stop"
            break
        out.token_ids.append(token)
        delta = stream.push(token)
        out.text += delta
        if delta:
            yield delta
        if len(out.token_ids) >= max_tokens or engine.room(slot) == 0:
            out.finish_reason = "length"
            break
    steps.close()
    tail = stream.flush()
    if tail:
        out.text += tail
        yield tail
