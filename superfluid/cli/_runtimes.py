"""``superfluid runtimes [MODEL] [--json]`` and ``superfluid runtime install|update|repair|remove|use``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import trio

__all__ = ["add_parsers", "install_on_first_use", "run"]


def add_parsers(sub: Any) -> None:
    r = sub.add_parser("runtimes", help="the state of every runtime and install; with MODEL, which one serves it")
    r.add_argument("model", nargs="?", help="a model path (or mock spec): which runtime reads it")
    r.add_argument("--json", action="store_true", help="one JSON document on stdout")
    r.add_argument("--no-check", action="store_true", help="do not start each install's worker check")

    rt = sub.add_parser("runtime", help="install, update, repair, remove or pin a runtime")
    verbs = rt.add_subparsers(dest="verb", required=True)
    i = verbs.add_parser("install", help="plan, fetch, verify, stage, check and place an install")
    i.add_argument("id")
    i.add_argument("--version")
    i.add_argument("--backend", help="cpu, cuda, vulkan ... (no fallback)")
    i.add_argument("--from", dest="from_", metavar="URL|PATH", help="an archive (https:// or a local file)")
    i.add_argument("--sha256", metavar="H", help="the SHA-256 the archive must have")
    i.add_argument("--untested", action="store_true")
    i.add_argument("--dry-run", action="store_true", help="print the plan, fetch nothing")
    i.add_argument("--json", action="store_true", help="--dry-run: the plan as JSON")
    u = verbs.add_parser("update", help="install the tested build beside the default one and make it the default")
    u.add_argument("id")
    u.add_argument("--dry-run", action="store_true")
    rp = verbs.add_parser("repair", help="re-verify an install's files and check; reinstall it if anything differs")
    rp.add_argument("id")
    rp.add_argument("install", nargs="?")
    rm = verbs.add_parser("remove", help="remove one install, or all of them")
    rm.add_argument("id")
    rm.add_argument("install", nargs="?")
    us = verbs.add_parser("use", help="pin the default install, or --auto to rank")
    us.add_argument("id")
    us.add_argument("install", nargs="?")
    us.add_argument("--auto", action="store_true")


class _TermProgress:
    """Steps as lines on stderr; on a terminal, a live line for bytes and elapsed time."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream if stream is not None else sys.stderr  # looked up now: tests swap it
        self.tty = self.stream.isatty()
        self.current = ""
        self.live = False
        self.phase_text = ""
        self.phase_started = 0.0

    def _clear(self) -> None:
        if self.live:
            self.stream.write("\r\x1b[K")
            self.live = False

    def step(self, index: int, total: int, name: str, detail: str) -> None:
        self._clear()
        self.current = f"[{index}/{total}] {name}"
        self.phase_text = ""
        self.stream.write(f"{self.current} {detail}".rstrip() + "\n")
        self.stream.flush()

    def advance(self, done: int, total: int | None) -> None:
        if not self.tty:
            return
        mib = done / (1 << 20)
        text = f"{mib:.1f}/{total / (1 << 20):.1f} MiB" if total else f"{mib:.1f} MiB"
        if total:
            filled = int(30 * done / total)
            text = "[" + "#" * filled + "." * (30 - filled) + "] " + text
        self.stream.write(f"\r\x1b[K  {text}")
        self.stream.flush()
        self.live = True

    def note(self, text: str) -> None:
        self._clear()
        self.stream.write(f"  {text}\n")
        self.stream.flush()

    def tick(self, elapsed_s: float) -> None:
        if self.tty:
            if self.phase_text:  # the phase and its own seconds: a source build is minutes of one phase
                text = f"{self.current}: {self.phase_text} {time.monotonic() - self.phase_started:.0f}s"
            else:
                text = f"{self.current}: {int(elapsed_s) // 60}m{int(elapsed_s) % 60:02d}s"
            self.stream.write(f"\r\x1b[K  {text}")
            self.stream.flush()
            self.live = True

    def end(self) -> None:
        """Erase the live line, so what is printed next starts a line of its own."""
        self._clear()
        self.stream.flush()

    def phase(self, text: str) -> None:
        """On a terminal the live line shows it with its seconds; elsewhere a line each."""
        self.phase_text, self.phase_started = text, time.monotonic()
        if self.tty:
            self.tick(0.0)
        else:
            self.note(text)


def _fail(message: str, code: int) -> int:
    print(f"superfluid: {message}", file=sys.stderr)
    return code


def run(args: argparse.Namespace) -> int:
    from ..runtime._home import cleanup_all
    from ..runtime._registry import UnknownRuntime

    cleanup_all()
    try:
        if args.command == "runtimes":
            return _runtimes(args)
        return _runtime(args)
    except UnknownRuntime as exc:
        return _fail(str(exc), 2)
    except KeyboardInterrupt:
        return _fail("interrupted; the installs are as they were", 130)


def install_on_first_use(rid: str) -> None:
    """``serve`` met a runtime with no install: install it now, with progress. Raises
    SystemExit (one line) if that fails."""
    from ..runtime import _install

    print(f"superfluid: runtime {rid} is not installed; installing it (--offline refuses instead)",
          file=sys.stderr)
    progress = _TermProgress()
    try:
        plan = _install.make_plan(rid)
        trio.run(lambda: _install.install(plan, progress=progress))
    except _install.InstallError as exc:
        progress.end()
        print(f"superfluid: {exc}", file=sys.stderr)
        raise SystemExit(2 if exc.usage else 1) from None
    finally:
        progress.end()  # the server's own lines start on a line of their own


# -- runtimes -------------------------------------------------------------------------------


