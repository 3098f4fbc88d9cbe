"""The fleet channel over real TCP on 127.0.0.1: Noise keyed by the token, records, lease, close, fencing."""

from __future__ import annotations

import os
import pathlib
import stat
import struct
from collections.abc import Awaitable, Callable

import pytest
import trio
from noise.connection import NoiseConnection

from superfluid.fleet._channel import (
    PROLOGUE,
    PROTOCOL_NAME,
    Channel,
    ChannelLost,
    HandshakeFailed,
    ensure_token,
    handshake,
    load_token,
    new_token,
    parse_token,
    token_path,
)

KEY = parse_token(new_token())
OTHER = parse_token(new_token())
LOCAL = "127.0.0.1"


async def _listen() -> tuple[trio.SocketListener, int]:
    listener = (await trio.open_tcp_listeners(0, host=LOCAL))[0]
    return listener, listener.socket.getsockname()[1]


async def _connect(client_key: bytes | None, server_key: bytes | None, *, lease_s: float = 6.0,
                   relay: Callable[[int], int] | None = None, timeout_s: float = 5.0,
                   ) -> tuple[Channel | BaseException, Channel | BaseException]:
    """(client, server): a channel each, or what its handshake raised."""
    listener, port = await _listen()
    out: dict[str, Channel | BaseException] = {}

    async def side(name: str, key: bytes | None, open_stream: Callable[[], Awaitable[trio.SocketStream]]) -> None:
        stream = await open_stream()
        try:
            out[name] = await handshake(stream, key, initiator=name == "client", lease_s=lease_s,
                                        timeout_s=timeout_s)
        except HandshakeFailed as exc:
            out[name] = exc

    async def dial() -> trio.SocketStream:
        return await trio.open_tcp_stream(LOCAL, relay(port) if relay else port)

    async with listener, trio.open_nursery() as nursery:
        nursery.start_soon(side, "server", server_key, listener.accept)
        nursery.start_soon(side, "client", client_key, dial)
    return out["client"], out["server"]


async def _pair(key: bytes | None = KEY, **kw: object) -> tuple[Channel, Channel]:
    client, server = await _connect(key, key, **kw)  # type: ignore[arg-type]
    assert isinstance(client, Channel) and isinstance(server, Channel), (client, server)
    return client, server


async def _pump(src: trio.SocketStream, dst: trio.SocketStream, log: bytearray, tamper_at: int | None) -> None:
    seen = 0
    try:
        while chunk := await src.receive_some(65536):
            data = bytearray(chunk)
            if tamper_at is not None and seen <= tamper_at < seen + len(data):
                data[tamper_at - seen] ^= 0x40
            seen += len(data)
            log += data
            await dst.send_all(data)
        await dst.send_eof()
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        await dst.aclose()


async def _relay(nursery: trio.Nursery, logs: dict[str, bytearray], tamper_at: int | None = None,
                 ) -> Callable[[int], int]:
    """A TCP relay that records every byte both ways; flips one client->server byte at ``tamper_at``."""
    listener, port = await _listen()

    async def serve(target: int) -> None:
        async with listener:
            a = await listener.accept()
        b = await trio.open_tcp_stream(LOCAL, target)
        async with a, b, trio.open_nursery() as pumps:
            pumps.start_soon(_pump, a, b, logs.setdefault("c2s", bytearray()), tamper_at)
            pumps.start_soon(_pump, b, a, logs.setdefault("s2c", bytearray()), None)

    def start(target: int) -> int:
        nursery.start_soon(serve, target)
        return port

    return start


async def _receive_exactly(channel: Channel, n: int) -> bytes:
    got = bytearray()
    while len(got) < n:
        chunk = await channel.receive_some()
        assert chunk, "clean end before the whole payload"
        got += chunk
    return bytes(got)


async def test_round_trip_both_ways() -> None:
    client, server = await _pair()
    assert client.peer is not None and client.peer[0] == LOCAL
    small = [f"message {i}".encode() * (i % 7 + 1) for i in range(300)]
    big = os.urandom(5 * 1024 * 1024)
    got: dict[str, bytes] = {}

    async def talk(me: Channel) -> None:
        for m in small:
            await me.send_all(m)
        await me.send_all(big)

    async def listen(ch: Channel, name: str) -> None:
        for m in small:
            assert await ch.receive_some() == m   # one small send, one record, one receive
        got[name] = await _receive_exactly(ch, len(big))

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(talk, client)
            nursery.start_soon(talk, server)
            nursery.start_soon(listen, server, "at server")
            nursery.start_soon(listen, client, "at client")
    assert got["at server"] == big and got["at client"] == big
    await client.aclose()
    assert await server.receive_some() == b""
    await server.aclose()


