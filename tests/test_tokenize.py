"""llama-server's ``POST /tokenize`` and ``POST /detokenize`` (api/_infill.py), and the worker-link
fields that carry a token's bytes (``Tokenize.ids``/``pieces``, ``Tokenized.pieces``)."""

from __future__ import annotations

import msgpack
import pytest

from superfluid.proto import Tokenize, Tokenized, from_wire, to_wire, tokenized_pieces
from superfluid.proto._events import TOKENIZED_PIECE
from superfluid.worker._mock import SPECIALS, MockEngine

from .conftest import REAL_GGUF, mock_config, open_daemon

ENGINE = MockEngine("mock", n_seq=4)


def test_link_fields_round_trip_and_stay_off_the_wire_unused() -> None:
    ask = Tokenize(req=1, segments=[], ids=[5, 6], pieces=True)
    assert from_wire(to_wire(ask), max_len=1 << 20) == ask
    answer = Tokenized(req=1, tokens=[5, 6], pieces=[b"a", b"\xc3"])
    assert from_wire(to_wire(answer), max_len=1 << 20) == answer
    # a plain tokenize is the same frame as before the fields existed (a peer that predates them reads it)
    assert msgpack.unpackb(to_wire(Tokenize(req=2, segments=[("x", False)])))[1].keys() == {
        "req", "segments", "add_special"}
    assert msgpack.unpackb(to_wire(Tokenized(req=2, tokens=[1])))[1].keys() == {"req", "tokens", "more"}
    # with bytes, an answer goes in smaller pieces, each id with its bytes
    n = TOKENIZED_PIECE // 8 + 3
    parts = tokenized_pieces(3, list(range(n)), [b"x"] * n)
    assert [len(p.tokens) for p in parts] == [n - 3, 3] and all(len(p.pieces) == len(p.tokens) for p in parts)


async def test_tokenize_and_detokenize_on_mock() -> None:
    async with open_daemon(mock_config()) as d:
        c = d.client
        r = await c.post("/tokenize", json={"content": "the model é"})
        assert r.status_code == 200, r.text
        ids = ENGINE.tokenize("the model é", add_special=False, parse_special=True)
        assert r.json() == {"tokens": ids}
        r = await c.post("/tokenize", json={"content": "the", "add_special": True, "model": "mock"})
        assert r.json()["tokens"][0] == SPECIALS["<s>"]
        # markers are parsed by default (as llama-server does), and not with parse_special: false
        r = await c.post("/tokenize", json={"content": "<|im_start|>"})
        assert r.json()["tokens"] == [SPECIALS["<|im_start|>"]]
        r = await c.post("/tokenize", json={"content": "<|im_start|>", "parse_special": False})
        assert SPECIALS["<|im_start|>"] not in r.json()["tokens"]
        # pieces: text where the bytes are UTF-8, else the byte values (é is two byte tokens here)
        r = await c.post("/tokenize", json={"content": " model é", "with_pieces": True})
        assert r.status_code == 200, r.text
        assert [t["piece"] for t in r.json()["tokens"]] == [" model", " ", [0xC3], [0xA9]]
        assert [t["id"] for t in r.json()["tokens"]] == ENGINE.tokenize(" model é", add_special=False,
                                                                        parse_special=True)

        r = await c.post("/detokenize", json={"tokens": ids})
        assert r.status_code == 200 and r.json() == {"content": "the model é"}
        r = await c.post("/detokenize", json={"tokens": []})
        assert r.json() == {"content": ""}

        for path, body, param in (("/tokenize", {}, "content"), ("/tokenize", {"content": 1}, "content"),
                                  ("/tokenize", {"content": "a", "with_pieces": "yes"}, "with_pieces"),
                                  ("/detokenize", {"tokens": "abc"}, "tokens"),
                                  ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
                                  ("/detokenize", {"tokens": [-1]}, "tokens"),
                                  ("/detokenize", {"tokens": [1.5]}, "tokens")):
            r = await c.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)
        r = await c.post("/tokenize", json={"content": "a", "model": "nope"})
        assert r.status_code == 404
        r = await c.get("/tokenize")
        assert r.status_code == 405


async def test_tokenize_is_bounded_by_the_prompt_limit() -> None:
    async with open_daemon(mock_config()) as d:
        limit = 1 << 20   # the mock's window of 4,096 asks for the floor (api/_lane.py PROMPT_BYTES_FLOOR)
        for pieces in (False, True):
            r = await d.client.post("/tokenize", json={"content": "a" * (limit + 1), "with_pieces": pieces})
            assert r.status_code == 413 and r.json()["error"]["code"] == "prompt_too_large", r.text


@pytest.mark.real
async def test_tokenize_round_trip_on_smollm2() -> None:
    from .test_real_daemon import real_config

    async with open_daemon(real_config(REAL_GGUF, "smol", max_batch=1)) as d:
        text = "def add(a, b):\n    return a + b  # ünïcode"
        r = await d.client.post("/tokenize", json={"content": "<|im_start|>" + text, "with_pieces": True})
        assert r.status_code == 200, r.text
        tokens = r.json()["tokens"]
        assert tokens[0] == {"id": 1, "piece": "<|im_start|>"}   # SmolLM2's marker, parsed
        r = await d.client.post("/detokenize", json={"tokens": [t["id"] for t in tokens]})
        assert r.json()["content"] == "<|im_start|>" + text
