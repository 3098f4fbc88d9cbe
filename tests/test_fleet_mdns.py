"""The fleet's mDNS discovery (fleet/_mdns.py), on real multicast DNS through python-zeroconf.

Where they run: on ``interfaces=["127.0.0.1"]``, so the tests keep their packets off the LAN and
find only this machine's heads, and need no multicast route. In the development container both
that and zeroconf's default (every interface: multicast out of eth0, looped back to the host)
find the head; there ``lo`` has no MULTICAST flag and carries mDNS all the same, zeroconf naming
it as the sending interface (``IP_MULTICAST_IF``).

When mDNS cannot be opened at all (no socket on 5353, no loopback interface), the tests skip
with the reason, and fail instead under ``SUPERFLUID_REQUIRE_REAL=1``.
"""

from __future__ import annotations

import os
import random
import re
import threading
from functools import partial

import pytest
import trio

from superfluid.fleet._mdns import SERVICE_TYPE, DiscoveryError, _open_zeroconf, advertise, find_head

REQUIRE_REAL = os.environ.get("SUPERFLUID_REQUIRE_REAL") == "1"
LOOPBACK = ["127.0.0.1"]
IDLE_TRIO_WORKER = re.compile(r"Trio thread \d+")  # trio's thread cache keeps idle workers ~10 s


@pytest.fixture
def mdns() -> None:
    """Skip (fail under ``SUPERFLUID_REQUIRE_REAL=1``) when zeroconf cannot open mDNS on loopback."""
    try:
        _open_zeroconf(LOOPBACK).close()
    except DiscoveryError as exc:
        why = f"real mDNS is unavailable on this machine: {exc}"
        if REQUIRE_REAL:
            pytest.fail(f"SUPERFLUID_REQUIRE_REAL=1 and {why}", pytrace=False)
        pytest.skip(why)


def busy_threads() -> set[str]:
    """Running threads, less trio's idle cached workers: zeroconf's loop and browser threads and
    any trio worker still inside a call (named after its function) count."""
    return {t.name for t in threading.enumerate() if not IDLE_TRIO_WORKER.fullmatch(t.name)}


@pytest.mark.usefixtures("mdns")
async def test_find_head_finds_an_advertised_head() -> None:
    port = random.randrange(20000, 60000)  # nothing listens: only the records are under test
    async with trio.open_nursery() as nursery:
        with trio.fail_after(5):  # probing and announcing take about 1.5 s
            await nursery.start(partial(advertise, port, instance=f"superfluid-test-{port}", interfaces=LOOPBACK))
        with trio.fail_after(5):
            address, found_port = await find_head(timeout_s=4, interfaces=LOOPBACK)
        assert found_port == port
        assert address == "127.0.0.1"
        nursery.cancel_scope.cancel()


@pytest.mark.usefixtures("mdns")
async def test_find_head_with_no_head_raises_within_its_timeout() -> None:
    start = trio.current_time()
    with pytest.raises(DiscoveryError) as caught:
        await find_head(timeout_s=1, interfaces=LOOPBACK)
    elapsed = trio.current_time() - start
    assert 1.0 <= elapsed < 2.0, elapsed
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("no superfluid head answered on mDNS (_superfluid-fleet._tcp) within 1s;")
    assert message.endswith("superfluid node join HOST:PORT")
    assert SERVICE_TYPE == "_superfluid-fleet._tcp.local."


@pytest.mark.usefixtures("mdns")
async def test_cancelled_find_head_returns_promptly_and_leaves_no_thread() -> None:
    before = busy_threads()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(find_head, interfaces=LOOPBACK))  # 10 s: only the cancel ends it
        await trio.sleep(0.3)          # browsing: zeroconf's loop and browser threads are up
        assert busy_threads() - before, "find_head started no zeroconf thread"
        cancelled_at = trio.current_time()
        nursery.cancel_scope.cancel()
    assert trio.current_time() - cancelled_at < 1.0
    with trio.move_on_after(1.0):  # a short grace for threads to unwind after their join
        while busy_threads() - before:
            await trio.sleep(0.02)
    assert not busy_threads() - before, f"threads left running: {sorted(busy_threads() - before)}"


async def test_advertise_on_a_missing_interface_is_a_discovery_error() -> None:
    with pytest.raises(DiscoveryError) as caught:
        await advertise(7777, interfaces=["203.0.113.77"])  # TEST-NET-3: on no interface of this machine
    assert "\n" not in str(caught.value)
    assert "203.0.113.77" in str(caught.value)
