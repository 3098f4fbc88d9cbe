"""``--api-key`` and ``--key-policy FILE``: the daemon's keys, checked at startup.

A policy file is JSON::

    {"keys": [{"name": "ci", "key_env": "CI_KEY", "class": "background",
               "models": ["mock"], "rate_limit_rpm": 60, "max_concurrent": 2}]}

Each entry: ``name`` (required), exactly one of ``key`` (the secret) or
``key_env`` (an environment variable holding it), ``class`` (the QoS class of
its requests that name none; default ``agent``), ``max_class`` (the highest
class it may ask; default its ``class``), ``models`` (the models it may use;
default any), ``rate_limit_rpm`` (its own token bucket; 0: none), ``max_concurrent``
(generations at once, each counted until it ends; 0: no limit), ``admin`` (default
false), and the storage quota of its tenant: ``max_conversations`` (default 1,000)
and ``max_stored_bytes`` (bytes of its conversations in the log; default 1 GiB).
An admin key has no quota unless its entry sets one; 0 is no limit.

Anything wrong is a :class:`KeyPolicyError` whose message is one line: the CLI
prints it and exits 2.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..sched import QosClass, parse_qos
from ..serving import ApiKey

__all__ = ["DEFAULT_MAX_CONVERSATIONS", "DEFAULT_MAX_STORED_BYTES", "KeyPolicyError", "load_keys"]

_FIELDS = {"name", "key", "key_env", "class", "max_class", "models", "rate_limit_rpm", "max_concurrent", "admin",
           "max_conversations", "max_stored_bytes"}
# a non-admin key's storage quota when its entry names none (F7 of the red-team review: one key could
# otherwise fill the log with 10,000 conversations of 16 MiB)
DEFAULT_MAX_CONVERSATIONS = 1000
DEFAULT_MAX_STORED_BYTES = 1 << 30


class KeyPolicyError(ValueError):
    """A key or policy file the daemon refuses to start with."""


def load_keys(api_key: str | None, policy: Path | None, environ: Mapping[str, str]) -> tuple[ApiKey, ...]:
    """The keys of ``--api-key`` (named ``default``, admin) and of the policy file.

    Raises:
        KeyPolicyError: an unreadable or invalid file, an unknown field, an empty
            list, a duplicate secret or name, a name equal to a secret, a secret
            equal to ``--api-key``.
    """
    keys = [ApiKey.from_secret("default", api_key, admin=True)] if api_key else []
    if policy is None:
        return tuple(keys)
    try:
        doc = json.loads(policy.read_text(encoding="utf-8"))
    except OSError as exc:
        raise KeyPolicyError(f"key policy {policy}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise KeyPolicyError(f"key policy {policy}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or set(doc) != {"keys"}:
        raise KeyPolicyError(f'key policy {policy}: expected an object with only a "keys" list')
    entries = doc["keys"]
    if not isinstance(entries, list) or not entries:
        raise KeyPolicyError(f'key policy {policy}: "keys" must be a non-empty list')
    secrets: dict[str, str] = {api_key: "--api-key"} if api_key else {}
    names: set[str] = {k.name for k in keys}
    for i, entry in enumerate(entries):
        where = f"key policy {policy}: keys[{i}]"
        key, secret = _entry(entry, where, environ)
        if key.name in names:
            raise KeyPolicyError(f"{where}: duplicate name {key.name!r}")
        if secret in secrets:
            raise KeyPolicyError(f"{where}: its secret is the same as that of {secrets[secret]}")
        names.add(key.name)
        secrets[secret] = f"keys[{i}]"
        keys.append(key)
    clash = names & secrets.keys()
    if clash:  # a name is logged and shown; it must not be someone's secret
        raise KeyPolicyError(f"key policy {policy}: a key's name is also a secret ({len(clash)} such)")
    return tuple(keys)


def _entry(entry: Any, where: str, environ: Mapping[str, str]) -> tuple[ApiKey, str]:
    if not isinstance(entry, dict):
        raise KeyPolicyError(f"{where}: expected an object")
    unknown = sorted(set(entry) - _FIELDS)
    if unknown:
        raise KeyPolicyError(f"{where}: unknown field {unknown[0]!r}")
    name = entry.get("name")
    if not isinstance(name, str) or not name.strip():
        raise KeyPolicyError(f'{where}: "name" must be a non-empty string')
    if ("key" in entry) == ("key_env" in entry):
        raise KeyPolicyError(f'{where} ({name}): give exactly one of "key" and "key_env"')
    if "key" in entry:
        secret = entry["key"]
        if not isinstance(secret, str) or not secret:
            raise KeyPolicyError(f'{where} ({name}): "key" must be a non-empty string')
    else:
        var = entry["key_env"]
        if not isinstance(var, str) or not var:
            raise KeyPolicyError(f'{where} ({name}): "key_env" must name an environment variable')
        secret = environ.get(var, "")
        if not secret:
            raise KeyPolicyError(f"{where} ({name}): environment variable {var} is unset or empty")
    klass = _qos(entry.get("class", "agent"), "class", where)
    max_class = _qos(entry.get("max_class", entry.get("class", "agent")), "max_class", where)
    if klass < max_class:  # a lower number is a higher class
        raise KeyPolicyError(f'{where} ({name}): "class" is above "max_class"')
    models = entry.get("models")
    if models is not None and (not isinstance(models, list) or not models
                               or not all(isinstance(m, str) and m for m in models)):
        raise KeyPolicyError(f'{where} ({name}): "models" must be a non-empty list of model names')
    admin = entry.get("admin", False)
    if not isinstance(admin, bool):
        raise KeyPolicyError(f'{where} ({name}): "admin" must be true or false')
    key = ApiKey.from_secret(
        name, secret, admin=admin, klass=klass, max_class=max_class,
        models=None if models is None else tuple(models),
        rate_limit_rpm=_count(entry, "rate_limit_rpm", where), max_concurrent=_count(entry, "max_concurrent", where),
        max_conversations=_count(entry, "max_conversations", where, 0 if admin else DEFAULT_MAX_CONVERSATIONS),
        max_stored_bytes=_count(entry, "max_stored_bytes", where, 0 if admin else DEFAULT_MAX_STORED_BYTES))
    return key, secret


def _qos(value: Any, field: str, where: str) -> QosClass:
    if not isinstance(value, str):
        raise KeyPolicyError(f'{where}: "{field}" must be a QoS class name')
    try:
        return parse_qos(value)
    except ValueError:
        raise KeyPolicyError(f'{where}: "{field}" {value!r} is not one of interactive, completion, agent, '
                             "background") from None


def _count(entry: dict[str, Any], field: str, where: str, default: int = 0) -> int:
    value = entry.get(field, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise KeyPolicyError(f'{where}: "{field}" must be a whole number >= 0')
    return value
