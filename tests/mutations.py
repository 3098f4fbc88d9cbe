"""Mutation check: every SPEC.md invariant's cited tests fail when the behaviour is removed.

Usage (from the repository root)::

    python -m tests.mutations                 # every mutation; exit 0 only if each applied and was caught
    python -m tests.mutations -k disconnect   # the mutations whose name contains "disconnect"
    python -m tests.mutations --list          # names, files and tests, nothing run
    python -m tests.mutations --no-baseline   # skip the unmutated run of each mutation's tests

The working tree (tracked and untracked, ignored files left out) is copied once to a scratch
directory. For each mutation the tests are first run unmutated (the baseline: they must pass,
else a "caught" would prove nothing), then the mutation's exact snippet is replaced in the
scratch copy, only its tests run (``pytest -x -q`` on the node ids, under a timeout), and the
file is restored. A snippet that is not found exactly once is "does not apply": the mutation
no longer points at the code, which fails the script. CPU heavy (each mutation starts
daemons): run it once before a merge, with ``-k`` while working on one invariant.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parent.parent


@attrs.frozen
class Mutation:
    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]


D = "tests/test_daemon.py::"

MUTATIONS = (
    Mutation("disconnect cancel", "superfluid/api/_generate.py",
             "        if not keep and not job.done:  # (a done job holds no lane and no place)\n",
             "        if False:\n",
             (D + "test_streamed_disconnect_cancels", D + "test_non_streamed_disconnect_cancels")),
    Mutation("process group", "superfluid/nursery/_worker.py",
             "                        env=child_env,\n",
             "                        env=child_env, start_new_session=True,\n",
             (D + "test_health_and_models",)),
    Mutation("Shutdown before kill", "superfluid/nursery/_worker.py",
             "                                await handle.send(Shutdown())\n",
             "                                pass\n",
             (D + "test_shutdown_reaps_workers",)),
    Mutation("shutdown ends streams typed", "superfluid/daemon/_server.py",
             "        app.stopping.begin()\n",
             "        pass\n",
             ("tests/test_shutdown.py",)),
    Mutation("worker_crashed", "superfluid/sched/_loop.py",
             "            if job.lost_without_progress >= self.config.lost_limit:\n",
             "            if False:\n",
             (D + "test_request_that_keeps_killing_its_worker_fails_typed",)),
    Mutation("commit before delivery", "superfluid/sched/_loop.py",
             "            if failure is not None or job.done:\n                job.staged = job.staged[n:]\n",
             "            if job.done:\n                job.staged = job.staged[n:]\n",
             ("tests/test_fuzz_regressions.py::"
              "test_tokens_are_shown_only_after_their_commit_and_a_failed_commit_ends_typed",)),
    Mutation("epoch fence", "superfluid/journal/_files.py",
             "epoch=state.epoch + 1, ts=now_ms, body=body_epoch_bump())",
             "epoch=state.epoch, ts=now_ms, body=body_epoch_bump())",
             ("tests/test_journal.py::test_journal_epoch_increments_across_reopen",)),
    Mutation("torn tail", "superfluid/journal/_files.py",
             "            if end.torn:\n                os.ftruncate(fd, end.offset)\n",
             "            if False:\n                os.ftruncate(fd, end.offset)\n",
             ("tests/test_journal.py::test_journal_torn_tail_short_record_is_truncated",
              "tests/test_journal.py::test_journal_torn_tail_bad_checksum_then_zeros")),
    Mutation("max-batch", "superfluid/sched/_plan.py",
             "        free = cfg.max_batch - len(lanes)\n",
             "        free = cfg.max_batch + 1 - len(lanes)\n",
             ("tests/test_planner.py", "tests/test_fuzz_regressions.py::"
              "test_lanes_active_never_exceeds_max_batch_during_preemption")),
    Mutation("TTL release", "superfluid/sessions/_resumable.py",
             "                    await job.scheduler.stop(job)\n",
             "                    pass\n",
             ("tests/test_sessions.py::test_explicit_stop_and_resume_ttl",)),
    Mutation("unload ends requests typed", "superfluid/daemon/_registry.py",
             'was unloaded", code="model_unloaded")',
             'was unloaded", code="worker_unavailable")',
             (D + "test_unload_under_traffic_and_reload_on_demand",)),
    Mutation("lane fault contained", "superfluid/worker/_executor.py",
             "                    res.faults.append((ln.lane, f\"{type(exc).__name__}: {exc}\"))\n",
             "                    raise\n",
             (D + "test_a_lane_fault_ends_only_its_request",)),
    Mutation("model fault contained (actor)", "superfluid/daemon/_registry.py",
             "            except ModelFailed as exc:\n",
             "            except ZeroDivisionError as exc:\n",
             ("tests/test_actor.py::test_a_fault_in_one_model_ends_only_its_requests_and_it_restarts",)),
    Mutation("preemption loses nothing", "superfluid/sched/_loop.py",
             "                if job.preempted and not job.cancelled:\n",
             "                if job.preempted and job.cancelled:\n",
             (D + "test_interactive_chat_preempts_background_agents",)),
    Mutation("per-model lanes gauge", "superfluid/daemon/_registry.py",
             "self.metrics.for_model(name), self.committer",
             'self.metrics.for_model(""), self.committer',
             ("tests/test_fuzz_regressions.py::test_lanes_active_counts_every_models_lanes",)),
    Mutation("a more urgent arrival aborts a prefill step", "superfluid/worker/_main.py",
             "    def _arrived(self) -> int:\n        return self.arrived\n",
             "    def _arrived(self) -> int:\n        return NOTHING_ARRIVED\n",
             (D + "test_a_chat_does_not_wait_out_an_agents_prompt_pass",)),
    Mutation("an aborted step does not advance", "superfluid/worker/_executor.py",
             "            abort = lambda: arrived() < floor  # noqa: E731\n",
             "            abort = lambda: arrived() <= floor  # noqa: E731\n",
             ("tests/test_executor.py::test_a_prefill_step_is_aborted_only_for_a_more_urgent_arrival",)),
    Mutation("the engine drops an aborted pass's earlier micro-batches", "superfluid/worker/_llamacpp.py",
             "                        L.llama_memory_seq_rm(self._mem, row.seq, row.pos0, -1)\n",
             "                        pass\n",
             ("tests/test_llamacpp_engine.py::test_an_aborted_pass_leaves_the_kv_as_it_was",)),
    Mutation("small prefill steps only beside a more urgent decoder", "superfluid/worker/_executor.py",
             "                d.priority < prefill_lanes[0].priority for d in decoders):\n",
             "                d.priority <= prefill_lanes[0].priority for d in decoders):\n",
             ("tests/test_executor.py::test_prefill_steps_shrink_only_while_a_more_urgent_lane_decodes",)),
    Mutation("a worker exits when its stuck engine outlives the link", "superfluid/worker/_main.py",
             "            os._exit(EXIT_ENGINE_STUCK)\n",
             "            pass\n",
             ("tests/test_shutdown.py::test_a_worker_whose_engine_is_stuck_does_not_outlive_a_killed_daemon",)),
    Mutation("commands behind a death report are applied", "superfluid/sched/_loop.py",
             "            if isinstance(event, LinkLost):\n                lost = event\n",
             "            if isinstance(event, LinkLost):\n                raise event\n",
             ("tests/test_fuzz_regressions.py::test_commands_drained_behind_a_dead_workers_report_are_applied",)),
    Mutation("a worker failure under an unload is the unload", "superfluid/nursery/_worker.py",
             "            if rest.split(trio.Cancelled)[1] is None:\n",
             "            if False:\n",
             ("tests/test_fuzz_regressions.py::test_a_worker_failure_while_the_model_is_unloaded_is_the_unload",)),
)


def copy_tree(dest: Path) -> None:
    """The working tree as it is (tracked and untracked files, ignored ones left out)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def run_tests(scratch: Path, tests: tuple[str, ...], timeout: float) -> str:
    """``passed``, ``failed``, ``timeout`` or ``error (exit N)`` (pytest could not run them)."""
    env = {**os.environ, "PYTHONPATH": str(scratch), "PYTHONDONTWRITEBYTECODE": "1"}
    argv = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    try:
        proc = subprocess.run(argv, cwd=scratch, env=env, capture_output=True, timeout=timeout,
                              start_new_session=True)
    except subprocess.TimeoutExpired:
        return "timeout"
    return {0: "passed", 1: "failed"}.get(proc.returncode, f"error (exit {proc.returncode})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutations", description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", dest="select", default="", help="only mutations whose name contains this (default: all)")
    parser.add_argument("--list", action="store_true", help="print the mutations and exit")
    parser.add_argument("--no-baseline", action="store_true", help="do not run each mutation's tests unmutated first")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds for one pytest run; a mutated run past it counts as caught (default: 300)")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if args.select.lower() in m.name.lower()]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.file}\n    " + "\n    ".join(m.tests))
        return 0
    rows: list[tuple[str, str, str, str]] = []
    ok = True
    with tempfile.TemporaryDirectory(prefix="superfluid-mutations-") as tmp:
        scratch = Path(tmp)
        copy_tree(scratch)
        for m in chosen:
            path = scratch / m.file
            original = path.read_text()
            tests = " ".join(t.rsplit("::", 1)[-1] for t in m.tests)
            if original.count(m.old) != 1:
                rows.append((m.name, f"does not apply ({original.count(m.old)} matches)", tests, "-"))
                ok = False
                continue
            if not args.no_baseline:
                baseline = run_tests(scratch, m.tests, args.timeout)
                if baseline != "passed":
                    rows.append((m.name, "yes", tests, f"no: unmutated run {baseline}"))
                    ok = False
                    print(f"{m.name}: baseline {baseline}", flush=True)
                    continue
            path.write_text(original.replace(m.old, m.new))
            try:
                outcome = run_tests(scratch, m.tests, args.timeout)
            finally:
                path.write_text(original)
            caught = outcome in ("failed", "timeout")
            ok &= caught
            rows.append((m.name, "yes", tests, f"yes ({outcome})" if caught else f"NO ({outcome})"))
            print(f"{m.name}: {outcome}", flush=True)
    widths = [max(len(r[i]) for r in [("mutation", "applied?", "tests", "caught?"), *rows]) for i in range(4)]
    for row in [("mutation", "applied?", "tests", "caught?"), *rows]:
        print(" | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
    return 0 if ok and rows else 1


if __name__ == "__main__":
    sys.exit(main())
