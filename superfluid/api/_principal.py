"""Who is calling: the principal a request runs as.

With no keys configured every request runs as :data:`ANONYMOUS` (one tenant,
allowed everything, as a loopback daemon has always been). With keys
(``ServeConfig.api_keys``) every route but ``GET /health`` needs one; the key
that matched becomes the request's principal, and its ``tenant`` partitions
sessions, conversations and the prefix cache.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import attrs

from .._config import ApiKey

__all__ = ["ANONYMOUS", "PRINCIPAL", "Principal", "authenticate", "presented_key", "principal_of"]

PRINCIPAL = "superfluid.principal"  # the ASGI scope key the guard sets


@attrs.frozen(kw_only=True)
class Principal:
    name: str                  # the key's name; "" when no keys are configured
    tenant: str                # partition of sessions, conversations and the prefix cache; "" = the only one
    key: ApiKey | None = None  # the policy that applies; None = no keys configured

    @property
    def admin(self) -> bool:
        return self.key is None or self.key.admin


ANONYMOUS = Principal(name="", tenant="")


def principal_of(scope: dict[str, Any]) -> Principal:
    """The principal the guard set on ``scope`` (:data:`ANONYMOUS` if none was)."""
    p = scope.get(PRINCIPAL)
    return p if isinstance(p, Principal) else ANONYMOUS


def presented_key(scope: dict[str, Any]) -> str | None:
    """The secret a client presented: ``Authorization: Bearer`` (OpenAI, Ollama's
    clients) or ``x-api-key`` (Anthropic)."""
    for k, v in scope.get("headers", ()):
        name = k.lower()
        if name == b"authorization":
            kind, _, token = v.decode("latin-1").strip().partition(" ")
            if kind.lower() == "bearer" and token.strip():
                return token.strip()
        elif name == b"x-api-key" and v.strip():
            return v.decode("latin-1").strip()
    return None


def authenticate(keys: tuple[ApiKey, ...], secret: str | None) -> Principal | None:
    """The principal of ``secret`` among ``keys``, compared in constant time
    against each key's SHA-256 digest; None if it matches none."""
    if secret is None:
        return None
    digest = hashlib.sha256(secret.encode("utf-8", "surrogateescape")).digest()
    found = None
    for key in keys:  # no early exit: the time does not tell which key came close
        if hmac.compare_digest(digest, key.digest):
            found = key
    return None if found is None else Principal(name=found.name, tenant=found.name, key=found)
