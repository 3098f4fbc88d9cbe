"""What a route handler sees of the application.

Handlers are typed against this protocol, not against the concrete
:class:`~superfluid.api._app.App`: ``_app.py`` imports every dialect to route
to it, so a dialect importing ``_app`` (even for typing) would close a cycle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:

    from ..serving import Metrics, Registry, ServedModel, ServeConfig
    from ..sessions._conversations import ConversationStore
    from ..sessions._resumable import SessionStore
    from ..sched import QosClass
    from ..sessions._files import FileStore
    from ._guard import Guard
    from ._principal import Principal
    from ._lifecycle import Stopping

__all__ = ["App"]


class App(Protocol):
    """The application's state and its model lookup (implemented by ``_app.App``)."""

    config: ServeConfig
    registry: Registry
    metrics: Metrics
    sessions: SessionStore
    conversations: ConversationStore
    guard: Guard
    accepting: bool
    stopping: Stopping    # SIGTERM/SIGINT as request handlers see it (_lifecycle.py)
    files: FileStore      # /v1/files (api/_files.py)

    async def dispatch(self, principal: Principal, path: str, body: bytes, *, qos: QosClass,
                       limit: int) -> tuple[int, bytes]:
        """``POST path`` run in this process (a batch's line): the status and the body."""
        ...

    async def resolve_model(self, name: Any) -> ServedModel:
        """The named model, loaded on demand if it is known but unloaded.

        Raises:
            ApiError: 400 missing/invalid, 404 unknown, 503 failed to load.
        """
        ...
