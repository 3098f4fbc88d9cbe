"""``superfluid pull``, ``superfluid models``, ``superfluid rm``, and the pull ``serve`` does for a hub id."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

import trio

from .._printable import printable
from ..models._hub import HubRef, PullError, PullProgress, cached, parse_hub_id, pull
from ..models._library import Entry, entries, find, remove

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..models._hub import Pulled

__all__ = ["COMMANDS", "PullInterrupted", "add_commands", "hub_model", "path_digest", "run_pull"]

DEFAULT_HTTP = ("127.0.0.1", 8453)


class PullInterrupted(Exception):
    """Ctrl-C during a pull; the message says what was kept."""


def add_commands(sub: Any, hostport: Callable[[str], tuple[str, int]]) -> None:
    p = sub.add_parser("pull", help="pull a GGUF model from Hugging Face: org/repo[:QUANT]")
    p.add_argument("id", help="org/repo[:QUANT], e.g. unsloth/Qwen3-4B-GGUF:Q4_K_M (default quant Q4_K_M)")
    p.add_argument("--offline", action="store_true", help="look only in the cache (also HF_HUB_OFFLINE=1)")
    p.add_argument("--revision", default="main", help="branch, tag or commit of the repo (default main)")
    m = sub.add_parser("models", help="list the models pulled, copied or in the models cache directory")
    m.add_argument("--json", action="store_true", help="one JSON array")
    m.add_argument("--http", type=hostport, default=DEFAULT_HTTP,
                   help="HOST:PORT of the daemon asked which models are loaded (default 127.0.0.1:8453)")
    r = sub.add_parser("rm", help="remove a model (refused while a running daemon has it loaded)")
    r.add_argument("name", help="a name `superfluid models` lists")
    r.add_argument("--http", type=hostport, default=DEFAULT_HTTP,
                   help="HOST:PORT of the daemon asked whether the model is loaded (default 127.0.0.1:8453)")


def _mb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


# -- pulling -----------------------------------------------------------------------------------------------------

async def _pull_main(ref: HubRef, offline: bool, revision: str) -> Pulled:
    from ._progress import show_progress

    progress = PullProgress()
    interrupted = False
    pulled: Pulled | None = None
    error: PullError | None = None
    async with trio.open_nursery() as nursery:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async def on_signal() -> None:
                nonlocal interrupted
                async for _ in signals:
                    interrupted = True
                    nursery.cancel_scope.cancel()
                    return

            shown = trio.CancelScope()

            async def show() -> None:
                with shown:
                    await show_progress(str(ref), progress)

            nursery.start_soon(on_signal)
            if not offline:
                nursery.start_soon(show)
            try:
                pulled = await pull(ref, revision=revision, offline=offline, progress=progress)
            except PullError as exc:
                error = exc
            finally:
                shown.cancel()
            nursery.cancel_scope.cancel()  # the signal watcher
    if error is not None:
        raise error
    if interrupted or pulled is None:
        where = ""
        if progress.file and progress.completed:
            where = f" at {_mb(progress.completed)} of {_mb(progress.total)} of {progress.file.rpartition('/')[2]}"
        kept = "; what arrived is kept and the next pull resumes it" if progress.received else ""
        raise PullInterrupted(f"pull of {ref} cancelled{where}{kept}")
    return pulled


def run_pull(ref: HubRef, *, offline: bool = False, revision: str = "main") -> Pulled:
    """Pull ``ref`` showing progress on stderr.

    Raises:
        PullError: one line.
        PullInterrupted: Ctrl-C (or SIGTERM) stopped it.
    """
    return trio.run(_pull_main, ref, offline, revision)


def hub_model(spec: str, *, offline: bool) -> Pulled | None:
    """``spec`` as a hub id's cached model, pulled first if the cache lacks it; None if
    ``spec`` is not a hub id. The one place a model argument becomes a pull.

    Raises:
        PullError, PullInterrupted.
    """
    ref = parse_hub_id(spec)
    if ref is None:
        return None
    found = cached(ref, strict=offline)
    if found is not None:
        return found
    return run_pull(ref, offline=offline)


def _cmd_pull(args: argparse.Namespace) -> int:
    ref = parse_hub_id(args.id)
    if ref is None:
        print(f"superfluid: {args.id!r} is not a Hugging Face id (org/repo[:QUANT])"
              + (" (a file of that name exists)" if os.path.exists(args.id) else ""), file=sys.stderr)
        return 2
    pulled = run_pull(ref, offline=args.offline, revision=args.revision)
    print(printable(f"{pulled.name} {_mb(pulled.size)} {pulled.path}"))
    return 0


# -- listing and removing ----------------------------------------------------------------------------------------

def path_digest(path: str | os.PathLike[str]) -> str:
    """What ``/api/ps`` reports as a loaded model's digest: the sha256 of its file's real path."""
    return hashlib.sha256(os.path.realpath(path).encode()).hexdigest()


class _NeedsKey(Exception):
    pass


def _daemon_loaded(addr: tuple[str, int]) -> tuple[str, list[dict[str, Any]]] | None:
    """``(url, models)`` from the daemon's ``/api/ps`` at ``addr``; None if nothing answers there.

    Raises:
        _NeedsKey: a daemon answers but wants a key.
    """
    import httpx

    host, port = addr
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    key = os.environ.get("SUPERFLUID_API_KEY")
    headers = {"authorization": f"Bearer {key}"} if key else {}
    try:
        r = httpx.get(url + "/api/ps", headers=headers, timeout=2.0)
    except httpx.HTTPError:
        return None
    if r.status_code in (401, 403):
        raise _NeedsKey(url)
    try:
        models = r.json()["models"]
    except (ValueError, KeyError, TypeError):
        return None  # not a superfluid (or ollama) daemon
    return url, list(models) if isinstance(models, list) else []


def _is_loaded(entry: Entry, models: list[dict[str, Any]]) -> bool:
    digest = path_digest(entry.path)
    return any(isinstance(m, dict) and (m.get("digest") == digest or m.get("name") == entry.name) for m in models)


def _cmd_models(args: argparse.Namespace) -> int:
    try:
        state = _daemon_loaded(args.http)
    except _NeedsKey:
        state = None
    rows = []
    for e in entries():
        loaded = None if state is None else _is_loaded(e, state[1])
        rows.append({**e.as_json(), "loaded": loaded})
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print("no models yet: `superfluid pull org/repo:QUANT`, or `superfluid serve` for the embedded default")
        return 0
    table: list[tuple[str, ...]] = [("NAME", "RUNTIME", "QUANT", "SIZE", "LOADED", "PATH")]
    for r in rows:
        loaded = "-" if r["loaded"] is None else ("yes" if r["loaded"] else "no")
        table.append(tuple(printable(str(c)) for c in (  # names come from manifests and hubs: shown, never run
            r["name"], r["runtime"], r["quant"] or "-", _mb(r["size"]), loaded, r["path"])))
    widths = [max(len(row[i]) for row in table) for i in range(5)]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row[:5], widths, strict=True)) + "  " + row[5])
    return 0


def _cmd_rm(args: argparse.Namespace) -> int:
    entry = find(args.name)
    if entry is None:
        print(f"superfluid: no model named {args.name!r} (`superfluid models` lists them)", file=sys.stderr)
        return 1
    try:
        state = _daemon_loaded(args.http)
    except _NeedsKey as exc:
        print(f"superfluid: the daemon at {exc} needs a key to say whether {entry.name} is loaded; "
              "set SUPERFLUID_API_KEY", file=sys.stderr)
        return 1
    if state is not None and _is_loaded(entry, state[1]):
        print(f"superfluid: {entry.name} is loaded by the daemon at {state[0]}; unload it there first "
              f"(POST {state[0]}/v1/models/unload) or stop that daemon", file=sys.stderr)
        return 1
    removed = remove(entry)
    what = f" ({len(removed)} file{'s' if len(removed) != 1 else ''}, {_mb(entry.size)})" if removed else " (a name)"
    print(printable(f"removed {entry.name}{what}"))
    return 0


def _guarded(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except PullError as exc:
            print(f"superfluid: {printable(str(exc))}", file=sys.stderr)
            return 1
        except PullInterrupted as exc:
            print(f"superfluid: {printable(str(exc))}", file=sys.stderr)
            return 130
        except OSError as exc:
            print(f"superfluid: {printable(str(exc))}", file=sys.stderr)
            return 1

    return run


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "pull": _guarded(_cmd_pull), "models": _guarded(_cmd_models), "rm": _guarded(_cmd_rm)}
