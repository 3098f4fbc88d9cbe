"""The daemon's metrics, exported through ``prometheus-client`` (text format 0.0.4).

Every series is per model: a scheduler writes through the view
``metrics.for_model(name)`` (made where the scheduler is), which adds the
``model`` label, so two models never overwrite each other's gauges. Extra
labels (``outcome``, ``class``) are keyword arguments of ``inc``/``set``.

``render(may_see)`` keeps only the series of the models a caller may use: a key
limited to some models learns nothing of the others' load from ``/metrics``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

__all__ = ["Metrics", "ModelMetrics", "TTFT_BUCKETS"]

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)

prometheus_client.disable_created_metrics()  # no ``*_created`` series beside every counter

# name: (kind, help, labels besides ``model``)
_FAMILIES: dict[str, tuple[type[MetricWrapperBase], str, tuple[str, ...]]] = {
    "superfluid_lanes_active": (Gauge, "Lanes currently admitted in a worker.", ()),
    "superfluid_lanes_total": (Gauge, "Lanes the model's worker has (--max-batch).", ()),
    "superfluid_queue_depth": (Gauge, "Jobs waiting for a lane, by QoS class.", ("class",)),
    "superfluid_preemptions_total": (Counter, "Lanes stopped to make room for a more urgent class.", ()),
    "superfluid_prefill_tokens_total": (Counter, "Prompt tokens prefilled by workers.", ()),
    "superfluid_decode_tokens_total": (Counter, "Tokens decoded by workers.", ()),
    "superfluid_warm_prefix_tokens_total": (Counter, "Prompt tokens seeded from the prefix cache.", ()),
    "superfluid_ticks_total": (Counter, "Scheduler ticks run.", ()),
    "superfluid_worker_respawns_total": (Counter, "Worker processes respawned after a death.", ()),
    "superfluid_worker_spawn_failures_total": (Counter, "Worker processes that could not be started (no fds).", ()),
    "superfluid_model_failures_total": (Counter, "Model actors that failed unexpectedly and were restarted.", ()),
    "superfluid_requests_total": (Counter, "Generation requests, by outcome.", ("outcome",)),
    "superfluid_batched_rounds_total": (Counter, "Decode rounds that carried more than one lane.", ()),
    "superfluid_engine_rounds_total": (Counter, "Decode rounds run by workers (one forward pass each).", ()),
    "superfluid_prefill_steps_aborted_total": (
        Counter, "Prefill passes stopped midway because a more urgent request arrived (redone later).", ()),
    "superfluid_engine_busy_seconds_total": (Counter, "Seconds workers spent inside ticks.", ()),
    "superfluid_kv_used_tokens": (Gauge, "KV cells held by live lanes.", ()),
    "superfluid_kv_total_tokens": (Gauge, "KV cells in the worker's pool.", ()),
    "superfluid_ttft_seconds": (Histogram, "Time from request to first token.", ()),
    "superfluid_spec_proposed_total": (Counter, "Draft tokens speculation proposed (prompt-lookup).", ()),
    "superfluid_spec_accepted_total": (Counter, "Draft tokens verification accepted.", ()),
    "superfluid_spec_gate_state": (
        Gauge, "Speculation's throughput gate per decoding lane count: 1 drafting, 0 plain, 0.5 measuring.",
        ("lanes",)),
    "superfluid_spec_gate_speedup": (
        Gauge, "The gate's last measured drafting/plain tokens-per-second ratio per lane count.", ("lanes",)),
    "superfluid_parks_total": (Counter, "Finished sequences' KV written to the park directory (--park).", ()),
    "superfluid_resumes_total": (Counter, "Admissions whose KV was restored from a parked artifact.", ()),
    "superfluid_resume_tokens_total": (Counter, "Prompt tokens restored from parked artifacts.", ()),
    "superfluid_park_restore_seconds_total": (Counter, "Seconds spent reading, checking and importing parks.", ()),
    "superfluid_park_export_seconds_total": (
        Counter, "Engine-thread seconds spent exporting sequences to park (the write is off that thread).", ()),
    "superfluid_park_evictions_total": (Counter, "Parked artifacts deleted to stay within --park-budget-gb.", ()),
    "superfluid_park_bytes": (Gauge, "Bytes in the park directory as the model's worker last counted them.", ()),
    "superfluid_park_fallbacks_total": (
        Counter, "Parks dropped or artifacts refused (the lane prefilled instead), by reason.", ("reason",)),
    "superfluid_queue_full_total": (Counter, "Requests refused with 429 because their class's queue was full.",
                                    ("class",)),
    # a fleet model's nodes (SPEC.md §14), refreshed at each scrape; the model's own gauges are their sums
    "superfluid_fleet_node_up": (Gauge, "1 while the node's link serves, else 0.", ("node",)),
    "superfluid_fleet_node_lanes_active": (Gauge, "Lanes admitted in the node's worker.", ("node",)),
    "superfluid_fleet_node_lanes_total": (Gauge, "Lanes the node's worker has.", ("node",)),
    "superfluid_fleet_node_queue_depth": (Gauge, "Jobs waiting for a lane of the node.", ("node",)),
    "superfluid_fleet_node_kv_used_tokens": (Gauge, "KV cells held by the node's live lanes.", ("node",)),
    "superfluid_fleet_node_kv_total_tokens": (Gauge, "KV cells in the node's pool.", ("node",)),
}
# the gauges a fleet node's scheduler does not write (the scrape sums its model's nodes instead)
NODE_SUMMED = frozenset({"superfluid_lanes_active", "superfluid_lanes_total", "superfluid_queue_depth",
                         "superfluid_kv_used_tokens", "superfluid_kv_total_tokens"})


class Metrics:
    """Every metric the daemon exports, in a registry of its own (not the process-global one)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._refresh: Callable[[Metrics], None] | None = None
        self._families: dict[str, MetricWrapperBase] = {}
        for name, (kind, text, labels) in _FAMILIES.items():
            extra: dict[str, object] = {"buckets": TTFT_BUCKETS} if kind is Histogram else {}
            self._families[name] = kind(name, text, ("model", *labels), registry=self.registry, **extra)

    def for_model(self, model: str, *, node: str = "") -> ModelMetrics:
        """The view a model's scheduler and actor write through (a fleet node's: its gauges are
        summed at the scrape, ``refresh``). Its series without other labels are exported (at 0)
        from now on."""
        for name, (_kind, _text, labels) in _FAMILIES.items():
            if not labels:
                self._series(name, model, {})
        return ModelMetrics(self, model, node=node)

    def refresh(self, hook: Callable[[Metrics], None]) -> None:
        """Run ``hook`` before every render (the registry sets the fleet's gauges)."""
        self._refresh = hook

    def _series(self, name: str, model: str, labels: dict[str, str]) -> MetricWrapperBase:
        return self._families[name].labels(model=model, **labels)

    def render(self, may_see: Callable[[str], bool] | None = None) -> str:
        """The text exposition; with ``may_see``, only the series whose ``model`` it
        accepts (and any without a model). A family left with no series keeps its
        ``HELP``/``TYPE`` lines, which are the same for every caller."""
        if self._refresh is not None:
            self._refresh(self)
        if may_see is None:
            return prometheus_client.generate_latest(self.registry).decode()
        return prometheus_client.generate_latest(_Only(self.registry, may_see)).decode()


