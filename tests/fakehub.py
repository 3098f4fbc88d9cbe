"""A local stand-in for the Hugging Face hub, for tests with no internet (and the
progress capture in docs/): ``python -m tests.fakehub PORT [BYTES_PER_S]``.

It answers what huggingface_hub asks when it pulls: ``GET /api/models/{repo}[/revision/{rev}]``
(the file list, with sizes and LFS sha256s when ``blobs=true``), and ``HEAD``/``GET
/{repo}/resolve/{rev}/{file}`` with ``ETag`` (the sha256), ``X-Repo-Commit``,
``Content-Length``, ``Accept-Ranges``, and ``206`` answers to ``Range: bytes=N-``.
A repo's files are bytes in memory or a file on disk read in ranges.

Knobs: ``rate`` (bytes a second per GET, 0 = unthrottled), ``lie_size`` / ``lie_etag``
(file -> the size or sha256 announced instead of the true one), ``served`` (body bytes
sent by GETs), ``requests`` (method, path, Range) and ``offline`` (every request 503).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class Blob:
    def __init__(self, data: bytes | Path) -> None:
        self.data = data
        if isinstance(data, Path):
            self.size = data.stat().st_size
            digest = hashlib.sha256()
            with open(data, "rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
            self.sha256 = digest.hexdigest()
        else:
            self.size = len(data)
            self.sha256 = hashlib.sha256(data).hexdigest()

    def read(self, start: int, n: int) -> bytes:
        if isinstance(self.data, bytes):
            return self.data[start:start + n]
        with open(self.data, "rb") as f:
            f.seek(start)
            return f.read(n)


class FakeHub:
    def __init__(self, repos: dict[str, dict[str, bytes | Path]], *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.repos = {repo: {name: Blob(data) for name, data in files.items()} for repo, files in repos.items()}
        self.rate = 0
        self.lie_size: dict[str, int] = {}
        self.lie_etag: dict[str, str] = {}
        self.served = 0
        self.served_by_range: dict[str, int] = {}  # body bytes sent, by the request's Range header ("" none)
        self.requests: list[tuple[str, str, str]] = []
        self.lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                hub._answer(self, body=True)

            def do_HEAD(self) -> None:  # noqa: N802
                hub._answer(self, body=False)

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.url = f"http://{host}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -- answers ----------------------------------------------------------------------------------------------

    def _answer(self, h: BaseHTTPRequestHandler, *, body: bool) -> None:
        url = urlsplit(h.path)
        path = unquote(url.path)
        with self.lock:
            self.requests.append((h.command, path, h.headers.get("Range", "")))
        try:
            if path.startswith("/api/models/"):
                self._info(h, path[len("/api/models/"):], "blobs=true" in url.query)
            elif "/resolve/" in path:
                repo, _, rest = path.lstrip("/").partition("/resolve/")
                _rev, _, name = rest.partition("/")
                self._file(h, repo, name, body=body)
            else:
                self._error(h, 404, "EntryNotFound", "no such route")
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _error(self, h: BaseHTTPRequestHandler, status: int, code: str, message: str) -> None:
        payload = json.dumps({"error": message}).encode()
        h.send_response(status)
        h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(payload)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(payload)

    def _info(self, h: BaseHTTPRequestHandler, rest: str, blobs: bool) -> None:
        repo = rest.split("/revision/")[0]
        files = self.repos.get(repo)
        if files is None:
            self._error(h, 404, "RepoNotFound", f"Repository {repo} not found")
            return
        siblings = []
        for name, blob in files.items():
            entry: dict[str, object] = {"rfilename": name}
            if blobs:
                entry.update(size=blob.size, blobId=blob.sha256[:40],
                             lfs={"size": blob.size, "sha256": blob.sha256, "pointerSize": 134})
            siblings.append(entry)
        payload = json.dumps({"_id": repo, "id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                              "gated": False, "disabled": False, "tags": ["gguf"], "siblings": siblings}).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(payload)))
        h.send_header("X-Repo-Commit", COMMIT)
        h.end_headers()
        h.wfile.write(payload)

    def _file(self, h: BaseHTTPRequestHandler, repo: str, name: str, *, body: bool) -> None:
        files = self.repos.get(repo)
        if files is None:
            self._error(h, 404, "RepoNotFound", f"Repository {repo} not found")
            return
        blob = files.get(name)
        if blob is None:
            self._error(h, 404, "EntryNotFound", f"{name} not found")
            return
        start = 0
        rng = h.headers.get("Range", "")
        if rng.startswith("bytes="):
            start = int(rng[len("bytes="):].partition("-")[0] or 0)
        if start >= blob.size and blob.size:
            h.send_response(416)
            h.send_header("Content-Range", f"bytes */{blob.size}")
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        h.send_response(206 if start else 200)
        h.send_header("ETag", f'"{self.lie_etag.get(name, blob.sha256)}"')
        h.send_header("X-Repo-Commit", COMMIT)
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Length", str(blob.size - start))
        if name in self.lie_size:
            h.send_header("X-Linked-Size", str(self.lie_size[name]))
        if start:
            h.send_header("Content-Range", f"bytes {start}-{blob.size - 1}/{blob.size}")
        h.end_headers()
        if not body:
            return
        pos = start
        chunk = 64 << 10
        while pos < blob.size:
            data = blob.read(pos, chunk)
            h.wfile.write(data)
            pos += len(data)
            with self.lock:
                self.served += len(data)
                self.served_by_range[rng] = self.served_by_range.get(rng, 0) + len(data)
            if self.rate:
                time.sleep(len(data) / self.rate)


def smollm_repo(real_gguf: Path, *, synthetic: int = 3 << 20) -> dict[str, bytes | Path]:
    """``org/repo``'s files: the real SmolLM2 GGUF as the Q4_1 quant, synthetic
    (distinct, not loadable) bytes for the others, one of them split in two parts."""
    def fake(seed: str, n: int) -> bytes:
        block = hashlib.sha256(seed.encode()).digest() * 1024
        return (b"GGUF" + block * (n // len(block) + 1))[:n]

    q8 = fake("q8", 2 * synthetic)
    return {
        "README.md": b"# a fake repo for superfluid's tests\n",
        "SmolLM2-135M-Instruct-Q4_1.gguf": real_gguf,
        "SmolLM2-135M-Instruct-Q4_K_M.gguf": fake("q4km", synthetic),
        "SmolLM2-135M-Instruct-UD-Q4_K_M.gguf": fake("ud", synthetic),
        "SmolLM2-135M-Instruct-Q8_0-00001-of-00002.gguf": q8[:synthetic],
        "SmolLM2-135M-Instruct-Q8_0-00002-of-00002.gguf": q8[synthetic:],
    }


def main() -> None:
    port = int(sys.argv[1])
    rate = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    real = Path(os.environ.get("SUPERFLUID_TEST_GGUF",
                               Path.home() / ".superfluid" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    with FakeHub({"org/repo": smollm_repo(real, synthetic=int(os.environ.get("FAKEHUB_SYNTHETIC", 3 << 20)))},
                 port=port) as hub:
        hub.rate = rate
        print(hub.url, flush=True)
        threading.Event().wait()


if __name__ == "__main__":
    main()
