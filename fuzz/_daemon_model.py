"""Harness for the stateful daemon fuzzers (``fuzz/test_fuzz_daemon.py``, ``fuzz/test_fuzz_real.py``,
``bench/fuzz_campaign.py``).

A *sequence* is a list of actions (the frozen classes below). :func:`run_batch`
starts the real daemon as a subprocess (``python -m superfluid serve``; the
:class:`Target` says what it serves: ``MOCK``, two mock models with ``--max-batch 4
--hang-timeout 2 --resume-ttl 5``, or :func:`real_target`, SmolLM2 on llama.cpp twice,
``--deterministic``), applies each sequence of the batch in turn in one ``trio.run``,
and checks the invariants after every step, at the quiescence each sequence ends in
(where the next one starts) and after the daemon's SIGTERM. Requests run in the
background while later actions (worker SIGKILL, unload, daemon SIGKILL and restart,
...) hit them. :func:`run_sequence` is a batch of one. ``Harness.stats`` counts what was
checked (:class:`Stats`).

Invariants (each violation is one line of the :class:`InvariantViolation`):

``terminates``
    Every request ends: completed, or a typed error (an HTTP status with a JSON
    ``error`` object, or an SSE ``data: {"error":…}`` frame right before
    ``data: [DONE]``); never a reset, a stream without ``[DONE]``, or no answer
    within ``REQUEST_DEADLINE_S``. Requests in flight when the daemon itself is
    SIGKILLed are exempt (their text is still checked as a prefix).
``explained``
    A valid request only fails when a disruption (worker kill, unload, a fault
    prompt, a hang) overlapped it; never with a 4xx. The fault ``bug_after=N``
    makes the model's actor raise (the injected bug): every request of that
    model then ends 503 ``model_failed`` and the actor restarts; the fault
    request explains them (as any fault request does).
``exact``
    The text a client received is a prefix of the reference text for the same
    body (computed on a separate clean daemon); a completed greedy or seeded
    request's text *equals* it, and a resumed session's head + resumed tail equals
    it. Nothing is delivered twice and nothing committed is lost.
``resumable``
    A session id can be resumed from the last ``id:`` its client saw, also
    after a daemon SIGKILL: never a 400 for a cursor the client was shown.
``max_batch``
    ``superfluid_lanes_active`` of each model (polled every few ms) never exceeds ``--max-batch``.
``quiescent``
    After the last request: ``superfluid_lanes_active`` and every queue depth are
    0; a normal request to each model succeeds with the reference text; exactly
    one live worker per loaded model among the daemon's children, no zombie;
    the daemon's open file descriptors return to their baseline (+ slack).
``clean_exit``
    SIGTERM stops the daemon (exit 0) with no process left in its group, and the
    session log replays (``open_journal``) without ``WalCorrupt``; every session's
    event ids are contiguous, and each tracked session's logged text is a prefix
    of (when it finished: equal to) its reference.
``no_traceback``
    The daemon's log holds no Python traceback, except the one traceback the
    injected bug (``InjectedBug``) logs when its model's actor fails.
``logged_end`` (only with ``strict_sessions`` or ``SUPERFLUID_FUZZ_STRICT_SESSIONS=1``)
    Every tracked session the last daemon run wrote to is finished in the log after
    quiescence and SIGTERM. A known issue breaks it (a resumable session whose client
    left and whose job then failed is never logged as ended:
    ``test_a_failed_resumable_sessions_end_is_logged``), so by default it is only counted
    (``Stats.unlogged_ends``).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Union

import attrs
import httpx
import psutil
import trio

from superfluid.client import aiter_sse
from superfluid.suite._client import metric_sum
import trio.lowlevel

__all__ = [
    "MOCK", "Action", "FreezeWorker", "InvariantViolation", "KillDaemon", "KillWorker", "Load", "Resume", "Sleep",
    "Start", "Stats", "StopGeneration", "Target", "Unload", "format_batch", "format_sequence", "random_sequence",
    "close_reference", "default_gguf", "real_batches", "real_sequence", "real_target", "run_batch", "run_sequence",
]

MODELS = ("mock", "m2")       # the names actions use; a Target maps them onto the models it serves
OPTS = "step_ms=2&prefill_us=20"
MAX_BATCH = 4
HANG_TIMEOUT_S = 2.0
POISON_SETTLE_S = 30.0   # how long a resumed fault request may crash-loop a worker after a daemon restart
RESUME_TTL_S = 5.0
REQUEST_DEADLINE_S = 45.0     # a request that is still open after this "hangs"
EXPLAIN_SLACK_S = 3.0         # a disruption explains errors of requests within this long after it
FD_SLACK = 4
FREEZE_MIN_AGE_S = 3.0        # FreezeWorker leaves younger workers alone (they may still be loading)
METRICS_POLL_S = 0.01         # how often the max_batch invariant samples /metrics
math_inf = float("inf")
PARK_BUDGET_GB = 0.05         # --park's directory budget for the daemon under test (evictions happen too)
SHARED_PREFIX = " the model reads every token and the worker keeps the cache" * 100  # ~1100 tokens


@attrs.frozen
class Target:
    """What the daemon under test serves, and how. Actions name the models ``mock`` and ``m2``
    (``MODELS``); ``models`` are the names the daemon serves them under, in that order."""

    name: str
    runtime: str                      # the worker's runtime (``superfluid-worker-<runtime>``)
    specs: tuple[str, ...]            # the serve command's model specs (first positional, then --model)
    models: tuple[str, ...]           # their served names
    flags: tuple[str, ...] = ()       # further serve flags (the daemon under test and the reference)
    ref_specs: tuple[str, ...] = ()   # the reference daemon's models (it answers as ``models[0]``)
    ref_parallel: int = 8             # reference requests at once (1: each runs alone)
    ref_max_batch: int = 8
    max_batch: int = MAX_BATCH
    hang_timeout_s: float = HANG_TIMEOUT_S
    resume_ttl_s: float = RESUME_TTL_S
    shared_prefix: str = SHARED_PREFIX
    park: bool = False                # the daemon under test (not the reference) runs with --park

    def served(self, model: str) -> str:
        return self.models[MODELS.index(model)]

    def argv(self, port: int, sessions: Path, *, reference: bool = False) -> list[str]:
        specs = self.ref_specs if reference else self.specs
        argv = [sys.executable, "-m", "superfluid", "serve", specs[0]]
        for spec in specs[1:]:
            argv += ["--model", spec]
        if self.runtime == "mock":
            argv += ["--runtime", "mock"]
        return argv + [
            "--http", f"127.0.0.1:{port}", "--sessions", str(sessions),
            "--max-batch", str(self.ref_max_batch if reference else self.max_batch),
            "--hang-timeout", str(self.hang_timeout_s), "--resume-ttl", str(self.resume_ttl_s),
            "--log-level", "WARNING", *self.flags,
            *(("--park", "--park-budget-gb", str(PARK_BUDGET_GB)) if self.park and not reference else ()),
        ]

    def model_of_worker(self, cmdline: list[str]) -> str | None:
        """The action name (``mock``/``m2``) of the model a worker process serves, or None."""
        from superfluid.models._files import model_name

        if not any(f"superfluid-worker-{self.runtime}" in c for c in cmdline) or "--model" not in cmdline:
            return None
        served = model_name(cmdline[cmdline.index("--model") + 1], self.runtime)
        return MODELS[self.models.index(served)] if served in self.models else None


# --park: a finished shared-prefix turn (~1100 tokens) is parked; after a daemon kill (its KV and
# host cache gone) the next turn on that prefix restores it from disk, and its text is still
# compared with the reference daemon's (which never parks)
MOCK = Target(
    name="mock", runtime="mock", specs=(f"mock?{OPTS}", f"mock?name=m2&{OPTS}"), models=MODELS,
    ref_specs=("mock?step_ms=0&prefill_us=0",), park=True,
)


def real_target(gguf: Path, linkdir: Path) -> Target:
    """SmolLM2 (or any GGUF) on llama.cpp as two models, the second a symlink under ``linkdir``
    (an unload needs a second model), ``--deterministic``: a request's text does not depend on
    its batch neighbours, the prefix cache or a worker restart (SPEC §5), so it equals the same
    request run alone on a fresh daemon. One engine thread each (llama.cpp's spinning barrier
    slows ~40x when its threads share cores with other busy processes)."""
    from superfluid.models._files import model_name

    linkdir.mkdir(parents=True, exist_ok=True)
    twin = linkdir / "fuzz-twin.gguf"
    if not twin.is_symlink():
        twin.symlink_to(gguf.resolve())
    first, second = str(gguf), str(twin)
    return Target(
        name="real", runtime="llamacpp", specs=(first, second),
        models=(model_name(first, "llamacpp"), model_name(second, "llamacpp")),
        flags=("--deterministic", "--threads", "1", "--max-context", "512",
               "--stream-interval-ms", "10", "--agent-stream-interval-ms", "10"),
        ref_specs=(first,), ref_parallel=1, ref_max_batch=4,
        hang_timeout_s=30.0, resume_ttl_s=5.0,
        shared_prefix=" the model reads every token and the worker keeps the cache" * 4,
    )


# --- actions ---------------------------------------------------------------------------------------

@attrs.frozen
class Start:
    """Start ``n`` requests in the background (request ``i`` gets prompt ``i`` of family ``prompt``)."""

    n: int = 1
    model: str = "mock"
    route: str = "chat"               # "chat" (/v1/chat/completions) or "completion" (/v1/completions)
    stream: bool = True
    resumable: bool = False           # x-superfluid-resumable (streams only)
    qos: str | None = None            # x-superfluid-qos
    prompt: int = 0
    shared: bool = False              # all n share a ~1100-token prefix
    max_tokens: int = 40
    ignore_eos: bool = False
    seeded: bool = False              # temperature 0.8 with a seed, else greedy
    fault: str | None = None          # a [[mock:...]] directive in request 0's prompt, e.g. "crash_after=3"
    disconnect: int | None = None     # streams: leave after this many data events; else after this many ms
    slow_ms: int = 0                  # sleep per line read


@attrs.frozen
class Sleep:
    ms: int


@attrs.frozen
class KillWorker:
    model: str


@attrs.frozen
class FreezeWorker:
    """SIGSTOP the model's worker: it reads and answers nothing until --hang-timeout replaces it."""

    model: str


