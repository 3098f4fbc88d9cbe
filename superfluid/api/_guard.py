"""The guard every HTTP and WebSocket request passes before routing.

A loopback daemon is reachable from every web page the user opens: a page can
send "simple" cross-origin requests (no preflight) and, by DNS rebinding, even
read the answers. So, in this order (``Guard.admit``):

1. **Host.** Exactly one ``Host``. A loopback listener answers only to a
   loopback name (``localhost``, ``*.localhost``, ``127.0.0.0/8``, ``[::1]``,
   any port); a keyless non-loopback listener only to an IP literal,
   ``localhost`` or this machine's hostname (full, short, ``<short>.local``);
   a keyed server to any Host. ``--allowed-host`` adds names. 403 ``host_refused``.
2. **Origin.** None is fine (not a browser). One that is present must be a
   page on this machine (``http(s)://`` + a loopback name, any port) or listed
   in ``--web-origin`` / ``SUPERFLUID_ORIGINS`` (``*``: any); ``null`` and a
   duplicate are refused. 403 ``origin_refused``; a WebSocket is closed before
   it is accepted (the client sees HTTP 403).
3. ``OPTIONS`` (a CORS preflight) is answered here, before any key is asked
   for: browsers send none on a preflight.
4. **Key** (``api/_principal.py``): 401 ``invalid_api_key``.
5. **Rate** (``--rate-limit``, a key's ``rate_limit_rpm``): 429
   ``rate_limit_exceeded`` with ``Retry-After``; ``/health`` and ``/metrics`` exempt.
6. **Content type** of a POST: JSON, none, form-urlencoded from a
   non-browser (``curl -d``), or ``multipart/form-data`` to ``/v1/files`` from
   a non-browser (an upload: ``curl -F``, the openai SDK); anything else is 415
   ``unsupported_media_type``. A browser page can POST ``text/plain``, multipart
   and form bodies without a preflight; the preflight that any other type
   forces is what the Origin check answers. A non-browser is a request with no
   ``Origin``, ``Sec-Fetch-Site`` or ``Sec-Fetch-Mode``: browsers send one of
   them with every cross-site POST. A multipart upload is refused from every
   browser page, those of a ``--web-origin`` and of this machine included:
   the guard cannot tell a page that may upload from one that may only read, so
   no page uploads (tests/test_files.py::test_browser_multipart_is_refused_everywhere).
7. **Admin routes** need an admin key: 403 ``admin_required``.

A WebSocket pays the rate once per op as well (``Guard.charge``). A key's
``max_concurrent`` is not counted here but where a generation is admitted
(``Guard.slots``, ``api/_admission.py``), for as long as the generation runs.
"""

from __future__ import annotations

import ipaddress
import math
import re
import socket
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import trio

from ._admission import Slots
from ._http import ApiError, Send
from ._principal import ANONYMOUS, PRINCIPAL, Principal, authenticate, presented_key
from ._ui import ui_public

if TYPE_CHECKING:
    from ..serving import ServeConfig

__all__ = ["Guard", "RateLimited", "exposure_refusal", "is_loopback_listener", "parse_allowed_host",
           "parse_web_origin", "peer_of", "refusal_headers"]

_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
_PORT = re.compile(r"[0-9]{1,5}")
_ORIGIN = re.compile(r"(https?)://([^/?#]*)", re.IGNORECASE)

# Response headers our clients may read, and request headers a preflight may ask for.
_EXPOSED = b"x-superfluid-session, x-superfluid-conversation, x-superfluid-warm, retry-after"
_ALLOWED_HEADERS = frozenset({"authorization", "content-type", "x-api-key", "anthropic-version", "anthropic-beta",
                              "openai-organization", "openai-project", "openai-beta"})
_ALLOWED_PREFIXES = ("x-superfluid-", "x-stainless-")  # ours; the openai and anthropic SDKs'
_METHODS = b"GET, POST, PATCH, DELETE, OPTIONS"
_PREFLIGHT_MAX_AGE = b"600"

_RATE_EXEMPT = frozenset({"/health", "/metrics", "/v1/metrics", "/ui/lanes"})  # the page's live view polls the last two
_ADMIN_ANY_METHOD = frozenset({"/api/pull", "/api/push", "/api/create", "/api/copy", "/api/delete"})
_MODEL_PATH = re.compile(r"/v1/models/.+")
_SLOT_PATH = re.compile(r"/slots/[^/]+")   # llama-server's slot actions: another lane's KV, files on disk

