"""What the HTTP handlers and the session store see of the model registry
(``daemon/_registry.ModelRegistry`` implements it), and the registry's typed load refusals.

Handlers type against :class:`Registry`, not the daemon's class: the daemon builds the
application (``daemon/_server.py`` imports ``api``), so ``api`` importing ``daemon`` back, even
for typing, would close a package cycle (the layers contract in pyproject.toml).
"""

from __future__ import annotations

from collections.abc import Callable

from typing import TYPE_CHECKING, Protocol

from ..models._gguf import MemoryNeed, format_bytes

if TYPE_CHECKING:
    from ._config import ModelSource
    from ._model import ServedModel

__all__ = ["InsufficientMemory", "Registry", "TooManyModels"]


class TooManyModels(Exception):
    """``max_models`` models are loaded; unload one first."""

    def __init__(self, cap: int, loaded: list[str]) -> None:
        self.cap = cap
        self.loaded = loaded
        super().__init__(f"at most {cap} models may be loaded at once (--max-models {cap}); loaded: "
                         f"{', '.join(loaded)}; unload one first")


class InsufficientMemory(Exception):
    """The model's weights and KV cache do not fit in the memory available."""

    def __init__(self, name: str, need: MemoryNeed, available: int, source: str) -> None:
        self.name, self.need, self.available = name, need, available
        super().__init__(
            f"model '{name}' needs {format_bytes(need.total)} ({format_bytes(need.weights)} of weights + "
            f"{format_bytes(need.kv)} of KV cache for {need.cells} cells) and {format_bytes(available)} is free "
            f"({source}); lower --max-batch or --max-context, or unload a model")


class Registry(Protocol):
    """The models a request may name, and the holds that keep one loaded while it is used."""

    loaded: dict[str, ServedModel]     # name -> the model, loaded now
    known: dict[str, ModelSource]      # name -> how to load it (loaded or not)
    aliases: dict[str, str]            # --alias NAME=MODEL
    default: str | None                # the model a request naming none gets
    idle_timeout_s: float              # --idle-timeout (serving/_keepalive.py)
    pinned_until: Callable[[str, float], float]  # (model, now) -> until when a pinned conversation holds it (pins())

    def resolve_alias(self, name: str) -> str:
        """The model an ``--alias`` name stands for, or the known model a Hugging Face name
        means (``hf.co/org/repo:QUANT``, a quant in any case, ``org/repo`` for its one quant);
        a name that is neither, as is."""
        ...

    async def get(self, name: str) -> ServedModel | None:
        """A loaded model, loading a known one on demand; None if unknown.

        Raises:
            TooManyModels, InsufficientMemory: the load was refused.
            WorkerLoadFailed: its worker did not start.
        """
        ...

    def lookup(self, ident: str, runtime: str | None = None) -> ModelSource | None:
        """How to load ``ident``: a known name, or a file the model directories allow."""
        ...

    async def load(self, source: ModelSource, *, make_default: bool = False) -> ServedModel:
        """Load ``source`` (or return it, loaded already).

        Raises:
            TooManyModels, InsufficientMemory: the load was refused.
            WorkerLoadFailed: its worker did not start.
        """
        ...

    async def unload(self, name: str) -> bool:
        """False if ``name`` was not loaded; True once its actor (and worker) has ended.

        Raises:
            ValueError: it is the last loaded model.
        """
        ...

    def hold(self, model: ServedModel) -> None:
        """An HTTP request uses ``model`` until :meth:`release`: it is not idle."""
        ...

    def release(self, model: ServedModel) -> None: ...

    def keep_alive(self, model: ServedModel, seconds: float | None) -> None:
        """A request's ``keep_alive`` for ``model`` (None: ``--idle-timeout``)."""
        ...

    def pins(self, pinned_until: Callable[[str, float], float]) -> None:
        """Conversations pin models: ``pinned_until(name, time.time())`` is the wall time until
        which one holds model ``name`` loaded (0: none). Called again when a pin changes."""
        ...
