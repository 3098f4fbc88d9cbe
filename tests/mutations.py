"""Mutation check: the tests SPEC.md cites for a rule fail when the rule is removed from the code.

Usage (from the repository root)::

    python -m tests.mutations                 # every mutation; exit 0 only if each applied and was caught
    python -m tests.mutations -k disconnect   # the mutations whose name contains "disconnect"
    python -m tests.mutations --list          # names, files and tests, nothing run
    python -m tests.mutations --no-baseline   # skip the unmutated run of the tests
    python -m tests.mutations -j 2            # two mutations at once, each in its own copy of the tree

Each mutation removes one rule SPEC.md states (a line or a few, replaced by an exact snippet) and
names the tests SPEC.md cites for that rule. The working tree (tracked and untracked files, ignored
ones left out) is copied once to a scratch directory. First the baseline: the union of the chosen
mutations' tests runs unmutated in one pytest invocation; a mutation whose tests do not all pass
there (failed, skipped or not found) fails, since a "caught" would prove nothing. Then, one
mutation at a time, its snippet is replaced in the scratch copy, only its tests run (``pytest -x``,
under a timeout sized from their baseline time; running past it counts as caught) and the file is
restored. A snippet not found exactly once is "not applied": the mutation no longer points at the
code (tests/test_mutations_apply.py fails the normal test run on that too).

The output is one line per mutation and a summary; the exit status is 0 only if every mutation
applied and was caught. CI runs it after the test suite (.ci/run, about 5 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs

ROOT = Path(__file__).resolve().parent.parent
_REPORT = "SUPERFLUID_MUTATIONS_REPORT"  # the baseline run's per-test outcomes go to this file


@attrs.frozen
class Mutation:
    name: str                # the rule, as SPEC.md states it
    file: str                # where the rule lives
    old: str                 # must occur exactly once in file
    new: str                 # the code without the rule
    tests: tuple[str, ...]   # pytest node ids or files SPEC.md cites for the rule


D = "tests/test_daemon.py::"
P = "tests/test_proto.py::"
G = "tests/test_security_guard.py::"
T = "tests/test_session_tree.py::"
R = "tests/test_session_rest.py::"
A = "tests/test_actor.py::"
B = "tests/test_boundaries.py::"
C = "tests/test_sched_core.py::"
AD = "tests/test_security_admission.py::"
L = "tests/test_security_logs.py::"
RA = "tests/test_security_archive.py::"
BD = "tests/test_security_bodies.py::"
CN = "tests/test_security_connections.py::"
F = "tests/test_fleet.py::"
BT = "tests/test_batches.py::"
UI = "tests/test_ui.py::"
UB = "tests/test_ui_browser.py::"
DG = "tests/test_docs_generated.py::"
SS = "tests/test_suite_scoring.py::"

MUTATIONS = (
    # ---- code that is not being refactored: proto, journal, worker, policy, api checks, runtime, chat ----
    Mutation("a frame's length is checked before its body is buffered", "superfluid/proto/_frames.py",
             "            if length > self.max_frame_size:\n",
             "            if False:\n",
             (P + "test_remote_oversized_frame_is_refused_before_its_body",)),
    Mutation("an unknown required message is a protocol error", "superfluid/proto/_events.py",
             "        if code >= DROPPABLE_BASE:\n            return None\n",
             "        if True:\n            return None\n",
             (P + "test_remote_unknown_required_message",)),
    Mutation("a refused send changes nothing", "superfluid/proto/_link.py",
             "        try:\n            data = encode_frame(to_wire(event), max_frame_size=self.max_frame_size)\n"
             "        except (TypeError, ValueError, OverflowError) as exc:\n"
             "            raise LocalProtocolError(f\"cannot encode {type(event).__name__}: {exc}\") from None\n"
             "        self._apply(self.our_role, event, LocalProtocolError)\n",
             "        self._apply(self.our_role, event, LocalProtocolError)\n"
             "        try:\n            data = encode_frame(to_wire(event), max_frame_size=self.max_frame_size)\n"
             "        except (TypeError, ValueError, OverflowError) as exc:\n"
             "            raise LocalProtocolError(f\"cannot encode {type(event).__name__}: {exc}\") from None\n",
             (P + "test_local_oversized_send_leaves_no_trace",)),
    Mutation("at most two ticks in flight", "superfluid/proto/_link.py",
             "MAX_TICKS_IN_FLIGHT = 2\n",
             "MAX_TICKS_IN_FLIGHT = 3\n",
             (P + "test_local_tick_beyond_the_pipeline_depth",)),
    Mutation("EOF outside CLOSING is a protocol error", "superfluid/proto/_link.py",
             "                    elif self._decoder.at_eof and self.state is not CLOSED:\n",
             "                    elif False:\n",
             (P + "test_remote_eof_between_frames_before_shutdown",)),
    Mutation("a bad record with data after it is WalCorrupt, not a torn tail", "superfluid/proto/_wal.py",
             "            if self._nonzero_at is not None:\n                raise self._fail(WalCorrupt(\n",
             "            if False:\n                raise self._fail(WalCorrupt(\n",
             ("tests/test_wal_codec.py::test_wal_reader_corrupt_middle_record",
              "tests/test_journal.py::test_journal_corrupt_middle_record_refuses_to_open")),
    Mutation("epoch fence", "superfluid/journal/_files.py",
             "epoch=state.epoch + 1, ts=now_ms, body=body_epoch_bump())",
             "epoch=state.epoch, ts=now_ms, body=body_epoch_bump())",
             ("tests/test_journal.py::test_journal_epoch_increments_across_reopen",)),
    Mutation("torn tail", "superfluid/journal/_files.py",
             "            if end.torn:\n                os.ftruncate(fd, end.offset)\n",
             "            if False:\n                os.ftruncate(fd, end.offset)\n",
             ("tests/test_journal.py::test_journal_torn_tail_short_record_is_truncated",
              "tests/test_journal.py::test_journal_torn_tail_bad_checksum_then_zeros")),
    Mutation("compaction keeps every unfinished session of this run", "superfluid/journal/_journal.py",
             "            elif s.epoch >= self.epoch or s.session in busy:\n",
             "            elif s.session in busy:\n",
             ("tests/test_journal.py::test_journal_compaction_keeps_unfinished_and_recent",)),
    Mutation("journal files are created 0600", "superfluid/_private.py",
             "FILE_MODE = 0o600\n",
             "FILE_MODE = 0o644\n",
             ("tests/test_security_faults.py::test_sessions_directory_and_every_journal_file_are_private",)),
    Mutation("looser modes are tightened at start", "superfluid/journal/_files.py",
             "        _tighten_modes(directory)\n",
             "        pass\n",
             ("tests/test_security_faults.py::test_looser_modes_are_fixed_at_start_with_one_warning",)),
    Mutation("lane fault contained", "superfluid/worker/_executor.py",
             "            res.faults.append((ln.lane, f\"{type(exc).__name__}: {exc}\"))\n            return 0\n",
             "            raise\n",
             (D + "test_a_lane_fault_ends_only_its_request",)),
    Mutation("an aborted step does not advance", "superfluid/worker/_executor.py",
             "            abort = lambda: arrived() < floor  # noqa: E731\n",
             "            abort = lambda: arrived() <= floor  # noqa: E731\n",
             ("tests/test_executor.py::test_a_prefill_step_is_aborted_only_for_a_more_urgent_arrival",)),
    Mutation("small prefill steps only beside a more urgent decoder", "superfluid/worker/_executor.py",
             "                d.priority < prefill_lanes[0].priority for d in decoders):\n",
             "                d.priority <= prefill_lanes[0].priority for d in decoders):\n",
             ("tests/test_executor.py::test_prefill_steps_shrink_only_while_a_more_urgent_lane_decodes",)),
    Mutation("KV is reused only under its own cache salt", "superfluid/worker/_executor.py",
             "        tokens = list(msg.tokens)\n        if len(tokens) >= self.info.n_ctx_seq:\n",
             "        msg = attrs.evolve(msg, cache_salt=\"\")\n"
             "        tokens = list(msg.tokens)\n        if len(tokens) >= self.info.n_ctx_seq:\n",
             ("tests/test_security_tenancy.py::test_the_executor_reuses_kv_only_under_its_salt",)),
    Mutation("a lone request keeps another prompt's sequence by taking an empty one", "superfluid/worker/_executor.py",
             "            return self._onto_empty(*picked, tokens=tokens, limit=limit, recent=recent)\n",
             "            return picked\n",
             ("tests/test_executor.py::test_lone_requests_keep_their_own_sequences_while_empty_ones_remain",)),
    Mutation("an empty sequence is taken only within the live span's reach", "superfluid/worker/_executor.py",
             "            if span(empty) > max(span(seq), 1 + recent):\n",
             "            if False:\n",
             ("tests/test_executor.py::test_lone_requests_keep_their_own_sequences_while_empty_ones_remain",)),
    Mutation("the same prompt again stays on its sequence", "superfluid/worker/_executor.py",
             "        if src is None and common_prefix(held, tokens, min(limit, size)) >= min(limit, size):\n",
             "        if size == 0:\n",
             ("tests/test_executor.py::test_a_wave_on_known_prompts_goes_back_to_their_sequences",)),
    Mutation("the lowest empty sequence is the first spare", "superfluid/worker/_executor.py",
             "        return (True, s.last_use, seq) if s.held else (False, 0, seq)\n",
             "        return (bool(s.held), s.last_use, seq)\n",
             ("tests/test_executor.py::test_lone_requests_keep_their_own_sequences_while_empty_ones_remain",)),
    Mutation("a short prefix is copied by state export", "superfluid/worker/_executor.py",
             "        if held <= STATE_COPY_MAX:\n",
             "        if False:\n",
             ("tests/test_executor.py::test_a_short_prefix_is_copied_by_state_and_a_long_one_by_seq_cp",)),
    Mutation("a prefix goes to host memory only when it would lose 8 tokens", "superfluid/worker/_executor.py",
             "        if len(slot.tokens) - keep < HOST_MIN_TOKENS or not self.host.wants(",
             "        if not self.host.wants(",
             ("tests/test_executor.py::test_a_prefix_goes_to_host_memory_only_when_it_would_lose_enough",)),
    Mutation("a more urgent arrival aborts a prefill step", "superfluid/worker/_main.py",
             "    def _arrived(self) -> int:\n        return self.arrived\n",
             "    def _arrived(self) -> int:\n        return NOTHING_ARRIVED\n",
             (D + "test_a_chat_does_not_wait_out_an_agents_prompt_pass",)),
    Mutation("the engine drops an aborted pass's earlier micro-batches", "superfluid/worker/_llamacpp.py",
             "                        L.llama_memory_seq_rm(self._mem, row.seq, row.pos0, -1)\n",
             "                        pass\n",
             ("tests/test_llamacpp_engine.py::test_an_aborted_pass_leaves_the_kv_as_it_was",)),
    Mutation("a worker exits when its stuck engine outlives the link", "superfluid/worker/_main.py",
             "            os._exit(EXIT_ENGINE_STUCK)\n",
             "            pass\n",
             ("tests/test_shutdown.py::test_a_worker_whose_engine_is_stuck_does_not_outlive_a_killed_daemon",)),
    Mutation("--idle-timeout never unloads the default model", "superfluid/serving/_keepalive.py",
             "    if model.name == default or idle_timeout_s <= 0:\n",
             "    if idle_timeout_s <= 0:\n",
             ("tests/test_models_lifetime.py::test_idle_unload_timing_in_virtual_time",)),
    Mutation("a foreign Origin is refused", "superfluid/api/_guard.py",
             "        return _is_loopback_name(parsed[0]) or \"*\" in self.origins",
             "        return True or \"*\" in self.origins",
             (G + "test_foreign_origins_are_refused_and_local_pages_get_cors",)),
    Mutation("a browser's form body is 415", "superfluid/api/_guard.py",
             "kind == \"application/x-www-form-urlencoded\" and not browser:",
             "kind == \"application/x-www-form-urlencoded\":",
             (G + "test_browser_simple_bodies_are_refused_and_curl_forms_are_not",)),
    Mutation("only GET /health is exempt from the key", "superfluid/api/_guard.py",
             "        exempt = path == \"/health\" and method in (\"GET\", \"HEAD\")\n",
             "        exempt = method == \"GET\"\n",
             (G + "test_every_dialect_needs_the_key",)),
    Mutation("admin routes need an admin key", "superfluid/api/_guard.py",
             "        if not principal.admin and self._is_admin_route(method, path):\n",
             "        if False:\n",
             (G + "test_admin_routes_need_an_admin_key",)),
    Mutation("rate-limit buckets are bounded", "superfluid/api/_guard.py",
             "        while len(self._buckets) > self._limit:\n",
             "        while False:\n",
             (G + "test_rate_limit_buckets_are_bounded",)),
    Mutation("a stream holds its key's concurrency slot", "superfluid/api/_admission.py",
             "        if len(live) >= key.max_concurrent:\n",
             "        if False:\n",
             (G + "test_a_stream_holds_its_concurrency_slot", G + "test_a_websocket_generation_holds_its_keys_slot")),
    Mutation("a response's end is not the client leaving", "superfluid/api/_lifecycle.py",
             "                if self.responded:\n                    self._ended()\n                else:\n                    self._left()\n",
             "                self._left()\n",
             (CN + "test_connection_close_and_http_1_0_answers_end_with_eof",
              CN + "test_the_end_of_the_exchange_is_not_the_client_leaving")),
    Mutation("the listen backlog is --backlog", "superfluid/daemon/_server.py",
             "    hconfig.backlog = config.backlog\n", "",
             (CN + "test_a_burst_of_1024_streams_all_complete_with_the_shipped_listener",)),
    Mutation("a client holds at most --max-connections-per-client", "superfluid/daemon/_listener.py",
             "            if counted and not self.peers.admit(peer):", "            if False:",
             (CN + "test_a_client_over_its_connection_cap_gets_a_typed_429",)),
    Mutation("a body's element count is checked before it parses", "superfluid/api/_http.py",
             "    if count > MAX_BODY_ELEMENTS:\n", "    if False:\n",
             (BD + "test_a_body_with_too_many_elements_is_413_and_prose_commas_are_not_elements",)),
    Mutation("a big body parses off the event loop", "superfluid/api/_http.py",
             "    if len(box[0]) <= INLINE_PARSE_BYTES:\n", "    if True:\n",
             (BD + "test_a_big_body_parses_in_a_thread_and_gives_its_bytes_back",
              BD + "test_a_wait_for_the_parse_slot_is_cancellable_and_an_abandoned_parse_gives_its_bytes_back")),
    Mutation("a body cancelled before its parse gives its bytes back", "superfluid/api/_http.py",
             "        if box:  # cancelled while it waited for the slot: no thread will release it\n",
             "        if False:\n",
             (BD + "test_a_wait_for_the_parse_slot_is_cancellable_and_an_abandoned_parse_gives_its_bytes_back",)),
    Mutation("a long string literal decodes a piece at a time", "superfluid/api/_http.py",
             '    spans = _long_strings(raw, LONG_STRING) if encoding in ("utf-8", "utf-8-sig") else []\n',
             "    spans = []\n",
             (BD + "test_no_parse_call_reads_more_than_a_window_of_a_long_string",)),
    Mutation("a long literal is cut in pieces of a window", "superfluid/api/_http.py",
             "    while end - cuts[-1] > _WINDOW:\n", "    while False:\n",
             (BD + "test_no_parse_call_reads_more_than_a_window_of_a_long_string",)),
    Mutation("exact mode's last prompt step takes the full cell before a partial last cell",
             "superfluid/worker/_executor.py",
             "    return last - GRID if end % GRID and last >= GRID else last\n",
             "    return last\n",
             ("tests/test_executor.py::test_a_prompts_last_step_has_one_shape_cold_warm_and_after_a_longer_prompt",
              "tests/test_executor.py::test_a_copy_and_a_host_import_stop_at_the_new_prompts_last_step")),
    Mutation("a reused prefix stops at the new prompt's last step", "superfluid/worker/_executor.py",
             "        own = min(self._cells(min(raw, slot.exact)), limit)\n",
             "        own = self._cells(min(raw, slot.exact))\n",
             ("tests/test_executor.py::test_a_prompts_last_step_has_one_shape_cold_warm_and_after_a_longer_prompt",)),
    Mutation("a tail is kept only from a lone last step", "superfluid/worker/_executor.py",
             "        keep = self._keep if self.deterministic or len(rows) == 1 else None\n",
             "        keep = self._keep\n",
             ("tests/test_executor.py::test_a_tail_is_kept_only_from_a_lone_last_step_and_only_for_its_salt",)),
    Mutation("a tail hit is within its cache salt", "superfluid/worker/_executor.py",
             "            if (len(held) == n_prompt and held[-1] == last and slot.salt == salt and slot.owner is None\n",
             "            if (len(held) == n_prompt and held[-1] == last and slot.owner is None\n",
             ("tests/test_executor.py::test_a_tail_is_kept_only_from_a_lone_last_step_and_only_for_its_salt",)),
    Mutation("kept tails stay within TAIL_BYTES", "superfluid/worker/_executor.py",
             "        while self._tail_bytes > TAIL_BYTES and len(self._tails) > 1:\n",
             "        while False:\n",
             ("tests/test_executor.py::test_tails_stay_within_their_budget_oldest_dropped",)),
    Mutation("a tail goes with its KV", "superfluid/worker/_executor.py",
             "        self.slots[seq].held = tokens\n        self._set_tail(seq, None)\n",
             "        self.slots[seq].held = tokens\n",
             ("tests/test_executor.py::test_a_tail_goes_with_its_kv",)),
    Mutation("a conversation holds only what its log can", "superfluid/api/_conversations.py",
             "        check_loggable(value, param)   # as the conversation's first record holds it\n",
             "        pass\n",
             ("tests/test_security_inputs.py::test_a_conversation_holds_only_what_its_log_can",)),
    Mutation("Anthropic stop_sequences stop generation", "superfluid/api/_anthropic.py",
             'tools=tools, choice=choice, stops=stops_from(body, "stop_sequences"),',
             "tools=tools, choice=choice,",
             ("tests/test_security_inputs.py::test_anthropic_stop_sequences_stop_generation",)),
    Mutation("log lines escape what clients sent", "superfluid/daemon/_logs.py",
             "        record.message = printable(record.message)  # format() sets it afresh for every handler\n",
             "",
             (L + "test_an_injected_path_writes_no_escape_or_forged_line_in_either_log",)),
    Mutation("the JSON log escapes what json.dumps leaves raw", "superfluid/daemon/_logs.py",
             "        return json_printable(json.dumps(obj, ensure_ascii=False, default=str))",
             "        return json.dumps(obj, ensure_ascii=False, default=str)",
             (L + "test_an_injected_path_writes_no_escape_or_forged_line_in_either_log",)),
    Mutation("/metrics shows a key only its models", "superfluid/serving/_metrics.py",
             "                if model is None or self.may_see(model):",
             "                if True:",
             (L + "test_metrics_show_a_key_only_its_models",)),
    Mutation("a generation's slot is held until its job ends", "superfluid/api/_admission.py",
             "        return self.held or (self.queued and not self.job.done)\n",
             "        return self.held\n",
             (AD + "test_a_resumable_stream_whose_client_left_keeps_its_slot_until_it_ends",
              AD + "test_conversation_turns_take_the_keys_slot_over_http_and_websocket",
              AD + "test_a_claim_counts_while_held_or_while_its_job_runs")),
    Mutation("a conversation turn takes its key's slot", "superfluid/api/_turns.py",
             "        with admit(app, job) as claim:",
             "        with app.guard.slots.claim(None, job) as claim:",
             (AD + "test_conversation_turns_take_the_keys_slot_over_http_and_websocket",)),
    Mutation("each WebSocket op pays the rate limit", "superfluid/api/_ws.py",
             "            refusal = self.app.guard.charge(self.scope, principal_of(self.scope))",
             "            refusal = None",
             (AD + "test_each_websocket_op_pays_the_rate_limit",)),
    Mutation("a refused WebSocket upgrade answers its own status", "superfluid/api/_app.py",
             "                    send = ws_denial(send)",
             "                    await send({\"type\": \"websocket.close\", \"code\": 1008})\n                    return",
             (AD + "test_each_websocket_op_pays_the_rate_limit",)),
    Mutation("all of 127/8 is one rate bucket", "superfluid/api/_guard.py",
             "        return \"127.0.0.0/8\" if ip.is_loopback else str(ip)\n",
             "        return str(ip)\n",
             (AD + "test_the_per_peer_bucket_is_one_for_loopback_and_one_per_ipv6_64",)),
    Mutation("/health tells what is loaded only to a key", "superfluid/api/_app.py",
             "            if self.config.api_keys and authenticate(self.config.api_keys, presented_key(scope)) is None:\n",
             "            if False:\n",
             (AD + "test_health_tells_what_is_loaded_only_to_a_key",)),
    Mutation("keep_alive is an admin's", "superfluid/api/_admission.py",
             "    return seconds if admin else None\n",
             "    return seconds\n",
             (AD + "test_a_non_admin_keys_keep_alive_neither_unloads_nor_pins",
              AD + "test_keep_alive_is_granted_to_admins_only")),
    Mutation("a key's conversations have a quota", "superfluid/api/_turns.py",
             "    if key is None or not (key.max_conversations or key.max_stored_bytes):\n",
             "    if True:\n",
             (AD + "test_a_keys_conversations_are_capped_in_number_and_bytes",)),
    Mutation("a conversation's qos obeys --no-http-qos-header", "superfluid/api/_turns.py",
             "    if not app.config.http_qos_header:\n        return qos_of(app, scope)\n",
             "",
             (AD + "test_a_conversations_qos_is_ignored_under_no_http_qos_header",)),
    Mutation("a key uses only its models", "superfluid/api/_principal.py",
             "        return self.key is None or self.key.models is None or name in self.key.models\n",
             "        return True\n",
             (G + "test_a_key_uses_only_its_models",)),
    Mutation("a class above the key's max is refused, not lowered", "superfluid/api/_principal.py",
             "        if asked < self.key.max_class:  # a lower number is a higher class\n",
             "        if False:\n",
             (G + "test_a_key_cannot_ask_a_class_above_its_max",)),
    Mutation("another tenant's id answers as an unknown one", "superfluid/api/_tenancy.py",
             "        if tenant_of(app, sid) == tenant:\n",
             "        if tenant_of(app, sid) is not None:\n",
             ("tests/test_security_tenancy.py::test_another_key_gets_the_unknown_id_answer_over_http",)),
    Mutation("a client-chosen id needs keys", "superfluid/api/_tenancy.py",
             "    if not app.config.api_keys:\n",
             "    if False:\n",
             ("tests/test_security_tenancy.py::test_client_chosen_ids_are_refused_without_keys",)),
    Mutation("seed 0 is a real seed", "superfluid/api/_params.py",
             "seed=secrets.randbits(32) if seed is None else seed % 2**32,",
             "seed=secrets.randbits(32) if not seed else seed % 2**32,",
             ("tests/test_security_inputs.py::test_seed_is_bounded_and_zero_is_a_real_seed",)),
    Mutation("logit_bias keys are token ids of the model", "superfluid/api/_params.py",
             " or not int(k) < n_vocab:\n",
             ":\n",
             ("tests/test_security_inputs.py::test_logit_bias_is_validated",)),
    Mutation("chat_template_kwargs never shadow a template variable", "superfluid/api/_params.py",
             "        if name in TEMPLATE_NAMES:\n",
             "        if False:\n",
             ("tests/test_security_inputs.py::test_chat_template_kwargs_are_validated",)),
    Mutation("client strings reach the template as data", "superfluid/chat/_template.py",
             "            segments.append((self.texts[int(m.group(1))], False))\n",
             "            segments.append((self.texts[int(m.group(1))], True))\n",
             ("tests/test_security_inputs.py::test_every_client_string_reaches_the_template_as_data",)),
    Mutation("an artifact's SHA-256 is verified", "superfluid/runtime/_install.py",
             "            elif got != artifact.sha256:\n",
             "            elif False:\n",
             ("tests/test_runtime_install.py::test_wrong_sha256_installs_nothing",)),
    Mutation("an archive member may not climb out with '..'", "superfluid/runtime/_archive.py",
             '    if ".." in parts:\n', "    if False:\n",
             ("tests/test_runtime_install.py::test_unsafe_archives_fail_the_install",
              RA + "test_refused_tar_members_write_nothing_outside")),
    Mutation("an archive makes no link, device or special file", "superfluid/runtime/_archive.py",
             "                if why is not None:\n", "                if False:\n",
             (RA + "test_cve_2025_4517_symlink_chain_writes_nothing_outside",
              RA + "test_refused_tar_members_write_nothing_outside")),
    Mutation("an archive has at most LIMITS.members members", "superfluid/runtime/_archive.py",
             "        if self.members > self.limits.members:\n", "        if False:\n",
             (RA + "test_too_many_members_is_refused_without_unpacking_them_all",
              RA + "test_a_refused_archive_leaves_home_as_it_was")),
    Mutation("plain http only from a loopback host", "superfluid/runtime/_install.py",
             "    if parts.scheme == \"http\" and _loopback(parts.hostname):\n",
             "    if parts.scheme == \"http\":\n",
             ("tests/test_runtime_install.py::test_remote_archive_without_sha256_or_over_http_is_refused",)),
    Mutation("credentials never reach the check", "superfluid/runtime/_install.py",
             "    return {k: v for k, v in os.environ.items() if not _CRED_RE.search(k)}\n",
             "    return dict(os.environ)\n",
             ("tests/test_runtime_install.py::test_credentials_never_reach_the_check_or_the_log",)),

    # ---- the scheduler: its sans-I/O core (sched/_core.py) and its actor (sched/_loop.py) ----
    Mutation("one writer: a handler applies its command itself", "superfluid/sched/_loop.py",
             "        try:\n            await self.inbox_send.send(command)\n",
             "        self.core.apply(command, trio.current_time())  # the pre-actor design\n        return\n"
             "        try:\n            await self.inbox_send.send(command)\n",
             (A + "test_handlers_reach_the_scheduler_only_by_commands",
              A + "test_handlers_cannot_write_the_schedulers_state_while_its_actor_runs")),
    Mutation("one writer: every write to the core runs the actor's guard", "superfluid/sched/_core.py",
             "        if self.guard is not None:\n            self.guard()\n",
             "        pass\n",
             (C + "test_every_write_runs_the_holders_guard",
              A + "test_handlers_cannot_write_the_schedulers_state_while_its_actor_runs")),
    Mutation("stops are applied before commands, also while commits are backed up", "superfluid/sched/_loop.py",
             "        self._take_stops()\n        self._take_results()\n",
             "        if self._in_flight_rounds < COMMIT_QUEUE:\n            self._take_stops()\n"
             "        self._take_results()\n",
             (A + "test_a_stop_reaches_a_stalled_actor_behind_a_full_inbox",)),
    Mutation("a stop is never dropped (a full inbox does not refuse it)", "superfluid/sched/_loop.py",
             "        if self.closed is None:\n            self._stops[job.id] = job\n",
             "        if self.closed is None and self.inbox_send.statistics().current_buffer_used < INBOX_SIZE:\n"
             "            self._stops[job.id] = job\n",
             (A + "test_a_stop_reaches_a_stalled_actor_behind_a_full_inbox",)),
    Mutation("a stopped job's late reservation takes no place", "superfluid/sched/_core.py",
             "        if job.done or job.cancelled:\n            return   # stopped before its reservation arrived",
             "        if False:\n            return   # stopped before its reservation arrived",
             (C + "test_a_stopped_jobs_late_reservation_holds_nothing_when_its_handler_never_queues",
              A + "test_a_handler_cancelled_while_waiting_leaves_nothing_behind")),
    Mutation("disconnect cancel", "superfluid/api/_lane.py",
             "    if not keep and not job.done:  # (a done job holds no lane and no place)\n",
             "    if False:\n",
             (D + "test_streamed_disconnect_cancels", D + "test_non_streamed_disconnect_cancels")),
    Mutation("commit before delivery", "superfluid/sched/_core.py",
             "            if failure is not None or job.done:\n                job.staged = job.staged[n:]\n",
             "            if job.done:\n                job.staged = job.staged[n:]\n",
             ("tests/test_fuzz_regressions.py::"
              "test_tokens_are_shown_only_after_their_commit_and_a_failed_commit_ends_typed",)),
    Mutation("a failed commit stops the lanes of its jobs", "superfluid/sched/_core.py",
             "        if job.lane is not None:   # (before finish_with, which lets go of the lane number)\n"
             "            self._stopping.append((job, job.lane))\n        job.finish_with(error=error)\n",
             "        job.finish_with(error=error)\n"
             "        if job.lane is not None:\n            self._stopping.append((job, job.lane))\n",
             (C + "test_a_failed_commit_stops_the_lanes_of_its_running_jobs",
              "tests/test_fuzz_regressions.py::"
              "test_tokens_are_shown_only_after_their_commit_and_a_failed_commit_ends_typed")),
    Mutation("an unload ends a job whose finish is being committed", "superfluid/sched/_core.py",
             "        for job in [*self.running.values(), *self._settling.values()]:\n",
             "        for job in [*self.running.values()]:\n",
             (C + "test_an_unload_ends_a_job_whose_finish_is_still_being_committed",)),
    Mutation("worker_crashed", "superfluid/sched/_core.py",
             "            if job.lost_without_progress >= self.config.lost_limit:\n",
             "            if False:\n",
             (C + "test_a_job_that_keeps_killing_workers_fails_typed_and_spares_the_rest",
              D + "test_request_that_keeps_killing_its_worker_fails_typed")),
    Mutation("a tokenize goes to 3 workers at most", "superfluid/sched/_core.py",
             "            if pending.attempts >= TOKENIZE_ATTEMPTS:\n",
             "            if pending.attempts > TOKENIZE_ATTEMPTS:\n",
             (C + "test_a_tokenize_waits_for_a_worker_and_goes_to_at_most_three",)),
    Mutation("waiting tokenizes go in arrival order within a class", "superfluid/sched/_core.py",
             "                req = waiting.popleft()\n",
             "                req = waiting.pop()\n",
             (C + "test_tokenizes_go_the_most_urgent_class_first_in_arrival_order_within_a_class",)),
    Mutation("preemption loses nothing", "superfluid/sched/_core.py",
             "                if job.preempted and not job.cancelled:\n",
             "                if job.preempted and job.cancelled:\n",
             (C + "test_a_preempted_lane_requeues_and_an_urgent_job_asks_for_an_interrupt",
              D + "test_interactive_chat_preempts_background_agents")),
    Mutation("the events before a death report are applied", "superfluid/sched/_loop.py",
             "            if isinstance(event, LinkLost):\n                self._apply_events(out)\n",
             "            if isinstance(event, LinkLost):\n",
             (A + "test_a_workers_answers_before_its_death_report_are_applied",)),
    Mutation("max-batch", "superfluid/sched/_plan.py",
             "        free = cfg.max_batch - len(lanes)\n",
             "        free = cfg.max_batch + 1 - len(lanes)\n",
             ("tests/test_planner.py::test_plan_admits_only_queued_jobs_once_into_free_lanes",)),
    Mutation("TTL release", "superfluid/sessions/_resumable.py",
             "                job.scheduler.stop(job)  # never waits",
             "                pass  # never waits",
             ("tests/test_sessions.py::test_explicit_stop_and_resume_ttl",)),

    # ---- the nursery: worker, model actor, supervisor ----
    Mutation("process group", "superfluid/nursery/_worker.py",
             "                        env=child_env,\n",
             "                        env=child_env, start_new_session=True,\n",
             (D + "test_health_and_models",)),
    Mutation("Shutdown before kill", "superfluid/nursery/_worker.py",
             "                                await handle.send(Shutdown())\n",
             "                                pass\n",
             (D + "test_shutdown_reaps_workers",)),
    Mutation("a worker link has one writer", "superfluid/nursery/_worker.py",
             "        assert task is self._writer, f\"worker pid {self.pid}: the link has one writer, the model's actor\"\n",
             "",
             ("tests/test_fuzz_regressions.py::test_a_worker_link_has_one_writer",)),
    Mutation("a worker failure under an unload is the unload", "superfluid/nursery/_worker.py",
             "        if rest.split(trio.Cancelled)[1] is None:\n",
             "        if False:\n",
             ("tests/test_fuzz_regressions.py::test_a_worker_failure_while_the_model_is_unloaded_is_the_unload",)),
    Mutation("a session task is its own boundary", "superfluid/nursery/_actor.py",
             "        except* Exception as failures:  # noqa: BLE001",
             "        except* ZeroDivisionError as failures:  # noqa: BLE001",
             (B + "test_a_bug_in_a_session_task_stops_its_job_and_the_model_goes_on",)),
    Mutation("a shutdown bounds every request scope", "superfluid/api/_lifecycle.py",
             "        for request in list(self._requests):\n            request.shut(deadline)\n",
             "        for request in list(self._requests):\n            pass\n",
             ("tests/test_request_scope.py::test_a_request_stuck_where_no_helper_watches_ends_503_on_shutdown",)),
    Mutation("a request ended by the shutdown's backstop is answered typed", "superfluid/api/_app.py",
             "            if request.scope.cancelled_caught and request.stopped and not request.gone:\n",
             "            if False:\n",
             ("tests/test_request_scope.py::test_a_request_stuck_where_no_helper_watches_ends_503_on_shutdown",)),
    Mutation("a failed session task's job ends typed", "superfluid/sched/_job.py",
             "        if finish == \"cancelled\" and self.abort is not None:\n",
             "        if False:\n",
             (B + "test_a_bug_in_a_session_task_stops_its_job_and_the_model_goes_on",)),
    Mutation("a session task starts in a clean context", "superfluid/nursery/_actor.py",
             "        contextvars.Context().run(self._sessions.start_soon, self._session, fn, args, job)\n",
             "        self._sessions.start_soon(self._session, fn, args, job)\n",
             (B + "test_a_session_task_starts_in_a_clean_context_and_none_starts_once_the_actor_ended",)),
    Mutation("start_session refuses typed once the actor ended", "superfluid/nursery/_actor.py",
             "        if self._sessions is None:\n            message, code = self._stop or",
             "        if False:\n            message, code = self._stop or",
             (B + "test_a_session_task_starts_in_a_clean_context_and_none_starts_once_the_actor_ended",)),
    Mutation("model fault contained (actor)", "superfluid/nursery/_supervisor.py",
             "        except Exception as exc:  # noqa: BLE001 - the model's boundary",
             "        except ZeroDivisionError as exc:  # noqa: BLE001 - the model's boundary",
             (B + "test_the_supervisor_catches_a_group_from_the_whole_actor_and_gives_up_past_the_intensity",
              A + "test_a_fault_in_one_model_ends_only_its_requests_and_it_restarts")),
    Mutation("the supervisor catches whatever the whole actor raises", "superfluid/nursery/_supervisor.py",
             "            if not actor.started:\n                raise  # the first load's failure",
             "            if not actor.started or type(exc).__name__ != \"ModelFailed\":\n"
             "                raise  # the first load's failure",
             (B + "test_the_supervisor_catches_a_group_from_the_whole_actor_and_gives_up_past_the_intensity",
              B + "test_a_failure_in_the_sessions_nursery_restarts_the_model_not_the_daemon")),

    # ---- the daemon and the API around the actor ----
    Mutation("shutdown ends streams typed", "superfluid/daemon/_server.py",
             "        app.stopping.begin()\n",
             "        pass\n",
             ("tests/test_shutdown.py::test_ctrl_c_ends_every_stream_typed_and_a_resumable_one_resumes_after_restart",)),
    Mutation("unload ends requests typed", "superfluid/daemon/_registry.py",
             'was unloaded", code="model_unloaded")',
             'was unloaded", code="worker_unavailable")',
             (D + "test_unload_under_traffic_and_reload_on_demand",)),
    Mutation("per-model lanes gauge", "superfluid/daemon/_registry.py",
             "self.metrics.for_model(name, node=node), self.committer",
             'self.metrics.for_model("", node=node), self.committer',
             ("tests/test_fuzz_regressions.py::test_lanes_active_counts_every_models_lanes",)),
    Mutation("a turn's owner starts before the turn is logged", "superfluid/api/_turns.py",
             "        try:  # the owner first: a turn in the log always has one\n"
             "            model.actor.start_session(_own_turn, app, handed, job=job)\n"
             "        except Unavailable as exc:\n"
             "            raise ApiError(503, str(exc), code=exc.code) from None  # nothing logged\n"
             "        with hand:  # closed without a turn: the owner has nothing to own\n"
             "            await store.begin(turn, params)\n",
             "        await store.begin(turn, params)\n"
             "        try:\n"
             "            model.actor.start_session(_own_turn, app, handed, job=job)\n"
             "        except Unavailable as exc:\n"
             "            raise ApiError(503, str(exc), code=exc.code) from None\n"
             "        with hand:\n",
             (B + "test_a_turn_whose_model_stopped_before_it_was_logged_is_refused_with_nothing_logged",)),
    Mutation("the request scope is cancelled when its client leaves", "superfluid/api/_lifecycle.py",
             "        self.gone = True\n        self.scope.cancel()\n",
             "        self.gone = True\n",
             ("tests/test_request_scope.py::test_a_client_that_leaves_during_a_tokenize_costs_nothing_more",
              "tests/test_request_scope.py::test_a_request_without_a_body_is_cancelled_when_its_client_leaves")),
    Mutation("a socket watches the shutdown itself", "superfluid/api/_ws.py",
             "                    work.start_soon(self._close_for_shutdown)  # this socket's own task",
             "                    pass  # this socket's own task",
             ("tests/test_ws_shutdown.py::test_a_shutdown_closes_an_open_socket_with_1001_from_its_own_task",)),
    Mutation("the shutdown's begin never spawns into a socket", "superfluid/api/_ws.py",
             "                    work.start_soon(self._close_for_shutdown)  # this socket's own task: nothing else spawns here\n",
             "                    stopping, begin = self.app.stopping, self.app.stopping.begin\n\n"
             "                    def hooked() -> None:  # the old hook: the stop task spawns into this socket\n"
             "                        begin()\n"
             "                        self.work.start_soon(self._close_for_shutdown)\n\n"
             "                    stopping.begin = hooked\n",
             ("tests/test_ws_shutdown.py::test_a_shutdown_beginning_as_a_socket_closes_does_not_raise",
              "tests/test_ws_shutdown.py::test_a_shutdown_at_any_moment_of_a_closing_socket_ends_it_cleanly")),
    # ---- the fleet (SPEC.md §14) ----
    Mutation("a stop follows its job to the scheduler that holds it", "superfluid/sched/_loop.py",
             "        if owner is not None and owner is not self:\n",
             "        if False:\n",
             (F + "test_a_client_that_leaves_after_its_stream_moved_stops_it_on_the_new_node",)),
    Mutation("a job whose tokens are still being committed stays until they land", "superfluid/sched/_core.py",
             "            keep = [job for job in q if job.staged]\n            moved += [job for job in q if not job.staged]\n",
             "            keep = []\n            moved += list(q)\n",
             (C + "test_a_gone_nodes_core_gives_up_its_waiting_jobs_and_tokenizes_to_another",)),
    Mutation("a gone node's waiting jobs go to a node that is up", "superfluid/serving/_placement.py",
             "        targets = [a for a in self.live() if a.scheduler is not source]\n",
             "        targets = []\n",
             (F + "test_a_node_killed_mid_stream_loses_nothing_and_repeats_nothing",)),
    Mutation("a request counts on its node from the moment it is placed", "superfluid/serving/_placement.py",
             "            load = {id(a): max(_load(a), placed.get(id(a.scheduler), 0)) for a in fits}\n",
             "            load = {id(a): _load(a) for a in fits}\n",
             (F + "test_requests_placed_together_spread_before_any_reached_a_node",)),
    Mutation("a node whose link is lost fences its worker at once", "superfluid/fleet/_node.py",
             "        kill_now(self.process)   # nothing it generates from now on reaches anyone\n",
             "        pass\n",
             (F + "test_a_partition_ends_with_every_stream_complete_and_nothing_twice",)),
    Mutation("the link is keyed by the fleet token", "superfluid/fleet/_channel.py",
             "        noise.set_psks(psk=key)\n",
             "        noise.set_psks(psk=bytes(32))\n",
             (F + "test_the_link_is_encrypted_and_a_wrong_token_is_refused",
              "tests/test_fleet_channel.py::test_wrong_token_fails_both_sides")),
    Mutation("a restarted head waits for the nodes of its resumable sessions", "superfluid/daemon/_server.py",
             "                await registry.wait_for_models(store.models_to_resume(), config.fleet_wait_s)\n",
             "                pass\n",
             (F + "test_a_head_restart_resumes_resumable_streams_on_the_nodes",)),
    # ---- the built-in page (SPEC.md §8 "The built-in page", §10) ----
    Mutation("the page's files need no key (the page asks for it)", 'superfluid/api/_guard.py',
             '        exempt = exempt or (http and self.ui and ui_public(scope))  # the page: it asks for the key itself\n',
             '        exempt = exempt or False\n',
             (UI + 'test_the_page_needs_no_key_but_passes_the_host_and_origin_checks', UB + 'test_with_keys_the_page_asks_for_one_and_keeps_it_in_the_tab',)),
    Mutation('the page is served with a strict CSP', 'superfluid/api/_ui.py',
             '_HEADERS = [(b"content-security-policy", CSP), ',
             '_HEADERS = [',
             (UI + 'test_the_page_and_its_assets_are_served_with_a_strict_policy',)),
    Mutation('--no-ui: no page', 'superfluid/api/_ui.py',
             '    if not enabled or not (path in ("/", "/ui") or path.startswith("/ui/")):\n',
             '    if not (path in ("/", "/ui") or path.startswith("/ui/")):\n',
             (UI + 'test_no_ui_turns_the_page_off',)),
    Mutation("only a browser's GET / goes to the page", 'superfluid/api/_ui.py',
             '        if path == "/" and (method not in ("GET", "HEAD") or not _wants_html(scope)):\n',
             '        if path == "/" and method not in ("GET", "HEAD"):\n',
             (UI + 'test_the_page_and_its_assets_are_served_with_a_strict_policy',)),
    Mutation("/ui/lanes lists only the key's models", 'superfluid/api/_ui.py',
             '        if not may_use(model.name):\n',
             '        if False:\n',
             (UI + 'test_lanes_tell_a_key_only_its_models',)),
    Mutation('/ui/lanes is exempt from the rate limit', 'superfluid/api/_guard.py',
             '"/v1/metrics", "/ui/lanes"})',
             '"/v1/metrics"})',
             (UI + 'test_the_live_views_polls_do_not_pay_the_rate_limit',)),
    Mutation("/slots lists only the key's models", "superfluid/api/_infill.py",
             "        models = [m for m in list(app.registry.loaded.values()) if principal.may_use(m.name)]\n",
             "        models = list(app.registry.loaded.values())\n",
             ("tests/test_slots.py::test_slots_tell_a_key_only_its_models",)),
    Mutation("/slots shows a running job's lane as processing", "superfluid/api/_infill.py",
             '"speculative": False, "is_processing": job is not None,',
             '"speculative": False, "is_processing": False,',
             ("tests/test_slots.py::test_slots_list_each_lane_busy_or_idle",)),
    Mutation("/slots lists every KV sequence, the ids slot actions take", "superfluid/api/_infill.py",
             '.get("n_seq", 0)) or sched.config.planner.max_batch',
             '.get("max_lanes", 0)) or sched.config.planner.max_batch',
             ("tests/test_slots.py::test_the_ids_get_slots_lists_are_the_ids_slot_actions_take",)),
    Mutation("/slots shows a running job in the sequence its lane runs in", "superfluid/api/_infill.py",
             "        in_seq = {job.kv_seq: job for job in list(sched.running.values()) if job.kv_seq >= 0 and not job.preempted}\n",
             "        in_seq = dict(enumerate(job for job in list(sched.running.values()) if not job.preempted))\n",
             ("tests/test_slots.py::test_the_ids_get_slots_lists_are_the_ids_slot_actions_take",)),
    Mutation("the worker names an admitted lane's KV sequence", "superfluid/worker/_main.py",
             "Admitted(lane=op.lane, cached=lane.cached, seq=lane.seq)",
             "Admitted(lane=op.lane, cached=lane.cached)",
             ("tests/test_slots.py::test_the_ids_get_slots_lists_are_the_ids_slot_actions_take",
              "tests/test_slots.py::test_slots_list_each_lane_busy_or_idle")),
    Mutation("/slots fail_on_no_slot: no lane free", "superfluid/api/_infill.py",
             "            _lane_free(model) for model in models):",
             '            not row["is_processing"] for row in rows):',
             ("tests/test_slots.py::test_slots_list_each_lane_busy_or_idle",)),
    Mutation("a slot action is an admin route", "superfluid/api/_guard.py",
             '                or (method == "POST" and _SLOT_PATH.fullmatch(path) is not None))\n',
             "                )\n",
             ("tests/test_slots.py::test_a_slot_saved_for_one_tenant_does_not_restore_for_another",)),
    Mutation("a slot file of another model or tenant is refused as foreign", "superfluid/worker/_park.py",
             'if not isinstance(tokens, list) or park_digest(salt, self.identity, tokens) != header.get("digest"):',
             "if not isinstance(tokens, list):",
             ("tests/test_slots.py::test_a_slot_saved_for_one_tenant_does_not_restore_for_another",
              "tests/test_slots.py::test_a_saved_slot_restores_in_a_fresh_daemon_with_the_same_text")),
    Mutation("a slot file's name is a plain name (HTTP)", "superfluid/api/_infill.py",
             '    if action != "erase" and (not isinstance(filename, str) or not SLOT_FILE.fullmatch(filename)\n',
             '    if action != "erase" and (not isinstance(filename, str)\n',
             ("tests/test_slots.py::test_a_saved_slot_restores_in_a_fresh_daemon_with_the_same_text",)),
    Mutation("a slot file's name is a plain name (worker)", "superfluid/worker/_executor.py",
             '        if not SLOT_FILE.fullmatch(filename) or filename in (".", ".."):\n',
             "        if False:\n",
             ("tests/test_slots.py::test_the_worker_refuses_a_slot_file_name_that_is_a_path",)),
    Mutation("a restored slot serves later prompts as cached KV", "superfluid/worker/_executor.py",
             "        self._set_held(seq, tokens)\n        return 0, \"\", \"\", len(tokens), len(data)\n",
             "        self.engine.seq_rm(seq, 0, -1)\n        return 0, \"\", \"\", len(tokens), len(data)\n",
             ("tests/test_slots.py::test_a_saved_slot_restores_in_a_fresh_daemon_with_the_same_text",)),
    Mutation("slot files need --park", "superfluid/worker/_executor.py",
             '        if park is None:\n            return 501, "slots_unavailable"',
             '        if False:\n            return 501, "slots_unavailable"',
             ("tests/test_slots.py::test_slot_files_need_park",)),
    Mutation("--kv-bits 8 makes a q8_0 K and V cache", "superfluid/worker/_llamacpp.py",
             "        cp.type_v = L.GGML_TYPE_Q8_0\n",
             "",
             ("tests/test_kv_bits.py::test_real_model_q8_kv_generates_and_never_restores_a_16_bit_park",)),
    Mutation("the worker is told --kv-bits", "superfluid/nursery/_worker.py",
             '        argv += ["--kv-bits", str(spec.kv_bits)]\n',
             "        pass\n",
             ("tests/test_kv_bits.py::test_the_worker_is_told_its_kv_width",)),
    Mutation("--kv-bits 8 is refused for a runtime with a 16-bit KV", "superfluid/cli/_main.py",
             '            if s.runtime != "llamacpp":\n',
             "            if False:\n",
             ("tests/test_kv_bits.py::test_kv_bits_8_is_refused_where_it_cannot_hold",)),
    Mutation("--kv-bits takes 16 or 8 only", "superfluid/cli/_flags.py",
             "lambda n: n in (16, 8)", "lambda n: n > 0",
             ("tests/test_kv_bits.py::test_kv_bits_is_16_or_8",)),
    Mutation("the daemon fuzzer runs its daemon with --park", "fuzz/_daemon_model.py",
             '    ref_specs=("mock?step_ms=0&prefill_us=0",), park=True,\n',
             '    ref_specs=("mock?step_ms=0&prefill_us=0",),\n',
             ("fuzz/test_fuzz_daemon.py::test_a_turn_restored_from_a_park_after_a_daemon_restart_gives_the_reference_text",)),
    Mutation("a restored park is trimmed to the prompt it shares", "superfluid/worker/_executor.py",
             "        if n < len(entry.tokens):\n            self.engine.seq_rm(seq, n, -1)\n        park.resumed(",
             "        park.resumed(",
             ("fuzz/test_fuzz_daemon.py::test_a_turn_restored_from_a_park_after_a_daemon_restart_gives_the_reference_text",)),
    Mutation("a running lane's slot is not restored over", "superfluid/worker/_executor.py",
             "        if slot.owner is not None:\n            return 409, \"slot_busy\", f\"slot {seq} is running a generation\", 0, 0\n        try:\n",
             "        try:\n",
             ("tests/test_slots.py::test_a_running_lanes_slot_saves_its_kv_so_far_and_is_not_restored_over_or_erased",)),
    Mutation("the monitor shows a parking model's park line", "superfluid/daemon/_monitor.py",
             "            if view.park is not None:\n",
             "            if False:\n",
             ("tests/test_monitor.py::test_monitor_shows_park_activity_for_a_model_with_park",)),
    Mutation("the monitor's park line only for a model that parks", "superfluid/daemon/_monitor.py",
             "    if not parks and not any(values) and not fallbacks:\n        return None\n",
             "",
             ("tests/test_monitor.py::test_monitor_shows_lanes_and_tokens_q_drains_and_restores_the_terminal",)),
    Mutation("the monitor's park fallbacks by reason, nonzero only", "superfluid/daemon/_monitor.py",
             "for r, n in series[\"fallbacks\"].items() if n > 0))",
             "for r, n in {**series[\"fallbacks\"], \"missing\": 0.0}.items()))",
             ("tests/test_monitor.py::test_monitor_shows_park_activity_for_a_model_with_park",)),
    Mutation("the worker reports its park index once loaded", "superfluid/worker/_main.py",
             "        worker.park_written()   # what the index found",
             "        pass   # what the index found",
             ("tests/test_monitor.py::test_monitor_shows_park_activity_for_a_model_with_park",)),
    Mutation("MLX parks a model of plain KVCache layers", "superfluid/worker/_mlx.py",
             "        self.parks = not kinds\n",
             "        self.parks = False\n",
             ("tests/test_mlx.py::test_mlx_a_conversation_resumes_from_its_park_after_a_daemon_restart",)),
    Mutation("an export of arrays is parked as its bytes", "superfluid/worker/_executor.py",
             "    return data if to_bytes is None or isinstance(data, (bytes, bytearray)) else to_bytes()\n",
             "    return data\n",
             ("tests/test_mlx.py::test_mlx_a_conversation_resumes_from_its_park_after_a_daemon_restart",)),
    Mutation("MLX state bytes longer than their header are refused", "superfluid/worker/_mlx.py",
             "        if at != len(raw) or len(arrays) % 2:\n",
             "        if len(arrays) % 2:\n",
             ("tests/test_mlx.py::test_mlx_state_bytes_read_back_as_written_and_nothing_else",)),
    Mutation("a model directory's park identity names its files", "superfluid/worker/_main.py",
             "        if os.path.isdir(args.model):\n",
             "        if False:\n",
             ("tests/test_park.py::test_a_model_directorys_park_identity_changes_with_its_files",)),
    # ---- clients (SPEC.md §5, §8, §11: issue #47) ----
    Mutation("n is at most 16", "superfluid/api/_chat.py",
             'integer(body, "n", lo=1, hi=MAX_CHOICES, default=1)',
             'integer(body, "n", lo=1, hi=1 << 20, default=1)',
             ("tests/test_n_choices.py::test_n_is_bounded_and_typed",)),
    Mutation("a stored response is its tenant's only", "superfluid/api/_responses.py",
             "(tenant is not None and item.tenant != tenant)",
             "False",
             ("tests/test_responses_store.py::test_another_key_sees_no_response_of_mine",)),
    Mutation("a document cut by max_tokens gets a legal ending", "superfluid/api/_lane.py",
             '            if self.document is not None and self.finish == "length":\n',
             "            if False:\n",
             ("tests/test_right_numbers.py::test_a_document_cut_by_max_tokens_gets_a_legal_ending_in_its_last_delta",)),
    Mutation("--spec-max-temperature caps only a default temperature", "superfluid/worker/_executor.py",
             "if s.temperature_default and 0 <= cap < s.temperature",
             "if 0 <= cap < s.temperature",
             ("tests/test_right_numbers.py::test_spec_max_temperature_caps_a_default_temperature_never_a_requested_one",)),
    Mutation("abbreviated flags are refused", "superfluid/cli/_errors.py",
             '        kwargs["allow_abbrev"] = False\n',
             '        kwargs["allow_abbrev"] = True\n',
             ("tests/test_cli_flags.py::test_an_abbreviation_is_a_mistake",)),
    Mutation("the sessions directory follows SUPERFLUID_HOME", "superfluid/serving/_config.py",
             '    return home() / "sessions"\n',
             '    return Path.home() / ".superfluid" / "sessions"\n',
             ("tests/test_first_run.py::test_the_sessions_directory_follows_superfluid_home",)),
    # ---- stop strings (SPEC.md §1: matched in the worker and in the core) ----
    Mutation("the worker ends a lane at the token completing a stop", "superfluid/worker/_executor.py",
             "        if ln.stops is not None and ln.stops.feed(piece):\n",
             "        if False:\n",
             ("tests/test_right_numbers.py::test_a_seeded_stop_counts_the_same_on_completions_stream_or_not",)),
    Mutation("the core ends a job at the token completing a stop", "superfluid/sched/_core.py",
             "                stopped = bool(job.stops) and job.completes_stop(piece)\n",
             "                stopped = False\n",
             (C + "test_a_token_that_completes_a_stop_ends_its_job_there_and_cancels_a_lane_the_worker_left_open",)),
    # ---- batches (SPEC.md §7 "Batches") ----
    Mutation("a line is logged once: replay keeps the first result of an index", "superfluid/proto/_batch.py",
             "            if index in self.lines:\n                return  # the first result of a line is the one",
             "            if False:\n                return  # the first result of a line is the one",
             (BT + "test_a_torn_record_ends_the_log_and_a_line_counts_once",)),
    Mutation("a torn record ends a batch's log", "superfluid/proto/_batch.py",
             "        if zlib.crc32(body) != crc:\n            break\n",
             "        if False:\n            break\n",
             (BT + "test_a_torn_record_ends_the_log_and_a_line_counts_once",)),
    Mutation("a batch's line runs as its owner", "superfluid/api/_app.py",
             "            \"headers\": [(b\"content-type\", b\"application/json\")], PRINCIPAL: principal, QOS: qos,\n",
             "            \"headers\": [(b\"content-type\", b\"application/json\")], QOS: qos,\n",
             (BT + "test_batches_belong_to_their_key",)),
    Mutation("a batch's lines run in its class (background)", "superfluid/api/_chat.py",
             "    if isinstance(forced, QosClass):  # a batch's line",
             "    if False:  # a batch's line",
             (BT + "test_batch_lines_run_in_the_background_class_and_a_chat_goes_first",)),
    Mutation("cancel is the batch's cancel scope", "superfluid/api/_batches.py",
             "        if scope is not None:\n            scope.cancel()\n",
             "        if scope is not None:\n            pass\n",
             (BT + "test_cancel_ends_the_running_lines_and_keeps_what_finished",)),
    Mutation("a duplicate custom_id is an error line", "superfluid/api/_batches.py",
             "            elif error is None and cid in seen:\n",
             "            elif False:\n",
             (BT + "test_the_openai_sdk_runs_a_batch_and_bad_lines_are_error_lines",)),
    # the session tree (SPEC.md §7, "The session tree")
    Mutation("a purged conversation answers as an unknown id", "superfluid/api/_tenancy.py",
             "    if slog is None or (slog.conversation is not None and slog.done):  # (a purged conversation is no one's)\n",
             "    if slog is None:\n",
             (T + "test_meta_tree_rebase_trim_purge_over_http_survive_a_restart",)),
    Mutation("compaction drops purged conversations", "superfluid/journal/_journal.py",
             "                if s.done:  # purged\n                    drop.append(s.session)\n                elif s.open_turn",
             "                if s.open_turn",
             (T + "test_journal_meta_and_purged_events_replay_and_compaction_drops_purged",)),
    Mutation("a stale expected_version is 409 version_conflict", "superfluid/api/_conversations.py",
             "    if value != version:\n",
             "    if False:\n",
             (T + "test_meta_tree_rebase_trim_purge_over_http_survive_a_restart",
              T + "test_every_tree_operation_over_http_ws_and_the_unix_socket_survives_a_restart")),
    Mutation("the tree is the caller's tenant's", "superfluid/sessions/_conversations.py",
             "                if slog.conversation is not None and not slog.done and slog.tenant == tenant]\n\n",
             "                if slog.conversation is not None and not slog.done]\n\n",
             (T + "test_another_tenant_gets_the_unknown_id_answer_on_every_tree_route",)),
    Mutation("a full subscriber queue ends it lagged", "superfluid/sessions/_conversations.py",
             "        if len(self.queue) >= self.capacity:\n            self.end(\"lagged\")\n            return\n",
             "",
             (T + "test_a_watcher_is_bounded",
              T + "test_a_lagging_subscriber_is_ended_lagged_and_resubscribes_from_its_cursor")),
    Mutation("a purge ends its subscribers", "superfluid/sessions/_conversations.py",
             "                    watcher.end(\"purged\")\n",
             "                    pass\n",
             (T + "test_subscribers_see_committed_events_and_the_turns_text_live_then_purge_ends_them",)),
    Mutation("shutdown ends subscribers", "superfluid/api/_watch.py",
             "    watcher.end(\"shutdown\")\n",
             "    pass\n",
             (T + "test_shutdown_ends_subscribers_with_ended_shutdown",)),
    # (no mutation for "a subscriber waits for a new turn's generation" (api/_watch.py): whether a
    # subscriber reaches a turn before its generation opens is timing; without the wait its cited
    # test failed on one run and passed on another, 2026-12-06, so the mutation could survive)
    Mutation("a purge stops a running turn first", "superfluid/api/_conversations.py",
             "                    await cancel_generation(app, scope, turn.generation)\n",
             "                    pass\n",
             (T + "test_purge_stops_a_running_turn_first_and_a_conversations_qos_runs_its_turns",)),
    Mutation("the unix socket is 0600", "superfluid/daemon/_socket.py",
             "        os.chmod(path, 0o600)\n",
             "",
             (T + "test_the_socket_file_is_private_replaces_a_stale_one_and_refuses_a_live_one",
              T + "test_every_tree_operation_over_http_ws_and_the_unix_socket_survives_a_restart")),
    Mutation("a PATCH body is JSON", "superfluid/api/_guard.py",
             "        if method in (\"POST\", \"PATCH\"):\n",
             "        if method == \"POST\":\n",
             (T + "test_a_page_patches_only_with_json_after_a_preflight_that_grants_patch",)),
    Mutation("an export without content leaves out titles", "superfluid/cli/_session.py",
             '"template_kwargs", "title", "tool",',
             '"template_kwargs", "tool",',
             (T + "test_an_export_without_content_leaves_out_titles_and_edited_messages",)),
    Mutation("an export without content leaves out what permissions say", "superfluid/cli/_session.py",
             '"arguments",\n                      "reason", "note"})',
             '})',
             (R + "test_an_export_without_content_leaves_out_what_permissions_say",)),
    Mutation("a rebase never breaks a turn", "superfluid/sessions/_conversations.py",
             "            open_turn = open_turn_after(open_turn, event_id, body)\n",
             "            pass\n",
             (T + "test_meta_tree_rebase_trim_purge_over_http_survive_a_restart",)),
    Mutation("a tool cancel marks the open call cancel_requested", "superfluid/api/_conversations.py",
             '             "status": "cancel_requested" if c.get("id") in cancelled else "open"}\n',
             '             "status": "open"}\n',
             (R + "test_a_tool_cancel_is_an_event_the_call_stays_open_until_answered_and_survives_a_restart",)),
    Mutation("a tool call takes one cancel request", "superfluid/api/_conversations.py",
             '        if call["status"] == "cancel_requested":\n',
             '        if False:\n',
             (R + "test_a_tool_cancel_is_an_event_the_call_stays_open_until_answered_and_survives_a_restart",)),
    Mutation("a permission request is answered once", "superfluid/api/_conversations.py",
             '        if _permission(app, cid, pid)["status"] != "pending":\n',
             '        if _permission(app, cid, pid) is None:\n',
             (R + "test_permissions_are_requested_answered_once_listed_and_survive_a_restart",)),
    Mutation("an answer sets the permission's status", "superfluid/api/_conversations.py",
             '            held[body["permission"]].update(status="allowed" if body["allow"] else "denied", note=body["note"],\n',
             '            held[body["permission"]].update(note=body["note"],\n',
             (R + "test_permissions_are_requested_answered_once_listed_and_survive_a_restart",)),
    Mutation("at most 256 permission requests pending", "superfluid/api/_conversations.py",
             "        if pending >= MAX_PENDING_PERMISSIONS:\n",
             "        if False:\n",
             (R + "test_at_most_256_permission_requests_are_pending_per_conversation",)),
    Mutation("a pinned conversation holds its model", "superfluid/daemon/_registry.py",
             "        self.pinned_until = pinned_until\n",
             "        pass\n",
             (R + "test_a_pinned_conversation_holds_its_model_past_the_idle_timeout_and_after_a_restart",)),
    Mutation("the log keeps a conversation's pin", "superfluid/journal/_sessionlog.py",
             "                self.pin = body[\"deadline\"]\n",
             "                self.pin = body[\"deadline\"] if self.last_event_id < 0 else 0\n",
             (R + "test_a_pinned_conversation_holds_its_model_past_the_idle_timeout_and_after_a_restart",)),
    Mutation("a branch starts unpinned", "superfluid/journal/_sessionlog.py",
             "                self.meta = None\n                self.pin = 0\n",
             "                self.meta = None\n",
             (R + "test_a_pinned_conversation_holds_its_model_past_the_idle_timeout_and_after_a_restart",)),
    Mutation("/api/ps shows a pinned model's expiry after its pin", "superfluid/serving/_keepalive.py",
             "    return max(time.time() + (since + ttl - now), pinned_until + ttl)\n",
             "    return time.time() + (since + ttl - now)\n",
             (R + "test_a_pinned_conversation_holds_its_model_past_the_idle_timeout_and_after_a_restart",)),
    Mutation("a pin is bounded", "superfluid/api/_conversations.py",
             "not 0 <= ttl <= MAX_PIN_S:\n",
             "not 0 <= ttl:\n",
             (R + "test_a_pinned_conversation_holds_its_model_past_the_idle_timeout_and_after_a_restart",)),
    # ---- issue #42: published numbers from their logs, and the suite's scoring ----
    Mutation("a committed table equals its bench's render of its log", "bench/park.py",
             "f\"{r['ttft2']:.2f} | {int(r['superfluid_resume_tokens_total'])} | \"",
             "f\"{r['ttft2']:.3f} | {int(r['superfluid_resume_tokens_total'])} | \"",
             (DG + "test_a_generated_block_equals_its_generators_render_of_its_committed_log",)),
    Mutation("a suite page equals compare over its result directories", "superfluid/suite/_compare.py",
             "    said = \" \".join(str(d) for d in dirs) + ",
             "    said = \" \".join(Path(d).name for d in dirs) + ",
             (DG + "test_a_suite_page_equals_compare_over_its_committed_result_directories",)),
    Mutation("the suite's headline is scored on the scenarios both systems ran", "superfluid/suite/_compare.py",
             "    both = [s for s in scenarios if all(verdicts.get((s, col)) in RAN for col in columns)]\n",
             "    both = [s for s in scenarios if any(verdicts.get((s, col)) in RAN for col in columns)]\n",
             (SS + "test_the_headline_is_scored_on_the_scenarios_both_systems_ran",
              SS + "test_an_error_counts_as_ran_and_not_passed_in_the_headline")),
    Mutation("the suite counts inconclusive apart from fail", "superfluid/suite/_compare.py",
             "        counts = {k: mine.count(k) for k in (\"pass\", \"fail\", \"inconclusive\", \"error\", \"unsupported\")}\n",
             "        counts = {k: mine.count(k) for k in (\"pass\", \"fail\", \"inconclusive\", \"error\", \"unsupported\")}\n"
             "        counts.update(fail=counts[\"fail\"] + counts[\"inconclusive\"], inconclusive=0)\n",
             (SS + "test_inconclusive_is_reported_apart_from_fail",)),
    Mutation("tool_session needs 10 of 12 turns with a valid call", "superfluid/suite/_conditions.py",
             "    if calls_ok < need:\n",
             "    if calls_ok < 1:\n",
             (SS + "test_tool_session_needs_10_of_12_turns_with_a_valid_call_and_the_asked_arguments",)),
    Mutation("tool_session judges a call's arguments against the turn", "superfluid/suite/_behaviour.py",
             "    return isinstance(args, dict) and args.get(\"account\") == account\n",
             "    return isinstance(args, dict)\n",
             (SS + "test_a_calls_arguments_are_judged_against_what_the_turn_asked",
              SS + "test_tool_session_fails_a_server_whose_calls_or_answers_are_wrong")),
    Mutation("tool_session judges the answers", "superfluid/suite/_conditions.py",
             "    if answers_ok < need:\n",
             "    if False:\n",
             (SS + "test_tool_session_needs_10_of_12_turns_with_a_valid_call_and_the_asked_arguments",
              SS + "test_tool_session_fails_a_server_whose_calls_or_answers_are_wrong")),
    Mutation("kv_exhaustion: a typed refusal is no pass", "superfluid/suite/_conditions.py",
             "    if refused:\n",
             "    if False:\n",
             (SS + "test_kv_exhaustion_passes_only_when_every_request_completes",)),
    Mutation("a repeated cell's verdict is the majority of its runs", "superfluid/suite/_conditions.py",
             "        if 2 * verdicts.count(v) > len(verdicts):\n",
             "        if verdicts.count(v):\n",
             (SS + "test_majority_of_runs", SS + "test_repeat_runs_each_cell_n_times_and_takes_the_majority")),
    Mutation("--repeat runs each cell N times", "superfluid/suite/_runner.py",
             "            while len(runs) < opts.repeat:\n",
             "            for _ in range(min(1, opts.repeat - len(runs))):\n",
             (SS + "test_repeat_runs_each_cell_n_times_and_takes_the_majority",)),
    Mutation("compare re-judges recorded runs under the current rules", "superfluid/suite/_compare.py",
             "    judged = [rejudge({**r, \"scenario\": cell[\"scenario\"]}) for r in runs]\n",
             "    judged = [(r.get(\"verdict\", \"error\"), str(r.get(\"reason\") or \"\")) for r in runs]\n",
             (SS + "test_compare_rejudges_every_run_under_the_current_rules",)),
)


# ---- the baseline run's report (this module is loaded into it as a pytest plugin: -p tests.mutations) ----

def pytest_runtest_logreport(report: Any) -> None:
    path = os.environ.get(_REPORT)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"node": report.nodeid, "when": report.when, "outcome": report.outcome,
                                "duration": report.duration}) + "\n")


@attrs.frozen
class Baseline:
    outcome: str   # "passed", or why the tests prove nothing: "failed", "skipped", "not found"
    seconds: float


def covers(test: str, node: str) -> bool:
    """Whether the pytest node id ``node`` is (part of) the cited ``test`` (a file, class or function)."""
    return node == test or node.startswith((test + "[", test + "::"))


def baselines(report: Path, chosen: list[Mutation]) -> dict[str, Baseline]:
    """Each mutation's tests as the baseline run found them."""
    outcome: dict[str, str] = {}
    seconds: dict[str, float] = {}
    if report.exists():
        for line in report.read_text(encoding="utf-8").splitlines():
            r = json.loads(line)
            seconds[r["node"]] = seconds.get(r["node"], 0.0) + r["duration"]
            if r["outcome"] != "passed" and outcome.get(r["node"]) != "failed":
                outcome[r["node"]] = r["outcome"]
            outcome.setdefault(r["node"], "passed")
    out = {}
    for m in chosen:
        nodes = [n for n in outcome if any(covers(t, n) for t in m.tests)]
        bad = sorted({outcome[n] for n in nodes} - {"passed"})
        missing = [t for t in m.tests if not any(covers(t, n) for n in nodes)]
        verdict = bad[0] if bad else "not found" if missing else "passed"
        out[m.name] = Baseline(verdict, sum(seconds[n] for n in nodes))
    return out


