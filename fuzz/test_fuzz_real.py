"""Stateful fuzzing of the daemon on a real model: SmolLM2-135M (the embedded default) on
llama.cpp, ``--deterministic``, served twice (the second name a symlink, so one can be unloaded).

``SUPERFLUID_FUZZ_REAL_SEQUENCES`` short random sequences (12), ``SUPERFLUID_FUZZ_REAL_PER_DAEMON``
to a daemon (6), drawn by ``_daemon_model.real_sequence`` from ``SUPERFLUID_FUZZ_REAL_SEED``
(random when unset; a failure names it). Sequence ``k`` is cut by the disruption
``REAL_THEMES[k % 4]`` while its streams run: client disconnects, a worker SIGKILL, an unload, a
daemon SIGKILL and restart on the same sessions dir followed by resumes of the sessions it cut;
random further actions follow. The invariants are the mock fuzzer's (``_daemon_model``): every
request ends completed or typed; a completed request's text (a resumed one's head + tail) equals
the reference, the same request run alone, greedy, on a fresh daemon; nothing lost or
duplicated in the session log; quiescence; SIGTERM exits 0.

Replay a failure: ``SUPERFLUID_FUZZ_REAL_SEED=N pytest fuzz/test_fuzz_real.py``, or
``python bench/fuzz_campaign.py --sequences 0 --real 12 --real-seed N``.
"""

from __future__ import annotations

import importlib.util
import os
import random
from pathlib import Path

import pytest

from ._daemon_model import (
    InvariantViolation, Stats, close_reference, default_gguf, format_batch, real_batches, real_target, run_batch,
)

pytestmark = [pytest.mark.fuzz, pytest.mark.real]

REAL_GGUF = default_gguf()
SEQUENCES = int(os.environ.get("SUPERFLUID_FUZZ_REAL_SEQUENCES", "12"))
PER_DAEMON = max(1, int(os.environ.get("SUPERFLUID_FUZZ_REAL_PER_DAEMON", "6")))


def _require_model() -> None:
    """As ``@pytest.mark.real`` in tests/conftest.py: skip without llama-cpp-python or the model,
    fail instead under ``SUPERFLUID_REQUIRE_REAL=1`` (CI)."""
    missing = [] if importlib.util.find_spec("llama_cpp") else ["llama-cpp-python"]
    if not REAL_GGUF.exists():
        missing.append(str(REAL_GGUF))
    if missing:
        why = f"missing {', '.join(missing)} (pip install -e '.[llamacpp]'; python -m superfluid.models)"
        if os.environ.get("SUPERFLUID_REQUIRE_REAL") == "1":
            pytest.fail(f"SUPERFLUID_REQUIRE_REAL=1 and {why}", pytrace=False)
        pytest.skip(why)


def test_real_model_daemon_invariants_hold_under_random_sequences(tmp_path: Path) -> None:
    _require_model()
    seed = int(os.environ.get("SUPERFLUID_FUZZ_REAL_SEED") or random.randrange(1, 1_000_000))
    target = real_target(REAL_GGUF, tmp_path)
    totals = Stats()
    try:
        for b, batch in enumerate(real_batches(seed, SEQUENCES, PER_DAEMON)):
            try:
                harness = run_batch(batch, target=target)
            except InvariantViolation as exc:
                raise InvariantViolation(f"SUPERFLUID_FUZZ_REAL_SEED={seed} (batch {b}): {exc}") from None
            totals.add(harness.stats)
    finally:
        close_reference(target)
    print(f"\nreal-model fuzz (seed {seed}): {totals}")
    assert totals.sequences >= SEQUENCES
    if SEQUENCES >= 4:   # every theme ran: the disruptions happened and text was compared across them
        flat = [s for batch in real_batches(seed, SEQUENCES, PER_DAEMON) for s in batch]
        assert totals.worker_kills >= 1 and totals.daemon_kills >= 1, totals
        assert totals.streams_completed >= SEQUENCES // 2 and totals.tokens_compared > 0, totals
        assert totals.resumed_completed >= 1, f"seed {seed}: no resumed stream completed: {totals}\n{format_batch(flat)}"
