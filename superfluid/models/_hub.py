"""Pulling GGUF models from the Hugging Face hub (``org/repo[:quant]``).

Files land in huggingface_hub's own cache (``$HF_HUB_CACHE``, ``$HF_HOME``), so
other tools share them; ``HF_TOKEN``, ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE``
mean what they mean there. A pull is three steps:

1. :func:`resolve` (network, blocking): the repo's file list and, for the
   files of the chosen quant, their size, ETag (the sha256 of an LFS file) and
   the commit.
2. :func:`fetch` (blocking, in a thread): under the pull lock of the repo
   (``$SUPERFLUID_HOME/pulls/<repo>.lock``, one pull of a repo at a time across
   processes), each missing file is downloaded into ``blobs/<etag>.incomplete``
   with huggingface_hub's ``http_get``, resuming from the bytes already there
   (huggingface_hub's own ``hf_hub_download`` writes a fresh per-process
   temporary file and resumes nothing across processes), checked (size, and the
   sha256 when the ETag is one), renamed to ``blobs/<etag>``, and linked into
   the snapshot by ``hf_hub_download`` itself (the blob is found, nothing is
   downloaded again).
3. :func:`pull` runs both from trio. Cancelling it (Ctrl-C, a client that
   disconnects) stops the transfer at its next chunk: the partial file keeps
   its ``.incomplete`` name, is never linked into a snapshot, and the next
   pull resumes it.

Quants: the files of a GGUF repo are grouped (the parts ``-0000K-of-0000N`` of a
split file are one group, loaded from its first part); a group's quant is the
end of its stem (``Q4_K_M``, ``UD-Q4_K_M``, ``IQ2_XXS``, ``BF16``...). A tag
matches a quant exactly (any case), else as the end of exactly one quant.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import threading
import time
from pathlib import Path
from collections.abc import Iterable
from typing import Any

import attrs
import trio

from .._private import make_private_dir
from ._files import cache_dir

__all__ = ["HubRef", "PullCancelled", "PullError", "PullProgress", "Pulled", "Quant", "cached", "fetch", "hub_cache",
           "fetch_async", "hub_name_in", "is_offline", "parse_hub_id", "pull", "resolve_async", "pull_lock_path",
           "quants", "resolve", "strip_hub_host", "superfluid_home"]

DEFAULT_QUANT = "Q4_K_M"
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})$", re.IGNORECASE)
_QUANT = re.compile(r"(?:^|[-._])((?:UD[-_])?(?:I?Q\d+(?:_[A-Z0-9]+)*|T?Q\d_\d|BF16|F16|F32|FP16|FP32|MXFP4(?:_MOE)?))$",
                    re.IGNORECASE)
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CHUNK = 256 << 10


class PullError(Exception):
    """A pull that cannot go on; the message is one line for a person. ``kind``:
    ``not_found`` (repo, revision, quant), ``ambiguous`` (a tag matching several
    quants, or none given), ``unreachable`` (the hub), ``integrity`` (size or
    sha256 wrong: the download was removed), ``failed`` (the transfer broke off)."""

    def __init__(self, message: str, kind: str = "failed") -> None:
        super().__init__(message)
        self.kind = kind


class PullCancelled(Exception):
    """Raised in the transfer thread when its pull was cancelled."""


def superfluid_home() -> Path:
    return cache_dir().parent


def pull_lock_path(repo: str) -> Path:
    return superfluid_home() / "pulls" / (repo.replace("/", "--") + ".lock")


def hub_cache() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def is_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.is_offline_mode())


# -- names ------------------------------------------------------------------------------------------------------

@attrs.frozen
class HubRef:
    repo: str               # org/name
    tag: str | None = None  # the quant asked for; None: the default

    def __str__(self) -> str:
        return self.repo + (f":{self.tag}" if self.tag else "")


_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# Ollama names a Hub GGUF hf.co/org/repo[:QUANT] (and huggingface.co/...): the same model as org/repo[:QUANT]
_HUB_HOSTS = re.compile(r"(?:https?://)?(?:www\.)?(?:hf\.co|huggingface\.co)/", re.IGNORECASE)


def strip_hub_host(name: str) -> str:
    """``name`` without an Ollama-style ``hf.co/`` or ``huggingface.co/`` prefix (with or
    without ``https://``), when it names ``org/repo`` after it; else ``name`` as is."""
    m = _HUB_HOSTS.match(name)
    if m is None or not _REPO.fullmatch(name[m.end():].partition(":")[0]):
        return name
    return name[m.end():]


def hub_name_in(name: str, names: Iterable[str]) -> str | None:
    """The one of ``names`` (models served as ``org/repo:QUANT``) that ``name`` means as a
    Hugging Face id, as Ollama clients write one: ``hf.co/`` or ``huggingface.co/`` before it,
    the repo and quant in any case, ``org/repo`` (or ``:latest``) for its one quant, else for
    its default quant; None if it means none, or several."""
    bare = strip_hub_host(name)
    repo, _, tag = bare.partition(":")
    if "/" not in repo:
        return None
    names = list(names)
    if tag.lower() == "latest":
        tag = ""
    if tag:
        same = [n for n in names if n.lower() == f"{repo}:{tag}".lower()]
        return same[0] if len(same) == 1 else None
    if bare != name and bare in names:
        return bare
    quants = [n for n in names if ":" in n and n.partition(":")[0].lower() == repo.lower()]
    if len(quants) > 1:
        quants = [n for n in quants if n.partition(":")[2].lower() == DEFAULT_QUANT.lower()]
    return quants[0] if len(quants) == 1 else None


def parse_hub_id(arg: str, *, disk: bool = True) -> HubRef | None:
    """``arg`` as a hub id, or None if it is a path: an id contains ``/`` (before an
    optional ``:tag``), does not exist on disk (``disk``: checked; over HTTP it is not,
    so no client learns what exists), does not start with ``.``, ``/`` or ``~`` and does
    not end in ``.gguf``. An ``hf.co/`` or ``huggingface.co/`` prefix (Ollama's names for
    Hub models) is dropped."""
    if not arg or arg[0] in "./~" or arg.lower().endswith(".gguf") or (disk and os.path.exists(arg)):
        return None
    arg = strip_hub_host(arg)
    repo, _, tag = arg.partition(":")
    if not _REPO.fullmatch(repo) or ".." in repo or (tag and not re.fullmatch(r"[\w.-]+", tag)):
        return None
    return HubRef(repo, tag or None)


@attrs.frozen
class Quant:
    label: str               # Q4_K_M, UD-Q4_K_M, ...; the whole stem when no quant is recognised
    files: tuple[str, ...]   # repo paths; a split file's parts in order (the first is what loads)
    size: int | None = None  # bytes, all parts

    def describe(self) -> str:
        parts = f", {len(self.files)} parts" if len(self.files) > 1 else ""
        size = f" ({_mb(self.size)}{parts})" if self.size else (f" ({len(self.files)} parts)" if parts else "")
        return self.label + size


def _mb(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def quants(files: dict[str, int | None]) -> list[Quant]:
    """The GGUF quants among ``files`` (repo path -> size)."""
    groups: dict[str, list[str]] = {}
    for name in files:
        if not name.lower().endswith(".gguf") or "mmproj" in name.lower().rpartition("/")[2]:
            continue
        stem = name[: -len(".gguf")]
        groups.setdefault(_SPLIT.sub("", stem), []).append(name)
    out = []
    for stem, names in groups.items():
        names.sort()
        m = _QUANT.search(stem.rpartition("/")[2])
        label = m.group(1) if m else stem.rpartition("/")[2]
        sizes = [files[n] for n in names]
        out.append(Quant(label, tuple(names), None if None in sizes else sum(s or 0 for s in sizes)))
    return sorted(out, key=lambda q: q.label.lower())


def pick(ref: HubRef, found: list[Quant]) -> Quant:
    """The quant ``ref`` names among ``found``.

    Raises:
        PullError: none, or more than one, matches (the message lists what the repo has).
    """
    have = ", ".join(q.describe() for q in found)
    if not found:
        raise PullError(f"{ref.repo} has no GGUF files", "not_found")
    tag = ref.tag
    if tag is None:
        exact = [q for q in found if q.label.lower() == DEFAULT_QUANT.lower()]
        if len(exact) == 1 or len(found) == 1:
            return (exact or found)[0]
        raise PullError(f"{ref.repo} has several quants and none is {DEFAULT_QUANT}; name one as {ref.repo}:QUANT "
                        f"(it has: {have})", "ambiguous")
    exact = [q for q in found if q.label.lower() == tag.lower()]
    tail = [q for q in found if re.search(rf"(?:^|[-._]){re.escape(tag)}$", q.label, re.IGNORECASE)]
    match = exact or tail
    if len(match) == 1:
        return match[0]
    if not match:
        raise PullError(f"{ref.repo} has no quant {tag!r} (it has: {have})", "not_found")
    raise PullError(f"{ref.repo}: {tag!r} is ambiguous: it matches {', '.join(q.label for q in match)} "
                    f"(it has: {have})", "ambiguous")


# -- the cache ---------------------------------------------------------------------------------------------------

@attrs.frozen
class Pulled:
    """A quant whose files are all in the cache."""

    repo: str
    label: str
    paths: tuple[Path, ...]  # snapshot paths, in order; the first loads
    commit: str
    size: int
    etags: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.repo}:{self.label}"

    @property
    def path(self) -> Path:
        return self.paths[0]


def _storage(repo: str) -> Path:
    return hub_cache() / ("models--" + repo.replace("/", "--"))


def cached(ref: HubRef, revision: str = "main", *, strict: bool = False) -> Pulled | None:
    """The quant ``ref`` names, if all its files are in the cache (no network).

    Raises:
        PullError: ``strict`` (offline: the cache is all there is) and the repo is
            cached but the tag matches none of its cached quants, or several.
    """
    storage = _storage(ref.repo)
    try:
        commit = (storage / "refs" / revision).read_text().strip()
    except OSError:
        return None
    snapshot = storage / "snapshots" / commit
    if not snapshot.is_dir():
        return None
    files: dict[str, int | None] = {}
    for root, _dirs, names in os.walk(snapshot):
        for n in names:
            p = Path(root) / n
            if p.exists():  # a dangling link is no file
                files[str(p.relative_to(snapshot))] = p.stat().st_size
    found = quants(files)
    if not found:
        return None
    try:
        q = pick(ref, found)
    except PullError as exc:
        if not strict:
            return None  # the hub may have it
        if exc.kind == "ambiguous":
            raise PullError(f"{exc} [offline: in the cache]", exc.kind) from None
        have = ", ".join(q.describe() for q in found)
        raise PullError(f"{ref} is not in the cache and the pull is offline (the cache has {ref.repo}: {have})",
                        exc.kind) from None
    parts = _split_total(q.files)
    if parts and parts != len(q.files):
        return None  # some parts missing: pull again
    paths = tuple(snapshot / f for f in q.files)
    etags = tuple(os.path.basename(os.path.realpath(p)) for p in paths)
    return Pulled(ref.repo, q.label, paths, commit, sum(p.stat().st_size for p in paths), etags)


def _split_total(names: tuple[str, ...]) -> int:
    m = _SPLIT.search(names[0][: -len(".gguf")])
    return int(m.group(2)) if m else 0


# -- resolving on the hub -----------------------------------------------------------------------------------------

@attrs.frozen
class FilePlan:
    name: str
    url: str
    etag: str
    size: int | None


@attrs.frozen
class Plan:
    ref: HubRef
    revision: str
    commit: str
    quant: Quant
    files: tuple[FilePlan, ...]


def _hub_error(ref: HubRef, exc: BaseException) -> PullError:
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    endpoint = constants.ENDPOINT
    if isinstance(exc, GatedRepoError):
        return PullError(f"{ref.repo} is gated on {endpoint}: accept its terms there and set HF_TOKEN", "not_found")
    if isinstance(exc, RepositoryNotFoundError):
        return PullError(f"{ref.repo}: no such model on {endpoint} (or it is private: set HF_TOKEN)", "not_found")
    if isinstance(exc, RevisionNotFoundError):
        return PullError(f"{ref.repo}: no such revision on {endpoint}", "not_found")
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, HfHubHTTPError):
        return PullError(f"{ref.repo}: {endpoint} answered {first}", "unreachable")
    return PullError(f"{ref.repo}: cannot reach {endpoint} ({first}); --offline uses only the cache", "unreachable")