class _Only(Collector):
    """A collector view of ``registry`` with only the series of models ``may_see`` accepts."""

    def __init__(self, registry: CollectorRegistry, may_see: Callable[[str], bool]) -> None:
        self.registry = registry
        self.may_see = may_see

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            kept = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                model = sample.labels.get("model")
                if model is None or self.may_see(model):
                    kept.samples.append(sample)
            yield kept


class ModelMetrics:
    """One model's series: ``inc``/``set``/``observe`` with ``model`` filled in."""

    def __init__(self, metrics: Metrics, model: str, *, node: str = "") -> None:
        self.metrics = metrics
        self.model = model
        self.node = node    # a fleet node's view: the gauges in NODE_SUMMED are left to the scrape
        # (name, labels) -> its series: prometheus-client's labels() takes a lock and sorts
        # the labels on every call (3% of the daemon's time at 256 streams, a few calls a
        # round). Label values are closed sets (classes, outcomes), so this stays small.
        self._cache: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}

    def _series(self, name: str, labels: dict[str, str]) -> Any:
        key = (name, tuple(labels.items()))
        series = self._cache.get(key)
        if series is None:
            series = self._cache[key] = self.metrics._series(name, self.model, labels)
        return series

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        self._series(name, labels).inc(amount)

    def set(self, name: str, value: float, **labels: str) -> None:
        if self.node and name in NODE_SUMMED:
            return
        self._series(name, labels).set(value)

    def gauge(self, name: str, value: float, **labels: str) -> None:
        """Set a gauge whatever the view (the scrape's refresh)."""
        self._series(name, labels).set(value)

    def observe(self, name: str, value: float, **labels: str) -> None:
        self._series(name, labels).observe(value)
