"""Reading model weights (GGUF, Hugging Face folders), config, tokenizer, chat template, fingerprint.

Its names are imported when first asked for (PEP 562): `floe.model.tokenizer` alone imports no torch, so
that floe serve's HTTP fronts (which never import torch) can render and tokenize prompts.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from floe.model.chat_template import ChatTemplateError
    from floe.model.checkpoint import Checkpoint, Progress
    from floe.model.config import KNOWN_SHAPES, ModelConfig, RopeScaling
    from floe.model.default import default_model_path
    from floe.model.load import load_checkpoint
    from floe.model.tokenizer import Tokenizer

_WHERE = {"KNOWN_SHAPES": "config", "ModelConfig": "config", "RopeScaling": "config",
          "Checkpoint": "checkpoint", "Progress": "checkpoint", "default_model_path": "default",
          "load_checkpoint": "load", "ChatTemplateError": "chat_template", "Tokenizer": "tokenizer"}

__all__ = [
    "KNOWN_SHAPES",
    "ChatTemplateError",
    "Checkpoint",
    "ModelConfig",
    "Progress",
    "RopeScaling",
    "Tokenizer",
    "default_model_path",
    "load_checkpoint",
]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'floe.model' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"floe.model.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
