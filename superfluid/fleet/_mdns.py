"""Finding the fleet's head on the LAN by mDNS (DNS-SD over multicast DNS, RFC 6762/6763).

The head advertises its fleet listener as :data:`SERVICE_TYPE` (:func:`advertise`, for as long
as the task runs); ``superfluid node join`` with no address browses for it (:func:`find_head`).
The wire work is python-zeroconf's; nothing here speaks DNS.

zeroconf runs its own asyncio loop in its own thread, and its synchronous API (``Zeroconf``,
``ServiceInfo``, ``ServiceBrowser``) blocks the calling thread, so from trio:

- every blocking call (opening the sockets, starting and stopping the browser, closing) goes
  through ``trio.to_thread.run_sync``; none runs on the trio thread;
- the two waits that may be cancelled midway, registering (probing and announcing, ~1.5 s) and
  resolving a found name, are zeroconf's own coroutines put on its loop
  (``asyncio.run_coroutine_threadsafe``, what its synchronous calls do inside) and waited for in a
  thread; a cancel cancels the coroutine there, so the waiting thread returns at once rather than
  outliving the call on a closed ``Zeroconf`` until its timeout;
- the browser's callbacks run in the browser's own thread and only hand the service's name to
  trio (``trio.from_thread.run_sync`` onto an unbounded memory channel); trio resolves it;
- whatever happens (found, timed out, cancelled, failed), the browser and the ``Zeroconf`` are
  closed in a thread, shielded, under a deadline (:data:`CLOSE_TIMEOUT_S`); past it the closing
  thread is abandoned rather than hanging the daemon's shutdown.

The service type is longer than RFC 6763's 15-byte limit on service names
(``superfluid-fleet`` is 16 bytes): zeroconf's browser takes it as it is, registering takes
``strict=False``. Both ends are this module.

Nursery tree (the head)::

    daemon nursery
    └── advertise(port)      registered until cancelled; then goodbye packets, close (<= CLOSE_TIMEOUT_S)
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import re
import socket
from collections.abc import Coroutine
from typing import Any, TypeVar

import ifaddr  # zeroconf's own dependency: the machine's interface addresses
import trio
import zeroconf
from zeroconf import IPVersion, ServiceBrowser, ServiceInfo, ServiceStateChange, Zeroconf

log = logging.getLogger(__name__)

__all__ = ["CLOSE_TIMEOUT_S", "SERVICE_TYPE", "DiscoveryError", "advertise", "find_head"]

SERVICE_TYPE = "_superfluid-fleet._tcp.local."
TXT = {"v": "1"}
CLOSE_TIMEOUT_S = 3.0     # unregistering (goodbye packets) and closing, at most
RESOLVE_TIMEOUT_S = 3.0   # one found name's SRV/TXT/A lookup, at most (less when the browse's time is shorter)
_ANY = {"", "0.0.0.0", "::"}
_MAX_LABEL = 63           # bytes in one DNS label (the instance name, the server's host label)

T = TypeVar("T")


class DiscoveryError(Exception):
    """mDNS could not advertise the head, or found none: one line, for the operator."""


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _short_hostname() -> str:
    return socket.gethostname().split(".")[0] or "host"


def _default_instance(port: int) -> str:
    tail = f"-{port}"
    host = _short_hostname().encode()[: _MAX_LABEL - len("superfluid-") - len(tail)].decode(errors="ignore")
    return f"superfluid-{host}{tail}"


def _host_label(instance: str) -> str:
    """The SRV target's label: the instance, made a host name. Not the machine's own ``<hostname>.local.``,
    which avahi or mDNSResponder may own with other addresses (a conflict would make them rename it)."""
    label = re.sub(r"[^A-Za-z0-9-]+", "-", instance).strip("-")[:_MAX_LABEL].strip("-")
    return label or "superfluid-head"


def _machine_ipv4() -> list[str]:
    """This machine's non-loopback IPv4 addresses, in interface order, once each (blocking: a thread)."""
    found: list[str] = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if ip.is_IPv4 and isinstance(ip.ip, str) and not ipaddress.ip_address(ip.ip).is_loopback \
                    and ip.ip not in found:
                found.append(ip.ip)
    return found


