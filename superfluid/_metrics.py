"""Counters, gauges and histograms, rendered as Prometheus text (0.0.4).

A deliberately small writer: the daemon owns every metric it exports, so
labels are fixed tuples and rendering is one pass.
"""

from __future__ import annotations

import math
from collections import defaultdict

__all__ = ["Metrics", "TTFT_BUCKETS"]

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)

_HELP = {
    "superfluid_lanes_active": ("gauge", "Lanes currently admitted in a worker."),
    "superfluid_queue_depth": ("gauge", "Jobs waiting for a lane, by QoS class."),
    "superfluid_preemptions_total": ("counter", "Lanes stopped to make room for a more urgent class."),
    "superfluid_prefill_tokens_total": ("counter", "Prompt tokens prefilled by workers."),
    "superfluid_decode_tokens_total": ("counter", "Tokens decoded by workers."),
    "superfluid_warm_prefix_tokens_total": ("counter", "Prompt tokens seeded from the prefix cache."),
    "superfluid_ticks_total": ("counter", "Scheduler ticks run."),
    "superfluid_worker_respawns_total": ("counter", "Worker processes respawned after a death."),
    "superfluid_worker_spawn_failures_total": ("counter", "Worker processes that could not be started (no fds)."),
    "superfluid_model_failures_total": ("counter", "Model actors that failed unexpectedly and were restarted."),
    "superfluid_requests_total": ("counter", "Generation requests, by outcome."),
    "superfluid_batched_rounds_total": ("counter", "Decode rounds that carried more than one lane."),
    "superfluid_engine_rounds_total": ("counter", "Decode rounds run by workers (one forward pass each)."),
    "superfluid_engine_busy_seconds_total": ("counter", "Seconds workers spent inside ticks."),
    "superfluid_kv_used_tokens": ("gauge", "KV cells held by live lanes."),
    "superfluid_kv_total_tokens": ("gauge", "KV cells in the worker's pool."),
    "superfluid_ttft_seconds": ("histogram", "Time from request to first token."),
    "superfluid_queue_full_total": ("counter", "Requests refused with 429 because their class's queue was full."),
}


class Metrics:
    def __init__(self) -> None:
        self.values: dict[str, dict[tuple[tuple[str, str], ...], float]] = defaultdict(dict)
        self.hist: dict[str, dict[tuple[tuple[str, str], ...], list[float]]] = defaultdict(dict)

    @staticmethod
    def _key(labels: dict[str, str] | None) -> tuple[tuple[str, str], ...]:
        return tuple(sorted((labels or {}).items()))

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        series = self.values[name]
        key = self._key(labels)
        series[key] = series.get(key, 0.0) + amount

    def set(self, name: str, value: float, **labels: str) -> None:
        self.values[name][self._key(labels)] = value

    def get(self, name: str, **labels: str) -> float:
        return self.values.get(name, {}).get(self._key(labels), 0.0)

    def observe(self, name: str, value: float, **labels: str) -> None:
        series = self.hist[name]
        key = self._key(labels)
        row = series.get(key)
        if row is None:
            row = series[key] = [0.0] * (len(TTFT_BUCKETS) + 2)  # buckets..., count, sum
        for i, bound in enumerate(TTFT_BUCKETS):
            if value <= bound:
                row[i] += 1
        row[-2] += 1
        row[-1] += value

    def render(self) -> str:
        out: list[str] = []
        names = sorted(set(self.values) | set(self.hist) | set(_HELP))
        for name in names:
            kind, text = _HELP.get(name, ("untyped", name))
            out.append(f"# HELP {name} {text}")
            out.append(f"# TYPE {name} {kind}")
            if kind == "histogram":
                for key, row in sorted(self.hist.get(name, {}).items()):
                    for i, bound in enumerate(TTFT_BUCKETS):
                        out.append(f"{name}_bucket{_labels(key, le=_num(bound))} {_num(row[i])}")
                    out.append(f'{name}_bucket{_labels(key, le="+Inf")} {_num(row[-2])}')
                    out.append(f"{name}_count{_labels(key)} {_num(row[-2])}")
                    out.append(f"{name}_sum{_labels(key)} {_num(row[-1])}")
                continue
            series = self.values.get(name) or ({(): 0.0} if name in _HELP and not _labelled(name) else {})
            for key, value in sorted(series.items()):
                out.append(f"{name}{_labels(key)} {_num(value)}")
        return "\n".join(out) + "\n"


def _labelled(name: str) -> bool:
    return name in ("superfluid_queue_depth", "superfluid_requests_total", "superfluid_queue_full_total")


def _labels(key: tuple[tuple[str, str], ...], **extra: str) -> str:
    items = list(key) + sorted(extra.items())
    if not items:
        return ""
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in items)
    return "{" + body + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value):
        return str(int(value))
    return repr(value)