async def test_insecure_mode_round_trip() -> None:
    client, server = await _pair(None)
    await client.send_all(b"no auth, still sealed")
    assert await server.receive_some() == b"no auth, still sealed"
    await client.aclose()
    await server.aclose()


async def test_wrong_token_fails_both_sides() -> None:
    logs: dict[str, bytearray] = {}
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            client, server = await _connect(KEY, OTHER, relay=await _relay(nursery, logs))
    assert isinstance(client, HandshakeFailed) and isinstance(server, HandshakeFailed), (client, server)
    assert "authenticate" in str(server) and "\n" not in str(server)
    assert len(logs["c2s"]) == 2 + 32 + 16 and not logs["s2c"]   # message 1 only, no answer, no data


@pytest.mark.parametrize("client_key,server_key", [(KEY, None), (None, KEY)], ids=["psk-to-nn", "nn-to-psk"])
async def test_psk_side_meets_insecure_side(client_key: bytes | None, server_key: bytes | None) -> None:
    client, server = await _connect(client_key, server_key)
    assert isinstance(client, HandshakeFailed) and isinstance(server, HandshakeFailed), (client, server)


async def test_handshake_timeout_and_garbage() -> None:
    listener, port = await _listen()
    async with listener:
        silent = await trio.open_tcp_stream(LOCAL, port)
        with pytest.raises(HandshakeFailed, match="timed out after 0.2s"):
            await handshake(await listener.accept(), KEY, initiator=False, timeout_s=0.2)
        await silent.aclose()
        for garbage in (b"\x00\x00", b"\x00\x30" + b"GET / HTTP/1.1\r\n" * 3, b"\x00\x10short"):
            peer = await trio.open_tcp_stream(LOCAL, port)
            await peer.send_all(garbage)
            await peer.send_eof()
            with pytest.raises(HandshakeFailed):
                await handshake(await listener.accept(), KEY, initiator=False, timeout_s=2)
            assert await peer.receive_some() == b""   # the responder closed the connection
            await peer.aclose()


async def test_wire_carries_no_plaintext() -> None:
    logs: dict[str, bytearray] = {}
    marker = b"SUPERFLUID-PLAINTEXT-MARKER"
    payload = b"header " + marker + b" " + marker * 5000
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            client, server = await _pair(relay=await _relay(nursery, logs))
            await client.send_all(payload)
            assert await _receive_exactly(server, len(payload)) == payload
            await server.send_all(payload)
            assert await _receive_exactly(client, len(payload)) == payload
            await client.aclose()
            assert await server.receive_some() == b""
            await server.aclose()
    wire = bytes(logs["c2s"] + logs["s2c"])
    assert len(logs["c2s"]) > len(payload) and len(logs["s2c"]) > len(payload)
    for needle in (marker, marker[:12], KEY.hex().encode(), KEY, b"header "):
        assert needle not in wire


async def test_lease_expires_without_keepalive() -> None:
    client, server = await _pair(lease_s=0.3)
    start = trio.current_time()
    with trio.fail_after(3), pytest.raises(ChannelLost, match="lease expired"):
        await client.receive_some()
    assert 0.25 <= trio.current_time() - start < 1.5
    with pytest.raises(ChannelLost):
        await client.send_all(b"after the loss")
    await client.aclose()
    await server.aclose()


async def test_keepalive_holds_the_lease() -> None:
    client, server = await _pair(lease_s=0.3)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.keepalive)
        with trio.move_on_after(0.9) as idle:       # three leases, nothing but keepalives
            await client.receive_some()
        assert idle.cancelled_caught
        await server.send_all(b"still here")
        assert await client.receive_some() == b"still here"
        await server.aclose()                        # the keepalive task returns by itself
    assert await client.receive_some() == b""
    await client.aclose()


async def test_second_reader_is_busy() -> None:
    client, server = await _pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.receive_some)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.BusyResourceError):
            await client.receive_some()
        await server.send_all(b"x")
    await client.aclose()
    await server.aclose()


async def test_aclose_is_a_clean_end_and_idempotent() -> None:
    client, server = await _pair()
    await server.send_all(b"last words")
    await server.aclose()
    await server.aclose()
    assert await client.receive_some() == b"last words"
    assert await client.receive_some() == b""
    assert await client.receive_some() == b""
    with pytest.raises(ChannelLost):
        await server.send_all(b"after close")
    await client.aclose()


async def test_abort_fences_both_sides() -> None:
    client, server = await _pair()
    seen: dict[str, object] = {}

    async def pending_receive() -> None:
        with pytest.raises(ChannelLost):
            await client.receive_some()
        seen["own"] = trio.current_time()

    with trio.fail_after(2):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pending_receive)
            await trio.testing.wait_all_tasks_blocked()
            client.abort()
            try:
                seen["peer"] = await server.receive_some()
            except ChannelLost as exc:
                seen["peer"] = exc
    assert "own" in seen and (seen["peer"] == b"" or isinstance(seen["peer"], ChannelLost))
    with pytest.raises(ChannelLost):
        await client.send_all(b"fenced")
    await client.aclose()
    await server.aclose()