def _advertised_addresses(host: str, interfaces: list[str] | None) -> list[str]:
    """What the head's A/AAAA records say (blocking: a thread).

    ``host`` given (not a wildcard): that address. A wildcard: the IPv4 addresses among
    ``interfaces`` when it names some (``127.0.0.1`` included: a head on loopback for the
    machine's own nodes), else the machine's non-loopback IPv4 addresses; non-loopback first.
    """
    if host not in _ANY:
        try:
            return [str(ipaddress.ip_address(host))]
        except ValueError:
            pass
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise DiscoveryError(f"cannot advertise the fleet on mDNS: {host!r} does not resolve ({_one_line(exc)})") \
                from exc
        resolved: list[str] = []
        for info in infos:
            if (address := str(info[4][0])) not in resolved:
                resolved.append(address)
        return sorted(resolved, key=lambda a: ipaddress.ip_address(a).version)
    given: list[str] = []
    for entry in interfaces or ():
        try:
            address = ipaddress.ip_address(entry)
        except ValueError:
            continue
        if address.version == 4 and str(address) not in given:
            given.append(str(address))
    addresses = given or _machine_ipv4()
    if not addresses:
        raise DiscoveryError("cannot advertise the fleet on mDNS: this machine has no non-loopback IPv4 address; "
                             "give nodes the head's address: superfluid node join HOST:PORT")
    return sorted(addresses, key=lambda a: ipaddress.ip_address(a).is_loopback)


def _open_zeroconf(interfaces: list[str] | None) -> Zeroconf:
    """Zeroconf's sockets on 5353 and its loop thread (blocking: a thread)."""
    try:
        return Zeroconf() if interfaces is None else Zeroconf(interfaces=interfaces)
    except (OSError, ValueError, zeroconf.Error) as exc:
        where = "" if interfaces is None else f" on {', '.join(interfaces)}"
        raise DiscoveryError(f"mDNS (UDP port 5353) is unavailable{where}: {_one_line(exc)}") from exc


def _close(zc: Zeroconf, browser: ServiceBrowser | None = None) -> None:
    """Stop the browser (joins its thread), unregister every service (goodbye packets), close (blocking: a thread)."""
    try:
        if browser is not None:
            browser.cancel()
    finally:
        zc.close()


async def _on_zeroconf_loop(zc: Zeroconf, coro: Coroutine[Any, Any, T]) -> T:
    """Run one of zeroconf's coroutines on its loop, waited for in a thread; cancelled there on a cancel here."""
    assert zc.loop is not None
    future = asyncio.run_coroutine_threadsafe(coro, zc.loop)
    try:
        return await trio.to_thread.run_sync(future.result, abandon_on_cancel=True)
    finally:
        future.cancel()  # done: nothing; else the coroutine is cancelled and the abandoned thread returns


async def _register(zc: Zeroconf, info: ServiceInfo) -> None:
    """Probe for the name and announce it (zeroconf's loop)."""
    announced = await zc.async_register_service(info, allow_name_change=True, strict=False)
    await announced


def _closed_late() -> None:
    log.warning("mDNS did not close within %gs; its thread is left to finish", CLOSE_TIMEOUT_S)


