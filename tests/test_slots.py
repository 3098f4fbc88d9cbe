"""llama-server's ``GET /slots`` (api/_infill.py): each loaded model's lanes as slots."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from superfluid.proto import DAEMON, WORKER, LocalProtocolError, SlotAction, SlotDone, Tokenize

from superfluid.serving import ApiKey

from .conftest import mock_config, open_daemon
from .test_proto import LinkPair


async def test_slots_list_each_lane_busy_or_idle() -> None:
    async with open_daemon(mock_config("mock?step_ms=20&prefill_us=5", max_batch=3)) as d:
        c = d.client
        r = await c.get("/slots")
        assert r.status_code == 200, r.text
        rows = r.json()
        assert [row["id"] for row in rows] == [0, 1, 2, 3, 4]   # 3 lanes' sequences and 2 spares (n_seq)
        assert not any(row["is_processing"] for row in rows)
        assert all(row["model"] == "mock" and row["n_ctx"] > 0 and row["id_task"] == -1 for row in rows)
        assert (await c.get("/slots", params={"model": "mock"})).json() == rows
        assert (await c.get("/slots", params={"model": "nope"})).status_code == 404
        assert (await c.get("/slots", params={"fail_on_no_slot": "1"})).status_code == 200
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                body = {"model": "mock", "prompt": "count", "max_tokens": 400, "ignore_eos": True}
                nursery.start_soon(partial(c.post, "/v1/completions", json=body))
            with trio.fail_after(20):
                while True:
                    rows = (await c.get("/slots")).json()
                    running = [row for row in rows if row["is_processing"]]
                    if len(running) == 3 and all(row["next_token"]["n_decoded"] > 0 for row in running):
                        break
                    await trio.sleep(0.05)
            busy = running[0]
            assert busy["id_task"] >= 0 and busy["params"]["n_predict"] == 400
            assert 0 < busy["next_token"]["n_remain"] < 400
            r = await c.get("/slots", params={"fail_on_no_slot": "1"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_slot_available"
            nursery.cancel_scope.cancel()
        assert (await c.post("/slots", json={})).status_code == 405


async def test_slots_tell_a_key_only_its_models() -> None:
    keys = (ApiKey.from_secret("all", "sk-all"), ApiKey.from_secret("none", "sk-none", models=("other",)))
    async with open_daemon(mock_config(api_keys=keys)) as d:
        assert (await d.client.get("/slots")).status_code == 401
        r = await d.client.get("/slots", headers={"authorization": "Bearer sk-all"})
        assert len(r.json()) == 6   # n_seq: 4 lanes and 2 spares
        r = await d.client.get("/slots", headers={"authorization": "Bearer sk-none"})
        assert r.json() == []
        r = await d.client.get("/slots", params={"model": "mock"}, headers={"authorization": "Bearer sk-none"})
        assert r.status_code in (403, 404)


async def _slot(c: Any, seq: int, action: str, filename: str | None = None, **headers: str) -> Any:
    body = {} if filename is None else {"filename": filename}
    return await c.post(f"/slots/{seq}", params={"action": action}, json=body, headers=headers)


async def _completion(c: Any, prompt: str) -> tuple[str, int]:
    r = await c.post("/v1/completions", json={"model": "mock", "prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


async def _save_held(c: Any, filename: str) -> dict[str, Any]:
    """Save whichever slot holds the finished request's tokens (the worker picked the sequence)."""
    saved = []
    for seq in [row["id"] for row in (await c.get("/slots")).json()]:
        r = await _slot(c, seq, "save", filename)
        if r.status_code == 200:
            saved.append(r.json())
        else:
            assert r.status_code == 400 and r.json()["error"]["code"] == "slot_empty", r.text
    assert len(saved) == 1, saved
    return saved[0]


PROMPT = " ".join(["the lighthouse keeper counts the waves"] * 5)   # under PARK_MIN_TOKENS: never parked itself


