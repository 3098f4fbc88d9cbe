"""llama-server's ``GET /slots`` (api/_infill.py): each loaded model's lanes as slots."""

from __future__ import annotations

from functools import partial

import trio

from superfluid.serving import ApiKey

from .conftest import mock_config, open_daemon


async def test_slots_list_each_lane_busy_or_idle() -> None:
    async with open_daemon(mock_config("mock?step_ms=20&prefill_us=5", max_batch=3)) as d:
        c = d.client
        r = await c.get("/slots")
        assert r.status_code == 200, r.text
        rows = r.json()
        assert [row["id"] for row in rows] == [0, 1, 2]
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
                    if all(row["is_processing"] for row in rows) and all(
                            row["next_token"]["n_decoded"] > 0 for row in rows):
                        break
                    await trio.sleep(0.05)
            busy = rows[0]
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
        assert len(r.json()) == 4
        r = await d.client.get("/slots", headers={"authorization": "Bearer sk-none"})
        assert r.json() == []
        r = await d.client.get("/slots", params={"model": "mock"}, headers={"authorization": "Bearer sk-none"})
        assert r.status_code in (403, 404)