async def advertise(port: int, *, host: str = "", instance: str = "", interfaces: list[str] | None = None,
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Advertise the head's fleet listener (``host``:``port``) as :data:`SERVICE_TYPE` until cancelled.

    ``host`` empty or a wildcard: this machine's non-loopback IPv4 addresses (``127.0.0.1`` too
    when ``interfaces`` names it); otherwise that address. ``instance`` empty:
    ``superfluid-<hostname>-<port>`` (zeroconf renames it on a conflict). ``interfaces``: the
    addresses zeroconf answers on (``None``: all). ``task_status.started()`` once registered
    (probed and announced, about 1.5 s).

    Raises:
        DiscoveryError: mDNS is unavailable (no usable interface, port 5353 taken) or refused the name.
    """
    addresses = await trio.to_thread.run_sync(_advertised_addresses, host, interfaces)
    name = instance or _default_instance(port)
    try:
        info = ServiceInfo(SERVICE_TYPE, f"{name}.{SERVICE_TYPE}", port=port, properties=TXT,
                           parsed_addresses=addresses, server=f"{_host_label(name)}.local.")
    except (ValueError, zeroconf.Error) as exc:
        raise DiscoveryError(f"cannot advertise the fleet on mDNS as {name!r}: {_one_line(exc)}") from exc
    zc = await trio.to_thread.run_sync(_open_zeroconf, interfaces)
    try:
        try:
            await _on_zeroconf_loop(zc, _register(zc, info))
        except (OSError, ValueError, zeroconf.Error) as exc:
            raise DiscoveryError(f"cannot advertise the fleet on mDNS as {name!r}: {_one_line(exc)}") from exc
        log.info("fleet head advertised on mDNS as %r at %s port %d", info.name, ", ".join(addresses), port)
        task_status.started()
        await trio.sleep_forever()
    finally:
        with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True) as closing:
            await trio.to_thread.run_sync(_close, zc, abandon_on_cancel=True)
        if closing.cancelled_caught:
            _closed_late()


def _pick_address(info: ServiceInfo) -> str | None:
    """IPv4 first, non-loopback before loopback; else IPv6 (scoped, for a link-local one)."""
    v4 = sorted(info.parsed_addresses(IPVersion.V4Only), key=lambda a: ipaddress.ip_address(a).is_loopback)
    v6 = info.parsed_scoped_addresses(IPVersion.V6Only)
    return (v4 or v6 or [None])[0]


async def _resolve(zc: Zeroconf, name: str, timeout_s: float) -> tuple[str, int] | None:
    """A found name's address and port (its SRV, TXT and A/AAAA records: from the cache, else asked for), or ``None``."""
    try:
        info = ServiceInfo(SERVICE_TYPE, name)
        complete = await _on_zeroconf_loop(zc, info.async_request(zc, max(1, int(timeout_s * 1000))))
    except (OSError, zeroconf.Error) as exc:
        log.debug("mDNS: resolving %r failed: %s", name, _one_line(exc))
        return None
    if not complete or not info.port:
        return None
    address = _pick_address(info)
    return None if address is None else (address, info.port)


async def find_head(*, timeout_s: float = 10.0, interfaces: list[str] | None = None) -> tuple[str, int]:
    """Browse for :data:`SERVICE_TYPE`; the ``(address, port)`` of the first head resolved.

    ``interfaces``: the addresses zeroconf browses on (``None``: all).

    Raises:
        DiscoveryError: no head within ``timeout_s``, or mDNS is unavailable.
    """
    send, receive = trio.open_memory_channel[str](math.inf)
    token = trio.lowlevel.current_trio_token()

    def deliver(name: str) -> None:   # the trio thread
        try:
            send.send_nowait(name)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass  # find_head has returned

    def on_change(zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        # the browser's thread: hand the name over, nothing blocking beyond that
        if state_change is ServiceStateChange.Removed:
            return
        try:
            trio.from_thread.run_sync(deliver, name, trio_token=token)
        except trio.RunFinishedError:
            pass

    def start() -> tuple[Zeroconf, ServiceBrowser]:   # a thread
        zc = _open_zeroconf(interfaces)
        try:
            return zc, ServiceBrowser(zc, SERVICE_TYPE, handlers=[on_change])
        except BaseException:
            zc.close()
            raise

    opened: tuple[Zeroconf, ServiceBrowser] | None = None
    try:
        with receive, trio.move_on_after(timeout_s):
            deadline = trio.current_effective_deadline()
            # not abandoned on cancel: opening takes milliseconds and what it opens must be closed
            opened = await trio.to_thread.run_sync(start)
            zc = opened[0]
            async for name in receive:
                budget = min(RESOLVE_TIMEOUT_S, max(0.0, deadline - trio.current_time()))
                found = await _resolve(zc, name, budget)
                if found is not None:
                    log.info("fleet head found on mDNS: %r at %s port %d", name, *found)
                    return found
                log.debug("mDNS: %r did not resolve to an address and port", name)
    finally:
        send.close()
        if opened is not None:
            with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True) as closing:
                await trio.to_thread.run_sync(_close, *opened, abandon_on_cancel=True)
            if closing.cancelled_caught:
                _closed_late()
    service = SERVICE_TYPE.removesuffix(".local.")
    raise DiscoveryError(f"no superfluid head answered on mDNS ({service}) within {timeout_s:g}s; "
                         "give its address: superfluid node join HOST:PORT")