async def test_a_saved_slot_restores_in_a_fresh_daemon_with_the_same_text(tmp_path: Path) -> None:
    config = mock_config(sessions=tmp_path / "s", park=True, park_budget_gb=0.01, max_batch=2)
    with trio.fail_after(60):
        async with open_daemon(config) as d:
            c = d.client
            text, _ = await _completion(c, PROMPT)
            saved = await _save_held(c, "keeper.bin")
            assert saved["filename"] == "keeper.bin" and saved["n_saved"] > 0 and saved["n_written"] > 0
            path = tmp_path / "s" / "park" / "slots" / "keeper.bin"
            assert path.is_file() and path.stat().st_mode & 0o777 == 0o600
            for filename in ("../x", "a/b", "", ".", "x" * 129, 7):
                r = await _slot(c, 0, "save", filename)   # type: ignore[arg-type]
                err = r.json()["error"]
                assert r.status_code == 400 and err["code"] == "invalid_filename" and err["param"] == "filename", (
                    filename, r.text)
            r = await _slot(c, 0, "launch", "keeper.bin")
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_action"
            r = await _slot(c, 9, "erase")
            assert r.status_code == 404 and r.json()["error"]["code"] == "slot_not_found"
            r = await _slot(c, 0, "restore", "nothing.bin")
            assert r.status_code == 404 and r.json()["error"]["code"] == "slot_file_not_found"
        async with open_daemon(config) as d:   # a fresh daemon: an empty KV, the file on disk
            c = d.client
            r = await _slot(c, 1, "restore", "keeper.bin")
            assert r.status_code == 200, r.text
            assert r.json()["n_restored"] == saved["n_saved"] and r.json()["n_read"] > 0
            again, cached = await _completion(c, PROMPT)
            assert again == text and cached > 0
            erased = []
            for seq in range(2):
                r = await _slot(c, seq, "erase")
                assert r.status_code == 200 and r.json()["id_slot"] == seq
                erased.append(r.json()["n_erased"])
            assert max(erased) > 0
            r = await _slot(c, 1, "erase")
            assert r.json()["n_erased"] == 0   # nothing left to erase
        other = mock_config("mock?step_ms=1&prefill_us=6", sessions=tmp_path / "s", park=True,
                            park_budget_gb=0.01, max_batch=2)
        async with open_daemon(other) as d:   # another model file: its park identity differs
            r = await _slot(d.client, 0, "restore", "keeper.bin")
            assert r.status_code == 409 and r.json()["error"]["code"] == "slot_foreign", r.text


async def test_the_ids_get_slots_lists_are_the_ids_slot_actions_take(tmp_path: Path) -> None:
    """One id space: a slot's ``id`` in GET /slots is the sequence POST /slots/{id} acts on. A
    finished request's tokens are in exactly one listed slot; saved from it and restored into
    another listed one (the last: a spare sequence, past the lanes), that slot serves the prompt
    cached, and a request continuing what it holds runs in it: GET shows that id processing, and a
    restore or an erase of it is 409 slot_busy while the others erase. An id not listed is 404
    slot_not_found for every action."""
    config = mock_config("mock?step_ms=20&prefill_us=5", sessions=tmp_path / "s", park=True,
                         park_budget_gb=0.01, max_batch=2)
    with trio.fail_after(60):
        async with open_daemon(config) as d:
            c = d.client
            ids = [row["id"] for row in (await c.get("/slots")).json()]
            assert ids == list(range(len(ids))) and len(ids) > 2   # the lanes' sequences and the spares
            text, _ = await _completion(c, PROMPT)
            held = []
            for seq in ids:
                r = await _slot(c, seq, "save", "held.bin")
                if r.status_code == 200:
                    held.append(seq)
                else:
                    assert r.status_code == 400 and r.json()["error"]["code"] == "slot_empty", r.text
            assert len(held) == 1   # the request's tokens are in one listed slot
            for seq in ids:
                assert (await _slot(c, seq, "erase")).status_code == 200
            spare = ids[-1]
            r = await _slot(c, spare, "restore", "held.bin")
            assert r.status_code == 200 and r.json()["id_slot"] == spare, r.text
            again, cached = await _completion(c, PROMPT)
            assert again == text and cached > 0
            async with trio.open_nursery() as nursery:   # a prompt continuing the spare's KV runs there
                body = {"model": "mock", "prompt": PROMPT + again + " and on", "max_tokens": 400, "ignore_eos": True}
                nursery.start_soon(partial(c.post, "/v1/completions", json=body))
                while not (running := [row for row in (await c.get("/slots")).json() if row["is_processing"]]):
                    await trio.sleep(0.02)
                assert [row["id"] for row in running] == [spare], running
                for action, filename in (("erase", None), ("restore", "held.bin")):
                    r = await _slot(c, spare, action, filename)
                    assert r.status_code == 409 and r.json()["error"]["code"] == "slot_busy", (action, r.text)
                for other in ids[:-1]:
                    assert (await _slot(c, other, "erase")).status_code == 200
                nursery.cancel_scope.cancel()
            for action, filename in (("save", "x.bin"), ("restore", "held.bin"), ("erase", None)):
                r = await _slot(c, len(ids), action, filename)
                assert r.status_code == 404 and r.json()["error"]["code"] == "slot_not_found", (action, r.text)