async def test_abort_ends_a_blocked_send() -> None:
    client, server = await _pair()                  # the server never reads: the client's send blocks
    with trio.fail_after(3):
        async with trio.open_nursery() as nursery:
            async def blocked_send() -> None:
                with pytest.raises(ChannelLost):
                    await client.send_all(b"z" * (64 * 1024 * 1024))

            nursery.start_soon(blocked_send)
            await trio.sleep(0.1)
            client.abort()
    await client.aclose()
    await server.aclose()


async def test_tampered_record_is_lost() -> None:
    logs: dict[str, bytearray] = {}
    # client -> server: message 1 (2 + 48 bytes), then the first record: flip a ciphertext byte in it
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            client, server = await _pair(relay=await _relay(nursery, logs, tamper_at=50 + 10))
            await client.send_all(b"x" * 100)
            with trio.fail_after(2), pytest.raises(ChannelLost, match="decrypt"):
                await server.receive_some()
            await client.aclose()
            await server.aclose()


async def _raw_initiator(port: int) -> tuple[trio.SocketStream, NoiseConnection]:
    """A hand-driven initiator: the handshake done, then the test writes frames itself."""
    stream = await trio.open_tcp_stream(LOCAL, port)
    noise = NoiseConnection.from_name(PROTOCOL_NAME)
    noise.set_prologue(PROLOGUE + b" psk")
    noise.set_psks(psk=KEY)
    noise.set_as_initiator()
    noise.start_handshake()
    message = bytes(noise.write_message())
    await stream.send_all(struct.pack(">H", len(message)) + message)
    header = await stream.receive_some(2)
    (length,) = struct.unpack(">H", header)
    noise.read_message(await stream.receive_some(length))
    assert noise.handshake_finished
    return stream, noise


@pytest.mark.parametrize("wire", ["zero-length", "torn-record", "eof-without-close", "unknown-type"])
async def test_bad_framing_is_lost(wire: str) -> None:
    listener, port = await _listen()
    async with listener, trio.open_nursery() as nursery:
        accepted: list[Channel] = []

        async def respond() -> None:
            accepted.append(await handshake(await listener.accept(), KEY, initiator=False))

        nursery.start_soon(respond)
        stream, noise = await _raw_initiator(port)
    server = accepted[0]
    good = noise.encrypt(b"\x00fine")
    await stream.send_all(struct.pack(">H", len(good)) + good)
    assert await server.receive_some() == b"fine"
    if wire == "zero-length":
        await stream.send_all(b"\x00\x00")
    elif wire == "torn-record":
        record = noise.encrypt(b"\x00" + b"y" * 100)
        await stream.send_all(struct.pack(">H", len(record)) + record[:40])
        await stream.send_eof()
    elif wire == "unknown-type":
        record = noise.encrypt(b"\x07what")
        await stream.send_all(struct.pack(">H", len(record)) + record)
    if wire in ("eof-without-close", "zero-length"):
        await stream.send_eof()
    with trio.fail_after(2), pytest.raises(ChannelLost):
        await server.receive_some()
    await stream.aclose()
    await server.aclose()


def test_parse_token() -> None:
    token = new_token()
    assert len(token) == 64 and token == token.lower() and parse_token(f"  {token}\n") == bytes.fromhex(token)
    for bad in ("", "ab" * 31, "ab" * 33, "zz" * 32, "ab" * 31 + " a"):
        with pytest.raises(ValueError, match="^fleet token: "):
            parse_token(bad)


def test_ensure_token_creates_a_private_file(tmp_path: pathlib.Path) -> None:
    home = tmp_path / "home"
    token = ensure_token(home)
    path = token_path(home)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert ensure_token(home) == token and parse_token(path.read_text()).hex() == token
    assert [p.name for p in path.parent.iterdir()] == ["token"]      # no temp file left behind
    path.write_text("not a token\n")
    with pytest.raises(ValueError, match="fleet token"):
        ensure_token(home)


def test_load_token(tmp_path: pathlib.Path) -> None:
    home = tmp_path
    assert load_token(None, home) is None
    token = ensure_token(home)
    assert load_token(None, home) == bytes.fromhex(token)
    assert load_token(token.upper(), home) == bytes.fromhex(token)
    other = home / "other-token"
    other.write_text(new_token())
    assert load_token(f"@{other}", home) == parse_token(other.read_text())
    assert load_token(str(other), home) == parse_token(other.read_text())
    for bad in ("abc", "@" + str(home / "missing"), "g" * 64):
        with pytest.raises(ValueError, match="^fleet token: "):
            load_token(bad, home)