# ---- running ----

def copy_tree(dest: Path) -> None:
    """The working tree as it is (tracked and untracked files, ignored ones left out)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def pytest(scratch: Path, args: list[str], timeout: float, env: dict[str, str] | None = None,
           output: Path | None = None) -> str:
    """``passed``, ``failed``, ``timeout`` or ``error (exit N)`` (pytest could not run them)."""
    env = {**os.environ, "PYTHONPATH": str(scratch), "PYTHONDONTWRITEBYTECODE": "1", **(env or {})}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    out = open(output, "wb") if output is not None else subprocess.DEVNULL  # noqa: SIM115 - closed below
    try:
        proc = subprocess.Popen(argv, cwd=scratch, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    finally:
        if output is not None:
            out.close()
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the tests' daemons and workers with it
        proc.wait()
        _reap_strays(scratch)
        return "timeout"
    return {0: "passed", 1: "failed"}.get(code, f"error (exit {code})")


def _reap_strays(scratch: Path) -> None:
    """SIGKILL what a killed run left outside its process group: a process whose working
    directory is in ``scratch`` (a daemon a test started in tmux, whose server is its own
    session, outlives the group and would load every later run)."""
    root = str(scratch)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        if cwd == root or cwd.startswith(root + "/") or cwd.removesuffix(" (deleted)") == root:
            with contextlib.suppress(OSError):
                os.kill(int(entry.name), 9)


def judge(m: Mutation, scratch: Path, b: Baseline | None, timeout: float) -> tuple[str, float]:
    """Apply ``m`` in ``scratch``, run its tests, restore the file: the verdict and the seconds it took."""
    t1 = time.monotonic()
    path = scratch / m.file
    original = path.read_text() if path.exists() else ""
    n = original.count(m.old)
    if n != 1:
        return f"NOT APPLIED ({n})", time.monotonic() - t1
    if b is not None and b.outcome != "passed":
        return f"BASELINE {b.outcome.upper()}", time.monotonic() - t1
    limit = timeout if b is None else min(timeout, 30.0 + 4 * b.seconds)
    path.write_text(original.replace(m.old, m.new))
    try:
        outcome = pytest(scratch, ["-x", *m.tests], limit)
    finally:
        path.write_text(original)
    verdict = {"failed": "caught", "timeout": "caught (timeout)", "passed": "SURVIVED"}.get(outcome, f"ERROR {outcome}")
    return verdict, time.monotonic() - t1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutations", description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", dest="select", default="", help="only mutations whose name contains this (default: all)")
    parser.add_argument("--list", action="store_true", help="print the mutations and exit")
    parser.add_argument("--no-baseline", action="store_true", help="do not run the tests unmutated first")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="most seconds for one mutated run; past it counts as caught (default: 300; with a "
                             "baseline, 30 s plus 4 times the tests' baseline time, if less)")
    parser.add_argument("-j", "--jobs", type=int, default=1,
                        help="mutations judged at once, each in its own copy of the tree (default: 1)")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if args.select.lower() in m.name.lower()]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.file} <- {', '.join(t.rsplit('::', 1)[-1] for t in m.tests)}")
        return 0
    if not chosen:
        print(f"no mutation's name contains {args.select!r}")
        return 1
    width = max(len(m.name) for m in chosen)
    t0 = time.monotonic()
    counts: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="superfluid-mutations-") as tmp:
        scratches: queue.SimpleQueue[Path] = queue.SimpleQueue()  # one tree per job: a mutation owns its tree
        for j in range(args.jobs):
            copy_tree(Path(tmp) / f"tree{j}")
            scratches.put(Path(tmp) / f"tree{j}")
        base: dict[str, Baseline] = {}
        if not args.no_baseline:
            union = list(dict.fromkeys(t for m in chosen for t in m.tests))
            report, output = Path(tmp) / "baseline.jsonl", Path(tmp) / "baseline.out"
            ran = pytest(Path(tmp) / "tree0", ["-p", "tests.mutations", *union], 3600.0, {_REPORT: str(report)},
                         output)
            base = baselines(report, chosen)
            print(f"baseline: {len(union)} cited tests unmutated in one run: {ran} "
                  f"({time.monotonic() - t0:.0f} s)", flush=True)
            if ran != "passed":
                print("\n".join(output.read_text(errors="replace").splitlines()[-40:]), flush=True)
        print(f"{'#':>2}  {'verdict':<16} {'secs':>5}  {'mutation':<{width}}  file", flush=True)

        def run(m: Mutation) -> tuple[str, float]:
            scratch = scratches.get()
            try:
                return judge(m, scratch, base.get(m.name), args.timeout)
            finally:
                scratches.put(scratch)

        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            futures = {pool.submit(run, m): (i, m) for i, m in enumerate(chosen, 1)}
            for future in concurrent.futures.as_completed(futures):
                i, m = futures[future]
                verdict, secs = future.result()
                key = verdict.split(" (")[0] if verdict.startswith("caught") else verdict.split(" ")[0]
                counts[key] = counts.get(key, 0) + 1
                print(f"{i:>2}  {verdict:<16} {secs:5.1f}  {m.name:<{width}}  {m.file}", flush=True)
    caught = counts.get("caught", 0)
    rest = ", ".join(f"{v} {k.lower()}" for k, v in sorted(counts.items()) if k != "caught")
    print(f"{caught} of {len(chosen)} mutations caught{'; ' + rest if rest else ''} "
          f"({time.monotonic() - t0:.0f} s)")
    return 0 if caught == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
