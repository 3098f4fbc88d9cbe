"""One place for defaults (superfluid/_defaults.py): the command line, the daemon's config, the
scheduler's and planner's configs, the restart policy and the worker spec agree on every knob
they share, because each takes it from there."""

from __future__ import annotations

import attrs
import pytest

from superfluid import _defaults as D
from superfluid.cli._main import build_parser
from superfluid.serving import ServeConfig
from superfluid.nursery import RestartPolicy
from superfluid.nursery._worker import WorkerSpec
from superfluid.sched import PlannerConfig, SchedulerConfig


def _default(cls: type, name: str) -> object:
    field = attrs.fields_dict(cls)[name]
    return field.default.factory() if isinstance(field.default, attrs.Factory) else field.default


def test_every_layer_takes_its_defaults_from_one_module() -> None:
    args = build_parser().parse_args(["serve"])
    # flag -> (ServeConfig field, the constant)
    serve = {
        "host": ("host", D.HOST), "port": ("port", D.PORT), "resume_ttl": ("resume_ttl_s", D.RESUME_TTL_S),
        "max_batch": ("max_batch", D.MAX_BATCH), "max_context": ("max_context", D.MAX_CONTEXT),
        "threads": ("threads", D.THREADS), "host_cache_mb": ("host_cache_mb", D.HOST_CACHE_MB),
        "stream_interval_ms": ("stream_interval_ms", D.STREAM_INTERVAL_MS),
        "agent_stream_interval_ms": ("agent_stream_interval_ms", D.AGENT_STREAM_INTERVAL_MS),
        "drain_timeout": ("drain_timeout_s", D.DRAIN_TIMEOUT_S), "hang_timeout": ("hang_timeout_s", D.HANG_TIMEOUT_S),
        "max_conversation_bytes": ("max_conversation_bytes", D.MAX_CONVERSATION_BYTES),
        "max_message_bytes": ("max_message_bytes", D.MAX_MESSAGE_BYTES),
        "max_conversation_events": ("max_conversation_events", D.MAX_CONVERSATION_EVENTS),
        "body_timeout": ("body_timeout_s", D.BODY_TIMEOUT_S), "ws_idle_timeout": ("ws_idle_timeout_s", D.WS_IDLE_TIMEOUT_S),
        "max_queue": ("max_queue", D.MAX_QUEUE), "max_models": ("max_models", D.MAX_MODELS),
        "idle_timeout": ("idle_timeout_s", D.IDLE_TIMEOUT_S),
        "files_quota_gb": ("files_quota_gb", D.FILES_QUOTA_GB), "files_max_bytes": ("files_max_bytes", D.FILES_MAX_BYTES),
    }
    for flag, (field, value) in serve.items():
        assert getattr(args, flag) == value, flag
        assert _default(ServeConfig, field) == value, field
    planner = PlannerConfig()
    assert (args.starvation_ticks, args.prefill_budget, args.tick_target_ms) == (
        planner.starvation_ticks, planner.prefill_budget, planner.tick_busy_ms) == (
        D.STARVATION_TICKS, D.PREFILL_BUDGET, D.TICK_TARGET_MS)
    assert planner.max_batch == D.MAX_BATCH
    sched = SchedulerConfig()
    assert (sched.hang_timeout_s, sched.max_queue) == (D.HANG_TIMEOUT_S, D.MAX_QUEUE)
    policy = RestartPolicy()
    assert (policy.max_restarts, policy.window_s) == (_default(ServeConfig, "max_restarts"),
                                                      _default(ServeConfig, "restart_window_s"))
    spec = WorkerSpec(runtime="mock", model="mock")
    assert (spec.max_batch, spec.max_context, spec.threads, spec.stream_interval_ms, spec.agent_stream_interval_ms,
            spec.start_timeout_s) == (D.MAX_BATCH, D.MAX_CONTEXT, D.THREADS, D.STREAM_INTERVAL_MS,
                                      D.AGENT_STREAM_INTERVAL_MS, _default(ServeConfig, "worker_start_timeout_s"))


def test_the_help_states_the_defaults_it_applies(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in (f"lanes per model (default {D.MAX_BATCH})", f"(default {D.STREAM_INTERVAL_MS};",
                  f"(default {D.MAX_QUEUE})", f"(default {D.MAX_MODELS})", f"(default {D.HOST}:{D.PORT})"):
        assert shown in text, shown
