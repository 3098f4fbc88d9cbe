"""Pull the plug: SIGKILL the daemon mid-reply, restart it, and the stream finishes.

Starts ``superfluid serve`` on a fresh sessions directory, streams a story
with the blocking resumable client (``superfluid.client.stream_chat``),
SIGKILLs the daemon's whole process group a third of the way in, restarts it
on the same sessions directory, and lets the *same* stream finish: the client
reconnects with backoff while the daemon comes back, resumes the session by
id from its last SSE id, and nothing is repeated. Then it checks the text
against an uninterrupted run of the same (greedy, seeded) request.

    python examples/pull_the_plug.py                  # the mock runtime
    python examples/pull_the_plug.py path/to/model.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import IO, Any

from superfluid.client import stream_chat


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(model: str, port: int, sessions: Path, log: IO[bytes]) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "superfluid", "serve", model, "--http", f"127.0.0.1:{port}",
            "--sessions", str(sessions), "--log-level", "WARNING"]
    if model.startswith("mock"):
        argv += ["--runtime", "mock"]
    # its own process group, so one killpg takes the daemon and its workers
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the daemon exited with {proc.returncode}; see its log")
        try:
            get_json(url + "/health")
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit("the daemon did not become ready")


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="mock?step_ms=15", help="a GGUF path, or a mock spec")
    parser.add_argument("--tokens", type=int, default=240, help="max tokens of the story")
    args = parser.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="pull-the-plug-") as tmp:
        sessions = Path(tmp) / "sessions"
        log = open(Path(tmp) / "daemon.log", "ab")  # noqa: SIM115 -- shared by both daemons
        proc = spawn(args.model, port, sessions, log)
        try:
            wait_ready(url, proc)
            model = get_json(url + "/v1/models")["data"][0]["id"]
            body = {"model": model, "temperature": 0, "seed": 7, "max_tokens": args.tokens,
                    "messages": [{"role": "system", "content": "You are a storyteller."},
                                 {"role": "user", "content": "Tell me a story about a lighthouse keeper and a storm."}]}
            if args.model.startswith("mock"):
                body["ignore_eos"] = True
            print(f"daemon up on {url} (model {model}); an uninterrupted run first, for reference…", file=sys.stderr)
            reference = list(stream_chat(url, body))
            kill_at = max(1, len(reference) // 3)

            print("now the same request, and the plug is pulled a third of the way in:\n", file=sys.stderr)
            deltas: list[str] = []
            with stream_chat(url, body) as stream:
                for delta in stream:
                    deltas.append(delta)
                    print(delta, end="", flush=True)
                    if len(deltas) == kill_at:
                        kill_group(proc)
                        print(f"\n\n[SIGKILLed the daemon's process group at delta {kill_at} of session "
                              f"{stream.session_id}; restarting it on the same sessions dir]\n", file=sys.stderr,
                              flush=True)
                        proc = spawn(args.model, port, sessions, log)
            print()
            text, ref = "".join(deltas), "".join(reference)
            same = text == ref
            print(f"\nsession {stream.session_id}: {len(deltas)} deltas, {stream.reconnects} reconnect(s), "
                  f"finish_reason={stream.finish_reason}")
            print(f"text identical to an uninterrupted run: {same}")
            return 0 if same else 1
        finally:
            kill_group(proc)
            log.close()


if __name__ == "__main__":
    sys.exit(main())
