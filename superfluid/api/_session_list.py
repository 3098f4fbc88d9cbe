"""``GET /v1/sessions``: the caller's sessions and conversations, newest first, paged.

Query: ``limit`` (1..1000, default 100) and ``after`` (the ``last_id`` of the
previous page). Each item: ``id``, ``object``, ``kind`` (``chat``,
``completion`` or ``conversation``), ``state`` (``generating``, ``finished``,
``failed``, ``cancelled``, ``interrupted``, ``open``, ``conversation``),
``model``, ``created``/``updated`` (unix seconds), ``events``, and for a
generation ``prompt_tokens``, ``completion_tokens``, ``finish_reason``,
``qos``, ``resumable``. Only the caller's tenant's sessions are listed
(api/_tenancy.py): another key's are absent, as everywhere else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from ..journal._offline import session_summary
from ._http import ApiError
from ._principal import principal_of

if TYPE_CHECKING:
    from ._host import App

__all__ = ["MAX_LIMIT", "list_sessions"]

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000


def _query(scope: dict[str, Any]) -> tuple[int, str | None]:
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    raw = (query.get("limit") or [str(DEFAULT_LIMIT)])[0]
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIMIT:
        raise ApiError(400, f"invalid request: limit must be an integer in 1..{MAX_LIMIT}, got {raw!r}", param="limit")
    after = (query.get("after") or [None])[0]
    return int(raw), after


def list_sessions(app: App, scope: dict[str, Any]) -> dict[str, Any]:
    """The page of ``GET /v1/sessions``.

    Raises:
        ApiError: 400 a bad ``limit``, or an ``after`` that is not a session of the caller's.
    """
    limit, after = _query(scope)
    tenant = principal_of(scope).tenant
    journal = app.sessions.journal
    mine = [s for s in journal.sessions.values() if s.tenant == tenant and not (s.conversation is not None and s.done)]
    mine.sort(key=lambda s: (s.first_ts, s.first_seq), reverse=True)
    start = 0
    if after is not None:
        ids = [s.session.rpartition("/")[2] for s in mine]
        if after not in ids:
            raise ApiError(400, f"invalid request: after {after!r} is not one of your sessions (pass the last_id "
                                "of the previous page)", param="after")
        start = ids.index(after) + 1
    page = mine[start:start + limit]
    data = []
    for slog in page:
        live = app.sessions.live.get(slog.session)
        generating = (live is not None and not live.job.done) if slog.conversation is None else (
            slog.open_turn >= 0 and app.conversations.busy(slog.session))
        item = session_summary(slog, journal.epoch, live=generating)
        if live is not None and not live.job.done:
            item["completion_tokens"] = len(live.job.tokens)
        data.append(item)
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": start + limit < len(mine)}
