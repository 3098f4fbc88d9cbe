"""The live monitor of ``serve``: what the daemon is doing, redrawn twice a second.

It reads the daemon's own objects in-process (the registry's models, each
scheduler's lanes and queues, the metrics registry's counters), never a scrape
of ``/metrics``: a frame costs one walk over the prometheus collectors, the
running jobs and the queues, and no work is done per token. Log records are
taken by a logging handler into a bounded deque (and into
``<sessions>/logs/serve.log``) while the monitor owns the terminal, so nothing
writes over it; the stream handlers come back when it ends.

``q`` drains the daemon, as SIGUSR1 does; the monitor then shows "draining"
until the daemon stops. The terminal (modes, cursor, normal screen) is
restored on every exit path: a key, a signal, cancellation or an exception.
"""

from __future__ import annotations

import collections
import logging
import logging.handlers
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import attrs
import trio
from rich.console import RenderableType
from rich.text import Text

from .._private import FILE_MODE, make_private_dir
from .._term import QUIT_KEYS, Screen, cbreak, read_keys, sparkline
from .._printable import printable
from ..sched import QosClass
from ._logs import PrintableFormatter

if TYPE_CHECKING:
    from ..serving import Metrics
    from ._registry import ModelRegistry

__all__ = ["LogTail", "Monitor", "run_monitor"]

REFRESH_S = 1.0          # one frame a second (only changed rows are written)
HISTORY = 120            # rate samples kept per model (a minute at 2 Hz)
TTFT_WINDOW_S = 60.0     # TTFT percentiles over the last minute
LOG_LINES = 200          # log records kept for the view
LOG_FILE_BYTES = 16 << 20
SHORT = {QosClass.INTERACTIVE: "interactive", QosClass.COMPLETION: "completion", QosClass.AGENT: "agent",
         QosClass.BACKGROUND: "background"}


class LogTail(logging.Handler):
    """Keeps the last ``maxlen`` formatted records (a bounded deque; formatting is the only cost)."""

    def __init__(self, maxlen: int = LOG_LINES) -> None:
        super().__init__()
        self.lines: collections.deque[tuple[int, str]] = collections.deque(maxlen=maxlen)
        self.setFormatter(PrintableFormatter(datefmt="%H:%M:%S"))  # a client's path never drives the terminal

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append((record.levelno, self.format(record)))
        except Exception:  # noqa: BLE001 - a logging handler must not raise
            self.handleError(record)


class _PrivateRotatingFile(logging.handlers.RotatingFileHandler):
    def _open(self) -> TextIO:
        fd = os.open(self.baseFilename, os.O_WRONLY | os.O_CREAT | os.O_APPEND, FILE_MODE)
        return open(fd, "a", encoding=self.encoding or "utf-8")  # noqa: SIM115 - the handler owns it


def _terminal_handlers() -> Iterator[tuple[logging.Logger, logging.Handler]]:
    """Every handler that writes to the terminal (a plain StreamHandler on stdout/stderr)."""
    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    for logger in loggers:
        for handler in list(logger.handlers):
            if type(handler) is logging.StreamHandler and getattr(handler, "stream", None) in (
                    sys.stderr, sys.stdout):
                yield logger, handler


class _Captured:
    """While active: stream handlers off, records into a tail (and a file)."""

    def __init__(self, tail: LogTail, log_file: Path | None) -> None:
        self.tail = tail
        self.log_file = log_file
        self._moved: list[tuple[logging.Logger, logging.Handler]] = []
        self._file: logging.Handler | None = None

    def __enter__(self) -> _Captured:
        self._moved = list(_terminal_handlers())
        root = logging.getLogger()
        for logger, handler in self._moved:
            logger.removeHandler(handler)
        root.addHandler(self.tail)
        if self.log_file is not None:
            try:
                make_private_dir(self.log_file.parent)
                self._file = _PrivateRotatingFile(self.log_file, maxBytes=LOG_FILE_BYTES, backupCount=2)
                self._file.setFormatter(PrintableFormatter())
                root.addHandler(self._file)
            except OSError as exc:
                logging.getLogger("superfluid").warning("monitor: cannot write %s: %s", self.log_file, exc)
                self.log_file = None
        return self

    def to_file(self, name: str, lines: list[str]) -> None:
        """``lines`` as INFO records of logger ``name`` in the log file only (not the tail)."""
        for line in lines if self._file is not None else []:
            self._file.handle(logging.makeLogRecord({"name": name, "levelno": logging.INFO, "levelname": "INFO",
                                                     "msg": "%s", "args": (line,)}))

    def __exit__(self, *exc: object) -> None:
        root = logging.getLogger()
        root.removeHandler(self.tail)
        if self._file is not None:
            root.removeHandler(self._file)
            self._file.close()
        for logger, handler in self._moved:
            logger.addHandler(handler)