@attrs.frozen
class Unload:
    model: str


@attrs.frozen
class Load:
    model: str


@attrs.frozen
class KillDaemon:
    """SIGKILL the daemon's process group, then restart it on the same sessions dir and port."""


@attrs.frozen
class Resume:
    """Follow tracked session ``which`` (mod their number) from the last event id a client saw."""

    which: int = 0
    disconnect: int | None = None
    slow_ms: int = 0


@attrs.frozen
class StopGeneration:
    which: int = 0


Action = Union[Start, Sleep, KillWorker, FreezeWorker, Unload, Load, KillDaemon, Resume, StopGeneration]


def format_sequence(actions: list[Action], indent: str = "") -> str:
    return "[\n" + "".join(f"{indent}    {a!r},\n" for a in actions) + indent + "]"


def format_batch(batch: list[list[Action]]) -> str:
    return "[\n" + "".join(f"    {format_sequence(seq, '    ')},\n" for seq in batch) + "]"


class InvariantViolation(AssertionError):
    sequence_index: int | None = None     # which sequence of a batch was running (None: the batch's end)
    stats: Stats | None = None


# --- request bodies and references -----------------------------------------------------------------

RefKey = tuple[str, str, int, bool, bool]   # route, prompt text, max_tokens, ignore_eos, seeded
PROBE: RefKey = ("chat", "probe", 8, False, False)


def prompt_text(start: Start, i: int, shared_prefix: str = SHARED_PREFIX) -> str:
    text = f"story {start.prompt} part {i}"
    if start.shared:
        text = shared_prefix + " " + text
    if start.fault and i == 0:
        text = f"[[mock:{start.fault}]] " + text
    return text


def body_for(key: RefKey, *, model: str, stream: bool) -> dict[str, Any]:
    route, text, max_tokens, ignore_eos, seeded = key
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "ignore_eos": ignore_eos, "stream": stream}
    body.update({"temperature": 0.8, "seed": 1234} if seeded else {"temperature": 0})
    if route == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return body


def path_of(route: str) -> str:
    return "/v1/chat/completions" if route == "chat" else "/v1/completions"


def _free_port() -> int:
    """A free port below Linux's ephemeral range (32768-60999): a port the kernel hands out
    (bind to 0) may become a client connection's local port before the daemon binds it, or
    while a killed daemon restarts on it (seed 19024: "address already in use", and requests
    reached another sequence's daemon)."""
    import random

    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


def _wait_ready_sync(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode} during startup")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError("daemon did not become ready")


@attrs.frozen
class Ref:
    text: str
    finish: str
    tokens: int          # the reference's completion_tokens


class _Reference:
    """A clean daemon that computes reference texts, cached: for the mock, no faults and no
    timing (``step_ms=0``); for a real model, a fresh daemon that runs each request alone."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.dir = Path(tempfile.mkdtemp(prefix="superfluid-fuzz-ref-"))
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            target.argv(self.port, self.dir / "sessions", reference=True),
            stdout=open(self.dir / "daemon.log", "ab"), stderr=subprocess.STDOUT, start_new_session=True,
        )
        atexit.register(self.close)
        _wait_ready_sync(self.url, self.proc, timeout=120.0)
        self.cache: dict[RefKey, Ref] = {}

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    async def fill(self, keys: set[RefKey]) -> None:
        missing = sorted(k for k in keys if k not in self.cache)
        if not missing:
            return
        async with httpx.AsyncClient(base_url=self.url, timeout=120) as client:
            async def one(key: RefKey, limiter: trio.CapacityLimiter) -> None:
                async with limiter:
                    r = await client.post(path_of(key[0]), json=body_for(key, model=self.target.models[0],
                                                                         stream=False))
                if r.status_code != 200:
                    raise RuntimeError(f"reference daemon refused {key!r}: {r.status_code} {r.text}")
                obj = r.json()
                choice = obj["choices"][0]
                text = choice["message"]["content"] if key[0] == "chat" else choice["text"]
                self.cache[key] = Ref(text or "", choice["finish_reason"], int(obj["usage"]["completion_tokens"]))

            limiter = trio.CapacityLimiter(self.target.ref_parallel)
            async with trio.open_nursery() as n:
                for key in missing:
                    n.start_soon(one, key, limiter)


_REFERENCES: dict[Target, _Reference] = {}


def reference(target: Target | None = None) -> _Reference:
    target = target or MOCK
    ref = _REFERENCES.get(target)
    if ref is None or ref.proc.poll() is not None:
        ref = _REFERENCES[target] = _Reference(target)
    return ref


def close_reference(target: Target) -> None:
    """Stop ``target``'s reference daemon now (else at exit)."""
    ref = _REFERENCES.pop(target, None)
    if ref is not None:
        ref.close()


# --- the daemon under test ---------------------------------------------------------------------------

