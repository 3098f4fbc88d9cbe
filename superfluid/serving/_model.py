"""A served model: its actor (worker + scheduler), template and facts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from ..chat import ChatTemplate, pick_template

if TYPE_CHECKING:
    from ..nursery import ModelActor
    from ._placement import FleetGroup
    from ..sched import Job, Scheduler

__all__ = ["ServedModel"]


@attrs.define(eq=False)
class ServedModel:
    name: str
    runtime: str
    path: str
    actor: ModelActor
    created: int
    _template: ChatTemplate | None = None
    size: int = 0                       # bytes in memory: weights + KV cache (models/_gguf.py); 0 for the mock
    last_used: float = 0.0              # trio time it was last in use (daemon/_lifetime.py)
    keep_alive_s: float | None = None   # an Ollama request's keep_alive; None: --idle-timeout
    holds: int = 0                      # HTTP requests holding it now
    group: FleetGroup | None = None     # served by fleet nodes: one actor per node (``actor`` is the first)
    template_override: str = ""         # --chat-template-file: this source instead of the model's own

    @property
    def actors(self) -> list[ModelActor]:
        return list(self.group.members.values()) if self.group is not None else [self.actor]

    @property
    def in_use(self) -> bool:
        """A request or a session has something here (idle unload waits)."""
        return bool(self.holds or any(a.session_tasks or a.scheduler.active for a in self.actors))

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler a request goes to: the model's own, or the node placement picks."""
        return self.place()

    def place(self, need: int = 0, job: Job | None = None) -> Scheduler:
        """The scheduler for a request of ``need`` tokens (a fleet model: placement's node,
        which counts ``job`` from now on)."""
        if self.group is None:
            return self.actor.scheduler
        return self.group.place(need, job=job).scheduler

    @property
    def info(self) -> dict[str, Any]:
        return self.actor.info

    @property
    def n_ctx(self) -> int:
        if self.group is not None:
            return self.group.window
        return int(self.info.get("n_ctx_seq", 0))

    @property
    def template(self) -> ChatTemplate:
        if self._template is None:
            info = self.info
            specials: dict[str, int] = info.get("special_tokens", {})
            source, kind = ((self.template_override, "file") if self.template_override
                            else pick_template(info.get("chat_template", ""), specials))
            by_id = {v: k for k, v in specials.items()}
            eog = info.get("eog", [])
            self._template = ChatTemplate(
                source, kind=kind, bos_token=by_id.get(info.get("bos", -1), ""),
                eos_token=by_id.get(eog[0], "") if eog else "", specials=specials,
            )
        return self._template

    def describe(self) -> dict[str, Any]:
        ack = self.actor.ack
        return {
            "id": self.name, "object": "model", "created": self.created, "owned_by": "superfluid", "loaded": True,
            "meta": {"n_ctx": self.n_ctx, "architecture": self.info.get("architecture", "")},
            "architecture": {"input_modalities": ["text"]},
            "runtime": {"id": self.runtime, "version": ack.runtime_version if ack else ""},
            "capabilities": dict(ack.capabilities) if ack else {},
            **({"fleet": self.group.describe()} if self.group is not None else {}),
        }