async def test_a_slot_saved_for_one_tenant_does_not_restore_for_another(tmp_path: Path) -> None:
    keys = (ApiKey.from_secret("boss", "sk-boss", admin=True), ApiKey.from_secret("boss2", "sk-boss2", admin=True),
            ApiKey.from_secret("user", "sk-user"))   # a key is its own tenant
    config = mock_config(sessions=tmp_path / "s", park=True, park_budget_gb=0.01, max_batch=2, api_keys=keys)
    async with open_daemon(config) as d:
        c = d.client
        r = await c.post("/v1/completions", json={"model": "mock", "prompt": PROMPT, "max_tokens": 4},
                         headers={"authorization": "Bearer sk-boss"})
        assert r.status_code == 200, r.text
        r = await _slot(c, 0, "save", "t.bin", authorization="Bearer sk-user")
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_required"
        r = await _slot(c, 0, "erase", authorization="Bearer sk-user")
        assert r.status_code == 403
        for seq in range(2):
            await _slot(c, seq, "save", "t.bin", authorization="Bearer sk-boss")
        assert (tmp_path / "s" / "park" / "slots" / "t.bin").is_file()
        for seq in range(2):
            assert (await _slot(c, seq, "erase", authorization="Bearer sk-boss")).status_code == 200
        r = await _slot(c, 0, "restore", "t.bin", authorization="Bearer sk-boss2")
        assert r.status_code == 409 and r.json()["error"]["code"] == "slot_foreign", r.text
        r = await _slot(c, 0, "restore", "t.bin", authorization="Bearer sk-boss")
        assert r.status_code == 200, r.text


async def test_slot_files_need_park() -> None:
    async with open_daemon(mock_config()) as d:
        r = await _slot(d.client, 0, "save", "x.bin")
        assert r.status_code == 501 and r.json()["error"]["code"] == "slots_unavailable"
        assert (await _slot(d.client, 0, "erase")).status_code == 200   # erase needs no file
        assert (await d.client.get("/slots/0")).status_code == 405


def test_slot_messages_round_trip_and_are_tracked_like_tokenize() -> None:
    p = LinkPair()
    p.handshake()
    with pytest.raises(LocalProtocolError):   # no answer to a request never made
        p.worker.send(SlotDone(req=1))
    p.send(DAEMON, SlotAction(req=1, action="save", seq=0, filename="a.bin"))
    with pytest.raises(LocalProtocolError):   # one pending request per id (shared with the tokenizes)
        p.daemon.send(Tokenize(req=1, segments=[("x", False)]))
    p.send(WORKER, SlotDone(req=1, tokens=3, nbytes=12))
    with pytest.raises(LocalProtocolError):   # answered once
        p.worker.send(SlotDone(req=1))
    with pytest.raises(ValueError):
        SlotAction(req=2, action="load", seq=0)