class Daemon:
    def __init__(self, workdir: Path, target: Target) -> None:
        self.target = target
        self.sessions = workdir / "sessions"
        self.log = workdir / "daemon.log"
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.pgids: list[int] = []

    async def start(self) -> None:
        self._spawn()  # a fork and a log line: quick
        await trio.to_thread.run_sync(_wait_ready_sync, self.url, self.proc)

    def _spawn(self) -> None:
        with open(self.log, "ab") as log:
            log.write(f"--- start at {time.time():.3f}\n".encode())
            self.proc = subprocess.Popen(self.target.argv(self.port, self.sessions), stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.pgids.append(self.proc.pid)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def workers(self) -> dict[str, list[psutil.Process]]:
        """Live (non-zombie) worker children of the daemon, by model name."""
        out: dict[str, list[psutil.Process]] = {}
        try:
            children = psutil.Process(self.pid).children()
        except psutil.NoSuchProcess:
            return out
        for p in children:
            try:
                model = self.target.model_of_worker(p.cmdline())
                if model is None or p.status() == psutil.STATUS_ZOMBIE:
                    continue
            except psutil.NoSuchProcess:
                continue
            out.setdefault(model, []).append(p)
        return out

    def zombies(self) -> list[int]:
        try:
            return [p.pid for p in psutil.Process(self.pid).children() if p.status() == psutil.STATUS_ZOMBIE]
        except psutil.NoSuchProcess:
            return []

    def num_fds(self) -> int:
        """Open fds, less TCP sockets the client already closed (CLOSE_WAIT): hypercorn's trio
        server keeps those until ``keep_alive_timeout`` (a known issue with its own regression
        test, ``test_client_closed_connections_release_their_fds``). ``SUPERFLUID_FUZZ_STRICT_FDS=1``
        counts them too."""
        proc = psutil.Process(self.pid)
        n = proc.num_fds()
        if os.environ.get("SUPERFLUID_FUZZ_STRICT_FDS") != "1":
            n -= sum(1 for c in proc.net_connections("tcp") if c.status == psutil.CONN_CLOSE_WAIT)
        return n

    def group_survivors(self, pgid: int) -> list[str]:
        out = []
        for p in psutil.process_iter(["pid", "status", "cmdline"]):
            try:
                if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                    out.append(f"{p.pid} {' '.join(p.info['cmdline'] or [])[:120]}")
            except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
                continue
        return out

    async def kill(self) -> None:
        """SIGKILL the whole process group and wait for the daemon."""
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        await trio.to_thread.run_sync(self.proc.wait)

    def log_tail(self, n: int = 60) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


# --- requests ---------------------------------------------------------------------------------------

@attrs.define(eq=False)
class Req:
    no: int
    step: int
    kind: str                          # "request", "resume", "stop", "unload", "load"
    epoch: int
    model: str = ""
    key: RefKey | None = None          # None: no reference (a fault prompt)
    stream: bool = False
    resumable: bool = False
    fault: bool = False
    session: str | None = None         # the tracked session (resumes and resumable streams)
    t0: float = 0.0
    t1: float | None = None
    status: int | None = None
    text: str = ""
    finish: str | None = None
    error: Any = None
    done_frame: bool = False
    outcome: str = "running"           # completed, error, disconnected, killed, violation
    problems: list[str] = attrs.field(factory=list)

    def describe(self) -> str:
        return (f"#{self.no} ({self.kind} from step {self.step}, model={self.model}, stream={self.stream}, "
                f"resumable={self.resumable}, session={self.session}) outcome={self.outcome} status={self.status} "
                f"finish={self.finish} error={json.dumps(self.error)[:200] if self.error is not None else None} "
                f"text[:60]={self.text[:60]!r}")


@attrs.define(eq=False)
class Tracked:
    """A resumable session: the furthest cursor a client was shown, and the text up to it."""

    id: str
    key: RefKey | None
    model: str
    cursor: int = 0
    head: str = ""
    finished: str | None = None        # the finish reason a follower saw, if any


def _is_typed_error(obj: Any) -> bool:
    if not isinstance(obj, dict) or not isinstance(obj.get("error"), dict):
        return False
    err = obj["error"]
    return isinstance(err.get("message"), str) and bool(err["message"]) and isinstance(err.get("type"), str) \
        and set(err) == {"message", "type", "param", "code"}


def _content(obj: dict[str, Any]) -> str:
    out = []
    for c in obj.get("choices") or ():
        delta = c.get("delta")
        out.append((delta.get("content") or "") if isinstance(delta, dict) else (c.get("text") or ""))
    return "".join(out)


def _finish(obj: dict[str, Any]) -> str | None:
    for c in obj.get("choices") or ():
        if c.get("finish_reason"):
            return str(c["finish_reason"])
    return None


# --- the harness ------------------------------------------------------------------------------------

@attrs.define
class Stats:
    """What a batch (or a campaign) checked. ``lost``: text a client was promised and did not get
    (a completed text short of its reference, a cursor it was shown refused on resume, a session
    neither live nor logged, a log shorter than what a client saw); ``duplicated``: text delivered
    twice (an event id going back, a text longer than its reference, a log with repeated ids)."""

    sequences: int = 0
    steps: int = 0
    requests: int = 0
    completed: int = 0                # requests and resumes that completed
    streams_completed: int = 0        # of them, streams (SSE to [DONE] with a finish)
    resumed_completed: int = 0        # resumes that completed (head + tail == reference)
    errors: int = 0                   # typed errors (each explained by a disruption)
    disconnected: int = 0
    killed: int = 0                   # in flight when the daemon was SIGKILLed
    tokens_compared: int = 0          # completion tokens of the references that completed texts equalled
    chars_compared: int = 0           # characters compared (prefix checks of cut texts included)
    lost: int = 0
    duplicated: int = 0
    mismatched: int = 0               # other differences from the reference
    daemon_kills: int = 0
    worker_kills: int = 0
    unlogged_ends: int = 0            # sessions left unfinished in the log at the end (strict_sessions)
    park_resumes: int = 0             # admissions restored from a parked artifact (--park), summed over daemons

    def add(self, other: Stats) -> None:
        for field in attrs.fields(Stats):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))


