"""Who is calling: the principal a request runs as.

With no keys configured every request runs as :data:`ANONYMOUS` (one tenant,
allowed everything, as a loopback daemon has always been). With keys
(``ServeConfig.api_keys``) every route but ``GET /health`` needs one; the key
that matched becomes the request's principal, and its ``tenant`` partitions
sessions, conversations and the prefix cache.
"""

from __future__ import annotations

import hmac
from contextvars import ContextVar
from typing import Any

import attrs

from ..serving import ApiKey, secret_digest
from ..sched import QosClass
from ._http import ApiError

__all__ = ["ANONYMOUS", "PRINCIPAL", "QOS", "Principal", "authenticate", "current_principal", "presented_key",
           "principal_of", "set_current_principal"]

PRINCIPAL = "superfluid.principal"  # the ASGI scope key the guard sets
# the class an in-process request runs in (a batch's line, App.dispatch): set only by the daemon, never
# from anything a client sends (a scope key is not a header); checked against the key when the batch was made
QOS = "superfluid.qos"


@attrs.frozen(kw_only=True)
class Principal:
    name: str                  # the key's name; "" when no keys are configured
    tenant: str                # partition of sessions, conversations and the prefix cache; "" = the only one
    key: ApiKey | None = None  # the policy that applies; None = no keys configured

    @property
    def admin(self) -> bool:
        return self.key is None or self.key.admin

    def may_use(self, name: str) -> bool:
        """Whether the key's ``models`` list (if any) names ``name``; model lists show only these."""
        return self.key is None or self.key.models is None or name in self.key.models

    def check_model(self, name: str) -> None:
        """Raises ApiError 403 ``model_not_allowed`` if the key may not use ``name``.
        Checked before the model is looked up, so the answer is the same for a
        model that exists and one that does not: nothing is disclosed."""
        if not self.may_use(name):
            raise ApiError(403, f"this API key may not use model '{name}'", code="model_not_allowed",
                           param="model", type="permission_error")

    def qos(self, asked: QosClass | None, default: QosClass) -> QosClass:
        """The class a request runs in: ``asked``, else the key's ``class`` (else
        ``default``). Raises ApiError 403 ``qos_class_not_allowed`` for a class
        above the key's ``max_class``: refused, not lowered, so a client never
        believes it got a class it did not get."""
        if self.key is None:
            return default if asked is None else asked
        if asked is None:
            return self.key.klass
        if asked < self.key.max_class:  # a lower number is a higher class
            raise ApiError(403, f"this API key may not ask QoS class {asked.name.lower()} "
                                f"(its highest is {self.key.max_class.name.lower()})",
                           code="qos_class_not_allowed", param="x-superfluid-qos", type="permission_error")
        return asked


ANONYMOUS = Principal(name="", tenant="")

# The request's principal for code that is not handed the ASGI scope
# (``App.resolve_model``). ``App.__call__`` sets it once per request; a task
# spawned for the request inherits it; daemon work outside any request
# (restoring turns at startup) runs as ANONYMOUS.
_CURRENT: ContextVar[Principal] = ContextVar("superfluid_principal", default=ANONYMOUS)


def set_current_principal(principal: Principal) -> None:
    _CURRENT.set(principal)


def current_principal() -> Principal:
    return _CURRENT.get()


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
    digest = secret_digest(secret)
    found = None
    for key in keys:  # no early exit: the time does not tell which key came close
        if hmac.compare_digest(digest, key.digest):
            found = key
    return None if found is None else Principal(name=found.name, tenant=found.name, key=found)
