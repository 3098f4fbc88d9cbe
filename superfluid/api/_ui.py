"""The built-in web page (issue #48): ``GET /ui`` and its assets.

Plain HTML, CSS and JavaScript shipped as package data (``superfluid/ui/``): no
CDN, no build step. The page is a client of the public API like any other
(``/v1/models``, ``/v1/sessions…``, ``/metrics``); it holds no secret, so it is
served without a key, but only past the guard's Host and Origin checks (a
DNS-rebinding page never gets it). With keys configured the page asks for one
and keeps it in ``sessionStorage``.

* ``GET /ui/``: ``index.html``; ``GET /ui/app.js``, ``/ui/app.css``, ``/ui/favicon.svg``
  (relative paths, so a copy of the directory served elsewhere works as is).
* ``GET /ui``, and ``GET /`` from a browser (``Accept`` naming ``text/html``), are
  redirected (302) to ``/ui/``; any other client still reads ``superfluid is running``
  at ``/``.
* Every answer carries a strict ``Content-Security-Policy`` (``default-src
  'self'``, no inline script or style, no framing), ``X-Content-Type-Options:
  nosniff`` and ``Referrer-Policy: no-referrer``.
* ``GET /ui/lanes``: what ``/metrics`` cannot say, each busy lane's QoS class
  (``lanes``); an API route like ``/metrics``, so it needs the key, and a key sees
  only the models it may use.
* ``--no-ui`` (``ServeConfig.ui``): none of this; ``/ui`` is 404.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._http import ApiError, Send, send_json

if TYPE_CHECKING:
    from ..serving import ServedModel

__all__ = ["ASSETS", "CSP", "lanes", "route_ui", "ui_public"]

ASSETS = Path(__file__).resolve().parent.parent / "ui"
# path -> (file under ASSETS, content type)
_FILES: dict[str, tuple[str, bytes]] = {
    "/ui/": ("index.html", b"text/html; charset=utf-8"),
    "/ui/app.js": ("app.js", b"text/javascript; charset=utf-8"),
    "/ui/app.css": ("app.css", b"text/css; charset=utf-8"),
    "/ui/favicon.svg": ("favicon.svg", b"image/svg+xml"),
}
CSP = (b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       b"object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_HEADERS = [(b"content-security-policy", CSP), (b"x-content-type-options", b"nosniff"),
            (b"referrer-policy", b"no-referrer"), (b"x-frame-options", b"DENY"), (b"cache-control", b"no-cache")]


@functools.cache
def _asset(name: str) -> bytes:
    """An asset's bytes, read once (a few tens of KiB in all)."""
    return (ASSETS / name).read_bytes()


def _wants_html(scope: dict[str, Any]) -> bool:
    """A browser navigating: its ``Accept`` names ``text/html`` (curl's ``*/*`` does not)."""
    return any(k.lower() == b"accept" and b"text/html" in v.lower() for k, v in scope.get("headers", ()))


def ui_public(scope: dict[str, Any]) -> bool:
    """Whether this request is for the page (or the redirect to it), which needs no key:
    the page carries no data, and asks for the key itself (``api/_guard.py``)."""
    if scope.get("method") not in ("GET", "HEAD"):
        return False
    path = scope.get("path", "")
    return path in _FILES or path == "/ui" or (path == "/" and _wants_html(scope))


def lanes(models: list[ServedModel], may_use: Callable[[str], bool]) -> dict[str, Any]:
    """Per model ``may_use`` accepts: each running job's class, phase and tokens so far (every node's, for a fleet model), as the
    terminal monitor shows them (``daemon/_monitor.py``). Read only; no waiting."""
    data = []
    for model in models:
        if not may_use(model.name):
            continue
        rows = []
        for actor in model.actors:
            for job in list(actor.scheduler.running.values()):
                phase = ("preempted" if job.preempted
                         else "prefill" if job.prefill_left > 0 or not job.n_generated else "decode")
                rows.append({"class": job.klass.name.lower(), "phase": phase, "tokens": job.n_generated})
        data.append({"model": model.name, "lanes": rows})
    return {"object": "list", "data": data}


async def route_ui(enabled: bool, scope: dict[str, Any], send: Send,
                   models: Callable[[], list[ServedModel]], may_use: Callable[[str], bool]) -> bool:
    """Serve the page, one of its assets or ``/ui/lanes`` (of ``models()``); False if the
    request is not for them (or the page is off: ``/ui`` then falls through to the 404
    of an unknown route)."""
    path, method = scope["path"], scope["method"]
    if enabled and path == "/ui/lanes" and method == "GET":
        await send_json(send, 200, lanes(models(), may_use))
        return True
    if not enabled or not (path in ("/", "/ui") or path.startswith("/ui/")):
        return False
    if path in ("/", "/ui"):  # to /ui/, where the page's relative asset paths resolve
        if path == "/" and (method not in ("GET", "HEAD") or not _wants_html(scope)):
            return False  # curl, Ollama clients: "superfluid is running" (api/_ollama.py)
        await send({"type": "http.response.start", "status": 302,
                    "headers": [(b"location", b"/ui/"), (b"content-length", b"0"), *_HEADERS]})
        await send({"type": "http.response.body", "body": b""})
        return True
    entry = _FILES.get(path)
    if entry is None:
        raise ApiError(404, f"no route for {method} {path}", code="not_found")
    if method not in ("GET", "HEAD"):
        raise ApiError(405, f"method {method} not allowed on {path}")
    name, kind = entry
    body = _asset(name)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", kind), (b"content-length", str(len(body)).encode()), *_HEADERS]})
    await send({"type": "http.response.body", "body": b"" if method == "HEAD" else body})
    return True