class Harness:
    """Runs a batch of sequences on one daemon: after each sequence the daemon is quiescent
    (checked), which is where the next one starts; the daemon is stopped and its log replayed
    after the last."""

    def __init__(self, batch: list[list[Action]], workdir: Path, target: Target = MOCK, *,
                 strict_sessions: bool | None = None) -> None:
        self.batch = batch
        self.target = target
        # a resumable session whose client left and whose job then failed (unload, worker
        # unavailable, a lane fault, an actor bug) is never logged as ended: a known daemon issue,
        # counted in ``unlogged_ends`` and a violation only with SUPERFLUID_FUZZ_STRICT_SESSIONS=1
        self.strict_sessions = (os.environ.get("SUPERFLUID_FUZZ_STRICT_SESSIONS") == "1"
                                if strict_sessions is None else strict_sessions)
        self.actions: list[Action] = batch[0] if batch else []
        self.workdir = workdir
        self.daemon = Daemon(workdir, target)
        self.dumped = False
        self.ref = reference(target)
        self.epoch = 0
        self.seq = -1
        self.step = -1
        self.reqs: list[Req] = []
        self.tracked: list[Tracked] = []
        self.past_reqs: list[Req] = []
        self.disruptions: list[list[Any]] = []   # [start, end (inf while it lasts), what]
        self.past_disruptions: list[list[Any]] = []
        self.violations: list[str] = []
        self.stats = Stats()
        self.outcomes: dict[str, int] = {}
        self.max_lanes = 0.0
        self.max_lanes_at = ""
        self.client: httpx.AsyncClient | None = None
        self.old_clients: list[httpx.AsyncClient] = []
        self.fd_baseline = 0
        self.active = 0
        self.idle = trio.Event()
        self.idle.set()
        self.killing = False
        self.nursery: trio.Nursery | None = None

    # -- bookkeeping ------------------------------------------------------------------------------

    def violate(self, message: str, kind: str | None = None) -> None:
        """``kind``: ``lost``, ``duplicated`` or ``mismatched`` (counted in the stats)."""
        self.violations.append(message)
        if kind is not None:
            setattr(self.stats, kind, getattr(self.stats, kind) + 1)

    def now(self) -> float:
        return trio.current_time()

    def new_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.daemon.url, timeout=httpx.Timeout(REQUEST_DEADLINE_S + 5),
                                 limits=httpx.Limits(max_keepalive_connections=0, max_connections=200))

    def body(self, key: RefKey, model: str, *, stream: bool) -> dict[str, Any]:
        return body_for(key, model=self.target.served(model), stream=stream)

    def key_of(self, start: Start, i: int) -> RefKey:
        return (start.route, prompt_text(start, i, self.target.shared_prefix), start.max_tokens, start.ignore_eos,
                start.seeded)

    def reference_keys(self) -> set[RefKey]:
        keys: set[RefKey] = {PROBE}
        for actions in self.batch:
            for a in actions:
                if isinstance(a, Start):
                    for i in range(a.n):
                        if not (a.fault and i == 0):
                            keys.add(self.key_of(a, i))
        return keys

    def check(self, where: str) -> None:
        if self.daemon.proc is not None and not self.killing and not self.daemon.alive():
            self.violate(f"daemon exited on its own with status {self.daemon.proc.returncode}")
        if self.max_lanes > self.target.max_batch:
            self.violate(f"superfluid_lanes_active reached {self.max_lanes:g} > --max-batch {self.target.max_batch} "
                         f"({self.max_lanes_at})")
        if self.violations:
            exc = InvariantViolation(self.report(where))
            exc.sequence_index = self.seq if self.seq < len(self.batch) else None
            exc.stats = self.stats
            raise exc

    def report(self, where: str) -> str:
        seq = f" (sequence {self.seq} of the batch)" if len(self.batch) > 1 and 0 <= self.seq < len(self.batch) else ""
        lines = [f"invariant violated {where}{seq}:"] + [f"  - {v}" for v in dict.fromkeys(self.violations)]
        lines.append("requests:")
        lines += [f"  {r.describe()}" for r in self.reqs]
        lines.append(f"disruptions: {[(round(a, 2), round(b, 2), w) for a, b, w in self.disruptions]}")
        lines.append(f"max lanes_active seen: {self.max_lanes:g}")
        lines.append(f"workdir (kept): {self.workdir}")
        lines.append("daemon log tail:\n" + self.daemon.log_tail())
        return "\n".join(lines)

    # -- the run ----------------------------------------------------------------------------------

    async def run(self) -> None:
        await self.ref.fill(self.reference_keys())
        await self.daemon.start()
        self.client = self.new_client()
        await self.settle_baseline()
        for k, actions in enumerate(self.batch):
            await self.run_one(k, actions)
        self.seq = len(self.batch)   # the shutdown checks belong to the whole batch
        await self.stop_and_replay()
        self.check("after shutdown")

    async def run_one(self, k: int, actions: list[Action]) -> None:
        """One sequence, from a quiescent daemon to a quiescent daemon."""
        self.seq, self.actions, self.step = k, actions, -1
        if k:
            self.client = self.new_client()   # quiesce closed the last one
            self.old_clients = []
        # requests and disruptions are the sequence's own; tracked sessions stay resumable targets
        # (a later sequence's Resume may follow one that ended, or expired, long ago)
        self.past_reqs += self.reqs
        self.past_disruptions += self.disruptions
        self.reqs, self.disruptions = [], []
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            poll_scope = trio.CancelScope()
            nursery.start_soon(self.poll_metrics, poll_scope)
            for i, action in enumerate(actions):
                self.step = i
                self.stats.steps += 1
                await self.apply(action)
                self.check(f"after step {i}: {action!r}")
            with trio.move_on_after(REQUEST_DEADLINE_S + 15):
                await self.idle.wait()
            if not self.idle.is_set():
                self.violate("requests still open long after their deadline")
            self.check("after every request ended")
            poll_scope.cancel()
        await self.quiesce()
        self.check("at quiescence")
        self.stats.sequences += 1

    def spawn(self, req: Req, fn: Any, *args: Any) -> None:
        assert self.nursery is not None
        self.reqs.append(req)
        self.active += 1
        self.idle = trio.Event() if self.idle.is_set() else self.idle

        async def wrapper() -> None:
            req.t0 = self.now()
            try:
                with trio.move_on_after(REQUEST_DEADLINE_S) as deadline:
                    await fn(req, *args)
                if deadline.cancelled_caught:
                    req.outcome = "violation"
                    req.problems.append(f"no end within {REQUEST_DEADLINE_S:g}s")
                    self.dump_daemon()
            except (httpx.TransportError, httpx.StreamError) as exc:
                if req.epoch != self.epoch or self.killing:
                    req.outcome = "killed"
                else:
                    req.outcome = "violation"
                    req.problems.append(f"transport error: {type(exc).__name__}: {exc}")
            finally:
                req.t1 = self.now()
                self.judge(req)
                self.active -= 1
                if self.active == 0:
                    self.idle.set()

        self.nursery.start_soon(wrapper)

    def dump_daemon(self) -> None:
        """Once a sequence: SIGUSR2 makes the daemon log where every task waits (kept in the workdir)."""
        if self.dumped or self.daemon.proc is None or not self.daemon.alive():
            return
        self.dumped = True
        try:
            os.kill(self.daemon.proc.pid, signal.SIGUSR2)
        except ProcessLookupError:
            pass

    async def apply(self, action: Action) -> None:
        if isinstance(action, Start):
            for i in range(action.n):
                fault = bool(action.fault and i == 0)
                key = self.key_of(action, i)
                req = Req(no=len(self.reqs), step=self.step, kind="request", epoch=self.epoch, model=action.model,
                          key=None if fault else key, stream=action.stream,
                          resumable=action.stream and action.resumable, fault=fault)
                self.spawn(req, self.do_request, action, key)
            await trio.lowlevel.checkpoint()
        elif isinstance(action, Sleep):
            await trio.sleep(action.ms / 1000)
        elif isinstance(action, KillWorker):
            t = self.now()
            for p in self.daemon.workers().get(action.model, []):
                try:
                    p.send_signal(signal.SIGKILL)
                    self.stats.worker_kills += 1
                except psutil.NoSuchProcess:
                    pass
            self.disruptions.append([t, t, f"kill worker {action.model}"])
        elif isinstance(action, FreezeWorker):
            t = self.now()
            for p in self.daemon.workers().get(action.model, []):
                try:
                    # a worker frozen before its handshake waits out the start timeout (300 s, as
                    # a slow model load may): by design, and longer than a request's deadline here
                    if time.time() - p.create_time() >= FREEZE_MIN_AGE_S:
                        p.send_signal(signal.SIGSTOP)
                except psutil.NoSuchProcess:
                    pass
            self.disruptions.append([t, t + self.target.hang_timeout_s, f"freeze worker {action.model}"])
        elif isinstance(action, (Unload, Load)):
            req = Req(no=len(self.reqs), step=self.step, kind=type(action).__name__.lower(), epoch=self.epoch,
                      model=action.model)
            self.spawn(req, self.do_admin, action)
            await trio.lowlevel.checkpoint()
        elif isinstance(action, KillDaemon):
            await self.kill_daemon()
        elif isinstance(action, Resume):
            if self.tracked:
                tr = self.tracked[action.which % len(self.tracked)]
                req = Req(no=len(self.reqs), step=self.step, kind="resume", epoch=self.epoch, model=tr.model,
                          key=tr.key, stream=True, resumable=True, session=tr.id)
                self.spawn(req, self.do_resume, tr, action)
                await trio.lowlevel.checkpoint()
        elif isinstance(action, StopGeneration):
            if self.tracked:
                tr = self.tracked[action.which % len(self.tracked)]
                req = Req(no=len(self.reqs), step=self.step, kind="stop", epoch=self.epoch, model=tr.model,
                          session=tr.id)
                self.spawn(req, self.do_stop, tr)
                await trio.lowlevel.checkpoint()

    async def count_park_resumes(self) -> None:
        """Add the daemon's ``superfluid_resumes_total`` to the stats before it goes (a restarted
        daemon counts from 0). A daemon that does not answer in time adds nothing."""
        if not self.target.park:
            return
        with trio.move_on_after(2):
            try:
                async with self.new_client() as client:   # (the harness's own may be closed by now)
                    text = (await client.get("/metrics")).text
            except httpx.HTTPError:
                return
            self.stats.park_resumes += int(metric_sum(text, "superfluid_resumes_total") or 0)

    async def kill_daemon(self) -> None:
        await self.count_park_resumes()
        self.killing = True
        self.stats.daemon_kills += 1
        old = self.daemon.pid
        await self.daemon.kill()
        self.epoch += 1
        with trio.move_on_after(10):
            while self.daemon.group_survivors(old):
                await trio.sleep(0.05)
        survivors = self.daemon.group_survivors(old)
        if survivors:
            self.violate(f"processes of the SIGKILLed daemon's group survive: {survivors}")
        if self.client is not None:
            self.old_clients.append(self.client)
        await self.daemon.start()
        self.client = self.new_client()
        self.killing = False
        # a resumable fault request cut by the kill is re-admitted by the restarted daemon and
        # goes on killing workers until it fails typed: a disruption until the baseline settles.
        # Also one whose client left (its generation ran on unfollowed, possibly into the kill),
        # in any sequence of the batch: a disconnected session's error is never logged (the
        # known issue ``strict_sessions`` checks), so it is re-admitted after every restart.
        poisoned = [r for r in self.past_reqs + self.reqs
                    if r.fault and r.resumable and r.outcome in ("killed", "running", "disconnected")]
        span = [self.now(), math_inf, f"fault request #{poisoned[0].no} resumed by the restart"] if poisoned else None
        if span is not None:
            self.disruptions.append(span)
        try:
            await self.settle_baseline(retry_s=POISON_SETTLE_S if poisoned else 0.0)
        finally:
            if span is not None:
                span[1] = self.now()

    async def settle_baseline(self, *, retry_s: float = 0.0) -> None:
        """Warm both models up and take the daemon's fd baseline (no client connection open).
        With ``retry_s``, a probe that fails 503 (a resumed fault request crash-looping the
        worker, then the restart intensity spent) is sent again for up to that long: past the
        intensity the next request is the demand that starts a worker (SPEC §2)."""
        for model in MODELS:
            await self.probe(model, retry_s=retry_s)
        await trio.sleep(0.2)
        self.fd_baseline = self.daemon.num_fds()

    async def probe(self, model: str, *, retry_s: float = 0.0) -> None:
        assert self.client is not None
        key = PROBE
        deadline = trio.current_time() + retry_s
        while True:
            r = await self.client.post("/v1/chat/completions", json=self.body(key, model, stream=False))
            if r.status_code != 503 or trio.current_time() >= deadline:
                break
            await trio.sleep(0.5)
        if r.status_code != 200:
            self.violate(f"a normal request to {model} failed: {r.status_code} {r.text[:300]}")
            return
        text = r.json()["choices"][0]["message"]["content"]
        if text != self.ref.cache[key].text:
            self.violate(f"probe of {model}: text {text!r} != reference {self.ref.cache[key].text!r}",
                         "mismatched")

    # -- request bodies ---------------------------------------------------------------------------

    async def do_request(self, req: Req, start: Start, key: RefKey) -> None:
        assert self.client is not None
        client = self.client
        headers = {}
        if start.qos:
            headers["x-superfluid-qos"] = start.qos
        if start.resumable:
            headers["x-superfluid-resumable"] = "true"
        body = self.body(key, start.model, stream=start.stream)
        if not start.stream:
            with trio.move_on_after(start.disconnect / 1000 if start.disconnect is not None else math_inf) as cs:
                r = await client.post(path_of(start.route), json=body, headers=headers)
            if cs.cancelled_caught:
                req.outcome = "disconnected"
                return
            req.status = r.status_code
            self.read_whole(req, r, chat=start.route == "chat")
            return
        async with client.stream("POST", path_of(start.route), json=body, headers=headers) as r:
            req.status = r.status_code
            sid = r.headers.get("x-superfluid-session")
            tracked = None
            if r.status_code == 200 and req.resumable:
                if not sid:
                    req.problems.append("a resumable stream without x-superfluid-session")
                else:
                    req.session = sid
                    tracked = Tracked(id=sid, key=req.key, model=start.model)
                    self.tracked.append(tracked)
            await self.read_stream(req, r, tracked, disconnect=start.disconnect, slow_ms=start.slow_ms)

    async def do_resume(self, req: Req, tr: Tracked, action: Resume) -> None:
        assert self.client is not None
        cursor, head = tr.cursor, tr.head
        req.text = head
        async with self.client.stream("GET", f"/v1/sessions/{tr.id}/stream",
                                      headers={"Last-Event-ID": str(cursor)}) as r:
            req.status = r.status_code
            if r.status_code == 404:
                await self.read_error_body(req, r)
                # not live here: then the log must show it ended (it was not lost)
                info = await self.client.get(f"/v1/sessions/{tr.id}")
                if info.status_code != 200:
                    req.problems.append(f"session {tr.id} is neither live nor in the log ({info.status_code})")
                elif info.json().get("finish_reason") is None:
                    req.problems.append(f"session {tr.id} is not live but its log shows no end: {info.text[:200]}")
                else:
                    req.outcome = "gone"
                return
            await self.read_stream(req, r, tr, disconnect=action.disconnect, slow_ms=action.slow_ms)

    async def do_stop(self, req: Req, tr: Tracked) -> None:
        assert self.client is not None
        r = await self.client.delete(f"/v1/sessions/{tr.id}/generation")
        req.status = r.status_code
        if r.status_code == 200:
            req.outcome = "completed"
        else:
            await self.read_error_body(req, r)
            if r.status_code in (404, 409):
                req.outcome = "refused"

    async def do_admin(self, req: Req, action: Unload | Load) -> None:
        assert self.client is not None
        path = "/v1/models/unload" if isinstance(action, Unload) else "/v1/models/load"
        span = [self.now(), math_inf, f"{type(action).__name__.lower()} {action.model}"]
        if isinstance(action, Unload):
            self.disruptions.append(span)
        try:
            r = await self.client.post(path, json={"model": self.target.served(action.model)})
        finally:
            span[1] = self.now()
        req.status = r.status_code
        if r.status_code == 200:
            req.outcome = "completed"
        else:
            await self.read_error_body(req, r)
            if r.status_code == 400 and isinstance(action, Unload):
                req.outcome = "refused"   # the last loaded model

    async def read_error_body(self, req: Req, r: httpx.Response) -> None:
        raw = await r.aread()
        try:
            obj = json.loads(raw)
        except ValueError:
            req.problems.append(f"HTTP {r.status_code} with a body that is not JSON: {raw[:200]!r}")
            req.outcome = "violation"
            return
        if not _is_typed_error(obj):
            req.problems.append(f"HTTP {r.status_code} without a typed error body: {raw[:200]!r}")
            req.outcome = "violation"
            return
        req.error = obj["error"]
        req.outcome = "error"

    def read_whole(self, req: Req, r: httpx.Response, *, chat: bool) -> None:
        try:
            obj = r.json()
        except ValueError:
            req.problems.append(f"HTTP {r.status_code} with a body that is not JSON: {r.text[:200]!r}")
            req.outcome = "violation"
            return
        if r.status_code != 200:
            if not _is_typed_error(obj):
                req.problems.append(f"HTTP {r.status_code} without a typed error body: {r.text[:200]!r}")
                req.outcome = "violation"
            else:
                req.error = obj["error"]
                req.outcome = "error"
            return
        choice = obj["choices"][0]
        req.text = (choice["message"]["content"] if chat else choice["text"]) or ""
        req.finish = choice["finish_reason"]
        req.outcome = "completed"

    async def read_stream(self, req: Req, r: httpx.Response, tr: Tracked | None, *, disconnect: int | None,
                          slow_ms: int) -> None:
        if r.status_code != 200:
            await self.read_error_body(req, r)
            return
        if not r.headers.get("content-type", "").startswith("text/event-stream"):
            req.problems.append(f"200 stream with content-type {r.headers.get('content-type')!r}")
        n = 0
        last_id = -1
        current_id: str | None = None
        async for event in aiter_sse(r.aiter_bytes()):
            if slow_ms:
                await trio.sleep(slow_ms / 1000)
            current_id = event.id if event.id is not None else current_id
            if not event.data:
                continue
            payload = event.data
            if req.done_frame:
                req.problems.append(f"data after [DONE]: {payload[:100]!r}")
            if payload == "[DONE]":
                req.done_frame = True
                continue
            if req.error is not None:
                req.problems.append(f"data after the error frame: {payload[:100]!r}")
            try:
                obj = json.loads(payload)
            except ValueError:
                req.problems.append(f"an SSE frame that is not JSON: {payload[:100]!r}")
                continue
            if "error" in obj:
                if not _is_typed_error(obj):
                    req.problems.append(f"an untyped SSE error frame: {payload[:200]!r}")
                req.error = obj.get("error")
            else:
                req.text += _content(obj)
                req.finish = _finish(obj) or req.finish
                if tr is not None and current_id is not None:
                    cursor = int(current_id)
                    if cursor < last_id:
                        req.problems.append(f"event id went back: {cursor} after {last_id}")
                    last_id = cursor
                    if len(req.text) >= len(tr.head):
                        tr.cursor, tr.head = cursor, req.text
                    if req.finish is not None:
                        tr.finished = req.finish
            n += 1
            if disconnect is not None and n >= disconnect and not req.done_frame:
                req.outcome = "disconnected"
                return
        if not req.done_frame:
            if req.epoch != self.epoch or self.killing:
                req.outcome = "killed"
                return
            req.problems.append("the stream ended without data: [DONE]")
            req.outcome = "violation"
            return
        req.outcome = "error" if req.error is not None else "completed"
        if req.outcome == "completed" and req.finish is None:
            req.problems.append("a completed stream without a finish_reason")

    # -- judging ----------------------------------------------------------------------------------

    def explained(self, req: Req) -> bool:
        if req.fault:
            return True
        end = req.t1 if req.t1 is not None else self.now()
        # a resume replays how its session ended, which may have been long before the resume began
        # (in an earlier sequence of the batch, too); a request, only by what overlapped it
        resume = req.kind == "resume"
        start = -math_inf if resume else req.t0
        for a, b, _what in (self.past_disruptions + self.disruptions) if resume else self.disruptions:
            if a <= end and start <= b + EXPLAIN_SLACK_S:
                return True
        for other in (self.past_reqs + self.reqs) if resume else self.reqs:
            if other.fault and other.t0 <= end and start <= (other.t1 or self.now()) + EXPLAIN_SLACK_S:
                return True
        return False

    def judge(self, req: Req) -> None:
        if req.fault and req.t1 is not None:
            self.disruptions.append([req.t0, req.t1, f"fault request #{req.no}"])
        if req.problems and req.outcome != "killed":
            req.outcome = "violation"
        self.count(req)
        if req.outcome == "violation":
            kind = None
            if any("event id went back" in p or "data after [DONE]" in p for p in req.problems):
                kind = "duplicated"
            elif any("neither live nor in the log" in p or "its log shows no end" in p for p in req.problems):
                kind = "lost"
            self.violate(f"request #{req.no}: " + "; ".join(req.problems or ["no outcome"]), kind)
        elif req.outcome == "error" and req.kind in ("request", "resume"):
            status = req.status or 0
            invalid = isinstance(req.error, dict) and req.error.get("type") == "invalid_request_error"
            if 400 <= status < 500 or invalid:
                # a resume refused at a cursor its client was shown: committed text lost
                self.violate(f"request #{req.no}: a valid request answered {status}: {req.error}",
                             "lost" if req.kind == "resume" else None)
            elif not self.explained(req):
                self.violate(f"request #{req.no}: failed with no disruption to explain it: {req.error}")
        # exact text: a prefix of the reference always; equal when it completed
        if req.key is not None and req.kind in ("request", "resume"):
            ref = self.ref.cache[req.key]
            self.stats.chars_compared += len(req.text)
            if not ref.text.startswith(req.text):
                self.violate(f"request #{req.no}: text is not a prefix of the reference\n"
                             f"      got {req.text!r}\n      ref {ref.text!r}", _classify(req.text, ref.text))
            elif req.outcome == "completed" and req.finish in ("stop", "length"):
                if req.text != ref.text or req.finish != ref.finish:
                    self.violate(f"request #{req.no}: completed with {len(req.text)} chars/{req.finish}, the "
                                 f"reference has {len(ref.text)} chars/{ref.finish}\n"
                                 f"      got {req.text!r}\n      ref {ref.text!r}",
                                 "lost" if len(req.text) < len(ref.text) else "mismatched")
                else:
                    self.stats.tokens_compared += ref.tokens

    def count(self, req: Req) -> None:
        st = self.stats
        self.outcomes[f"{req.kind}:{req.outcome}"] = self.outcomes.get(f"{req.kind}:{req.outcome}", 0) + 1
        if req.kind == "request":
            st.requests += 1
        if req.kind not in ("request", "resume"):
            return
        if req.outcome == "completed":
            st.completed += 1
            st.streams_completed += req.stream
            st.resumed_completed += req.kind == "resume"
        elif req.outcome == "error":
            st.errors += 1
        elif req.outcome == "disconnected":
            st.disconnected += 1
        elif req.outcome == "killed":
            st.killed += 1

    # -- background checks ------------------------------------------------------------------------

    async def metrics(self) -> dict[str, float]:
        """Each series summed over its labels, plus ``max_lanes_per_model``: the largest
        ``superfluid_lanes_active`` of one model (``--max-batch`` is per model)."""
        assert self.client is not None
        text = (await self.client.get("/metrics")).text
        out = {name: metric_sum(text, name) or 0.0 for name in ("superfluid_lanes_active", "superfluid_queue_depth")}
        out["max_lanes_per_model"] = max(metric_sum(text, "superfluid_lanes_active", model=m) or 0.0
                                         for m in self.target.models)
        return out

    async def poll_metrics(self, scope: trio.CancelScope) -> None:
        with scope:
            while True:
                if not self.killing:
                    try:
                        lanes = (await self.metrics())["max_lanes_per_model"]
                        if lanes > self.max_lanes:
                            self.max_lanes = lanes
                            self.max_lanes_at = f"step {self.step}"
                    except Exception:  # noqa: BLE001 - the daemon may be restarting
                        pass
                await trio.sleep(METRICS_POLL_S)

    async def quiesce(self) -> None:
        d = self.daemon
        m: dict[str, float] = {}
        with trio.move_on_after(self.target.resume_ttl_s + 20):
            while True:
                m = await self.metrics()
                if m.get("superfluid_lanes_active", 0) == 0 and m.get("superfluid_queue_depth", 0) == 0:
                    break
                await trio.sleep(0.05)
        if m.get("superfluid_lanes_active", 0) or m.get("superfluid_queue_depth", 0):
            self.violate(f"not quiescent: lanes_active={m.get('superfluid_lanes_active')} "
                         f"queued={m.get('superfluid_queue_depth')}")
            return
        for model in MODELS:   # a normal request still works (and loads an unloaded model)
            await self.probe(model)
        health = (await self.client.get("/health")).json()  # type: ignore[union-attr]
        if health.get("models_loaded") != len(MODELS):
            self.violate(f"after a request to each model, /health says {health}")
        with trio.move_on_after(10):
            while True:
                workers = d.workers()
                if sorted(workers) == sorted(MODELS) and all(len(v) == 1 for v in workers.values()) \
                        and not d.zombies():
                    break
                await trio.sleep(0.05)
        workers = d.workers()
        if sorted(workers) != sorted(MODELS) or any(len(v) != 1 for v in workers.values()):
            self.violate(f"workers per model: { {k: [p.pid for p in v] for k, v in workers.items()} }")
        zombies = d.zombies()
        if zombies:
            self.violate(f"unreaped worker processes: {zombies}")
        assert self.client is not None
        for c in [self.client, *self.old_clients]:
            await c.aclose()
        fds = d.num_fds()
        with trio.move_on_after(5):
            while fds > self.fd_baseline + FD_SLACK:
                await trio.sleep(0.05)
                fds = d.num_fds()
        if fds > self.fd_baseline + FD_SLACK:
            self.violate(f"daemon holds {fds} fds, baseline {self.fd_baseline} (+{FD_SLACK})")

    async def stop_and_replay(self) -> None:
        from superfluid.journal import WalCorrupt, open_journal

        d = self.daemon
        assert d.proc is not None
        await self.count_park_resumes()
        self.killing = True  # the daemon is meant to go now
        d.proc.send_signal(signal.SIGTERM)
        with trio.move_on_after(30):
            await trio.to_thread.run_sync(d.proc.wait)
        if d.proc.poll() is None:
            self.violate("SIGTERM did not stop the daemon within 30 s")
            await d.kill()
        elif d.proc.returncode != 0:
            self.violate(f"the daemon exited with {d.proc.returncode} after SIGTERM")
        survivors = d.group_survivors(d.pid)
        if survivors:
            self.violate(f"processes left in the daemon's group after it exited: {survivors}")
        log = _without_injected_bugs(d.log.read_text(errors="replace"))
        if "Traceback" in log:
            i = log.index("Traceback")
            self.violate("the daemon logged a traceback:\n" + log[max(0, i - 300): i + 3000])
        try:
            async with open_journal(d.sessions) as journal:
                sessions = dict(journal.sessions)
        except WalCorrupt as exc:
            self.violate(f"the session log does not replay: {exc}")
            return
        for sid, slog in sessions.items():
            ids = [rec.event_id for rec in slog.events]
            if ids != list(range(len(ids))):
                self.violate(f"session {sid}: event ids {ids[:20]}... are not contiguous from 0",
                             "duplicated" if len(set(ids)) < len(ids) else "lost")
        final_epoch = max((slog.epoch for slog in sessions.values()), default=0)
        for tr in self.tracked:
            slog = sessions.get(tr.id)
            if slog is not None and slog.finish is None and slog.epoch == final_epoch:
                # quiescent, then SIGTERM: nothing generates, so every session the last run wrote
                # to has its end in the log (else a restart re-admits and re-runs it)
                self.stats.unlogged_ends += 1
                if self.strict_sessions:
                    self.violate(f"session {tr.id}: unfinished in the log after quiescence and SIGTERM (its end "
                                 f"was never logged: a restart would run it again)", "lost")
            if slog is None or tr.key is None:
                continue
            ref_text = self.ref.cache[tr.key].text
            if not ref_text.startswith(slog.text):
                self.violate(f"session {tr.id}: logged text is not a prefix of the reference\n"
                             f"      log {slog.text!r}\n      ref {ref_text!r}", _classify(slog.text, ref_text))
            elif slog.finish not in (None, "cancelled", "error") and slog.text != ref_text:
                self.violate(f"session {tr.id}: finished ({slog.finish}) with logged text != reference\n"
                             f"      log {slog.text!r}\n      ref {ref_text!r}", "lost")
            if len(tr.head) > len(slog.text):
                self.violate(f"session {tr.id}: a client saw {len(tr.head)} chars, the log holds {len(slog.text)}",
                             "lost")

    def cleanup(self) -> None:
        for pgid in self.daemon.pgids:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.daemon.proc is not None:
            self.daemon.proc.wait()



