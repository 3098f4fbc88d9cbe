"""``superfluid batch submit|status|results|cancel|list``: a thin client of ``/v1/files`` and
``/v1/batches`` (SPEC.md §7 "Batches") for a running daemon.

``submit FILE`` takes JSON lines that are either whole batch lines (``{custom_id, method,
url, body}``) or bare request bodies (then ``custom_id`` is ``line-<n>``, counted from 1,
and the URL is ``--endpoint``); ``--model`` fills a body's ``model`` where it has none. The
file is uploaded as it is read (never whole in memory), the batch created, and with
``--wait`` followed to its end with a progress bar. Standard library HTTP (``urllib``), as
``superfluid top``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from .._printable import printable
from ._errors import USAGE, CliError, HelpFormatter
from ._flags import in_range

__all__ = ["add_batch_parser"]

DEFAULT_SERVER = "127.0.0.1:8453"
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
_FINAL = ("completed", "failed", "expired", "cancelled")
_CHUNK = 1 << 20


def add_batch_parser(sub: Any) -> None:
    p = sub.add_parser("batch", help="submit a file of requests to a running daemon as a batch, follow it, fetch "
                                     "its results", formatter_class=HelpFormatter,
                       description="OpenAI's Batches API from the command line: the lines run in the background "
                                   "class, survive a daemon restart, and never delay interactive requests.")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--server", default=DEFAULT_SERVER, metavar="HOST:PORT",
                        help=f"the daemon (default {DEFAULT_SERVER}; a URL works too)")
    common.add_argument("--api-key", metavar="KEY", help="the key, if the daemon has keys (default $SUPERFLUID_API_KEY)")
    s = actions.add_parser("submit", parents=[common], formatter_class=HelpFormatter,
                           help="upload FILE (JSON lines) and start a batch of it")
    s.add_argument("file", type=Path, metavar="FILE")
    s.add_argument("--model", help="the model of every request that names none")
    s.add_argument("--endpoint", default=ENDPOINTS[0], choices=ENDPOINTS, help="what each line calls")
    s.add_argument("--qos", choices=["background", "agent"], default="background",
                   help="the class the lines run in (agent only where the key may ask it)")
    s.add_argument("--wait", action="store_true", help="follow the batch to its end with a progress bar")
    st = actions.add_parser("status", parents=[common], formatter_class=HelpFormatter, help="one batch's state")
    st.add_argument("id", metavar="ID")
    st.add_argument("--wait", action="store_true", help="follow it to its end with a progress bar")
    st.add_argument("--json", action="store_true", help="print the batch object")
    r = actions.add_parser("results", parents=[common], formatter_class=HelpFormatter,
                           help="a batch's output lines (standard output or --out) and error lines (--errors)")
    r.add_argument("id", metavar="ID")
    r.add_argument("--out", type=Path, metavar="FILE", help="write the output lines to FILE")
    r.add_argument("--errors", type=Path, metavar="FILE", help="write the error lines to FILE")
    c = actions.add_parser("cancel", parents=[common], formatter_class=HelpFormatter, help="cancel a batch")
    c.add_argument("id", metavar="ID")
    ls = actions.add_parser("list", parents=[common], formatter_class=HelpFormatter, help="the key's batches")
    ls.add_argument("--limit", type=in_range(int, 1, 100), default=20, help="at most this many, newest first (1-100)")
    p.set_defaults(run=run_batch)


class _Api:
    def __init__(self, server: str, key: str | None) -> None:
        self.base = (server if "://" in server else f"http://{server}").rstrip("/")
        self.key = key if key is not None else os.environ.get("SUPERFLUID_API_KEY")

    def _headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        head = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        return {**head, **(extra or {})}

    def call(self, method: str, path: str, body: Any = None, *, data: Any = None,
             headers: dict[str, str] | None = None, raw: bool = False) -> Any:
        if body is not None:
            data = json.dumps(body).encode()
            headers = {"Content-Type": "application/json", **(headers or {})}
        request = urllib.request.Request(self.base + path, data=data, method=method, headers=self._headers(headers))
        try:
            response = urllib.request.urlopen(request, timeout=600)  # noqa: S310 - the user's daemon
            if raw:
                return response  # the caller reads and closes it
            with response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            try:
                detail = json.loads(exc.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                detail = exc.reason
            raise CliError(f"{method} {path}: {exc.code} {printable(str(detail))}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise CliError(f"cannot reach {self.base} ({reason}); is `superfluid serve` running there?") from None

    def download(self, path: str, out: BinaryIO) -> None:
        response = self.call("GET", path, raw=True)
        with response:
            while chunk := response.read(_CHUNK):
                out.write(chunk)


def _normalized(src: Path, dst: BinaryIO, model: str | None, endpoint: str) -> int:
    """Write ``src``'s lines to ``dst`` as batch lines; the number of lines."""
    n = 0
    try:
        f = open(src, "rb")
    except OSError as exc:
        raise CliError(f"cannot read {src}: {exc.strerror}", USAGE) from None
    with f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                line = json.loads(raw)
            except ValueError:
                raise CliError(f"{src}:{number}: not JSON", USAGE) from None
            if not isinstance(line, dict):
                raise CliError(f"{src}:{number}: not a JSON object", USAGE)
            if "custom_id" not in line or "body" not in line:
                line = {"custom_id": f"line-{number}", "method": "POST", "url": endpoint, "body": line}
            if model and isinstance(line.get("body"), dict):
                line["body"].setdefault("model", model)
            dst.write(json.dumps(line, ensure_ascii=False).encode() + b"\n")
            n += 1
    if n == 0:
        raise CliError(f"{src} holds no request lines", USAGE)
    return n