def resolve(ref: HubRef, revision: str = "main") -> Plan:
    """What pulling ``ref`` means now on the hub (blocking: run it in a thread).

    Raises:
        PullError: the repo, revision or quant does not exist, or the hub cannot be reached.
    """
    from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_url

    try:
        info = HfApi().model_info(ref.repo, revision=revision, files_metadata=True)
        files = {s.rfilename: s.size for s in info.siblings or ()}
        quant = pick(ref, quants(files))
        commit = info.sha or revision
        plans = []
        for name in quant.files:
            meta = get_hf_file_metadata(hf_hub_url(ref.repo, name, revision=commit))
            if meta.etag is None or meta.commit_hash is None:
                raise PullError(f"{ref.repo}: {name} has no ETag or commit on the hub; is HF_ENDPOINT a hub?",
                                "unreachable")
            plans.append(FilePlan(name, meta.location, meta.etag, meta.size))
    except PullError:
        raise
    except Exception as exc:  # noqa: BLE001 - hub and network errors, each one line
        raise _hub_error(ref, exc) from None
    return Plan(ref, revision, meta.commit_hash or commit, quant, tuple(plans))


# -- fetching -----------------------------------------------------------------------------------------------------

@attrs.define
class PullProgress:
    """Where a pull is; written by the transfer thread, read by whoever shows it."""

    status: str = "pulling manifest"
    file: str = ""
    digest: str = ""
    index: int = 0          # 1-based number of the current file
    count: int = 0          # files in the quant
    total: int = 0          # bytes of the current file
    completed: int = 0      # bytes of it on disk
    resumed_from: int = 0   # bytes it had on disk when its transfer started
    received: int = 0       # bytes received over the network in this pull
    started: float = attrs.field(factory=time.monotonic)
    finished: list[tuple[str, int, int, float]] = attrs.field(factory=list)  # (file, size, resumed_from, seconds)