def _without_injected_bugs(log: str) -> str:
    """The daemon's log without the tracebacks of injected bugs (each ends with the
    line naming ``InjectedBug``): the one traceback a failed model actor logs."""
    out, rest = [], log
    while "Traceback" in rest:
        i = rest.index("Traceback")
        end = rest.find("InjectedBug: ", i)
        nxt = rest.find("Traceback", i + 1)
        if end < 0 or (0 <= nxt < end):
            out.append(rest[: i + len("Traceback")])
            rest = rest[i + len("Traceback"):]
            continue
        line_end = rest.find("\n", end)
        out.append(rest[:i])
        rest = rest[line_end:] if line_end >= 0 else ""
    return "".join(out) + rest


def _classify(got: str, ref: str) -> str:
    """How ``got`` departs from ``ref`` (it is not a prefix): ``duplicated`` when, after their
    common prefix, it goes on with text the reference had already given (a replay), ``lost``
    when it skips ahead in the reference, else ``mismatched``."""
    common = 0
    while common < min(len(got), len(ref)) and got[common] == ref[common]:
        common += 1
    rest = got[common:common + 16]
    if not rest:
        return "mismatched"
    if ref.find(rest, 0, common + len(rest) - 1) >= 0:
        return "duplicated"
    if ref.find(rest, common + 1) >= 0:
        return "lost"
    return "mismatched"