# -- what a frame shows -----------------------------------------------------------------------


@attrs.frozen
class LaneRow:
    job: int
    klass: QosClass
    phase: str
    tokens: int
    prompt: int


@attrs.frozen
class ParkView:
    """A model's park counts (``--park``), from its metrics: cumulative over worker restarts."""

    parks: float
    resumes: float
    resume_tokens: float
    bytes: float
    restore_s: float
    evictions: float
    fallbacks: tuple[tuple[str, float], ...]   # (reason, count), nonzero only

    def line(self) -> str:
        restore = f"  restore avg {_fmt_s(self.restore_s / self.resumes)}" if self.resumes else ""
        fallbacks = ", ".join(f"{reason} {n:.0f}" for reason, n in self.fallbacks)
        return (f"park: parked {self.parks:.0f}  resumed {self.resumes:.0f} ({_fmt_n(self.resume_tokens)} tokens)"
                f"{restore}  on disk {_fmt_bytes(self.bytes)}  evicted {self.evictions:.0f}"
                + (f"  fallbacks: {fallbacks}" if fallbacks else ""))


@attrs.frozen
class ModelView:
    name: str
    runtime: str
    lanes_total: int
    lanes: tuple[LaneRow, ...]
    queues: dict[QosClass, int]
    kv_used: float
    kv_total: float
    decode_total: float
    prefill_total: float
    preemptions: float
    respawns: float
    ttft_buckets: tuple[tuple[float, float], ...]   # (le, cumulative count)
    park: ParkView | None = None   # None: the model's worker does not park

    @property
    def busy(self) -> int:
        return sum(1 for lane in self.lanes if lane.phase != "preempted")


def _samples(metrics: Metrics) -> dict[str, dict[str, Any]]:
    """The metrics registry's samples by model: plain series by name, TTFT buckets as a list,
    park fallbacks by reason."""
    out: dict[str, dict[str, Any]] = collections.defaultdict(lambda: {"buckets": [], "fallbacks": {}})
    for family in metrics.registry.collect():
        for sample in family.samples:
            model = sample.labels.get("model")
            if model is None:
                continue
            if sample.name == "superfluid_ttft_seconds_bucket":
                out[model]["buckets"].append((float(sample.labels["le"]), sample.value))
            elif sample.name == "superfluid_park_fallbacks_total":
                out[model]["fallbacks"][sample.labels.get("reason", "")] = sample.value
            elif "class" not in sample.labels and "outcome" not in sample.labels:
                out[model][sample.name] = sample.value
    return out


def snapshot(registry: ModelRegistry, metrics: Metrics) -> list[ModelView]:
    """Read the daemon's state (no I/O, no waiting): one view per loaded model."""
    samples = _samples(metrics)
    views = []
    for name, model in list(registry.loaded.items()):
        sched = model.scheduler
        series = samples.get(name, {"buckets": [], "fallbacks": {}})
        lanes = []
        for job in sched.running.values():
            if job.preempted:
                phase = "preempted"
            elif job.prefill_left > 0 or not job.n_generated:
                phase = "prefill"
            else:
                phase = "decode"
            lanes.append(LaneRow(job=job.id, klass=job.klass, phase=phase, tokens=job.n_generated,
                                 prompt=len(job.prompt)))
        views.append(ModelView(
            name=name, runtime=model.runtime, lanes_total=registry.config.max_batch,
            lanes=tuple(sorted(lanes, key=lambda r: r.job)),
            queues={k: len(q) for k, q in sched.queues.items()},
            kv_used=series.get("superfluid_kv_used_tokens", 0.0),
            kv_total=series.get("superfluid_kv_total_tokens", 0.0),
            decode_total=series.get("superfluid_decode_tokens_total", 0.0),
            prefill_total=series.get("superfluid_prefill_tokens_total", 0.0),
            preemptions=series.get("superfluid_preemptions_total", 0.0),
            respawns=series.get("superfluid_worker_respawns_total", 0.0),
            ttft_buckets=tuple(sorted(series["buckets"])),
            park=_park_view(series, parks=bool(getattr(sched, "park", None))),
        ))
    return views


