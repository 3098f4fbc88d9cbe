"""Files (``/v1/files``, ``sessions/_files.py``, ``api/_files.py``): uploads streamed to disk
under a per-tenant quota, read by the official openai client, private to their tenant, refused
from browsers, and kept whole across a crash."""

from __future__ import annotations

import json
import logging
import os
import secrets
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from superfluid.api import _files as files_api
from superfluid.cli._main import build_parser
from superfluid.serving import ApiKey
from superfluid.sessions._files import FileStore, FilesQuotaExceeded

from .conftest import Daemon, mock_config, start_daemon

CHAT = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
LINES = b"".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                             "body": CHAT}).encode() + b"\n" for i in range(3))
KEYS = (ApiKey.from_secret("a", "ka"), ApiKey.from_secret("b", "kb"))
A = {"authorization": "Bearer ka"}
B = {"authorization": "Bearer kb"}
BOUNDARY = "sf-test-boundary-0123456789"


@pytest.fixture
async def serve(nursery: trio.Nursery, tmp_path: Path) -> AsyncIterator[Any]:
    """``await serve(**config_fields)``: a mock daemon on ``tmp_path/sessions``; all stopped at the end."""
    started: list[Daemon] = []

    async def start(**fields: Any) -> Daemon:
        d = await start_daemon(nursery, attrs.evolve(mock_config(), sessions=tmp_path / "sessions", **fields))
        started.append(d)
        return d

    yield start
    for d in started:
        await d.client.aclose()
        d.scope.cancel()


def files_dir(tmp_path: Path) -> Path:
    return tmp_path / "sessions" / "files"


def on_disk(tmp_path: Path) -> list[str]:
    return sorted(os.listdir(files_dir(tmp_path)))


def openai_client(d: Daemon, key: str = "unused") -> Any:
    import openai

    return openai.OpenAI(base_url=d.url + "/v1", api_key=key, max_retries=0)