def _violation_in(exc: BaseException) -> InvariantViolation | None:
    if isinstance(exc, InvariantViolation):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _violation_in(inner)
            if found is not None:
                return found
    return None


def run_batch(batch: list[list[Action]], *, target: Target = MOCK, keep: bool = False,
              strict_sessions: bool | None = None) -> Harness:
    """Run the sequences of ``batch`` one after another on one fresh daemon (each starts from the
    quiescence the previous one ended in, which is checked). Raises InvariantViolation (an
    AssertionError) with a report, the failing sequence's literal and the batch's; returns the
    harness (``stats``, ``outcomes``)."""
    workdir = Path(tempfile.mkdtemp(prefix="superfluid-fuzz-daemon-"))
    harness = Harness([list(actions) for actions in batch], workdir, target, strict_sessions=strict_sessions)
    ok = False

    def literal(found: InvariantViolation | None) -> str:
        index = found.sequence_index if found is not None else harness.seq
        out = ""
        if index is not None and 0 <= index < len(batch):
            out = f"\nsequence = {format_sequence(batch[index])}"
        if len(batch) > 1:
            out += f"\nbatch (sequence {index} failed; each ran on the same daemon) = {format_batch(batch)}"
        return out

    try:
        trio.run(harness.run)
        ok = True
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: ASYNC104 - outside trio.run: nothing to cancel here
        found = _violation_in(exc)
        if found is not None:
            err = InvariantViolation(f"{found}{literal(found)}")
            err.sequence_index, err.stats = found.sequence_index, harness.stats
            raise err from None  # noqa: ASYNC104
        err = InvariantViolation(  # noqa: ASYNC104 - outside trio.run
            f"the harness failed with {type(exc).__name__}: {exc}\n{harness.report('(harness error)')}"
            f"{literal(None)}")
        err.sequence_index = harness.seq if 0 <= harness.seq < len(batch) else None
        err.stats = harness.stats
        raise err from exc  # noqa: ASYNC104 - outside trio.run
    finally:
        harness.cleanup()
        if ok and not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return harness


