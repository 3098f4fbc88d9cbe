"""``superfluid session inspect|export``: read one session from the log, no daemon needed.

The log is read read-only and without the lock (``journal/_offline.py``), so
this is safe while a daemon serves the directory: it shows what was committed
when it read, and says that a daemon holds the directory.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any

from .._printable import json_printable, printable
from .._private import FILE_MODE, make_private_dir
from ..serving import default_sessions_dir
from ..journal import SessionLog, WalCorrupt
from ..journal._offline import OfflineLog, read_log, session_summary
from ._errors import USAGE, CliError, HelpFormatter, suggest

__all__ = ["add_session_parser", "run_session"]

# Body fields that hold what a user or a model wrote; left out of an export unless --include-content.
_CONTENT = frozenset({"tokens", "text", "message", "system", "tools", "template_kwargs", "title", "tool", "arguments",
                      "reason", "note"})
_CONTENT_PARAMS = frozenset({"stops", "stop", "grammar", "logit_bias"})


def add_session_parser(sub: Any) -> None:
    p = sub.add_parser("session", help="inspect or export a session from the session log (no daemon needed)",
                       description="Read a session from the session log offline; safe while a daemon runs.",
                       formatter_class=HelpFormatter)
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("id", help="the session or conversation id (as x-superfluid-session or the API shows it)")
    common.add_argument("--sessions", type=Path, metavar="DIR",
                        help="the sessions directory (default ~/.superfluid/sessions)")
    i = actions.add_parser("inspect", parents=[common], formatter_class=HelpFormatter,
                           help="what the log holds of a session: state, model, tokens, times")
    i.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    e = actions.add_parser("export", parents=[common], formatter_class=HelpFormatter,
                           help="the session's events as JSON lines")
    e.add_argument("--format", choices=["jsonl"], default="jsonl", help="output format")
    e.add_argument("--out", type=Path, metavar="DIR",
                   help="write DIR/<id>.jsonl (0600; DIR made 0700) instead of standard output")
    e.add_argument("--include-content", action="store_true",
                   help="include prompts, generated text, token ids and messages (default: counts only)")


def _load(args: argparse.Namespace) -> tuple[OfflineLog, SessionLog]:
    directory = args.sessions or default_sessions_dir()
    try:
        log = read_log(directory)
    except FileNotFoundError:
        raise CliError(f"no session log in {directory} (pass the daemon's --sessions directory)") from None
    except WalCorrupt as exc:
        raise CliError(str(exc).splitlines()[0]) from None
    except OSError as exc:
        raise CliError(f"cannot read the session log in {directory}: {exc.strerror or exc}") from None
    sid = args.id
    slog = log.sessions.get(sid)
    if slog is None:  # a name chosen under a key is stored as <tenant>/<name>
        named = [s for key, s in log.sessions.items() if key.rpartition("/")[2] == sid]
        if len(named) > 1:
            raise CliError(f"session {sid!r} names {len(named)} sessions of different keys; "
                           f"use one of: {', '.join(s.session for s in named)}", USAGE)
        slog = named[0] if named else None
    if slog is None:
        ids = [key.rpartition("/")[2] for key in log.sessions]
        raise CliError(f"session {sid!r} not found in {directory}{suggest(sid, ids)}")
    return log, slog


def _when(ms: int) -> str:
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.timezone.utc).isoformat(timespec="seconds")


def inspect(args: argparse.Namespace) -> dict[str, Any]:
    log, slog = _load(args)
    info = session_summary(slog, log.epoch)
    info["tenant"] = slog.tenant or None
    if slog.conversation is None:
        params = (slog.created or {}).get("params") or {}
        info["params"] = {k: v for k, v in params.items() if k not in ("stops", "grammar")}
        info["error"] = slog.error
    info["directory"] = str(log.directory)
    info["daemon_pid"] = log.holder
    return info


def _text_lines(info: dict[str, Any]) -> list[str]:
    lines = [f"session {info['id']} ({info['kind']}): {info['state']}"
             + (f", finish {info['finish_reason']}" if info.get("finish_reason") else "")]
    lines.append(f"  model {info['model']}" + (f", qos {info['qos']}" if info.get("qos") else "")
                 + (", resumable" if info.get("resumable") else "") + (f", key {info['tenant']}" if info['tenant'] else ""))
    if "prompt_tokens" in info:
        lines.append(f"  tokens: prompt {info['prompt_tokens']}, completion {info['completion_tokens']}")
    if info.get("open_turn") is not None:
        lines.append(f"  turn {info['open_turn']} is open")
    lines.append(f"  events {info['events']} (last id {info['last_event_id']}); created "
                 f"{_when(info['created'] * 1000)}, updated {_when(info['updated'] * 1000)}")
    if info.get("error"):
        lines.append(f"  error: {info['error']}")
    if info["state"] == "interrupted":
        lines.append("  cut by a daemon restart: a resumable session resumes on the next start")
    if info["daemon_pid"] is not None:
        lines.append(f"  (a daemon, pid {info['daemon_pid'] or '?'}, serves {info['directory']}: "
                     "this is the log as committed when read)")
    return lines


def _event(record: Any, include_content: bool) -> dict[str, Any]:
    body = dict(record.body)
    out: dict[str, Any] = {"session": record.session.rpartition("/")[2], "event_id": record.event_id,
                           "epoch": record.epoch, "ts": record.ts, "type": body.pop("type", record.type)}
    for key, value in body.items():
        if not include_content and key in ("params", "sampling") and isinstance(value, dict):
            out[key] = {k: v for k, v in value.items() if k not in _CONTENT_PARAMS}
        elif not include_content and key == "edits" and isinstance(value, list):  # a rebase's: ranges, no messages
            out[key] = [{kind: {"from": span["from"], "to": span["to"]} for kind, span in edit.items()}
                        for edit in value]
        elif include_content or key not in _CONTENT:
            out[key] = value
        elif key == "tokens" and isinstance(value, (list, tuple)):
            out["n_tokens"] = len(value)
        elif key == "text" and isinstance(value, str):
            out["n_chars"] = len(value)
    return out


def export(args: argparse.Namespace) -> int:
    _log, slog = _load(args)
    lines = [json_printable(json.dumps(_event(r, args.include_content), ensure_ascii=False, separators=(",", ":"),
                                       default=list))
             for r in slog.records()]  # prompts may hold any character: one line each, none reaching the terminal
    data = "".join(line + "\n" for line in lines)
    if args.out is None:
        sys.stdout.write(data)
        return 0
    try:
        make_private_dir(args.out)
        target = args.out / f"{slog.session.rpartition('/')[2]}.jsonl"
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
        with open(fd, "w", encoding="utf-8") as f:
            f.write(data)
    except OSError as exc:
        raise CliError(f"--out {args.out}: {exc.strerror or exc}") from None
    print(f"wrote {len(lines)} events to {target}", file=sys.stderr)
    return 0


def run_session(args: argparse.Namespace) -> int:
    if args.action == "inspect":
        info = inspect(args)
        if args.json:
            print(json_printable(json.dumps(info, ensure_ascii=False, indent=2, default=str)))
        else:  # the model's name and an error message came from clients: shown, never run by the terminal
            print("\n".join(printable(line) for line in _text_lines(info)))
        return 0
    return export(args)