def _model_decision(spec: str) -> tuple[dict[str, Any], bool]:
    from ..runtime._choose import RuntimeRefused, choose
    from ..runtime._registry import RUNTIMES, detect, detect_format, mismatch

    fmt = detect_format(spec)
    reader = detect(spec)
    refused = {rid: why for rid, info in RUNTIMES.items() if (why := mismatch(info, spec))}
    decision: dict[str, Any] = {"model": spec, "format": fmt, "runtime": reader.id if reader else None,
                                "refused": refused, "serves": False, "problem": None}
    if not (fmt == "mock" or os.path.exists(spec)):
        decision["problem"] = f"{spec}: no such file or directory"
    elif reader is None:
        decision["problem"] = f"no runtime reads {Path(spec).name}: it is not a GGUF file, an MLX directory " \
                              "or a .base bundle"
    else:
        try:
            choose(spec, reader.id)
            decision["serves"] = True
        except RuntimeRefused as exc:
            decision["problem"] = str(exc)
    return decision, bool(decision["serves"])


def _runtimes(args: argparse.Namespace) -> int:
    from ..runtime._registry import RUNTIMES
    from ..runtime._status import states

    doc: dict[str, Any] = {"runtimes": []}
    for rid, info in RUNTIMES.items():
        doc["runtimes"].append({"id": rid, "aliases": list(info.aliases), "formats": list(info.formats),
                                "summary": info.summary, "engine": info.engine,
                                "installs": [s.to_json() for s in states(rid, check=not args.no_check)]})
    ok = True
    if args.model:
        doc["model"], ok = _model_decision(args.model)
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0 if ok else 1
    rows = [("RUNTIME", "INSTALL", "STATE", "VERSION", "FORMATS", "DEVICE", "WORKER")]
    notes: list[str] = []
    for rt in doc["runtimes"]:
        for s in rt["installs"]:
            mark = "*" if s["default"] else ""
            rows.append((rt["id"], (s["install"] or "-") + mark, s["state"], s["version"] or "-",
                         ",".join(rt["formats"]), s["device"] or "-", _short(s["worker"])))
            for p in s["problems"]:
                where = f"{rt['id']} {s['install']}" if s["install"] else rt["id"]
                notes.append(f"{where}: {p['problem']}\n    fix: {p['fix']}")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    print("(* the install serve uses)")
    if notes:
        print()
        print("\n".join(notes))
    if args.model:
        d = doc["model"]
        print()
        if d["serves"]:
            print(f"{d['model']}: read by runtime {d['runtime']} ({d['format']}); serve would use it")
        else:
            print(f"{d['model']}: not served: {d['problem']}")
        for rid, why in d["refused"].items():
            print(f"  {rid}: {why}")
    return 0 if ok else 1


def _short(worker: str | None) -> str:
    if not worker:
        return "-"
    home = str(Path.home())
    return worker.replace(home, "~", 1) if worker.startswith(home) else worker


# -- runtime install|update|repair|remove|use -----------------------------------------------


def _runtime(args: argparse.Namespace) -> int:
    from ..runtime import _install
    from ..runtime._home import current, pinned
    from ..runtime._registry import get

    info = get(args.id)
    progress = _TermProgress()
    hook = _install.fault_hook(os.environ.get("SUPERFLUID_INSTALL_FAULT"))
    try:
        if args.verb in ("install", "update"):
            if args.verb == "update":
                backend = None
                name = pinned(info.id) or current(info.id)
                if name is not None:
                    backend = name.rpartition("-")[2] or None
                plan = _install.make_plan(info.id, backend=backend, make_default=True)
            else:
                plan = _install.make_plan(info.id, version=args.version, backend=args.backend, from_=args.from_,
                                          sha256=args.sha256, untested=args.untested)
            if args.dry_run:
                if getattr(args, "json", False):
                    print(json.dumps(plan.to_json(), indent=2))
                else:
                    print("\n".join(plan.lines()))
                    print("(dry run: nothing fetched)")
                return 0
            for w in plan.warnings:
                print(f"superfluid: warning: {w}", file=sys.stderr)
            record = trio.run(lambda: _install.install(plan, progress=progress, hook=hook))
            default = current(info.id)
            print(f"installed {info.id} {record['install']} ({record['version']}, {record['backend']})"
                  + (" - the default" if default == record["install"] else f"; the default stays {default}"))
            return 0
        if args.verb == "repair":
            name, problems = trio.run(lambda: _install.repair(info.id, args.install, progress=progress, hook=hook))
            if not problems:
                print(f"{info.id} {name} is intact (files and the worker's check)")
            else:
                print(f"repaired {info.id} {name} (it had: {'; '.join(problems)})")
            return 0
        if args.verb == "remove":
            gone = trio.run(lambda: _install.remove(info.id, args.install, progress=progress))
            if not gone:
                return _fail(f"runtime {info.id} has no installs", 1)
            print(f"removed {info.id} {', '.join(gone)}; the default is now {current(info.id) or 'none'}")
            return 0
        if args.verb == "use":
            if args.auto == bool(args.install):
                return _fail("runtime use: give an INSTALL or --auto", 2)
            default = trio.run(lambda: _install.use(info.id, None if args.auto else args.install, progress=progress))
            print(f"{info.id}: the default install is {default or 'none'}"
                  + (" (pinned)" if not args.auto else " (ranked)"))
            return 0
    except _install.InstallError as exc:
        return _fail(str(exc), 2 if exc.usage else 1)
    finally:
        progress.end()
    return _fail(f"runtime {args.verb}: unknown", 2)