def test_the_worker_refuses_a_slot_file_name_that_is_a_path(tmp_path: Path) -> None:
    """The worker checks the name too (the daemon does first): nothing outside ``slots/`` is written or read."""
    from .test_park import executor, run, store

    ex = executor(store(tmp_path), n_seq=2)
    run(ex, list(range(1, 40)))
    for name in ("../escape", "/etc/passwd", "..", "a/b", ""):
        for action in ("save", "restore"):
            assert ex.slot_action(action, 0, name, "")[:2] == (400, "invalid_filename"), (action, name)
    assert not (tmp_path / "escape").exists()
    assert ex.slot_action("save", 0, "ok.bin", "")[0] == 0


@pytest.mark.real
async def test_real_model_a_saved_slot_restored_in_a_fresh_daemon_continues_the_same(tmp_path: Path) -> None:
    """SmolLM2 on llama.cpp: a slot saved by one daemon and restored into a fresh one (llama.cpp's
    per-sequence state, read back from disk) serves the prompt as cached KV with the same greedy text."""
    import attrs

    from .conftest import REAL_GGUF
    from .test_real_daemon import real_config

    config = attrs.evolve(real_config(REAL_GGUF, "smol", max_batch=1, max_context=1024),
                          sessions=tmp_path / "s", park=True, park_budget_gb=0.5)
    prompt = "Here is a short story about a lighthouse keeper and the sea. " * 30   # exact mode reuses whole cells

    async def complete(c: Any) -> tuple[str, int]:
        r = await c.post("/v1/completions", json={"model": "smol", "prompt": prompt, "max_tokens": 16,
                                                  "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        return body["choices"][0]["text"], (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    with trio.fail_after(120):
        async with open_daemon(config) as d:
            cold, _ = await complete(d.client)
            r = await _slot(d.client, 0, "save", "smol.slot")
            assert r.status_code == 200 and r.json()["n_saved"] > 256, r.text
        fresh = tmp_path / "s2" / "park" / "slots"   # another sessions directory: no park of the turn itself
        fresh.mkdir(parents=True)
        (fresh / "smol.slot").write_bytes((tmp_path / "s" / "park" / "slots" / "smol.slot").read_bytes())
        async with open_daemon(attrs.evolve(config, sessions=tmp_path / "s2")) as d:
            r = await _slot(d.client, 0, "restore", "smol.slot")
            assert r.status_code == 200, r.text
            warm, cached = await complete(d.client)
            assert cached > 256 and warm == cold


def test_a_running_lanes_slot_saves_its_kv_so_far_and_is_not_restored_over_or_erased(tmp_path: Path) -> None:
    from superfluid.proto import Admit, Sampling

    from .test_park import executor, store

    ex = executor(store(tmp_path), n_seq=2)
    prompt = list(range(1, 60))
    ex.admit(Admit(lane=0, tokens=prompt, n_prompt=len(prompt), max_new=50, sampling=Sampling(temperature=0.0)))
    ex.step(prefill_budget=512)
    ex.step(prefill_budget=512)
    [lane] = ex.lanes.values()
    status, _, _, tokens, nbytes = ex.slot_action("save", lane.seq, "live.bin", "")
    assert status == 0 and tokens == lane.n_past > len(prompt) - 1 and nbytes > 0
    for action in ("restore", "erase"):
        assert ex.slot_action(action, lane.seq, "live.bin", "")[:2] == (409, "slot_busy"), action
    other = 1 - lane.seq
    assert ex.slot_action("restore", other, "live.bin", "")[:4] == (0, "", "", tokens)
    assert ex.slots[other].held == lane.tokens[:tokens]