PARK_SERIES = ("superfluid_parks_total", "superfluid_resumes_total", "superfluid_resume_tokens_total",
               "superfluid_park_bytes", "superfluid_park_restore_seconds_total", "superfluid_park_evictions_total")


def _park_view(series: dict[str, Any], *, parks: bool) -> ParkView | None:
    """The park counts of a model whose worker reported a park store (``parks``) or that
    ever parked; None for the others (no --park, or a runtime that cannot)."""
    values = [series.get(name, 0.0) for name in PARK_SERIES]
    fallbacks = tuple(sorted((r, n) for r, n in series["fallbacks"].items() if n > 0))
    if not parks and not any(values) and not fallbacks:
        return None
    return ParkView(*values, fallbacks=fallbacks)


def quantile(q: float, buckets: tuple[tuple[float, float], ...]) -> float | None:
    """The ``q`` quantile of a cumulative histogram (linear inside a bucket, as
    Prometheus's ``histogram_quantile``); None when it holds nothing. Past the last
    finite bound it answers that bound."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return lower
            span = count - below
            return lower + (le - lower) * ((rank - below) / span if span else 1.0)
        lower, below = le, count
    return lower


@attrs.define
class _Rates:
    at: float
    decode: float
    prefill: float
    decode_hist: collections.deque[float] = attrs.field(factory=lambda: collections.deque(maxlen=HISTORY))
    prefill_hist: collections.deque[float] = attrs.field(factory=lambda: collections.deque(maxlen=HISTORY))
    ttft: collections.deque[tuple[float, tuple[tuple[float, float], ...]]] = attrs.field(
        factory=lambda: collections.deque(maxlen=int(TTFT_WINDOW_S / REFRESH_S) + 2))


def _fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _fmt_n(n: float) -> str:
    return f"{n / 1000:.1f}k" if n >= 10_000 else f"{n:.0f}"


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


class Monitor:
    """The frames: the rate history across them and how each is drawn."""

    def __init__(self, registry: ModelRegistry, metrics: Metrics, *, binds: list[str], tail: LogTail,
                 log_file: Path | None = None, clock: Callable[[], float] = time.monotonic,
                 summary: list[str] | None = None) -> None:
        self.registry = registry
        self.metrics = metrics
        self.binds = binds
        self.summary = summary or []  # the startup block (daemon/_summary.py), first line aside
        self.tail = tail
        self.log_file = log_file
        self.clock = clock
        self.started = clock()
        self.draining = False
        self._rates: dict[str, _Rates] = {}

    def _rate(self, view: ModelView, now: float) -> tuple[_Rates, float, float, tuple[tuple[float, float], ...]]:
        r = self._rates.get(view.name)
        if r is None:
            r = self._rates[view.name] = _Rates(at=now, decode=view.decode_total, prefill=view.prefill_total)
        dt = now - r.at
        decode = prefill = 0.0
        if dt > 0:
            decode = max(0.0, view.decode_total - r.decode) / dt
            prefill = max(0.0, view.prefill_total - r.prefill) / dt
            r.decode_hist.append(decode)
            r.prefill_hist.append(prefill)
        r.at, r.decode, r.prefill = now, view.decode_total, view.prefill_total
        while r.ttft and r.ttft[0][0] < now - TTFT_WINDOW_S:
            r.ttft.popleft()
        r.ttft.append((now, view.ttft_buckets))
        old = dict(r.ttft[0][1])
        window = tuple((le, count - old.get(le, 0.0)) for le, count in view.ttft_buckets)
        return r, decode, prefill, window

    def frame(self, height: int = 50, width: int = 120) -> RenderableType:
        """One frame of the view (reads the state; advances the rate history). Plain styled
        text in fixed columns: rich's tables and panels cost some 20 ms a frame, this ~2."""
        now = self.clock()
        views = snapshot(self.registry, self.metrics)
        live = {v.name for v in views}
        for gone in set(self._rates) - live:
            del self._rates[gone]
        up = int(now - self.started)
        out = Text(no_wrap=True, overflow="crop")
        out.append("superfluid ", "bold")
        out.append(" ".join(self.binds), "cyan")
        out.append(f"  up {up // 3600}:{up // 60 % 60:02d}:{up % 60:02d}  ")
        if self.draining:
            out.append(" draining: no new requests ", "black on yellow")
        out.append("  q quits (drains)\n", "dim")
        used = 1
        # the startup summary stays on top: the alternate screen would hide the block logged before it
        room = max(0, height // 3)
        shown = self.summary[1:1 + room] if len(self.summary) - 1 <= room else self.summary[1:room]
        for line in shown:
            out.append(printable(line)[: width - 1] + "\n", "dim")
        if len(shown) < len(self.summary) - 1:
            out.append(f"  … {len(self.summary) - 1 - len(shown)} more summary lines (in the log file)\n", "dim")
            used += 1
        used += len(shown)
        spark_w = max(10, min(HISTORY, width - 62))
        for view in views:
            rates, decode, prefill, window = self._rate(view, now)
            kv = (f"KV {_fmt_n(view.kv_used)}/{_fmt_n(view.kv_total)} ({view.kv_used / view.kv_total:.0%})"
                  if view.kv_total else f"KV {_fmt_n(view.kv_used)}")
            queues = "  ".join(f"{SHORT[k]} {n}" for k, n in view.queues.items())
            out.append(_rule(printable(f"{view.name} ({view.runtime})"), width), "bold")
            out.append(f"lanes {view.busy}/{view.lanes_total}".ljust(14), "bold")
            out.append(f"queue: {queues}   {kv}\n")
            out.append(f"decode {decode:8.1f} tok/s  ")
            out.append(sparkline(rates.decode_hist, spark_w).ljust(spark_w), "green")
            out.append(f"  TTFT p50 {_fmt_s(quantile(0.5, window))}  p99 {_fmt_s(quantile(0.99, window))}\n")
            out.append(f"prefill {prefill:7.0f} tok/s  ")
            out.append(sparkline(rates.prefill_hist, spark_w).ljust(spark_w), "blue")
            out.append(f"  preemptions {view.preemptions:.0f}  respawns {view.respawns:.0f}\n")
            used += 4
            if view.park is not None:
                out.append(view.park.line()[: width - 1] + "\n")
                used += 1
            room = max(1, (height - used - 6) // max(1, len(views)) - 5)
            if view.lanes:
                out.append(f"  {'lane':<6}{'class':<13}{'phase':<11}{'prompt':>8}{'tokens':>9}\n", "dim")
                for i, row in enumerate(view.lanes[:room]):
                    out.append(f"  {i + 1:<6}{SHORT[row.klass]:<13}{row.phase:<11}{row.prompt:>8}{row.tokens:>9}\n")
                if len(view.lanes) > room:
                    out.append(f"  …     {len(view.lanes) - room} more\n", "dim")
                used += 1 + min(len(view.lanes), room) + (len(view.lanes) > room)
        where = f" (also in {self.log_file})" if self.log_file else ""
        out.append(_rule(f"log{where}", width), "bold")
        room = max(3, height - used - 2)
        for level, line in list(self.tail.lines)[-room:]:
            style = "red" if level >= logging.ERROR else "yellow" if level >= logging.WARNING else ""
            out.append(printable(line)[: width - 1] + "\n", style)  # one row a record (a traceback's too)
        out.rstrip()
        return out


def _rule(title: str, width: int) -> str:
    head = f"── {title} "
    return head + "─" * max(0, width - len(head) - 1) + "\n"


async def run_monitor(registry: ModelRegistry, metrics: Metrics, *, binds: list[str], on_quit: Callable[[], None],
                      log_file: Path | None = None, refresh_s: float = REFRESH_S,
                      summary: list[str] | None = None) -> None:
    """Own the terminal until cancelled: draw a frame every ``refresh_s`` (the startup
    ``summary`` on top), call ``on_quit`` (drain) on ``q``. Runs in the daemon's root nursery."""
    tail = LogTail()
    monitor = Monitor(registry, metrics, binds=binds, tail=tail, log_file=log_file, summary=summary)

    def key(k: str) -> bool:
        if k in QUIT_KEYS and not monitor.draining:
            monitor.draining = True
            logging.getLogger("superfluid").info("monitor: q pressed: draining (no new requests)")
            on_quit()
        return False

    with _Captured(tail, log_file) as captured, cbreak() as fd, Screen() as screen:
        monitor.log_file = captured.log_file
        captured.to_file("superfluid.summary", summary or [])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_keys, fd, key)
            while True:
                width, height = screen.size
                screen.show(monitor.frame(height=height, width=width))
                await trio.sleep(refresh_s)
