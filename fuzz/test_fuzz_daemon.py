"""Stateful fuzzing of the real daemon: random sequences of requests and faults.

Each example is a list of actions (``fuzz/_daemon_model.py``): start N requests
(streamed or not, QoS classes, resumable or not, shared or distinct prefixes,
``max_tokens``, ``ignore_eos``, greedy or seeded, with a fault directive in one
prompt), sleeps, worker SIGKILL and SIGSTOP, model unload and load (and reload on demand),
daemon SIGKILL and restart on the same sessions dir, resume by session id,
stopping a generation, slow readers and client disconnects. Every example runs
a fresh daemon subprocess; the invariants listed in ``_daemon_model`` are
checked after every step and at the end. Hypothesis shrinks a failing list to
the shortest one that still fails and prints it; the failure message also
holds a ``sequence = [...]`` literal that :func:`test_replay` runs again.

Budget: ``SUPERFLUID_FUZZ_DAEMON_SEQUENCES`` sequences (default 4, about 15 s);
``SUPERFLUID_FUZZ_EXAMPLES`` is deliberately not used here (its default of 200
suits the pure fuzzers, not a daemon start per example). Reproducing: a
failure prints the shrunk sequence (paste it into ``SUPERFLUID_FUZZ_REPLAY``
for :func:`test_replay`) and a ``@reproduce_failure`` blob; pytest's
``--hypothesis-seed=N`` fixes the random draw of a whole run.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st

from ._daemon_model import (
    MODELS, Action, FreezeWorker, KillDaemon, KillWorker, Load, Resume, Sleep, Start, StopGeneration, Unload,
    format_sequence, run_sequence,
)

pytestmark = pytest.mark.fuzz

SEQUENCES = int(os.environ.get("SUPERFLUID_FUZZ_DAEMON_SEQUENCES", "4"))
MAX_ACTIONS = int(os.environ.get("SUPERFLUID_FUZZ_DAEMON_ACTIONS", "10"))

models = st.sampled_from(MODELS)
disconnects = st.sampled_from([None, None, None, 0, 1, 3, 12])
slow = st.sampled_from([0, 0, 0, 3, 30])
faults = st.sampled_from([None] * 12 + ["crash_after=2", "crash_after=9", "fault_after=3", "garbage_after=2",
                                        "bug_after=2", "hang_after=4"])

starts = st.builds(
    Start,
    n=st.integers(1, 7),
    model=models,
    route=st.sampled_from(["chat", "chat", "completion"]),
    stream=st.booleans(),
    resumable=st.booleans(),
    qos=st.sampled_from([None, "interactive", "completion", "agent", "background"]),
    prompt=st.integers(0, 2),
    shared=st.booleans(),
    max_tokens=st.sampled_from([1, 6, 40, 150]),
    ignore_eos=st.booleans(),
    seeded=st.booleans(),
    fault=faults,
    disconnect=disconnects,
    slow_ms=slow,
)
actions: st.SearchStrategy[Action] = st.one_of(
    starts, starts, starts, starts,
    st.builds(Sleep, st.sampled_from([0, 5, 30, 100, 300, 800])),
    st.builds(Sleep, st.sampled_from([0, 5, 30, 100, 300, 800])),
    st.builds(KillWorker, models),
    st.builds(FreezeWorker, models),
    st.builds(Unload, models),
    st.builds(Load, models),
    st.builds(Resume, st.integers(0, 5), disconnects, slow),
    st.builds(StopGeneration, st.integers(0, 5)),
    st.just(KillDaemon()),
)
sequences = st.lists(actions, min_size=3, max_size=MAX_ACTIONS)

DAEMON_FUZZ = settings(
    max_examples=SEQUENCES, database=None, deadline=None, print_blob=True,
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@DAEMON_FUZZ
@given(sequence=sequences)
def test_daemon_invariants_hold_under_any_sequence(sequence: list[Action]) -> None:
    note(f"sequence = {format_sequence(sequence)}")
    outcomes = run_sequence(sequence)
    log = os.environ.get("SUPERFLUID_FUZZ_DAEMON_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{len(sequence)} actions {outcomes}\n")


def test_replay() -> None:
    """``SUPERFLUID_FUZZ_REPLAY='[Start(n=2), KillWorker("mock"), ...]'`` runs that one sequence."""
    source = os.environ.get("SUPERFLUID_FUZZ_REPLAY")
    if not source:
        pytest.skip("set SUPERFLUID_FUZZ_REPLAY to a sequence literal from a failure report")
    names = {c.__name__: c for c in (Start, Sleep, KillWorker, FreezeWorker, Unload, Load, KillDaemon, Resume,
                                     StopGeneration)}
    sequence = eval(source, {"__builtins__": {}}, names)  # noqa: S307 - a literal the developer pasted
    run_sequence(sequence)