MAX_BUCKETS = 4096  # rate-limit buckets kept; the least recently used beyond this are dropped


@attrs.frozen
class RateLimited(ApiError):
    """429 ``rate_limit_exceeded``; ``retry_after`` seconds go in ``Retry-After``."""

    retry_after: int = 1


def refusal_headers(refusal: ApiError) -> list[tuple[bytes, bytes]] | None:
    """Headers of the answer to a refusal: ``Retry-After`` for a rate limit."""
    return [(b"retry-after", str(refusal.retry_after).encode())] if isinstance(refusal, RateLimited) else None


def _refuse(status: int, message: str, code: str) -> ApiError:
    return ApiError(status, message, code=code, type="permission_error")


def _authority(value: str) -> tuple[str, int | None] | None:
    """``host[:port]`` (a Host header, an Origin's authority) as (lower-case host,
    port); None if it is not one: a user part, a path, a port outside 1..65535."""
    value = value.lower()
    if value.startswith("["):
        host, sep, rest = value.partition("]")
        host += sep
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return None
    else:
        host, sep, port = value.partition(":")
        rest = sep + port
        if _NAME.fullmatch(host) is None:
            return None
    if not rest:
        return host, None
    if not rest.startswith(":") or _PORT.fullmatch(rest[1:]) is None or not 1 <= int(rest[1:]) <= 65535:
        return None
    return host, int(rest[1:])


def _ipv4(host: str) -> ipaddress.IPv4Address | None:
    try:
        return ipaddress.IPv4Address(host)
    except ValueError:
        return None


def _is_loopback_name(host: str) -> bool:
    if host == "localhost" or host.endswith(".localhost") or host == "[::1]":
        return True
    ip = _ipv4(host)
    return ip is not None and ip.is_loopback


def is_loopback_listener(host: str) -> bool:
    """Whether a bind address (``ServeConfig.host``) listens on loopback only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_refusal(config: ServeConfig) -> str | None:
    """Why the daemon must not start as configured: a non-loopback bind with no
    key and no ``--insecure-no-auth``; None if it may."""
    if is_loopback_listener(config.host) or config.api_keys or config.insecure_no_auth:
        return None
    return (f"refusing to serve {config.host} (not loopback) with no API key: set --api-key or --key-policy, "
            "or pass --insecure-no-auth to let anyone on the network use it")


def parse_web_origin(value: str) -> str:
    """A ``--web-origin`` as compared with a request's Origin: ``*``, or
    ``http(s)://host[:port]`` in lower case. Raises ValueError for anything else."""
    value = value.strip().rstrip("/")
    if value == "*":
        return value
    m = _ORIGIN.fullmatch(value)
    if m is None or _authority(m.group(2)) is None:
        raise ValueError(f"invalid web origin {value!r}: expected * or http(s)://HOST[:PORT] with no path")
    return value.lower()


def parse_allowed_host(value: str) -> str:
    """An ``--allowed-host`` NAME (compared with a Host's name, any port), in
    lower case. Raises ValueError for anything but a host name or IP."""
    parsed = _authority(value.strip())
    if parsed is None or parsed[1] is not None:
        raise ValueError(f"invalid --allowed-host {value!r}: expected a host name or IP, with no port")
    return parsed[0]


def _machine_names(hostname: str) -> frozenset[str]:
    full = hostname.lower().rstrip(".")
    short = full.split(".")[0]
    return frozenset(n for n in (full, short, f"{short}.local") if n)


def _values(scope: dict[str, Any], name: bytes) -> list[str]:
    return [v.decode("latin-1").strip() for k, v in scope.get("headers", ()) if k.lower() == name]