def run_sequence(actions: list[Action], *, target: Target = MOCK, keep: bool = False) -> dict[str, int]:
    """Run one sequence against a fresh daemon; returns a count of outcomes."""
    return run_batch([actions], target=target, keep=keep).outcomes


# --- a seeded random driver (long campaigns) -----------------------------------------------------------

FAULTS = ("crash_after=2", "crash_after=9", "fault_after=3", "garbage_after=2", "bug_after=2", "hang_after=4")


def random_sequence(rng: Any, max_actions: int = 14) -> list[Action]:
    """A sequence drawn from ``rng`` (a ``random.Random``): same seed, same sequence."""
    out: list[Action] = []
    for _ in range(rng.randint(3, max_actions)):
        r = rng.random()
        if r < 0.42:
            fault = None
            if rng.random() < 0.12:
                fault = rng.choice(FAULTS[:5]) if rng.random() < 0.8 else FAULTS[5]
            out.append(Start(
                n=rng.choice([1, 1, 2, 3, 4, 6, 8]), model=rng.choice(MODELS),
                route=rng.choice(["chat", "chat", "completion"]), stream=rng.random() < 0.7,
                resumable=rng.random() < 0.4,
                qos=rng.choice([None, "interactive", "completion", "agent", "background"]),
                prompt=rng.randint(0, 2), shared=rng.random() < 0.3, max_tokens=rng.choice([1, 6, 40, 150]),
                ignore_eos=rng.random() < 0.4, seeded=rng.random() < 0.3, fault=fault,
                disconnect=rng.choice([None, None, None, 0, 1, 3, 12]), slow_ms=rng.choice([0, 0, 0, 3, 30]),
            ))
        elif r < 0.66:
            out.append(Sleep(rng.choice([0, 5, 30, 100, 300, 800])))
        elif r < 0.71:
            out.append(KillWorker(rng.choice(MODELS)))
        elif r < 0.74:
            out.append(FreezeWorker(rng.choice(MODELS)))
        elif r < 0.79:
            out.append(Unload(rng.choice(MODELS)))
        elif r < 0.83:
            out.append(Load(rng.choice(MODELS)))
        elif r < 0.91:
            out.append(Resume(rng.randint(0, 5), rng.choice([None, None, 1, 5]), rng.choice([0, 0, 30])))
        elif r < 0.95:
            out.append(StopGeneration(rng.randint(0, 5)))
        else:
            out.append(KillDaemon())
    return out


