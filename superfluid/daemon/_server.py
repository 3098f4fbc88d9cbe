"""Building the daemon: config -> root nursery -> model actors and the listener.

Nursery tree (daemon)::

    root
    ├── signal watcher          SIGTERM/SIGINT: streams end typed, then cancel root (stop); SIGUSR1: drain; SIGUSR2: dump
    ├── models                  ModelRegistry.run (_registry.py): the registry's own nursery
    │   ├── model lifetimes     unloads models idle past their keep-alive (_lifetime.py)
    │   └── model supervisor × N   the model's failure boundary, restarts its actor (nursery/_supervisor.py)
    │       └── model actor     scheduler loop, commits, worker generations, sessions (nursery/_actor.py)
    ├── turn restorers          after a restart, in a nursery of their own: load each open turn, hand it on
    ├── batches                 BatchService.run (api/_batches.py): a cancel scope per running batch, its lines
    ├── monitor                 on a terminal: the live view (_monitor.py); q drains
    ├── unix socket             --socket: its accept loop and connections (_socket.py), WebSocket ops as JSON lines
    └── HTTP listener           our accept loop (_listener.py) -> hypercorn's connections -> request scopes
"""

from __future__ import annotations

import functools
import logging
import os
import signal
from collections.abc import Callable

import trio
from hypercorn.config import Config as HypercornConfig

from ._listener import MAX_HEAD_BYTES, raise_nofile, serve_http
from ._socket import serve_socket
from ._summary import summary_lines
from ._monitor import run_monitor
from .._cpu import CpuYield, unyielding
from ._registry import ModelRegistry
from ..sessions._resumable import SessionStore, serve_resume_ttl
from ..sched import Unavailable
from ..journal import JournalConfig, open_journal
from ..api import App
from ..api._ws import LIMITS as WS_LIMITS
from ..serving import Metrics, ServeConfig, default_sessions_dir

__all__ = ["serve", "stop"]

log = logging.getLogger("superfluid")
summary_log = logging.getLogger("superfluid.summary")


async def _serve_signals(root: trio.Nursery, drain: trio.Event, app_holder: list[App], grace_s: float) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2) as signals:
        stopping = False
        async for signum in signals:
            if signum == signal.SIGUSR2:
                _dump(app_holder)
            elif signum == signal.SIGUSR1:
                log.info("SIGUSR1: draining (no new requests; in-flight ones may finish)")
                for app in app_holder:
                    app.accepting = False
                drain.set()
            elif stopping:
                log.info("%s again: exiting now", signal.Signals(signum).name)
                root.cancel_scope.cancel()
                return
            else:
                stopping = True
                root.start_soon(stop, root.cancel_scope, app_holder, grace_s, signal.Signals(signum).name)


def _dump(apps: list[App]) -> None:
    """SIGUSR2: every task's await chain and every model's scheduler state, to the log."""
    from ._dump import task_tree

    lines = ["SIGUSR2: tasks and schedulers", *task_tree()]
    for app in apps:
        lines += [f"model {name}: {model.scheduler.describe()}" for name, model in app.registry.loaded.items()]
    log.warning("%s", "\n".join(lines))


async def stop(root: trio.CancelScope, apps: list[App], grace_s: float, why: str = "stop") -> None:
    """Shut the daemon down: every in-flight stream ends with a ``server_shutting_down``
    error frame (and ``[DONE]``), every waiting request with a 503, within ``grace_s``
    (``--shutdown-grace``); then the root is cancelled. Resumable generations are not
    ended: the log shows them unfinished and the next start resumes them."""
    inflight = sum(app.stopping.inflight for app in apps)
    log.info("%s: shutting down; %d exchange(s) in flight end typed within %g s", why, inflight, grace_s)
    for app in apps:
        app.stopping.begin()
    with trio.move_on_after(grace_s) as waited:
        for app in apps:
            await app.stopping.wait_idle()
    if waited.cancelled_caught:
        log.warning("shutdown: %d exchange(s) still in flight after %g s; closing them",
                    sum(app.stopping.inflight for app in apps), grace_s)
    root.cancel()


def hypercorn_config(config: ServeConfig) -> HypercornConfig:
    """hypercorn's settings for the daemon's listener (``_listener.serve_http``)."""
    hconfig = HypercornConfig()
    hconfig.bind = [f"{config.host}:{config.port}"]
    hconfig.backlog = config.backlog
    hconfig.graceful_timeout = config.drain_timeout_s
    hconfig.accesslog = None
    # our own logger object: hypercorn then adds no handler of its own (each of its lines was printed twice)
    hconfig.errorlog = logging.getLogger("hypercorn.error")
    # hypercorn's keep-alive timer runs from a connection's accept, and from the end of each response, until
    # a complete request head has arrived: it is the header timeout (a slowloris is closed when it fires)
    hconfig.keep_alive_timeout = config.header_timeout_s
    # a head still arriving is refused (431) by h11 past this; a complete one by _listener.head_limited
    hconfig.h11_max_incomplete_size = MAX_HEAD_BYTES
    # the WebSocket limit, enforced while a message is read (1009), not after 16 MiB are buffered
    hconfig.websocket_max_message_size = WS_LIMITS.max_message
    # hypercorn's read_timeout would bound every read of a connection, and a client that
    # streams a long reply or follows a WebSocket legitimately sends nothing for minutes:
    # the body deadline (--body-timeout, api/_http.py) and --ws-idle-timeout bound those
    hconfig.read_timeout = None
    return hconfig


