"""Prompts and sizes: the synthetic documents, the eight questions, the scales.

``document(n_tokens, seed)`` is deterministic prose over a small vocabulary of
serving terms, "Note <seed>.<i>: ..." sentences of 8-16 words, sized at about
1.3 tokens per word for BPE tokenizers. Most of its words are also single
tokens of the mock runtime, so the same text stays compact there.

A :class:`Scale` holds every size a scenario uses. ``full`` is the published
setup; ``small`` fits SmolLM2-135M on two cores (all eight scenarios for two
systems in under 15 minutes); ``quick`` is for CI against the mock runtime.
Scales shrink counts and lengths; pass thresholds do not change. Every system in a cell gets
the same lanes and context; ``agents_interactive`` runs fewer agents than lanes, so a lane is
left for the chat on every system.
"""

from __future__ import annotations

import random
from typing import Any

import attrs

__all__ = ["QUESTIONS", "SCALES", "Scale", "document", "percentile"]

QUESTIONS = (
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain how a hash map resolves collisions.",
    "Write an SQL query that finds the second-highest salary in an employees table.",
    "What is the difference between a process and a thread?",
    "Write a debounce function in JavaScript.",
    "Show how to insert a value into a binary search tree.",
    "Write a Rust function that reverses a singly linked list.",
    "Explain the CAP theorem in a few sentences.",
)

_VOCAB = (
    "model", "token", "lane", "stream", "worker", "daemon", "cache", "prefix", "batch", "tick", "queue", "agent",
    "chat", "memory", "budget", "kernel", "thread", "process", "signal", "scheduler", "socket", "buffer", "tensor",
    "layer", "sampler", "decoder", "prompt", "context", "window", "session", "journal", "snapshot", "replica",
    "pipeline", "latency", "throughput", "allocator", "request", "reply", "runtime", "adapter", "checkpoint",
    "quota", "shard", "vector", "router", "backlog", "timeout", "retry", "lease",
)
_LINKS = ("the", "a", "and", "or", "with", "without", "before", "after", "every", "some", "keeps", "drops",
          "reads", "writes", "waits", "runs", "sees", "resumes")
TOKENS_PER_WORD = 1.3


def document(n_tokens: int, seed: int) -> str:
    """About ``n_tokens`` tokens of deterministic technical notes."""
    rng = random.Random(seed * 7919 + 17)
    target_words = max(8, round(n_tokens / TOKENS_PER_WORD))
    sentences: list[str] = []
    words = 0
    i = 0
    while words < target_words:
        i += 1
        length = rng.randint(8, 16)
        body = [rng.choice(_VOCAB) if rng.random() < 0.7 else rng.choice(_LINKS) for _ in range(length - 2)]
        sentences.append(f"Note {seed}.{i}: the {' '.join(body)}.")
        words += length
    return " ".join(sentences)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100) of the non-None values."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return round(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo), 4)


@attrs.frozen
class Scale:
    name: str
    sizes: dict[str, dict[str, Any]]
    cooldown_s: float
    cell_limit_s: float              # a whole cell (scenario x system) never runs longer
    mock_spec: str                   # model spec for superfluid-mock (n_ctx is added per scenario)

    def of(self, scenario: str) -> dict[str, Any]:
        return dict(self.sizes[scenario])


_FULL = {
    "worker_kill": dict(lanes=4, ctx=4096, max_tokens=400, kill_chunk=60, recover_s=300),
    "daemon_restart": dict(lanes=4, ctx=8192, doc=5000, max_tokens=160, kill_chunk=20, start_s=600),
    "agents_interactive": dict(lanes=9, ctx=8192, agents=8, doc=6000, max_tokens=384, chat_delay_s=2.0,
                               request_limit_s=1800),
    "kv_exhaustion": dict(lanes=8, ctx=4096, requests=32, doc=3000, max_tokens=900, request_limit_s=1800),
    "unload_reload": dict(lanes=8, ctx=4096, streams=4, max_tokens=500, unload_delay_s=1.5),
    "tool_session": dict(lanes=4, ctx=32768, turns=200, budget_s=1200),
    "client_disconnect": dict(lanes=8, ctx=4096, requests=8, max_tokens=2000, abort_chunks=16, abort_s=2.0,
                              probe_tokens=32, idle_wait_s=600),
    "shared_prefix": dict(lanes=8, ctx=8192, requests=32, doc=4000, max_tokens=32,
                          request_limit_s=1800),
}
_SMALL = {
    "worker_kill": dict(lanes=4, ctx=2048, max_tokens=96, kill_chunk=24, recover_s=120),
    "daemon_restart": dict(lanes=4, ctx=4096, doc=1000, max_tokens=48, kill_chunk=12, start_s=120),
    "agents_interactive": dict(lanes=4, ctx=4096, agents=3, doc=800, max_tokens=96, chat_delay_s=1.0,
                               request_limit_s=300),
    "kv_exhaustion": dict(lanes=4, ctx=1024, requests=16, doc=650, max_tokens=100, request_limit_s=600),
    "unload_reload": dict(lanes=4, ctx=2048, streams=4, max_tokens=128, unload_delay_s=1.0),
    "tool_session": dict(lanes=4, ctx=8192, turns=12, budget_s=180),
    "client_disconnect": dict(lanes=4, ctx=2048, requests=4, max_tokens=1000, abort_chunks=16, abort_s=2.0,
                              probe_tokens=16, idle_wait_s=120),
    "shared_prefix": dict(lanes=4, ctx=4096, requests=12, doc=1000, max_tokens=16,
                          request_limit_s=600),
}
_QUICK = {
    "worker_kill": dict(lanes=4, ctx=4096, max_tokens=120, kill_chunk=30, recover_s=60),
    "daemon_restart": dict(lanes=4, ctx=4096, doc=800, max_tokens=60, kill_chunk=20, start_s=60),
    "agents_interactive": dict(lanes=4, ctx=4096, agents=3, doc=600, max_tokens=600, chat_delay_s=0.5,
                               request_limit_s=120),
    "kv_exhaustion": dict(lanes=4, ctx=1024, requests=16, doc=200, max_tokens=700, request_limit_s=120),
    "unload_reload": dict(lanes=4, ctx=2048, streams=4, max_tokens=300, unload_delay_s=0.5),
    "tool_session": dict(lanes=4, ctx=8192, turns=40, budget_s=60),
    "client_disconnect": dict(lanes=4, ctx=4096, requests=4, max_tokens=2000, abort_chunks=16, abort_s=1.0,
                              probe_tokens=16, idle_wait_s=60),
    "shared_prefix": dict(lanes=4, ctx=4096, requests=16, doc=800, max_tokens=16,
                          request_limit_s=120),
}

SCALES = {
    "full": Scale("full", _FULL, cooldown_s=60.0, cell_limit_s=7200.0,
                  mock_spec="mock?step_ms=20&prefill_us=200&eos_every=100000"),
    "small": Scale("small", _SMALL, cooldown_s=3.0, cell_limit_s=600.0,
                   mock_spec="mock?step_ms=8&prefill_us=100&eos_every=100000"),
    "quick": Scale("quick", _QUICK, cooldown_s=0.0, cell_limit_s=120.0,
                   mock_spec="mock?step_ms=3&prefill_us=20&eos_every=100000"),
}
