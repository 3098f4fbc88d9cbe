"""The model registry: which models are loaded, which are known, and the
nursery that supervises every model's actor.

Nursery tree (:meth:`ModelRegistry.run`, started by the daemon)::

    models nursery (ModelRegistry.run)
    ├── model lifetimes          idle unload, keep-alive (_lifetime.py)
    └── supervisor × N           nursery/_supervisor.supervise: the model's failure boundary
        └── model actor          nursery/_actor.ModelActor.serve: sessions + core

Loading starts a model's supervisor in the registry's models nursery, which
runs the model's actor (its worker must handshake before ``load`` returns).
The supervisor is the model's failure boundary: whatever the actor raises
(its core, its worker, its sessions sub-nursery) ends the model's jobs typed
(503 ``model_failed``), is logged once, and the actor restarts under the
``RestartPolicy``; nothing else in the daemon (other models, the HTTP
listener) sees it. A restart storm unloads the model. Unloading stops the
actor: its jobs end typed (503 ``model_unloaded``), its sessions (resume-TTL
watchers, turn owners) and its worker end with it, and ``unload`` returns
once they have (two actors never hold one name). An unloaded model stays
*known* and is loaded again on demand by the next request that names it.

The registry's lock guards its bookkeeping only (and the memory check): a
worker's handshake runs outside it, and concurrent loads of one name share
one handshake (a per-name *loading* marker).

Before a llama.cpp model loads, its weights (the file) and the KV cache the
worker will allocate (from the GGUF header) must fit in available memory, or
the load is refused typed (:class:`InsufficientMemory`, 507
``insufficient_memory``). Idle models are unloaded by :class:`Lifetimes`
(``_lifetime.py``: ``--idle-timeout``, Ollama ``keep_alive``). ``--alias
NAME=MODEL`` gives a model another name requests may use.

What a client may load (:meth:`ModelRegistry.lookup`): a known model (given at
startup, or loaded before), a mock spec, or a ``*.gguf`` file, by name or by
path, inside a ``--model-dir`` or the models cache directory (symlinks and
``..`` resolved first), or the file of a model given at startup. Anything else
is not found, whether or not it exists. At most ``max_models`` models are
loaded at once (:class:`TooManyModels`), so at most that many workers run.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import trio

from ._lifetime import Lifetimes
from ..models._files import cache_dir, model_name, resolve_runtime
from ..models._gguf import GgufError, available_memory, memory_need
from ..models._hub import hub_name_in
from ..nursery import ModelActor, RestartPolicy, WorkerSpec, supervise
from ..sched import Scheduler, SchedulerConfig
from ..fleet._head import NodeSource
from ..serving import (FOREVER, InsufficientMemory, Metrics, ModelSource, ServedModel, ServeConfig, TooManyModels,
                       default_sessions_dir)
from ..serving._placement import FleetGroup

if TYPE_CHECKING:
    from .._cpu import CpuYield
    from ..fleet._remote import NodeConnection
    from ..sched._loop import Committer

__all__ = ["InsufficientMemory", "ModelRegistry", "TooManyModels"]

log = logging.getLogger("superfluid.models")
GGUF = ".gguf"


def model_dir_names(dirs: tuple[Path, ...]) -> list[str]:
    """The model names the ``*.gguf`` files of ``dirs`` are served under (unreadable dirs skipped)."""
    names = []
    for directory in dirs:
        try:
            names += [model_name(n, "llamacpp") for n in os.listdir(directory) if n.endswith(GGUF)]
        except OSError:
            continue
    return names


def _library_sources(config: ServeConfig) -> list[ModelSource]:
    """The models pulled or copied before (``models/_library.py``), known by their names,
    but for the files of models given at startup (known already, by their served names)."""
    from ..models._library import entries

    startup = {os.path.realpath(s.spec) for s in config.models if s.runtime != "mock"}
    return [ModelSource(spec=str(e.path), runtime="llamacpp", name=e.name) for e in entries()
            if e.kind in ("pull", "copy") and (e.kind == "copy" or os.path.realpath(e.path) not in startup)]


@attrs.define(eq=False)
class _Loading:
    """A load in flight: its handshake runs outside the registry's lock, shared by every load of the name."""

    size: int
    done: trio.Event = attrs.field(factory=trio.Event)
    model: ServedModel | None = None
    error: BaseException | None = None