def _multipart(path: Path, boundary: str) -> tuple[Iterator[bytes], int]:
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"batch.jsonl\"\r\n"
            "Content-Type: application/jsonl\r\n\r\n").encode()
    tail = f"\r\n--{boundary}--\r\n".encode()
    size = len(head) + path.stat().st_size + len(tail)

    def parts() -> Iterator[bytes]:
        yield head
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                yield chunk
        yield tail

    return parts(), size


def _submit(api: _Api, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(prefix="superfluid-batch-", suffix=".jsonl") as tmp:
        n = _normalized(args.file, tmp, args.model, args.endpoint)
        tmp.flush()
        boundary = secrets.token_hex(16)
        body, size = _multipart(Path(tmp.name), boundary)
        uploaded = api.call("POST", "/v1/files", data=body, headers={
            "Content-Type": f"multipart/form-data; boundary={boundary}", "Content-Length": str(size)})
    headers = {"x-superfluid-qos": args.qos} if args.qos != "background" else None
    batch = api.call("POST", "/v1/batches", {"input_file_id": uploaded["id"], "endpoint": args.endpoint,
                                             "completion_window": "24h"}, headers=headers)
    print(f"{batch['id']}: {n} request(s) from {args.file} ({uploaded['id']})", file=sys.stderr)
    return batch


def _line(batch: dict[str, Any]) -> str:
    counts = batch.get("request_counts") or {}
    return (f"{batch['id']} {batch['status']}: {counts.get('completed', 0)} completed, {counts.get('failed', 0)} "
            f"failed of {counts.get('total', 0)}")


def _follow(api: _Api, batch: dict[str, Any]) -> dict[str, Any]:
    """Poll until the batch ends: a rich progress bar on a terminal, else a line per change."""
    path = f"/v1/batches/{batch['id']}"
    if sys.stderr.isatty():
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      transient=False) as bar:
            task = bar.add_task(batch["status"], total=None)
            while batch["status"] not in _FINAL:
                time.sleep(0.5)
                batch = api.call("GET", path)
                counts = batch["request_counts"]
                bar.update(task, description=batch["status"], total=counts["total"] or None,
                           completed=counts["completed"] + counts["failed"])
        return batch
    last = ""
    while True:
        line = _line(batch)
        if line != last:
            print(line, file=sys.stderr)
            last = line
        if batch["status"] in _FINAL:
            return batch
        time.sleep(1.0)
        batch = api.call("GET", path)


def _results(api: _Api, args: argparse.Namespace) -> None:
    batch = api.call("GET", f"/v1/batches/{args.id}")
    if batch["status"] not in _FINAL:
        raise CliError(f"{_line(batch)}; results come when it ends (superfluid batch status {args.id} --wait)")
    if batch.get("output_file_id"):
        if args.out is not None:
            with open(args.out, "wb") as out:
                api.download(f"/v1/files/{batch['output_file_id']}/content", out)
        else:
            api.download(f"/v1/files/{batch['output_file_id']}/content", sys.stdout.buffer)
            sys.stdout.flush()
    if batch.get("error_file_id"):
        if args.errors is not None:
            with open(args.errors, "wb") as out:
                api.download(f"/v1/files/{batch['error_file_id']}/content", out)
        else:
            print(f"{batch['request_counts']['failed']} line(s) failed: superfluid batch results {args.id} "
                  "--errors FILE writes them", file=sys.stderr)


def run_batch(args: argparse.Namespace) -> int:
    api = _Api(args.server, args.api_key)
    try:
        if args.action == "submit":
            batch = _submit(api, args)
            print(batch["id"])
            if args.wait:
                batch = _follow(api, batch)
                print(_line(batch), file=sys.stderr)
                return 0 if batch["status"] == "completed" else 1
        elif args.action == "status":
            batch = api.call("GET", f"/v1/batches/{args.id}")
            if args.wait:
                batch = _follow(api, batch)
            print(json.dumps(batch, indent=2) if args.json else _line(batch))
        elif args.action == "results":
            _results(api, args)
        elif args.action == "cancel":
            print(_line(api.call("POST", f"/v1/batches/{args.id}/cancel")))
        elif args.action == "list":
            if not 1 <= args.limit <= 100:
                raise CliError("--limit must be from 1 to 100", USAGE)
            for batch in api.call("GET", f"/v1/batches?limit={args.limit}")["data"]:
                print(_line(batch))
    except CliError as exc:
        print(f"superfluid batch: {exc.message}", file=sys.stderr)
        return exc.code
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # `| head`: no traceback
        return 0
    return 0
