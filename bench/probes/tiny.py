"""The probes' engine whose forward costs next to nothing, so the host's share shows: one layer, 64 wide,
seeded random weights, with a real tokenizer (a folder's, or the default model's) and its vocabulary."""

from __future__ import annotations

from pathlib import Path

import torch

from floe.engine import Engine
from floe.model.config import ModelConfig
from floe.model.synthetic import random_checkpoint
from floe.model.tokenizer import Tokenizer


def tokenizer(folder: str | None) -> Tokenizer:
    """The tokenizer of a Hugging Face folder, or the default model's."""
    if folder:
        from floe.model.hf_folder import tokenizer_from_folder

        return tokenizer_from_folder(Path(folder), {})
    from floe.model import load_checkpoint

    return load_checkpoint().tokenizer


def tiny_engine(tok: Tokenizer, n_slots: int, device: str = "cpu", reference_graphs: bool = False) -> Engine:
    """A one-layer 64-wide engine over `tok`'s vocabulary (float32 on the CPU, bfloat16 elsewhere),
    warmed up, with torch on one thread; reference_graphs: the CPU running CUDA's batched graph step's
    host side (floe.engine.reference_graph)."""
    torch.set_num_threads(1)
    config = ModelConfig(arch="llama", dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128,
                         vocab_size=tok.vocab_size, context_length=1024, name="tiny")
    cpu = torch.device(device).type == "cpu"
    weights = random_checkpoint(config, tok, dtype=torch.float32 if cpu else torch.bfloat16, device=device)
    engine = Engine(weights, device=device, dtype="float32" if cpu else "bfloat16", max_seq_len=512,
                    n_slots=n_slots, reference_graphs=reference_graphs)
    engine.warm_up()
    return engine