def _unpinned(name: str, now: float) -> float:
    return 0.0


class ModelRegistry:
    def __init__(self, config: ServeConfig, metrics: Metrics,
                 committer: Committer | None = None, cpu: CpuYield | None = None) -> None:
        """Every model's supervisor runs in the registry's own models nursery, open while
        :meth:`run` runs. ``committer`` makes every model's tokens durable (the session
        store); ``cpu`` is the daemon's CPU policy, told by each scheduler when a request
        awaits its first token."""
        self.config = config
        self.committer = committer
        self.cpu = cpu
        self.metrics = metrics
        self.loaded: dict[str, ServedModel] = {}
        self.known: dict[str, ModelSource] = {}
        self.default: str | None = None
        self._lock = trio.Lock()
        self._models: trio.Nursery | None = None     # open while run() runs
        self._loading: dict[str, _Loading] = {}
        # name -> set when its actor task has ended (an unloaded model's worker may still be shutting down)
        self._actors: dict[str, trio.Event] = {}
        self._groups: dict[str, FleetGroup] = {}   # a fleet model's nodes, by model name (attach_node)
        self._model_added = trio.Event()
        for source in (*config.models, *self._model_dir_files(), *_library_sources(config)):
            self.known.setdefault(source.name, source)
        self.aliases: dict[str, str] = dict(config.aliases)
        self.idle_timeout_s = config.idle_timeout_s
        self.pinned_until: Callable[[str, float], float] = _unpinned  # conversations' pins (pins())
        self.lifetimes = Lifetimes(self)
        metrics.refresh(self._fleet_gauges)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the models nursery (every model's supervisor) and the idle unloads until
        cancelled; cancelling shuts every model's actor and worker down."""
        async with trio.open_nursery() as models:
            await models.start(self.lifetimes.run)  # idle unload, keep_alive (_lifetime.py)
            self._models = models
            try:
                task_status.started()
                await trio.sleep_forever()
            finally:
                self._models = None

    def resolve_alias(self, name: str) -> str:
        """The model an ``--alias`` name stands for, or the known model a Hugging Face name
        means (``models/_hub.hub_name_in``); a name that is neither, as is."""
        if name in self.known:
            return name
        target = self.aliases.get(name, name)
        return target if target in self.known else hub_name_in(target, self.known) or target

    def hold(self, model: ServedModel) -> None:
        """An HTTP request uses ``model`` until :meth:`release`: it is not idle."""
        model.holds += 1
        model.last_used = trio.current_time()

    def release(self, model: ServedModel) -> None:
        model.holds -= 1
        model.last_used = trio.current_time()
        self.lifetimes.wake()

    def keep_alive(self, model: ServedModel, seconds: float | None) -> None:
        """Ollama ``keep_alive``: how long ``model`` stays loaded once idle (None: no change)."""
        if seconds is not None:
            model.keep_alive_s = seconds
            self.lifetimes.wake()

    def pins(self, pinned_until: Callable[[str, float], float]) -> None:
        """Conversations' pins hold models (``daemon/_lifetime.py``); look at expiries again."""
        self.pinned_until = pinned_until
        self.lifetimes.wake()

    async def expire(self, name: str, model: ServedModel) -> bool:
        """Unload ``model`` (its keep-alive ran out) if it is still loaded and still idle.
        Unlike :meth:`unload` it may leave no model loaded, and the default keeps its name.
        Returns once its actor (and worker) has ended."""
        async with self._lock:
            now = time.time()
            if self.loaded.get(name) is not model or model.in_use or self.pinned_until(name, now) > now:
                return False
            del self.loaded[name]
            idle = trio.current_time() - model.last_used
            for actor in model.actors:
                actor.stop(f"model '{name}' was unloaded (idle)", code="model_unloaded")
            log.info("model %s unloaded after %.3gs idle (a request naming it loads it again)", name, idle)
            gone = self._actors.get(name)
        if gone is not None:
            await gone.wait()
        return True

    async def _check_memory(self, source: ModelSource, *, pending: int = 0) -> int:
        """Bytes ``source`` will hold in memory (0 for the mock); ``pending`` bytes are
        promised to loads whose workers have not allocated them yet.

        Raises:
            InsufficientMemory: they are more than available memory.
        """
        if source.runtime != "llamacpp":
            return 0
        cfg = self.config
        try:
            need = await trio.to_thread.run_sync(partial(
                memory_need, source.spec, n_seq=max(4, cfg.max_batch + 2), n_ctx_seq=cfg.max_context))
        except (OSError, GgufError) as exc:
            log.warning("model %s: no memory estimate (%s); the worker will say whether it loads", source.name, exc)
            return 0
        available, where = available_memory()
        available = max(0, available - pending)
        if cfg.check_memory and need.total > available:
            raise InsufficientMemory(source.name, need, available, where)
        return need.total

    # -- what may be loaded -------------------------------------------------------------

    def lookup(self, ident: str, runtime: str | None = None) -> ModelSource | None:
        """The model a load request names, or None if it names nothing a client may load.

        ``runtime`` must already be a supported one (``resolve_runtime``).
        """
        ident = self.resolve_alias(ident)
        source = self.known.get(ident)
        if source is not None:
            return source
        selector, _, install = (runtime or "").partition("@")
        is_mock = ident == "mock" or ident.startswith("mock?")
        # an explicit runtime, or a mock spec; a path's format is read only once it is allowed
        explicit = bool(selector) and selector.lower() != "auto"
        rid = resolve_runtime(ident, selector) if explicit else ("mock" if is_mock else None)
        if rid == "mock":
            if is_mock:
                return ModelSource(spec=ident, runtime=rid, name=model_name(ident, rid))
            return None
        found = self._allowed_file(ident)
        if found is None:
            return None
        name, path = found
        rid = rid or resolve_runtime(str(path), None)
        return ModelSource(spec=str(path), runtime=rid, name=model_name(name, rid),
                           worker=_worker(rid, install or None))

    def _roots(self) -> list[Path]:
        return [Path(os.path.realpath(d)) for d in (*self.config.model_dirs, cache_dir())]

    def _allowed_file(self, ident: str) -> tuple[str, Path] | None:
        """``ident`` as a model file a client may load: a path, or a file name (``.gguf``
        optional) in an allowed directory. The path is resolved (symlinks, ``..``) before
        its containment is checked. Returns the file's name as named and its real path."""
        if "\x00" in ident:
            return None
        roots = self._roots()
        startup = {os.path.realpath(s.spec) for s in self.config.models if s.runtime != "mock"}
        candidates = [Path(ident)]
        if os.sep not in ident:
            candidates = [root / name for root in roots for name in (ident, ident + GGUF)]
        for candidate in candidates:
            real = Path(os.path.realpath(candidate))
            contained = candidate.name.endswith(GGUF) and any(real.is_relative_to(root) for root in roots)
            if (contained or str(real) in startup) and real.is_file():
                return candidate.name, real
        return None

    def _model_dir_files(self) -> list[ModelSource]:
        """Every ``*.gguf`` in the ``--model-dir`` directories, as known models."""
        found = []
        for directory in self.config.model_dirs:
            try:
                names = sorted(os.listdir(directory))
            except OSError as exc:
                log.warning("--model-dir %s: %s", directory, exc)
                continue
            for name in names:
                file = self._allowed_file(str(Path(directory) / name)) if name.endswith(GGUF) else None
                if file is not None:
                    found.append(ModelSource(spec=str(file[1]), runtime="llamacpp", name=model_name(name, "llamacpp"),
                                             worker=_worker("llamacpp")))
        return found

    # -- loading and unloading -------------------------------------------------------------

    async def load(self, source: ModelSource, *, make_default: bool = False) -> ServedModel:
        """Start the model's supervisor and wait for its worker's handshake (outside the
        registry's lock; concurrent loads of one name share it).

        Raises:
            TooManyModels: ``max_models`` other models are loaded.
            InsufficientMemory: its weights and KV cache do not fit in available memory.
            WorkerLoadFailed: the worker could not load the model.
        """
        name, cfg = source.name, self.config
        while True:
            wait: trio.Event | None = None
            async with self._lock:
                if name in self.loaded:
                    return self.loaded[name]
                loading = self._loading.get(name)
                if loading is None:
                    if len(self.loaded) + len(self._loading) >= cfg.max_models:
                        raise TooManyModels(cfg.max_models, sorted({*self.loaded, *self._loading}))
                    # its old actor, or one unloaded model's, is still shutting its worker down
                    wait = self._actors.get(name)
                    if wait is None and len(self._actors) >= cfg.max_models:
                        wait = next(gone for held, gone in self._actors.items()
                                    if held not in self.loaded and held not in self._loading)
                    if wait is None:
                        size = await self._check_memory(source, pending=sum(x.size for x in self._loading.values()))
                        loading = self._loading[name] = _Loading(size=size)
                        self._actors[name] = trio.Event()
                        break
            if wait is not None:
                await wait.wait()
                continue
            assert loading is not None
            await loading.done.wait()  # another request's load of this name
            if loading.model is not None:
                return loading.model
            if isinstance(loading.error, Exception):
                raise loading.error
            # that load was cancelled: try again
        try:
            model = await self._start(source, loading.size)
        except BaseException as exc:
            loading.error = exc
            raise
        else:
            loading.model = model
        finally:
            del self._loading[name]
            loading.done.set()
        if make_default or self.default is None:
            self.default = name
        log.info("model %s loaded on %s (worker pid %s)", name, source.runtime, model.actor.pid)
        return model

    async def _start(self, source: ModelSource, size: int) -> ServedModel:
        """Run the model's supervisor in the models nursery until its first worker's handshake."""
        cfg = self.config
        spec = WorkerSpec(runtime=source.runtime, model=source.spec, max_batch=cfg.max_batch,
                          max_context=cfg.max_context, threads=cfg.threads, host_cache_mb=cfg.host_cache_mb,
                          park_dir=str((cfg.sessions or default_sessions_dir()) / "park") if cfg.park else "",
                          park_budget_mb=int(cfg.park_budget_gb * 1024),
                          stream_interval_ms=cfg.stream_interval_ms,
                          agent_stream_interval_ms=cfg.agent_stream_interval_ms, deterministic=cfg.deterministic,
                          kv_bits=cfg.kv_bits,
                          pooling=cfg.pooling, start_timeout_s=cfg.worker_start_timeout_s,
                          speculate=cfg.speculate, spec_gates=cfg.spec_gates,
                          command=source.worker or _worker(source.runtime))
        policy = RestartPolicy(max_restarts=cfg.max_restarts, window_s=cfg.restart_window_s)
        actor = ModelActor(source.name, spec, self._scheduler(source.name), policy=policy)
        gone = self._actors[source.name]
        try:
            if self._models is None:
                raise RuntimeError("the model registry is not running (ModelRegistry.run)")
            await self._models.start(self._run_actor, actor, gone)
        except BaseException:
            if not gone.is_set():  # the task never ran (``start`` waits for one that did)
                del self._actors[source.name]
                gone.set()
            raise
        model = ServedModel(name=source.name, runtime=source.runtime, path=source.spec, actor=actor,
                            created=int(time.time()), size=size, last_used=trio.current_time(),
                            template_override=cfg.chat_template_for(source.name))
        self.loaded[source.name] = model
        self.metrics.for_model(source.name).set("superfluid_lanes_total", cfg.max_batch)
        self.known[source.name] = source
        return model

    async def _run_actor(self, actor: ModelActor, gone: trio.Event, key: str = "", *,
                         task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:  # noqa: ASYNC128 - passed on
        """The model's task in the models nursery: its supervisor, and the name's release when it ends."""
        key = key or actor.name
        try:
            await supervise(actor, partial(self._scheduler, actor.name), on_give_up=self._gave_up,
                            task_status=task_status)
        finally:
            if self._actors.get(key) is gone:
                del self._actors[key]
            gone.set()

    def _gave_up(self, actor: ModelActor) -> None:
        """A restart storm: the model is unloaded (a request naming it loads it again)."""
        model = self.loaded.get(actor.name)
        if model is not None and model.group is not None:   # a fleet node: the model's other nodes go on
            model.group.members = {k: a for k, a in model.group.members.items() if a is not actor}
            if model.group.members and model.actor is actor:
                model.actor = next(iter(model.group.members.values()))
            if model.group.members:
                return
        if model is not None and model.actor is actor:
            del self.loaded[actor.name]
            if self.default == actor.name:
                self.default = next(iter(self.loaded), None)

    async def unload(self, name: str) -> bool:
        """Returns False if ``name`` was not loaded; True once its actor (and worker) has ended.

        Raises:
            ValueError: it is the last loaded model.
        """
        name = self.resolve_alias(name)
        async with self._lock:
            model = self.loaded.get(name)
            if model is None:
                return False
            if len(self.loaded) == 1:
                raise ValueError("cannot unload the last remaining model")
            del self.loaded[name]
            if self.default == name:
                self.default = next(iter(self.loaded))
            for actor in model.actors:
                actor.stop(f"model '{name}' was unloaded", code="model_unloaded")
            log.info("model %s unloaded", name)
            gone = self._actors.get(name)
        if gone is not None:
            await gone.wait()
        return True

    # -- fleet nodes (SPEC.md §14) ----------------------------------------------------------

    async def attach_node(self, conn: NodeConnection) -> str:
        """A node's authenticated link: give it to the node's actor (a node seen before), or
        start one for it (a new node; its worker's handshake runs over this link). Returns
        why the link is refused ("" when taken)."""
        hello = conn.hello
        name = hello.model
        async with self._lock:
            model = self.loaded.get(name)
            if model is not None and model.group is None:
                return f"model {name!r} is served by the head itself; give the node another --model-name"
            if name in self._groups:
                member = self._groups[name].members.get(hello.identity)
                if member is not None and member.remote is not None:
                    await conn.accept()
                    member.remote.offer(conn)
                    return ""
            group = self._groups.get(name)
            if group is None:   # (one per name, made under the lock: two first nodes at once share it)
                group = self._groups[name] = FleetGroup(policy=self.config.fleet_policy,
                                                        pool_high=self.config.fleet_pool_high)
            key = f"{name}@{hello.identity}"
            if key in self._actors:
                return f"node {hello.identity} of model {name!r} is starting or shutting down; try again"
            self._actors[key] = gone = trio.Event()
        cfg = self.config
        source = NodeSource(hello.identity, group, start_timeout_s=cfg.worker_start_timeout_s)
        spec = WorkerSpec(runtime=hello.runtime, model=name, max_batch=hello.lanes, max_context=hello.n_ctx,
                          start_timeout_s=cfg.worker_start_timeout_s)
        policy = RestartPolicy(max_restarts=cfg.max_restarts, window_s=cfg.restart_window_s)
        actor = ModelActor(name, spec, self._scheduler(name, node=hello.identity), policy=policy, remote=source)
        await conn.accept()
        source.offer(conn)
        try:
            if self._models is None:
                raise RuntimeError("the model registry is not running (ModelRegistry.run)")
            await self._models.start(self._run_actor, actor, gone, key)
        except Exception as exc:  # noqa: BLE001 - the node's first worker did not start: the link ends, logged
            if not gone.is_set():
                del self._actors[key]
                gone.set()
            conn.channel.abort()
            conn.closed.set()
            log.warning("fleet: node %s (model %s) did not start: %s", hello.identity, name, exc)
            return ""
        async with self._lock:
            group.members[hello.identity] = actor
            model = self.loaded.get(name)
            if model is None:
                model = ServedModel(name=name, runtime=hello.runtime, path=f"fleet:{name}", actor=actor,
                                    created=int(time.time()), size=0, last_used=trio.current_time(),
                                    keep_alive_s=FOREVER, group=group,
                                    template_override=self.config.chat_template_for(name))
                self.loaded[name] = model
                self._model_added.set()
                self.known.setdefault(name, ModelSource(spec=name, runtime=hello.runtime, name=name))
                if self.default is None:
                    self.default = name
        group.up()
        lanes = int((actor.ack.limits if actor.ack else {}).get("max_lanes", hello.lanes))
        log.info("fleet: node %s at %s serves %s: context window %d tokens, %d lanes", hello.identity, conn.address,
                 name, int(actor.info.get("n_ctx_seq", 0)), lanes)
        return ""

    async def wait_for_models(self, names: set[str], timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until every model of ``names`` is loaded: after a head's
        restart, its nodes dial again and the log's resumable sessions resume on them."""
        with trio.move_on_after(timeout_s):
            while missing := names - set(self.loaded):
                log.info("fleet: waiting for nodes of %s to resume their sessions", ", ".join(sorted(missing)))
                self._model_added = trio.Event()
                await self._model_added.wait()
        await trio.lowlevel.checkpoint()

    def _scheduler(self, name: str, *, node: str = "") -> Scheduler:
        cfg = self.config
        return Scheduler(name, SchedulerConfig(planner=cfg.planner, hang_timeout_s=cfg.hang_timeout_s,
                                               max_queue=cfg.max_queue, max_prompt_bytes=cfg.max_prompt_bytes),
                         self.metrics.for_model(name, node=node), self.committer, cpu=self.cpu)

    def _fleet_gauges(self, metrics: Metrics) -> None:
        """Before a scrape: each fleet node's gauges, and its model's as their sums."""
        for name, group in self._groups.items():
            view = metrics.for_model(name)
            totals = dict.fromkeys(("lanes_active", "lanes_total", "queue_depth", "kv_used_tokens",
                                    "kv_total_tokens"), 0.0)
            for ident, actor in group.members.items():
                core = actor.scheduler.core
                tick = core.last_tick
                ack = actor.ack
                values = {"lanes_active": sum(1 for j in core.running.values() if not j.preempted),
                          "lanes_total": int((ack.limits if ack else {}).get("max_lanes", actor.spec.max_batch)),
                          "queue_depth": sum(len(q) for q in core.queues.values()),
                          "kv_used_tokens": tick.get("kv_used", 0), "kv_total_tokens": tick.get("kv_total", 0)}
                view.gauge("superfluid_fleet_node_up", float(group.is_up(actor)), node=ident)
                for key, value in values.items():
                    view.gauge(f"superfluid_fleet_node_{key}", value, node=ident)
                    totals[key] += value
            for key, value in totals.items():
                if key == "queue_depth":
                    continue   # (per class: the nodes' schedulers do not write it; the node series has it)
                view.gauge(f"superfluid_{key}", value)

    async def get(self, name: str) -> ServedModel | None:
        """A loaded model, loading a known one on demand; None if unknown.

        Raises:
            WorkerLoadFailed: a known model failed to load again.
        """
        name = self.resolve_alias(name)
        model = self.loaded.get(name)
        if model is not None:
            return model
        source = self.known.get(name)
        if source is None:
            return None
        return await self.load(source)



def _worker(rid: str, install: str | None = None) -> tuple[str, ...]:
    """The worker command of a runtime for a model loaded over HTTP (the API has already
    refused a runtime that cannot run here); empty: this interpreter."""
    from ..runtime._status import RuntimeUnavailable, worker_command

    try:
        return worker_command(rid, install)
    except (RuntimeUnavailable, ValueError):
        return ()
