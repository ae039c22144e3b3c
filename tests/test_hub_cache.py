"""A model named by its Hugging Face repo id resolves from the local Hugging Face cache, laid out as
huggingface_hub lays it out (refs, snapshots by commit, files as links to blobs), with nothing
downloaded; what is not there is a clear error naming where floe looked."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q
from models import save_hf_folder, write_gguf

from floe.errors import ModelNotFound
from floe.model import load_checkpoint

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cached_repo(cache: Path, repo: str, files: dict[str, Path], commit: str = COMMIT,
                ref: str = "main") -> Path:
    """`files` (name -> a file to hold) as repo `repo` at `commit` (named by `ref`) in `cache`, as
    huggingface_hub's downloads leave it: blobs, and the snapshot's files as links to them."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, source in files.items():
        blob = root / "blobs" / f"{abs(hash((commit, name))):x}"
        blob.write_bytes(source.read_bytes())
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).symlink_to(os.path.relpath(blob, (snapshot / name).parent))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache that huggingface_hub reads (HF_HUB_CACHE), offline."""
    folder = tmp_path / "hub"
    folder.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(folder))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(folder))  # (read at its import)
    return folder


def test_a_gguf_repo_resolves_by_quant_and_by_file(cache, tmp_path):
    q4, q8 = tmp_path / "tiny-Q4_0.gguf", tmp_path / "tiny-Q8_0.gguf"
    write_gguf(q4, [Q.Q4_0])
    write_gguf(q8, [Q.Q8_0])
    cached_repo(cache, "floe-test/Tiny-GGUF", {"tiny-Q4_0.gguf": q4, "tiny-Q8_0.gguf": q8})
    by_quant = load_checkpoint("floe-test/Tiny-GGUF:q4_0")
    assert by_quant.source.name == "tiny-Q4_0.gguf"
    assert by_quant.fingerprint == load_checkpoint(q4).fingerprint
    by_file = load_checkpoint("floe-test/Tiny-GGUF:tiny-Q8_0.gguf")
    assert by_file.fingerprint == load_checkpoint(q8).fingerprint
    with pytest.raises(ModelNotFound, match="several GGUF files .*tiny-Q4_0.gguf.*choose one"):
        load_checkpoint("floe-test/Tiny-GGUF")
    with pytest.raises(ModelNotFound, match="no GGUF file matching 'Q5_K'"):
        load_checkpoint("floe-test/Tiny-GGUF:Q5_K")


def test_a_model_folder_repo_resolves_at_main_or_a_revision(cache, tmp_path):
    folder = save_hf_folder(tmp_path / "tiny-llama", "llama", tie=False, shard=False)  # (the repo's name)
    files = {p.name: p for p in folder.iterdir() if p.is_file()}
    cached_repo(cache, "floe-test/tiny-llama", files)
    other = "fedcba9876543210fedcba9876543210fedcba98"
    cached_repo(cache, "floe-test/tiny-llama", files, commit=other, ref="v2")
    direct = load_checkpoint(folder)
    cached = load_checkpoint("floe-test/tiny-llama")
    assert cached.fingerprint == direct.fingerprint and cached.config.name == "tiny-llama"
    at = load_checkpoint("floe-test/tiny-llama@v2")
    assert at.source.name == other and at.fingerprint == direct.fingerprint


def test_a_repo_not_in_the_cache_names_where_it_looked_and_downloads_nothing(cache):
    with pytest.raises(ModelNotFound) as e:
        load_checkpoint("Qwen/Qwen3-0.6B")
    message = str(e.value)
    assert str(cache) in message and "downloads nothing" in message
    assert "hf download Qwen/Qwen3-0.6B" in message
    assert list(cache.iterdir()) == []  # nothing was fetched or made


def test_a_missing_file_is_not_taken_for_a_repo(tmp_path):
    with pytest.raises(ModelNotFound, match="no such model file"):
        load_checkpoint("models/tiny.gguf")