def _open_files() -> None:
    """Raise the open-files limit as far as the hard limit allows, and say once where it stands
    (every connection takes a descriptor: at the usual soft 1,024, a few hundred idle clients
    left accept failing with EMFILE)."""
    before, after = raise_nofile()
    if after != before:
        log.info("open files: at most %d (the soft limit was %d; raised toward the hard limit)", after, before)
    else:
        log.info("open files: at most %d (the hard limit allows no more); each connection takes one", after)


def journal_config() -> JournalConfig:
    # a commit's thread may have been started while the event loop ran SCHED_BATCH
    # (superfluid/_cpu.py): it never waits for a scheduler tick
    return JournalConfig(full_fsync=os.environ.get("SUPERFLUID_FULLFSYNC") == "1", in_thread=unyielding)


async def _start_fleet(root: trio.Nursery, config: ServeConfig, registry: ModelRegistry) -> None:
    """The head's fleet tasks in the root nursery (SPEC.md §14): the nodes' listener (advertised
    by mDNS), the dialers of --fleet nodes."""
    from ..fleet._head import dial_nodes, serve_fleet_listener

    link = {"key": config.fleet_key, "attach": registry.attach_node, "lease_s": config.fleet_lease_s}
    if config.fleet_listen is not None:
        host, port = config.fleet_listen
        bound = await root.start(functools.partial(serve_fleet_listener, host, port, **link))
        if config.fleet_mdns:
            root.start_soon(_advertise, bound, host)
    if config.fleet_dial:
        await root.start(functools.partial(dial_nodes, list(config.fleet_dial), **link))


async def _advertise(port: int, host: str) -> None:
    """mDNS for ``node join`` with no address; a network with no multicast only loses that."""
    from ..fleet._mdns import DiscoveryError, advertise

    try:
        await advertise(port, host="" if host in ("", "0.0.0.0", "::") else host)
    except DiscoveryError as exc:
        log.warning("fleet: not advertised by mDNS (%s); nodes join with the head's address", exc)


async def serve(
    config: ServeConfig, *, handle_signals: bool = True, monitor: bool = False,
    announce: Callable[[list[str]], None] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run the daemon until cancelled (or drained).

    Returns (via ``task_status``) the bound addresses, e.g. ``["http://127.0.0.1:8453"]``.
    ``monitor`` draws the live monitor on the terminal (daemon/_monitor.py) once listening.
    Once listening it hands the startup summary (``_summary.summary_lines``) to
    ``announce``; by default it is logged once on ``superfluid.summary`` (with the
    monitor on, it also heads every frame of the monitor and opens its log file).

    Raises:
        WorkerLoadFailed: a model did not load at startup.
        JournalLocked: another server holds the sessions directory.
        WalCorrupt: the session log is damaged (``sessions_cache`` starts fresh).

    Cancellation: cancelling stops the listener and shuts every worker down
    (protocol Shutdown, then SIGTERM/SIGKILL with bounded grace).
    """
    _open_files()
    metrics = Metrics()
    drain = trio.Event()
    cpu = CpuYield(enabled=config.cpu_yield)
    app_holder: list[App] = []
    sessions_dir = config.sessions or default_sessions_dir()
    try:
        async with open_journal(sessions_dir, fresh=config.sessions_cache, config=journal_config()) as journal, \
                trio.open_nursery() as root:
            if handle_signals:
                root.start_soon(_serve_signals, root, drain, app_holder, config.shutdown_grace_s)
            store = SessionStore(journal, resume_ttl_s=config.resume_ttl_s)
            registry = ModelRegistry(config, metrics, committer=store, cpu=cpu)
            await root.start(registry.run)  # the models nursery: supervisors, idle unload (_lifetime.py)
            for i, source in enumerate(config.models):
                await registry.load(source, make_default=(i == 0))
            app = App(config, registry, metrics, store)
            if config.fleet:   # nodes come back before the log's resumable sessions are resumed on them
                await _start_fleet(root, config, registry)
                await registry.wait_for_models(store.models_to_resume(), config.fleet_wait_s)
            restored = await store.restore(registry)
            turns = app.open_turns()  # conversation turns run to their end: no --resume-ttl for them
            # the restorers' own nursery (one short task a turn; each hands its turn to its model)
            root.start_soon(app.restore_turns, list(turns))
            await root.start(app.batches.run)  # batches left running go on (api/_batches.py)
            held = set(turns.values())
            for session in restored:
                if session.id not in held:
                    try:
                        registry.loaded[session.model].actor.start_session(serve_resume_ttl, store, session,
                                                                           job=session.job)
                    except Unavailable:
                        pass  # its model failed meanwhile: its close ended the job typed
            app_holder.append(app)
            hconfig = hypercorn_config(config)

            async def serve_listener(*, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
                # On drain, the listener stops accepting and waits up to graceful_timeout
                # for in-flight requests; when it returns, everything else shuts down.
                await serve_http(app, hconfig, per_client=config.max_connections_per_client,
                                 shutdown_trigger=drain.wait, task_status=task_status)
                root.cancel_scope.cancel()

            binds = await root.start(serve_listener)
            if config.socket is not None:
                await root.start(serve_socket, app, config.socket)
            lines = summary_lines(config, registry.loaded.values(), binds, sessions_dir=sessions_dir,
                                  default=registry.default)
            if announce is None:
                for line in lines:
                    summary_log.info("%s", line)
            else:
                announce(lines)
            if monitor:
                def quit_drain() -> None:  # q in the monitor: as SIGUSR1
                    for app in app_holder:
                        app.accepting = False
                    drain.set()

                root.start_soon(functools.partial(run_monitor, registry, metrics, binds=binds, on_quit=quit_drain,
                                                  log_file=sessions_dir / "logs" / "serve.log", summary=lines))
            task_status.started(binds)
    finally:
        cpu.close()  # back to SCHED_OTHER: the thread may live on (tests run the daemon in-process)
