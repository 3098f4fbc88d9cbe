"""The worker link's embedding pair, ``Embed``/``Embedded`` (SPEC.md §3): wire form,
validation, pieces under the frame limit, and the link tracking requests like tokenize."""

from __future__ import annotations

import struct

import pytest

from superfluid.proto import (
    DAEMON, EMBEDDED_PIECE_BYTES, WORKER, Embed, Embedded, LocalProtocolError, RemoteProtocolError,
    embedded_pieces, from_wire, to_wire,
)

from .test_proto import LinkPair, frame, receive_and_get


def vec(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


@pytest.mark.parametrize("message", [
    Embed(req=1, inputs=[(1, 2, 3)]),
    Embed(req=9, inputs=[(1,), (4, 5, 6, 7)], normalize=False),
    Embedded(req=1, dim=2, vectors=[vec(0.6, 0.8), vec(1.0, 0.0)]),
    Embedded(req=1, dim=3, vectors=[vec(1, 2, 3)], more=True),
    Embedded(req=2, error="input 0 has 9000 tokens; the window is 4096"),
])
def test_embed_messages_round_trip(message: object) -> None:
    assert from_wire(to_wire(message), max_len=1 << 24) == message  # type: ignore[arg-type]


@pytest.mark.parametrize("build", [
    lambda: Embed(req=1, inputs=[]),
    lambda: Embed(req=1, inputs=[()]),
    lambda: Embed(req=1, inputs=[(1, -2)]),
    lambda: Embed(req=-1, inputs=[(1,)]),
    lambda: Embedded(req=1, dim=3, vectors=[vec(1, 2)]),
])
def test_bad_embed_messages_are_refused(build: object) -> None:
    with pytest.raises(ValueError):
        build()  # type: ignore[operator]


def test_a_wrong_typed_embed_from_the_peer_is_a_protocol_error() -> None:
    p = LinkPair()
    p.handshake()
    with pytest.raises(RemoteProtocolError):
        receive_and_get(p.worker, frame(Embed.code, {"req": 1, "inputs": [["a"]]}))


def test_embedded_pieces_stay_under_the_frame_limit() -> None:
    dim = 4096
    vectors = [vec(*([float(i)] * dim)) for i in range(600)]  # 9.4 MiB of vectors
    pieces = embedded_pieces(5, dim, vectors)
    assert len(pieces) == 3 and [p.more for p in pieces] == [True, True, False]
    assert all(len(to_wire(p)) < EMBEDDED_PIECE_BYTES + 65536 for p in pieces)
    assert [v for p in pieces for v in p.vectors] == vectors
    assert embedded_pieces(5, 8, []) == [Embedded(req=5, dim=8, vectors=(), more=False)]


def test_embed_round_trips_and_is_tracked_like_tokenize() -> None:
    p = LinkPair()
    p.handshake()
    with pytest.raises(LocalProtocolError):  # no answer to a request never made
        p.worker.send(Embedded(req=1, dim=1, vectors=[vec(1.0)]))
    p.send(DAEMON, Embed(req=1, inputs=[(1, 2)]))
    with pytest.raises(LocalProtocolError):  # one pending request per id
        p.daemon.send(Embed(req=1, inputs=[(1, 2)]))
    p.send(WORKER, Embedded(req=1, dim=1, vectors=[vec(1.0)], more=True))
    p.send(WORKER, Embedded(req=1, dim=1, vectors=[vec(0.5)]))
    with pytest.raises(LocalProtocolError):  # answered: no more pieces
        p.worker.send(Embedded(req=1, dim=1, vectors=[vec(1.0)]))
    p.send(DAEMON, Embed(req=1, inputs=[(3,)]))  # the id may be used again
    p.send(WORKER, Embedded(req=1, error="no"))