def error(r: httpx.Response, status: int, code: str | None, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def multipart(*parts: tuple[str, bytes, str | None], boundary: str = BOUNDARY) -> bytes:
    """A multipart/form-data body of ``(name, value, filename)`` parts."""
    out = b""
    for name, value, filename in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + value + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


FORM = {"content-type": f"multipart/form-data; boundary={BOUNDARY}"}


# -- the openai client ---------------------------------------------------------------------------------------------

async def test_the_openai_client_uploads_lists_reads_and_deletes(serve: Any, tmp_path: Path) -> None:
    d = await serve()

    def run() -> None:
        client = openai_client(d)
        made = client.files.create(file=("requests.jsonl", LINES), purpose="batch")
        assert (made.object, made.bytes, made.filename, made.purpose, made.status) == (
            "file", len(LINES), "requests.jsonl", "batch", "processed")
        assert made.id.startswith("file-") and len(made.id) == 5 + 24
        other = client.files.create(file=("notes.txt", b"\x00binary\xff"), purpose="user_data")
        assert client.files.retrieve(made.id).model_dump() == made.model_dump()
        assert [f.id for f in client.files.list()] == [other.id, made.id]  # newest first
        assert [f.id for f in client.files.list(order="asc")] == [made.id, other.id]
        assert [f.id for f in client.files.list(purpose="batch")] == [made.id]
        page = client.files.list(limit=1)
        assert [f.id for f in page.data] == [other.id] and page.has_more
        assert [[f.id for f in p.data] for p in page.iter_pages()] == [[other.id], [made.id]]  # by `after`
        assert client.files.content(made.id).read() == LINES
        assert client.files.content(other.id).content == b"\x00binary\xff"
        deleted = client.files.delete(made.id)
        assert (deleted.id, deleted.deleted) == (made.id, True)
        assert [f.id for f in client.files.list()] == [other.id]
        import openai

        with pytest.raises(openai.NotFoundError) as caught:
            client.files.retrieve(made.id)
        assert caught.value.body["code"] == "file_not_found" and caught.value.body["param"] == "file_id"

    with trio.fail_after(60):
        await trio.to_thread.run_sync(run)
    assert stat.S_IMODE(files_dir(tmp_path).stat().st_mode) == 0o700
    names = on_disk(tmp_path)
    assert len(names) == 2 and {stat.S_IMODE((files_dir(tmp_path) / n).stat().st_mode) for n in names} == {0o600}
    r = await d.client.get(f"/v1/files/{names[0]}/content")
    assert r.headers["content-type"] == "application/octet-stream" and r.content == b"\x00binary\xff"


async def test_either_field_order_and_other_fields_are_taken(serve: Any) -> None:
    d = await serve()
    for parts in ([("file", LINES, "a.jsonl"), ("purpose", b"batch", None)],
                  [("expires_after[anchor]", b"created_at", None), ("purpose", b"batch", None),
                   ("file", LINES, "b.jsonl")]):
        r = await d.client.post("/v1/files", content=multipart(*parts), headers=FORM)
        assert r.status_code == 200, r.text
        assert r.json()["purpose"] == "batch" and r.json()["bytes"] == len(LINES)
        r = await d.client.get(f"/v1/files/{r.json()['id']}/content")
        assert r.content == LINES and r.headers["content-type"] == "application/jsonl"


# -- streamed, never whole in memory --------------------------------------------------------------------------------

async def test_a_20mb_upload_streams_through_without_being_held(serve: Any, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A 20 MB chunked upload: the parser hands on at most one body message at a time, and the
    daemon's Python allocations rise by a small fraction of the file while it arrives."""
    import tracemalloc

    d = await serve()
    taken: list[int] = []
    take = files_api._Form.take
    monkeypatch.setattr(files_api._Form, "take", lambda self: taken.append(len(data := take(self))) or data)
    size, piece = 20 << 20, secrets.token_bytes(1 << 16)
    head = multipart(("purpose", b"batch", None)).removesuffix(f"--{BOUNDARY}--\r\n".encode())
    head += f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="big.bin"\r\n\r\n'.encode()

    async def body() -> AsyncIterator[bytes]:
        await trio.lowlevel.checkpoint()
        yield head
        for _ in range(size // len(piece)):
            yield piece
        yield f"\r\n--{BOUNDARY}--\r\n".encode()

    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        with trio.fail_after(120):
            r = await d.client.post("/v1/files", content=body(), headers=FORM)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert r.status_code == 200, r.text
    assert r.json()["bytes"] == size
    assert sum(taken) == size and len(taken) > 20 and max(taken) <= 1 << 20, (len(taken), max(taken))
    assert peak < 8 << 20, peak  # (the whole file would be 20 MiB, twice that joined)
    path = files_dir(tmp_path) / r.json()["id"]
    assert path.stat().st_size == size
    with path.open("rb") as fh:
        assert fh.read(len(piece)) == piece
    async with d.client.stream("GET", f"/v1/files/{r.json()['id']}/content") as streamed:
        got = 0
        async for chunk in streamed.aiter_raw():
            got += len(chunk)
    assert got == size


# -- limits --------------------------------------------------------------------------------------------------------

async def test_an_upload_past_the_tenants_quota_is_413_and_leaves_nothing(serve: Any, tmp_path: Path) -> None:
    quota = 1 << 20
    d = await serve(files_quota_gb=quota / (1 << 30))
    first = secrets.token_bytes(600_000)
    import openai

    def run() -> tuple[str, Any]:
        client = openai_client(d)
        made = client.files.create(file=("one.bin", first), purpose="batch")
        with pytest.raises(openai.APIStatusError) as caught:  # a clean answer: the rest of the body was read
            client.files.create(file=("two.bin", secrets.token_bytes(600_000)), purpose="batch")
        return made.id, caught.value

    with trio.fail_after(60):
        fid, refused = await trio.to_thread.run_sync(run)
    assert refused.status_code == 413
    assert refused.body["code"] == "files_quota_exceeded" and refused.body["type"] == "quota_exceeded"
    assert f"{len(first)} bytes are stored of the {quota} allowed" in refused.body["message"], refused.body
    assert on_disk(tmp_path) == sorted([fid, fid + ".json"])  # no partial second file, no temporary one
    r = await d.client.post("/v1/files", content=multipart(("purpose", b"batch", None),
                                                           ("file", b"x" * 400_000, "three.bin")), headers=FORM)
    assert r.status_code == 200, r.text  # what fits still fits
    assert (await d.client.delete(f"/v1/files/{fid}")).json()["deleted"] is True
    r = await d.client.post("/v1/files", content=multipart(("purpose", b"batch", None),
                                                           ("file", b"y" * 600_000, "four.bin")), headers=FORM)
    assert r.status_code == 200, r.text  # a delete gives its bytes back


async def test_uploads_under_way_count_against_the_quota(tmp_path: Path) -> None:
    store = FileStore.open(tmp_path / "files", quota_bytes=1000)
    first_in, release = trio.Event(), trio.Event()

    async def slow() -> AsyncIterator[bytes]:
        yield b"a" * 600
        first_in.set()
        await release.wait()

    async def fast() -> AsyncIterator[bytes]:
        await trio.lowlevel.checkpoint()
        yield b"b" * 600

    async with trio.open_nursery() as n:
        n.start_soon(store.create, "t", "slow.bin", "batch", slow())
        await first_in.wait()
        with pytest.raises(FilesQuotaExceeded) as caught:
            await store.create("t", "fast.bin", "batch", fast())
        assert (caught.value.used, caught.value.quota) == (600, 1000)
        assert await store.create("u", "other.bin", "batch", fast())  # another tenant's quota is its own
        release.set()
    assert [f.filename for f in store.list("t")] == ["slow.bin"] and store.used_bytes("t") == 600
    output = await store.create("t", "out.jsonl", "batch_output", fast(), quota=False)  # a batch's: never refused
    assert store.used_bytes("t") == 1200 and output.purpose == "batch_output"


async def test_a_file_over_files_max_bytes_is_413(serve: Any, tmp_path: Path) -> None:
    d = await serve(files_max_bytes=1000)
    ok = multipart(("purpose", b"batch", None), ("file", b"z" * 1000, "ok.bin"))
    assert (await d.client.post("/v1/files", content=ok, headers=FORM)).status_code == 200
    over = multipart(("purpose", b"batch", None), ("file", b"z" * 5000, "over.bin"))

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: found while read
        await trio.lowlevel.checkpoint()
        for i in range(0, len(over), 700):
            yield over[i:i + 700]

    error(await d.client.post("/v1/files", content=chunked(), headers=FORM), 413, "payload_too_large", "file")
    huge = multipart(("purpose", b"batch", None), ("file", b"z" * (2 << 20), "huge.bin"))
    r = await d.client.post("/v1/files", content=huge, headers=FORM)  # refused by its Content-Length
    error(r, 413, "payload_too_large")
    assert len(on_disk(tmp_path)) == 2


async def test_a_stalled_upload_is_408(serve: Any, tmp_path: Path) -> None:
    d = await serve(body_timeout_s=0.5)
    host, port = d.url.removeprefix("http://").rsplit(":", 1)
    body = multipart(("purpose", b"batch", None), ("file", b"q" * 1000, "slow.bin"))
    head = (f"POST /v1/files HTTP/1.1\r\nHost: localhost\r\nContent-Type: {FORM['content-type']}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    out = b""
    with trio.fail_after(10):
        async with await trio.open_tcp_stream(host, int(port)) as stream:
            await stream.send_all(head + body[:300])
            while chunk := await stream.receive_some(65536):
                out += chunk
    assert out.startswith(b"HTTP/1.1 408"), out
    assert b"request_timeout" in out
    assert on_disk(tmp_path) == []


# -- tenancy --------------------------------------------------------------------------------------------------------

async def test_another_key_gets_the_unknown_file_answer(serve: Any) -> None:
    d = await serve(api_keys=KEYS)
    async with httpx.AsyncClient(base_url=d.url, headers=A) as a, httpx.AsyncClient(base_url=d.url, headers=B) as b:
        r = await a.post("/v1/files", content=multipart(("purpose", b"batch", None), ("file", LINES, "a.jsonl")),
                         headers=FORM)
        assert r.status_code == 200, r.text
        fid, none = r.json()["id"], "file-" + "0" * 24
        for method, tail in (("GET", ""), ("GET", "/content"), ("DELETE", "")):
            theirs = await b.request(method, f"/v1/files/{fid}{tail}")
            unknown = await b.request(method, f"/v1/files/{none}{tail}")
            error(theirs, 404, "file_not_found", "file_id")
            assert theirs.text.replace(fid, "?") == unknown.text.replace(none, "?")
        assert (await b.get("/v1/files")).json()["data"] == []
        theirs, unknown = await b.get("/v1/files", params={"after": fid}), await b.get("/v1/files",
                                                                                           params={"after": none})
        error(theirs, 400, None, "after")
        assert theirs.text.replace(fid, "?") == unknown.text.replace(none, "?")
        assert [f["id"] for f in (await a.get("/v1/files")).json()["data"]] == [fid]
        assert (await a.get(f"/v1/files/{fid}/content")).content == LINES  # b deleted nothing
    import openai

    def sdk() -> None:
        with pytest.raises(openai.NotFoundError):
            openai_client(d, "kb").files.content(fid)
        with pytest.raises(openai.AuthenticationError):
            openai_client(d, "wrong").files.list()

    await trio.to_thread.run_sync(sdk)


# -- the browser guard ----------------------------------------------------------------------------------------------

async def test_browser_multipart_is_refused_everywhere(serve: Any, tmp_path: Path) -> None:
    """Multipart is a CORS-simple type: a page posts it with no preflight. It passes the guard only
    to ``POST /v1/files`` and only from a non-browser; a page of this machine or of a
    ``--web-origin`` gets 415 too, and a foreign page is refused before (403)."""
    d = await serve(web_origins=("https://app.example",))
    body = multipart(("purpose", b"batch", None), ("file", LINES, "a.jsonl"))
    for marker in ({"origin": "http://localhost:3000"}, {"origin": "https://app.example"},
                   {"sec-fetch-site": "cross-site"}, {"sec-fetch-site": "same-origin"}, {"sec-fetch-mode": "no-cors"}):
        error(await d.client.post("/v1/files", content=body, headers={**FORM, **marker}), 415,
              "unsupported_media_type")
    error(await d.client.post("/v1/files", content=body, headers={**FORM, "origin": "http://evil.example"}), 403,
          "origin_refused")
    for path in ("/v1/chat/completions", "/v1/batches", "/v1/files/file-" + "0" * 24, "/v1/sessions", "/api/chat"):
        r = await d.client.post(path, content=body, headers=FORM)
        assert r.status_code == 415 and "unsupported content type" in r.text, (path, r.text)
    assert on_disk(tmp_path) == []
    assert (await d.client.post("/v1/files", content=body, headers=FORM)).status_code == 200  # curl -F, the SDK


# -- malformed bodies -----------------------------------------------------------------------------------------------

async def test_a_malformed_upload_is_a_400_naming_it_without_a_traceback(serve: Any, tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    d = await serve()
    good_file = ("file", LINES, "a.jsonl")
    cases: list[tuple[bytes, dict[str, str], str | None]] = [
        (b"this is not multipart at all", FORM, None),
        (multipart(("purpose", b"batch", None), good_file)[:-20], FORM, None),   # no closing boundary
        (multipart(("purpose", b"batch", None), good_file), {"content-type": "multipart/form-data"}, None),
        (b"--" + BOUNDARY.encode() + b"\r\nX-Nothing: 1\r\n\r\nvalue\r\n--" + BOUNDARY.encode() + b"--\r\n", FORM,
         None),                                                                  # a part with no name
        (b"--" + BOUNDARY.encode() + b"\r\nBad Header\x01: 1\r\n\r\nv\r\n", FORM, None),
        (multipart(("purpose", b"batch", None)), FORM, "file"),
        (multipart(good_file), FORM, "purpose"),
        (multipart(("purpose", b"steal", None), good_file), FORM, "purpose"),
        (multipart(good_file, ("purpose", b"batch_output", None)), FORM, "purpose"),  # (the server's own)
        (multipart(("purpose", b"batch", None), good_file, good_file), FORM, "file"),
        (multipart(("purpose", b"batch" * 300, None), good_file), FORM, "purpose"),
        (json.dumps({"purpose": "batch", "file": "x"}).encode(), {"content-type": "application/json"}, "file"),
    ]
    with caplog.at_level(logging.DEBUG):
        for body, headers, param in cases:
            r = await d.client.post("/v1/files", content=body, headers=headers)
            err = error(r, 400, None, param)
            assert err["type"] == "invalid_request_error", err
    assert not [rec for rec in caplog.records if rec.exc_info or rec.levelno >= logging.ERROR]
    assert not [rec for rec in caplog.records if rec.name.startswith("python_multipart")]
    assert on_disk(tmp_path) == []
    error(await d.client.put("/v1/files", content=b"{}"), 405, None)
    error(await d.client.post("/v1/files/file-x/content", json={}), 405, None)
    for query in ("limit=0", "limit=10001", "limit=x", "order=up"):
        error(await d.client.get(f"/v1/files?{query}"), 400, None, query.partition("=")[0])


# -- on disk --------------------------------------------------------------------------------------------------------

async def test_a_reopened_store_lists_the_same_files_and_drops_what_a_crash_left(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    directory = tmp_path / "files"
    store = FileStore.open(directory, quota_bytes=0)

    async def chunks(*pieces: bytes) -> AsyncIterator[bytes]:
        await trio.lowlevel.checkpoint()
        for p in pieces:
            yield p

    kept = [await store.create("t", f"{i}.jsonl", "batch", chunks(b"x" * i, b"y")) for i in range(3)]
    gone = await store.create("t", "gone.jsonl", "batch", chunks(b"g"))
    assert await store.delete("t", gone.id) and not await store.delete("t", gone.id)
    assert not await store.delete("u", kept[0].id)  # another tenant's is unknown to it
    # what a crash leaves: an upload under way, a create cut between its renames, a delete cut halfway
    (directory / ".tmp-file-0123456789abcdef01234567").write_bytes(b"half an upload")
    (directory / ".tmp-file-0123456789abcdef01234567.json").write_bytes(b"{")
    (directory / "file-aaaaaaaaaaaaaaaaaaaaaaaa").write_bytes(b"data, no metadata")
    (directory / "file-bbbbbbbbbbbbbbbbbbbbbbbb.json").write_text(json.dumps({**kept[0]._record(),
                                                                              "id": "file-bbbbbbbbbbbbbbbbbbbbbbbb"}))
    (directory / "file-cccccccccccccccccccccccc").write_bytes(b"c")
    (directory / "file-cccccccccccccccccccccccc.json").write_bytes(b"not json")
    with caplog.at_level(logging.INFO, logger="superfluid.files"):
        again = FileStore.open(directory, quota_bytes=0)
    assert again.list("t") == store.list("t") == kept[::-1]
    assert [again.get("t", f.id) for f in kept] == kept and again.used_bytes("t") == store.used_bytes("t") == 6
    assert sorted(os.listdir(directory)) == sorted([f.id for f in kept] + [f.id + ".json" for f in kept])
    assert (directory / kept[2].id).read_bytes() == b"xxy"
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    for fid in ("file-aaaaaaaaaaaaaaaaaaaaaaaa", "file-bbbbbbbbbbbbbbbbbbbbbbbb", "file-cccccccccccccccccccccccc"):
        assert fid in warned


async def test_an_upload_that_fails_midway_leaves_nothing(tmp_path: Path) -> None:
    store = FileStore.open(tmp_path / "files", quota_bytes=0)

    async def broken() -> AsyncIterator[bytes]:
        await trio.lowlevel.checkpoint()
        yield b"x" * 100
        raise RuntimeError("the client's body broke")

    with pytest.raises(RuntimeError):
        await store.create("t", "a.bin", "batch", broken())
    with trio.move_on_after(0.01):
        await store.create("t", "b.bin", "batch", _forever())
    assert os.listdir(tmp_path / "files") == [] and store.used_bytes("t") == 0 and store.list("t") == []
    assert store._pending == {}


async def _forever() -> AsyncIterator[bytes]:
    yield b"y"
    await trio.sleep_forever()


# -- flags ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["--files-quota-gb", "-1"], ["--files-quota-gb", "inf"],
                                  ["--files-max-bytes", "-5"], ["--files-max-bytes", "0"]])
def test_a_negative_files_flag_is_one_line_and_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["serve", *argv])
    assert caught.value.code == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 1 and f"argument {argv[0]}:" in errors[0], errors
    args = build_parser().parse_args(["serve", "--files-quota-gb", "0", "--files-max-bytes", "1024"])
    assert (args.files_quota_gb, args.files_max_bytes) == (0.0, 1024)