class _Buckets:
    """Token buckets of ``rpm`` requests a minute, each holding up to ``rpm``;
    at most ``limit`` of them, the least recently used dropped first (a bucket
    idle for a minute is full again, so dropping it forgets nothing)."""

    def __init__(self, clock: Callable[[], float], limit: int) -> None:
        self._clock = clock
        self._limit = limit
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # who -> (tokens, at)

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, who: str, rpm: int) -> float:
        """Take one token; 0.0 if there was one, else the seconds until there is."""
        now = self._clock()
        tokens, at = self._buckets.pop(who, (float(rpm), now))
        tokens = min(float(rpm), tokens + (now - at) * rpm / 60.0)
        wait = 0.0
        if tokens >= 1.0:
            tokens -= 1.0
        else:
            wait = (1.0 - tokens) * 60.0 / rpm
        self._buckets[who] = (tokens, now)
        while len(self._buckets) > self._limit:
            self._buckets.popitem(last=False)
        return wait


class Guard:
    """The checks above, for one daemon. ``clock`` is injectable for tests
    (default: trio's clock, so ``MockClock`` drives it in-process)."""

    def __init__(self, config: ServeConfig, *, clock: Callable[[], float] = trio.current_time,
                 hostname: str | None = None, max_buckets: int = MAX_BUCKETS) -> None:
        self.keys = config.api_keys
        self.loopback = is_loopback_listener(config.host)
        self.machine = _machine_names(socket.gethostname() if hostname is None else hostname)
        self.allowed_hosts = frozenset(h.lower() for h in config.allowed_hosts)
        self.origins = frozenset(config.web_origins)
        self.ui = config.ui  # the page (api/_ui.py) loads without a key, then asks for one
        self.rate_limit_rpm = config.rate_limit_rpm
        self.buckets = _Buckets(clock, max_buckets)
        self.slots = Slots()  # each key's max_concurrent generations (api/_admission.py)

    def admit(self, scope: dict[str, Any]) -> ApiError | None:
        """Set ``scope``'s principal; the refusal to answer instead of routing, if any."""
        scope[PRINCIPAL] = ANONYMOUS
        refusal = self._host(scope) or self._origin(scope)
        if refusal is not None:
            return refusal
        http = scope["type"] == "http"
        method, path = scope.get("method", "GET"), scope["path"]
        if http and method == "OPTIONS":
            return None
        exempt = path == "/health" and method in ("GET", "HEAD")
        exempt = exempt or (http and self.ui and ui_public(scope))  # the page: it asks for the key itself
        principal: Principal | None = ANONYMOUS
        if self.keys and not exempt:
            principal = authenticate(self.keys, presented_key(scope))
        refusal = self.charge(scope, principal)
        if refusal is not None:
            return refusal
        if principal is None:
            return ApiError(401, "a valid API key is required (Authorization: Bearer KEY, or x-api-key: KEY)",
                            code="invalid_api_key", type="authentication_error")
        scope[PRINCIPAL] = principal
        if not http:
            return None
        if method in ("POST", "PATCH"):
            refusal = self._content_type(scope)
            if refusal is not None:
                return refusal
        if not principal.admin and self._is_admin_route(method, path):
            return _refuse(403, f"{method} {path} needs an admin API key", "admin_required")
        return None

    def _host(self, scope: dict[str, Any]) -> ApiError | None:
        values = _values(scope, b"host")
        if len(values) != 1:
            return _refuse(403, "exactly one Host header is required", "host_refused")
        if self.keys:
            return None
        parsed = _authority(values[0])
        host = parsed[0] if parsed is not None else ""
        if parsed is not None and (host in self.allowed_hosts or (
                _is_loopback_name(host) if self.loopback
                else host == "localhost" or host in self.machine or _ipv4(host) is not None or host.startswith("["))):
            return None
        return _refuse(403, f"Host {values[0]!r} is not a name of this server (DNS rebinding guard; "
                            "--allowed-host adds one)", "host_refused")

    def origin_allowed(self, origin: str) -> bool:
        m = _ORIGIN.fullmatch(origin)
        parsed = None if m is None else _authority(m.group(2))
        if parsed is None:  # "null" included: sandboxed frames, file:// pages, redirects
            return False
        return _is_loopback_name(parsed[0]) or "*" in self.origins or origin.lower() in self.origins

    def _origin(self, scope: dict[str, Any]) -> ApiError | None:
        values = _values(scope, b"origin")
        if not values or (len(values) == 1 and self.origin_allowed(values[0])):
            return None
        shown = "several Origin headers" if len(values) > 1 else f"Origin {values[0]!r}"
        return _refuse(403, f"{shown} refused: only pages on this machine, or those named by --web-origin, "
                            "may call this server", "origin_refused")

    def charge(self, scope: dict[str, Any], principal: Principal | None) -> RateLimited | None:
        """Take one rate token for a request (``admit``) or a WebSocket op (``api/_ws.py``):
        from the key's bucket if its policy sets ``rate_limit_rpm``, else from its peer's
        (``--rate-limit``); the refusal if the bucket is empty."""
        if scope.get("path") in _RATE_EXEMPT:
            return None
        key = principal.key if principal is not None else None
        if key is not None and key.rate_limit_rpm:
            who, rpm = f"key:{key.name}", key.rate_limit_rpm
        elif self.rate_limit_rpm:
            client = scope.get("client")
            who, rpm = f"peer:{peer_of(client[0] if client else '')}", self.rate_limit_rpm  # X-Forwarded-For is not read
        else:
            return None
        wait = self.buckets.take(who, rpm)
        if wait <= 0.0:
            return None
        return RateLimited(429, "Rate limit exceeded", code="rate_limit_exceeded", type="rate_limit_error",
                           retry_after=max(1, math.ceil(wait)))

    @staticmethod
    def _content_type(scope: dict[str, Any]) -> ApiError | None:
        values = _values(scope, b"content-type")
        kind = values[0].partition(";")[0].strip().lower() if values else ""
        if len(values) <= 1 and (kind in ("", "application/json") or (
                kind.startswith("application/") and kind.endswith("+json"))):
            return None
        browser = any(_values(scope, name) for name in (b"origin", b"sec-fetch-site", b"sec-fetch-mode"))
        if len(values) == 1 and kind == "application/x-www-form-urlencoded" and not browser:
            return None  # curl -d '{...}': the README's quickstart
        if len(values) == 1 and kind == "multipart/form-data" and scope["path"] == "/v1/files" and not browser:
            return None  # an upload (api/_files.py): curl -F, the openai SDK; never from a page, even an allowed one
        return ApiError(415, f"unsupported content type {values[0] if len(values) == 1 else values!r}: "
                             "send the body as application/json", code="unsupported_media_type")

    @staticmethod
    def _is_admin_route(method: str, path: str) -> bool:
        return (path in _ADMIN_ANY_METHOD or (method == "POST" and path in ("/v1/models/load", "/v1/models/unload"))
                or (method == "DELETE" and _MODEL_PATH.fullmatch(path) is not None)
                or (method == "POST" and _SLOT_PATH.fullmatch(path) is not None))

    def cors(self, scope: dict[str, Any], send: Send) -> Send:
        """``send`` adding ``Access-Control-Allow-Origin`` (and ``Vary``,
        ``Access-Control-Expose-Headers``) to the response of a request from an
        allowed Origin; ``send`` itself when the request has none."""
        values = _values(scope, b"origin")
        if len(values) != 1 or not self.origin_allowed(values[0]):
            return send
        extra = [(b"access-control-allow-origin", values[0].encode("latin-1")), (b"vary", b"Origin"),
                 (b"access-control-expose-headers", _EXPOSED)]

        async def cors_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        return cors_send

    @staticmethod
    def preflight_headers(scope: dict[str, Any]) -> list[tuple[bytes, bytes]]:
        """The headers of a 204 answer to ``OPTIONS`` (its Origin already allowed):
        the methods, the asked-for request headers that we accept, the cache time."""
        asked = ",".join(_values(scope, b"access-control-request-headers"))
        granted = [h for h in (a.strip().lower() for a in asked.split(","))
                   if h in _ALLOWED_HEADERS or h.startswith(_ALLOWED_PREFIXES)]
        return [(b"allow", _METHODS), (b"access-control-allow-methods", _METHODS),
                (b"access-control-allow-headers", ", ".join(granted or sorted(_ALLOWED_HEADERS)).encode()),
                (b"access-control-max-age", _PREFLIGHT_MAX_AGE)]


def peer_of(address: str) -> str:
    """The rate-limit bucket of a client address: one for all of ``127.0.0.0/8``
    (a local client could otherwise take a fresh bucket per address), one per
    IPv6 ``/64`` (what one host is usually given), else the address itself."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if isinstance(ip, ipaddress.IPv4Address):
        return "127.0.0.0/8" if ip.is_loopback else str(ip)
    return str(ipaddress.IPv6Network((ip, 64), strict=False))
