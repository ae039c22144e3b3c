"""Loading a model: a GGUF file, a Hugging Face folder or a repo id from the local Hugging Face cache."""

from __future__ import annotations

from pathlib import Path

import torch

from floe.errors import ModelNotFound, NotAModel
from floe.model.checkpoint import Checkpoint, Progress
from floe.model.default import default_model_path


def load_checkpoint(
    path: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    progress: Progress | None = None,
) -> Checkpoint:
    """Load a GGUF file or a Hugging Face folder (config.json + safetensors), or a Hugging Face repo id
    (`owner/name[@revision][:quant-or-file]`) from the local Hugging Face cache (floe.model.hub_cache:
    nothing is downloaded); None: the default model."""
    from floe.model.hub_cache import is_repo_id, repo_name, resolve

    name = None
    if isinstance(path, str) and is_repo_id(path):
        name, path = repo_name(path), resolve(path)
    p = default_model_path() if path is None else Path(path).expanduser()
    if not p.exists():
        raise ModelNotFound(f"no such model file or folder: {p}")
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise NotAModel(f"{p} is a folder without config.json: not a Hugging Face model folder")
        from floe.model.hf_folder import load_hf_folder  # (safetensors: imported only for a folder)

        return load_hf_folder(p, dtype, progress, name)
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise NotAModel(f"{p} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    from floe.model.gguf_file import load_gguf

    return load_gguf(p, dtype, progress)
