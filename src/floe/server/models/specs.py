"""The models `floe serve` offers (docs/SERVER.md, "Several models"): their names (`--model NAME=PATH`,
`--models DIR`), checked so that none is a path, and a request's `keep_alive`."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from floe.server.protocol import ServeError
from floe.server.records import SESSION_ID

MODEL_NAME = SESSION_ID  # letters, digits, `_ . -`, the first a letter or digit, at most 128: never a path
SHOWN = 64  # the most characters of a name a message repeats (a 10 KB name is not echoed whole)
DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)?")
UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


@dataclass(frozen=True)
class ModelSpec:
    """A model `floe serve` offers: the name requests use, and its GGUF file or Hugging Face folder
    (None: the default model)."""

    name: str
    path: str | None


def model_specs(values: Iterable[str]) -> list[ModelSpec]:
    """`--model NAME=PATH` values (a bare PATH is named by its file or folder). Raises ValueError
    naming a name that is not one or is given twice."""
    specs = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep:
            name, path = Path(value).stem, value
        specs.append(ModelSpec(checked_name(name), path or None))
    names = [s.name for s in specs]
    if len(set(names)) < len(names):
        raise ValueError(f"a model name given twice: {sorted(n for n in names if names.count(n) > 1)[0]!r}")
    return specs


def models_in(folder: str | Path) -> list[ModelSpec]:
    """`--models DIR`: every GGUF file (named by its stem) and Hugging Face folder (a folder with
    config.json, named by the folder) in `folder`, by name."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder")
    specs = [ModelSpec(p.stem if p.is_file() else p.name, str(p)) for p in sorted(folder.iterdir())
             if (p.is_file() and p.suffix == ".gguf") or (p.is_dir() and (p / "config.json").is_file())]
    return [ModelSpec(checked_name(s.name), s.path) for s in specs]


def checked_name(name: str) -> str:
    if not MODEL_NAME.fullmatch(name):
        raise ValueError(f"model name {shown(name)}: letters, digits and `_ . -` (the first a letter or "
                         "digit), at most 128")
    return name


def shown(name) -> str:
    """A name as a message repeats it: its first SHOWN characters, control characters escaped."""
    text = str(name)
    return repr(text[:SHOWN]) + ("…" if len(text) > SHOWN else "")


def weights_bytes(path: str | None) -> int:
    """The bytes of a model's weights files (a GGUF file, a folder's safetensors; None: the default
    model's): what its load will take at least, before it was measured."""
    from floe.model import default_model_path

    p = Path(path).expanduser() if path is not None else default_model_path()
    if p.is_dir():
        return sum(f.stat().st_size for f in p.glob("*.safetensors"))
    return p.stat().st_size if p.exists() else 0


def keep_alive_seconds(value) -> float:
    """A request's `keep_alive` (Ollama's): seconds, or a duration ("30s", "5m", "1h"); negative: for
    ever (math.inf). Raises a 400 for anything else."""
    if isinstance(value, bool):
        value = "?"
    if isinstance(value, int | float) and not math.isnan(value):  # (NaN: never < or > a clock: a 400)
        seconds = float(value)
    elif isinstance(value, str) and (m := DURATION.fullmatch(value.strip())):
        seconds = float(m[1]) * UNITS[m[2]]
    elif isinstance(value, str) and value.strip().startswith("-"):
        seconds = -1.0
    else:
        raise ServeError(400, f"keep_alive {shown(value)}: seconds, or a duration such as \"5m\"",
                         param="keep_alive")
    return math.inf if seconds < 0 else seconds