class _Silent:
    """A tqdm stand-in for ``http_get``: the pull shows its own progress."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def update(self, n: float | None = 1) -> None:
        pass

    def __enter__(self) -> _Silent:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def close(self) -> None:
        pass


class _Sink:
    """The partial file as ``http_get`` writes it: stops at the next chunk once the pull is cancelled."""

    def __init__(self, file: Any, stop: threading.Event, progress: PullProgress) -> None:
        self.file = file
        self.stop = stop
        self.progress = progress

    def write(self, chunk: bytes) -> int:
        if self.stop.is_set():
            raise PullCancelled()
        n = self.file.write(chunk)
        self.progress.completed += len(chunk)
        self.progress.received += len(chunk)
        return n

    def __getattr__(self, name: str) -> Any:  # seek, tell, truncate (a server that ignored Range)
        return getattr(self.file, name)


def _sha256(path: Path, stop: threading.Event) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            if stop.is_set():
                raise PullCancelled()
            digest.update(chunk)
    return digest.hexdigest()


def _acquire(lock: Any, ref: HubRef, stop: threading.Event, progress: PullProgress) -> None:
    from filelock import Timeout

    while True:
        try:
            lock.acquire(timeout=0.2)
            return
        except Timeout:
            progress.status = f"waiting for another pull of {ref.repo}"
            if stop.is_set():
                raise PullCancelled() from None


def fetch(plan: Plan, stop: threading.Event, progress: PullProgress) -> Pulled:
    """Download what the cache lacks of ``plan`` (blocking: run it in a thread).

    Raises:
        PullCancelled: ``stop`` was set; the partial file is kept for the next pull.
        PullError: a file failed its size or sha256 check (and was removed), or the transfer failed.
    """
    from filelock import FileLock

    lock_path = pull_lock_path(plan.ref.repo)
    make_private_dir(lock_path.parent)
    lock = FileLock(str(lock_path), thread_local=False)
    _acquire(lock, plan.ref, stop, progress)
    try:
        progress.count = len(plan.files)
        paths = []
        for i, fp in enumerate(plan.files, 1):
            progress.index, progress.file, progress.total = i, fp.name, fp.size or 0
            progress.digest = f"sha256:{fp.etag}" if _SHA256.fullmatch(fp.etag) else fp.etag
            paths.append(_fetch_file(plan, fp, stop, progress))
        progress.status = "success"
        return Pulled(plan.ref.repo, plan.quant.label, tuple(paths), plan.commit,
                      sum(p.stat().st_size for p in paths), tuple(f.etag for f in plan.files))
    finally:
        lock.release()


def _headers_for(url: str) -> dict[str, str]:
    """The hub's headers (the token) for ``url``, without the token when the hub
    redirected to another host (a signed CDN URL), as huggingface_hub does."""
    from urllib.parse import urlsplit

    from huggingface_hub import constants
    from huggingface_hub.utils import build_hf_headers

    headers = build_hf_headers()
    if urlsplit(url).netloc != urlsplit(constants.ENDPOINT).netloc:
        headers.pop("authorization", None)
    return headers


def _fetch_file(plan: Plan, fp: FilePlan, stop: threading.Event, progress: PullProgress) -> Path:
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.file_download import http_get
    storage = _storage(plan.ref.repo)
    pointer = storage / "snapshots" / plan.commit / fp.name
    blob = storage / "blobs" / fp.etag
    if not pointer.exists() and not blob.exists():
        partial = blob.with_name(fp.etag + ".incomplete")
        partial.parent.mkdir(parents=True, exist_ok=True)
        began = time.monotonic()
        with open(partial, "ab") as f:
            start = f.tell()
            if fp.size is not None and start > fp.size:
                f.truncate(0)
                start = 0
            progress.completed = progress.resumed_from = start
            progress.status = f"pulling {fp.etag[:12]}"
            # http_get reads DOWNLOAD_CHUNK_SIZE (10 MB) before each write: a cancelled pull would
            # stop, and the progress move, only every 10 MB. 256 KiB keeps both prompt.
            constants.DOWNLOAD_CHUNK_SIZE = min(constants.DOWNLOAD_CHUNK_SIZE, _CHUNK)
            try:
                http_get(fp.url, _Sink(f, stop, progress), resume_size=start, headers=_headers_for(fp.url),
                         expected_size=fp.size, displayed_filename=fp.name, tqdm_class=_Silent)  # type: ignore[arg-type]
            except PullCancelled:
                raise
            except OSError as exc:
                f.flush()
                if fp.size is not None and f.tell() > fp.size or "Consistency check failed" in str(exc):
                    partial.unlink(missing_ok=True)
                    raise PullError(f"{plan.ref.repo}: {fp.name} is not the size the hub announced "
                                    f"({fp.size} bytes); the download was removed", "integrity") from None
                raise PullError(f"{plan.ref.repo}: {fp.name}: download interrupted ({exc}); pull again to "
                                "resume") from None
            except Exception as exc:  # noqa: BLE001 - transport errors, one line
                raise PullError(f"{plan.ref.repo}: {fp.name}: download failed ({type(exc).__name__}: "
                                f"{str(exc).splitlines()[0] if str(exc) else ''}); pull again to resume") from None
        if _SHA256.fullmatch(fp.etag):
            progress.status = "verifying sha256 digest"
            got = _sha256(partial, stop)
            if got != fp.etag:
                partial.unlink(missing_ok=True)
                raise PullError(f"{plan.ref.repo}: {fp.name} failed its sha256 check (got {got[:12]}, the hub says "
                                f"{fp.etag[:12]}); the download was removed", "integrity")
        os.replace(partial, blob)
        progress.finished.append((fp.name, blob.stat().st_size, progress.resumed_from, time.monotonic() - began))
    else:
        size = os.path.getsize(blob if blob.exists() else pointer)
        progress.completed = progress.total = size
        progress.finished.append((fp.name, size, size, 0.0))
    progress.status = "writing manifest"
    try:  # the blob is there: hf_hub_download links it into the snapshot and records the ref
        linked = hf_hub_download(plan.ref.repo, fp.name, revision=plan.revision)
    except Exception as exc:  # noqa: BLE001 - one line
        raise _hub_error(plan.ref, exc) from None
    return Path(linked)


# -- from trio ---------------------------------------------------------------------------------------------------

async def pull(ref: HubRef, *, revision: str = "main", offline: bool = False,
               progress: PullProgress | None = None) -> Pulled:
    """Pull ``ref`` (offline: find it in the cache only) and record it in the library.

    Raises:
        PullError: one line for a person.

    Cancellation: as :func:`fetch_async`.
    """
    from ._library import record_pull

    if offline or is_offline():
        found = await trio.to_thread.run_sync(functools.partial(cached, ref, revision, strict=True))
        if found is None:
            raise PullError(f"{ref} is not in the cache ({hub_cache()}) and the pull is offline", "not_found")
        await trio.to_thread.run_sync(record_pull, found)
        return found
    plan = await resolve_async(ref, revision)
    return await fetch_async(plan, progress if progress is not None else PullProgress())


async def resolve_async(ref: HubRef, revision: str = "main") -> Plan:
    """:func:`resolve` in a thread (abandoned when cancelled: it writes nothing)."""
    return await trio.to_thread.run_sync(resolve, ref, revision, abandon_on_cancel=True)


async def fetch_async(plan: Plan, progress: PullProgress) -> Pulled:
    """:func:`fetch` in a thread, then the pull is recorded in the library.

    Raises:
        PullError: one line for a person.

    Cancellation: the transfer stops at its next chunk (the thread is told, then
    waited for up to 5 s, shielded, so it has let go of the file and the lock);
    what it wrote stays ``.incomplete``, never linked into a snapshot, and the next
    pull resumes it.
    """
    from ._library import record_pull

    stop = threading.Event()
    done = threading.Event()

    def work() -> Pulled:
        try:
            return fetch(plan, stop, progress)
        finally:
            done.set()

    try:
        pulled = await trio.to_thread.run_sync(work, abandon_on_cancel=True)
    except BaseException:
        stop.set()
        with trio.move_on_after(5, shield=True):
            await trio.to_thread.run_sync(done.wait, 5, abandon_on_cancel=True)
        raise
    await trio.to_thread.run_sync(record_pull, pulled)
    return pulled
