"""Tenancy: sessions, conversations and the prefix cache belong to a key's tenant.

Every session and conversation records the tenant that made it (the
``tenant`` of its ``created`` / ``conversation`` record; none means "").
:func:`resolve` is the one gate from a client's id to a stored one: an id of
another tenant resolves exactly as an unknown id does, so every route answers
it with the same 404.

Ids are the server's (``s-<hex>``, ``c-<hex>``). A client may name a new
session or conversation only when keys are configured; the name is then
stored qualified by its tenant (``<tenant>/<name>``: ``/`` is never in an id a
client can send), so two tenants choosing one name neither collide nor see
each other, and clients keep using the bare name (:func:`public_id`).

A job's prefix-cache partition comes from its tenant and the request's
optional ``cache_salt`` (:func:`partition_of`, ``Job.partition``).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import attrs

from ._http import ApiError
from ._principal import principal_of

if TYPE_CHECKING:
    from ._host import App

__all__ = ["MAX_CACHE_SALT", "SESSION_ID", "Partition", "chosen_id", "partition_of", "public_id", "resolve", "tenant_of"]

MAX_CACHE_SALT = 256
SESSION_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")


@attrs.frozen
class Partition:
    """Who a generation belongs to: its tenant and the request's ``cache_salt``."""

    tenant: str = ""
    cache_salt: str = ""


def partition_of(scope: dict[str, Any], body: dict[str, Any] | None = None) -> Partition:
    """The scope's tenant and the body's ``cache_salt`` (vLLM's field).

    Raises:
        ApiError: 400 ``cache_salt`` not a string of at most 256 characters.
    """
    salt = (body or {}).get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or len(salt) > MAX_CACHE_SALT):
        raise ApiError(400, f"invalid request: cache_salt must be a string of at most {MAX_CACHE_SALT} characters",
                       param="cache_salt")
    return Partition(tenant=principal_of(scope).tenant, cache_salt=salt or "")


def tenant_of(app: App, sid: str) -> str | None:
    """The tenant owning session or conversation ``sid``; None if there is none (or it was purged)."""
    live = app.sessions.live.get(sid)
    if live is not None:
        return live.tenant
    slog = app.sessions.journal.sessions.get(sid)
    if slog is None or (slog.conversation is not None and slog.done):  # (a purged conversation is no one's)
        return None
    return slog.tenant


def resolve(app: App, scope: dict[str, Any], ident: str) -> str | None:
    """The stored id of the session or conversation the scope's tenant calls
    ``ident``: its own name for it, else a server-made id it owns. None if the
    tenant owns no such thing (whether or not another tenant does)."""
    tenant = principal_of(scope).tenant
    candidates = (_qualified(tenant, ident), ident) if app.config.api_keys else (ident,)
    for sid in candidates:
        if tenant_of(app, sid) == tenant:
            return sid
    return None


def chosen_id(app: App, scope: dict[str, Any], name: Any, param: str) -> str:
    """The stored id of a session or conversation the client names ``name``.

    Raises:
        ApiError: 400 with no keys configured (ids are server-made) or a bad name.
    """
    if not app.config.api_keys:
        raise ApiError(400, f"invalid request: {param} cannot name a new session; ids are server-made (omit it and "
                       "use the id in the reply)", param=param)
    if not isinstance(name, str) or not SESSION_ID.fullmatch(name):
        raise ApiError(400, f"invalid request: {param} must match [A-Za-z0-9_.-]{{1,128}}", param=param)
    return _qualified(principal_of(scope).tenant, name)


def public_id(sid: str) -> str:
    """The id a client uses for stored id ``sid`` (a chosen name without its tenant)."""
    return sid.rpartition("/")[2]


def _qualified(tenant: str, name: str) -> str:
    return f"{tenant}/{name}"
