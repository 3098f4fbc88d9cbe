"""Stored responses: ``GET`` and ``DELETE /v1/responses/{id}`` (issue 47), with the
official openai SDK, per tenant, bounded."""

from __future__ import annotations

import httpx
import trio

from superfluid.api._responses import ResponseStore, _Stored
from superfluid.serving import ApiKey

from .conftest import mock_config, open_daemon


def _sdk(url: str) -> None:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    made = client.responses.create(model="mock", input="hi", max_output_tokens=8)
    got = client.responses.retrieve(made.id)
    assert got.id == made.id and got.output_text == made.output_text and got.status == made.status
    assert got.usage is not None and got.usage.output_tokens == made.usage.output_tokens
    streamed = list(client.responses.create(model="mock", input="hi", max_output_tokens=8, stream=True))[-1].response
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text
    assert client.responses.delete(made.id) is None
    for call in (client.responses.retrieve, client.responses.delete):
        try:
            call(made.id)
        except openai.NotFoundError as exc:
            assert exc.code == "response_not_found"
        else:
            raise AssertionError("a deleted response was found")
    # a deleted response cannot be continued either; one not stored is not found
    try:
        client.responses.create(model="mock", input="more", previous_response_id=made.id)
    except openai.BadRequestError as exc:
        assert exc.code == "previous_response_not_found"
    else:
        raise AssertionError("a deleted response was continued")
    unstored = client.responses.create(model="mock", input="hi", max_output_tokens=8, store=False)
    try:
        client.responses.retrieve(unstored.id)
    except openai.NotFoundError:
        pass
    else:
        raise AssertionError("a response made with store=false was stored")


async def test_the_openai_sdk_retrieves_and_deletes_a_response() -> None:
    async with open_daemon(mock_config()) as d:
        await trio.to_thread.run_sync(_sdk, d.url)
        assert (await d.client.put("/v1/responses/resp_x")).status_code == 405


async def test_another_key_sees_no_response_of_mine() -> None:
    keys = (ApiKey.from_secret("alice", "sk-alice"), ApiKey.from_secret("bob", "sk-bob"))
    async with open_daemon(mock_config(api_keys=keys)) as d:
        alice = httpx.AsyncClient(base_url=d.url, headers={"authorization": "Bearer sk-alice"})
        bob = httpx.AsyncClient(base_url=d.url, headers={"authorization": "Bearer sk-bob"})
        async with alice, bob:
            r = await alice.post("/v1/responses", json={"model": "mock", "input": "hi", "max_output_tokens": 8})
            rid = r.json()["id"]
            for method in ("GET", "DELETE"):
                r = await bob.request(method, f"/v1/responses/{rid}")
                assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
            assert (await alice.get(f"/v1/responses/{rid}")).json()["id"] == rid
            assert (await alice.delete(f"/v1/responses/{rid}")).json() == {"id": rid, "object": "response",
                                                                           "deleted": True}
            assert (await alice.get(f"/v1/responses/{rid}")).status_code == 404


def _item(tenant: str, size: int) -> _Stored:
    return _Stored("mock", [], tenant, {"id": "x"}, size)


def test_the_store_is_bounded_per_tenant_and_in_all() -> None:
    store = ResponseStore(limit=3, max_bytes=100, max_total_bytes=250)
    for i in range(5):
        store.put(f"a{i}", _item("a", 10))
    assert [store.get(f"a{i}") is not None for i in range(5)] == [False, False, True, True, True]
    assert store.usage("a") == (3, 30)
    store.put("a5", _item("a", 90))       # over a's bytes: its oldest go until it fits
    assert store.usage("a") == (2, 100) and store.get("a3") is None and store.get("a5") is not None
    store.put("b0", _item("b", 101))      # larger than a tenant may keep: not stored
    assert store.get("b0") is None and store.usage("b") == (0, 0)
    store.put("b1", _item("b", 80))
    store.put("c1", _item("c", 80))       # 250 in all: the oldest of anyone's goes
    assert store.get("a4") is None and store.usage("a") == (1, 90) and store.total_bytes == 250
    assert store.get("b1", "c") is None and not store.delete("b1", "c")   # another tenant's is unknown
    assert store.delete("b1", "b") and store.usage("b") == (0, 0) and store.total_bytes == 170
