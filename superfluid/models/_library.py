"""The models a person has: what was pulled, the names given by copies, and the
files in the models cache directory, with ``superfluid models`` / ``rm`` and the
Ollama ``/api/tags``, ``/api/copy``, ``/api/delete`` reading and changing them.

A pull or a copy is one JSON record, ``$SUPERFLUID_HOME/library/<name>.json``
(0600 in a 0700 directory): ``name``, ``kind`` (``pull`` or ``copy``),
``path`` (the file that loads), ``files`` (every file of the model), ``repo``,
``quant``, ``size``. The files themselves stay where the pull put them (the
hub cache) or where the copied model is.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote

import attrs

from .._private import FILE_MODE, make_private_dir
from ._files import cache_dir

if TYPE_CHECKING:
    from ._hub import Pulled

__all__ = ["Entry", "add_copy", "entries", "find", "quant_of", "record_pull", "remove"]

_QUANT = re.compile(r"(?:^|[-._])((?:UD[-_])?(?:I?Q\d+(?:_[A-Z0-9]+)*|T?Q\d_\d|BF16|F16|F32|FP16|FP32))$",
                    re.IGNORECASE)


@attrs.frozen
class Entry:
    name: str
    kind: str                  # pull, copy, file (a *.gguf in the models cache directory)
    path: Path                 # the file that loads
    files: tuple[Path, ...]    # what removing it deletes (a copy: nothing)
    quant: str = ""
    size: int = 0
    repo: str = ""
    created: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "runtime": "llamacpp", "quant": self.quant, "size": self.size,
                "path": str(self.path), "repo": self.repo}


def library_dir() -> Path:
    return cache_dir().parent / "library"


def quant_of(path: str | Path) -> str:
    stem = Path(path).name
    stem = stem[: -len(".gguf")] if stem.lower().endswith(".gguf") else stem
    m = _QUANT.search(re.sub(r"-\d{5}-of-\d{5}$", "", stem))
    return m.group(1) if m else ""


def _write(record: dict[str, Any]) -> None:
    directory = library_dir()
    make_private_dir(directory)
    target = directory / (quote(record["name"], safe="") + ".json")
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, target)


def record_pull(pulled: Pulled) -> Entry:
    record = {"name": pulled.name, "kind": "pull", "path": str(pulled.path), "files": [str(p) for p in pulled.paths],
              "repo": pulled.repo, "quant": pulled.label, "size": pulled.size, "commit": pulled.commit,
              "created": time.time()}
    _write(record)
    return _entry(record)


def _entry(record: dict[str, Any]) -> Entry:
    return Entry(name=record["name"], kind=record["kind"], path=Path(record["path"]),
                 files=tuple(Path(p) for p in record.get("files", ())), quant=record.get("quant", ""),
                 size=int(record.get("size", 0)), repo=record.get("repo", ""), created=float(record.get("created", 0)))


def entries() -> list[Entry]:
    """Every model: pulls and copies whose file is there, and the models cache directory's ``*.gguf``."""
    out: list[Entry] = []
    try:
        names = sorted(os.listdir(library_dir()))
    except OSError:
        names = []
    for n in names:
        if not n.endswith(".json"):
            continue
        try:
            record = json.loads((library_dir() / n).read_text())
            entry = _entry(record)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # unreadable or half-written: not a model
        if entry.path.exists() and unquote(n[: -len(".json")]) == entry.name:
            out.append(entry)
    try:
        files = sorted(cache_dir().glob("*.gguf"))
    except OSError:
        files = []
    for f in files:
        size = f.stat().st_size
        out.append(Entry(name=f.name[: -len(".gguf")], kind="file", path=f, files=(f,), quant=quant_of(f), size=size,
                         created=f.stat().st_mtime))
    return out


def find(name: str) -> Entry | None:
    """The model ``name`` names: exactly, else with its tag in any case, else ``org/repo``
    when exactly one quant of that repo was pulled, else ``name.gguf`` in the cache directory.
    An Ollama-style ``hf.co/`` (or ``huggingface.co/``) before ``org/repo`` is dropped."""
    from ._hub import strip_hub_host

    name = strip_hub_host(name)
    every = entries()
    for test in (lambda e: e.name == name,
                 lambda e: e.name.lower() == name.lower(),
                 lambda e: e.name == f"{name}.gguf"):
        match = [e for e in every if test(e)]
        if match:
            return match[0]
    repo = [e for e in every if e.kind == "pull" and e.repo == name]
    return repo[0] if len(repo) == 1 else None


def add_copy(source: Entry | Path, destination: str) -> Entry:
    """Persist ``destination`` as another name of ``source``'s file.

    Raises:
        ValueError: the name is taken or not a usable name.
    """
    if not destination or "\x00" in destination or destination.startswith((".", "/", "~")) or len(destination) > 200:
        raise ValueError(f"{destination!r} is not a usable model name")
    if find(destination) is not None:
        raise ValueError(f"a model named {destination!r} already exists")
    path = source.path if isinstance(source, Entry) else source
    record = {"name": destination, "kind": "copy", "path": str(path), "files": [],
              "quant": quant_of(path), "size": path.stat().st_size, "created": time.time(),
              "repo": source.repo if isinstance(source, Entry) else ""}
    _write(record)
    return _entry(record)


def remove(entry: Entry) -> list[Path]:
    """Delete ``entry``: its record, the copies naming its file, and its files (for a pull,
    the snapshot links and the blobs nothing else links to; the repo's cache folder when
    it holds no other file). Returns the files removed."""
    removed: list[Path] = []
    if entry.kind in ("pull", "copy"):
        (library_dir() / (quote(entry.name, safe="") + ".json")).unlink(missing_ok=True)
    if entry.kind == "copy":
        return removed
    for other in entries():
        if other.kind == "copy" and os.path.realpath(other.path) == os.path.realpath(entry.path):
            (library_dir() / (quote(other.name, safe="") + ".json")).unlink(missing_ok=True)
    if entry.kind == "file":
        entry.path.unlink(missing_ok=True)
        return [entry.path]
    storage = _storage_of(entry.files[0]) if entry.files else None
    for pointer in entry.files:
        blob = Path(os.path.realpath(pointer))
        pointer.unlink(missing_ok=True)
        removed.append(pointer)
        if storage is not None and blob.is_relative_to(storage) and not _linked(storage, blob):
            blob.unlink(missing_ok=True)
    if storage is not None and not any(f for _r, _d, f in os.walk(storage / "snapshots")):
        shutil.rmtree(storage, ignore_errors=True)
    return removed


def _storage_of(pointer: Path) -> Path | None:
    for parent in pointer.parents:
        if parent.name.startswith("models--"):
            return parent
    return None


def _linked(storage: Path, blob: Path) -> bool:
    for root, _dirs, names in os.walk(storage / "snapshots"):
        if any(os.path.realpath(Path(root) / n) == str(blob) for n in names):
            return True
    return False