REAL_THEMES = ("disconnect", "kill_worker", "unload", "kill_daemon")


def real_sequence(rng: Any, theme: str | None = None) -> list[Action]:
    """A short sequence for the real-model target (greedy requests of a few tokens, no fault
    directives and no frozen workers): streams, some resumable, cut by ``theme`` (one of
    ``REAL_THEMES``; drawn when None) while they run, then random further actions. A daemon kill
    is followed by resumes of the sessions it cut."""
    theme = theme or rng.choice(REAL_THEMES)
    model = rng.choice(MODELS)

    def start(**kw: Any) -> Start:
        base: dict[str, Any] = dict(
            n=rng.choice([1, 2, 3, 4]), model=model, route=rng.choice(["chat", "chat", "completion"]),
            stream=rng.random() < 0.8, resumable=rng.random() < 0.6,
            qos=rng.choice([None, "interactive", "agent", "background"]), prompt=rng.randint(0, 3),
            shared=rng.random() < 0.3, max_tokens=rng.choice([4, 12, 24]), ignore_eos=rng.random() < 0.5,
            disconnect=rng.choice([None, None, None, 1, 4]), slow_ms=rng.choice([0, 0, 10]))
        base.update(kw)
        return Start(**base)

    out: list[Action] = []
    if theme == "disconnect":
        out += [start(disconnect=rng.choice([0, 1, 3, 6])), start(stream=False, disconnect=rng.choice([20, 150]))]
    elif theme == "kill_worker":
        out += [start(), Sleep(rng.choice([20, 80, 200])), KillWorker(model)]
    elif theme == "unload":
        out += [start(), Sleep(rng.choice([20, 80, 200])), Unload(model), start(n=1)]
    else:
        out += [start(stream=True, resumable=True, max_tokens=24, n=rng.choice([2, 3])),
                Sleep(rng.choice([100, 250, 400])), KillDaemon(),
                *(Resume(i, rng.choice([None, None, 2])) for i in range(3))]
    for _ in range(rng.randint(0, 3)):
        r = rng.random()
        if r < 0.4:
            out.append(start(model=rng.choice(MODELS)))
        elif r < 0.6:
            out.append(Sleep(rng.choice([0, 30, 150])))
        elif r < 0.7:
            out.append(KillWorker(rng.choice(MODELS)))
        elif r < 0.78:
            out.append(Unload(rng.choice(MODELS)))
        elif r < 0.84:
            out.append(Load(rng.choice(MODELS)))
        elif r < 0.94:
            out.append(Resume(rng.randint(0, 3)))
        else:
            out.append(StopGeneration(rng.randint(0, 3)))
    return out


def real_batches(seed: int, sequences: int, per_daemon: int) -> list[list[list[Action]]]:
    """The real-model sequences a seed gives, ``per_daemon`` to a batch: sequence ``k`` is cut by
    ``REAL_THEMES[k % 4]``."""
    import random

    rng = random.Random(seed)
    seqs = [real_sequence(rng, REAL_THEMES[k % len(REAL_THEMES)]) for k in range(sequences)]
    return [seqs[i:i + per_daemon] for i in range(0, len(seqs), per_daemon)]


def default_gguf() -> Path:
    """The real fuzzer's model: ``$SUPERFLUID_TEST_GGUF``, else the embedded SmolLM2-135M."""
    from superfluid.models._files import cache_dir

    return Path(os.environ.get("SUPERFLUID_TEST_GGUF") or cache_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf")


def _fails(actions: list[Action], tries: int) -> str | None:
    for _ in range(tries):
        try:
            run_sequence(actions)
        except InvariantViolation as exc:
            return str(exc)
    return None


def shrink(actions: list[Action], *, tries: int = 2, budget_s: float = 600.0) -> tuple[list[Action], str]:
    """Delta debugging: drop chunks of actions while the sequence still fails (each
    candidate runs up to ``tries`` times: timing makes some failures intermittent)."""
    deadline = time.monotonic() + budget_s
    report = _fails(actions, tries) or ""
    n = 2
    while len(actions) >= 2 and time.monotonic() < deadline:
        chunk = max(1, len(actions) // n)
        reduced = False
        for i in range(0, len(actions), chunk):
            candidate = actions[:i] + actions[i + chunk:]
            if not candidate:
                continue
            found = _fails(candidate, tries)
            if found is not None:
                actions, report, n, reduced = candidate, found, max(n - 1, 2), True
                break
        if not reduced:
            if chunk == 1:
                break
            n = min(len(actions), n * 2)
    return actions, report


def main(argv: list[str] | None = None) -> int:
    """``python -m fuzz._daemon_model --minutes 20`` (or ``--sequences 1000``): run seeded random
    sequences; shrink and print each failure with its seed; go on to the next seed."""
    import argparse
    import random

    p = argparse.ArgumentParser(prog="python -m fuzz._daemon_model")
    p.add_argument("--seed", type=int, default=int(time.time()) % 100000, help="first seed (sequence k uses seed+k)")
    p.add_argument("--sequences", type=int, default=1000)
    p.add_argument("--minutes", type=float, default=0.0, help="stop after this long (0: no limit)")
    p.add_argument("--max-actions", type=int, default=14)
    p.add_argument("--replay", type=int, help="run only this seed (and shrink it if it fails)")
    p.add_argument("--no-shrink", action="store_true")
    args = p.parse_args(argv)

    def _terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # run the cleanups (each daemon's process group is killed)

    signal.signal(signal.SIGTERM, _terminate)
    seeds = [args.replay] if args.replay is not None else [args.seed + k for k in range(args.sequences)]
    stop_at = time.monotonic() + args.minutes * 60 if args.minutes else math_inf
    ran = failed = 0
    t0 = time.monotonic()
    for seed in seeds:
        if time.monotonic() > stop_at:
            break
        actions = random_sequence(random.Random(seed), args.max_actions)
        ran += 1
        try:
            outcomes = run_sequence(actions)
        except InvariantViolation as exc:
            failed += 1
            print(f"\n=== seed {seed}: FAILED\n{exc}", flush=True)
            if not args.no_shrink:
                small, report = shrink(actions)
                print(f"\n=== seed {seed}: shortest failing sequence ({len(small)} of {len(actions)} actions):\n"
                      f"{report}\nsequence = {format_sequence(small)}", flush=True)
            continue
        kinds = ",".join(sorted({type(a).__name__ for a in actions}))
        print(f"seed {seed}: ok ({len(actions)} actions: {kinds}; {outcomes}; {time.monotonic() - t0:.0f}s)",
              flush=True)
    print(f"\n{ran} sequences, {failed} failed, {time.monotonic() - t0:.0f}s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
