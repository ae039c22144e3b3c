"""A model named by its Hugging Face repo id (`owner/name`, `owner/name@revision`, `owner/name:Q4_0`),
found in the local Hugging Face cache (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub)
with huggingface_hub's own lookups of its layout (refs, snapshots, revisions). Nothing is downloaded:
a repo that is not there is an error that says where floe looked and how to fetch it."""

from __future__ import annotations

import re
from pathlib import Path

from floe.errors import ModelNotFound

# owner/name, then @revision (a branch, tag or commit), then :choice (a GGUF file's name or its quant)
REPO_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+?))?"
                     r"(?::(?P<choice>[\w.-]+))?")


def is_repo_id(spec: str) -> bool:
    """Whether `spec` names a repo (owner/name…) rather than a path: it is not one on disk, and has the
    shape of a repo id."""
    m = REPO_ID.fullmatch(spec)
    return (m is not None and not Path(spec).expanduser().exists()
            and not (m["choice"] is None and spec.lower().endswith(".gguf")))  # (a file not there: its error)


def repo_name(spec: str) -> str:
    """The model's name in a repo id: `name` of owner/name@revision:choice."""
    return REPO_ID.fullmatch(spec)["repo"].split("/")[1]


def resolve(spec: str) -> Path:
    """The cached model `spec` names: its snapshot folder (a Hugging Face model folder), or one GGUF
    file in it (the only one, or the one `:choice` names by file name or quant, e.g. `:Q4_0`)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    m = REPO_ID.fullmatch(spec)
    if m is None:
        raise ModelNotFound(f"{spec!r} is neither a file or folder nor a Hugging Face repo id (owner/name)")
    repo, revision, choice = m["repo"], m["revision"], m["choice"]
    where = constants.HF_HUB_CACHE
    try:
        folder = Path(snapshot_download(repo, revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError) as e:
        at = f" at revision {revision!r}" if revision else ""
        raise ModelNotFound(f"no file or folder {spec!r}, and {repo}{at} is not in the local Hugging Face "
                            f"cache ({where}); floe downloads nothing: fetch it with `hf download {repo}`, "
                            f"or give a file or folder ({type(e).__name__})") from None
    ggufs = sorted(p for p in folder.rglob("*.gguf") if p.is_file())
    if choice is None and (folder / "config.json").is_file():
        return folder
    if choice is not None:
        ggufs = [p for p in ggufs if p.name == choice or _quant(choice) in _quant(p.name)]
    if len(ggufs) == 1:
        return ggufs[0]
    names = ", ".join(str(p.relative_to(folder)) for p in sorted(folder.rglob("*.gguf"))) or "none"
    if not ggufs:
        what = f"matching {choice!r}" if choice else "and no config.json"
        raise ModelNotFound(f"{repo} in the local cache ({folder}) has no GGUF file {what} "
                            f"(GGUF files: {names})")
    raise ModelNotFound(f"{repo} in the local cache has several GGUF files ({names}): choose one with "
                        f"{repo}:QUANT (e.g. :Q4_0) or {repo}:FILE")


def _quant(name: str) -> str:
    """A quant's name as file names write it, compared without case and separators (Q4_K_M ~ q4-k-m)."""
    return re.sub(r"[^a-z0-9]", "", name.lower().removesuffix(".gguf"))
