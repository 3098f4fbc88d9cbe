"""Aggregate throughput, superfluid vs llama-server on the same llama.cpp build and model, over fresh server pairs.

    python bench/throughput.py [--model PATH] [--llama-server PATH] [--pairs 8] [--rounds 2] [--tokens 128]
        [--concurrency 1,2,4,8] [--temperature 0.8 --seed S] [--huge-pages on|off] [--samplers SEQ]
        [--order-seed N] [--baseline TREE] [--only SIDE]
    python bench/throughput.py --render LOG [--doc docs/benchmarks.md]
    python bench/throughput.py --log-cost 5

**Pairs** (issue #42). One server process's speed varies by several percent from the next one's (where its
pages land, what its threads share), so a ratio from one pair of servers says little. Each pair is a
fresh superfluid daemon and a fresh llama-server, both started for the pair and stopped after it. In a
pair, every concurrency level (1, 2, 4 and 8 concurrent requests by default) runs ``--rounds`` rounds on
each side, the sides alternating A B B A (a pair's first side alternates too; ``--order-seed N``: a
seeded random order instead); a round is the same 8 distinct prompts, ``--tokens``-token replies on
/v1/completions with ``ignore_eos``, a warm-up round per server first. A side's tok/s in a pair is the
median of its rounds (tokens from each response's usage over the round's wall time); the pair's ratio
is ours/theirs. The reported ratio is the median over pairs, with a 95% t-interval on the mean of the
pairs' log-ratios (exponentiated: an interval for the geometric-mean ratio, ``pairs - 1`` degrees of
freedom), so the interval is over pairs, never over rounds.

**Equal terms**, written to the log and stated once in the table: the same model, threads (``-t``), KV
cells (:func:`kv_cells` of 8 lanes x 4,096: llama-server ``-c`` and ``-np 8``), batch and micro-batch
(llama-server ``-b``/``-ub`` = our worker's ``BATCH_TOKENS``/``UBATCH_TOKENS``), no host prompt cache
(``--cache-ram 0`` / ``--host-cache-mb 0``), the same request body (greedy: ``temperature`` 0; with
``--temperature T --seed S``: ``top_k``, ``top_p``, ``min_p`` and seed ``S + i`` for prompt ``i``), the
same prompts and the same client. Both servers get the same ``GLIBC_TUNABLES`` in their environment:
``glibc.malloc.hugetlb=1`` (malloc's transparent huge pages, which our daemon gives its worker by
default) with ``--huge-pages on`` (the default), ``=0`` with ``off``; our daemon passes its value to its
worker, and the log records what each process (daemon, worker, llama-server) has in its environment and
how much of its memory sits in huge pages. llama-server alone also gets ``LD_LIBRARY_PATH`` (its own
build's libraries). Every request's ``completion_tokens`` is logged and checked against ``--tokens``; a
mismatch is flagged in the table.

**Sampler path.** Our greedy draw is a numpy argmax over the logits (the worker's ``_LaneSampler``, the
``ignore_eos`` ban added to a copy); llama-server runs its sampler chain (``--samplers``, default
``penalties;dry;top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature`` then ``dist``; at temperature 0 the
chain still fills an n_vocab candidate array and cuts it to top-k 40). The log records each side's path
(llama-server's from ``/slots``); ``--samplers SEQ`` (and ``--llama-server-arg``, once per argument:
``--samplers top_k --llama-server-arg=--top-k --llama-server-arg=1``) hands llama-server a shorter chain
(the greedy one it then runs: the logit bias with the ``ignore_eos`` ban, top-k 1, ``dist`` over one).

**Raw log**: JSON lines in bench-results/<commit>/throughput_<UTC>.jsonl: a header (``_common.log_header``:
the commit, the arguments, the CPU, the load) with the machine, the versions and the equal terms; one
record per pair (both servers' full command lines, environment overrides, sampler paths, processes);
one per request (pair, concurrency, side, round, prompt index, completion_tokens, ttft, wall); one per
round (tok/s); an end record (the load at the end). ``--render LOG [--doc PATH]`` prints the table (or
writes it into the page between ``<!-- bench/throughput.py KEY: begin ... -->`` and ``... end -->``
markers, KEY = model, greedy/sampled and huge pages).

``--baseline TREE`` adds a third side per pair: our daemon run from another source tree (a ``git
worktree`` of an earlier commit, its working directory and first on ``PYTHONPATH``) with the same
flags, so a change is judged against itself before the change in the same pairs. ``--only SIDE``
measures one side (tok/s and TTFT, no ratio). The in-process executor is no longer run here: it is
``bench/in_process.py``.

    python bench/throughput.py --log-cost 5

prices the session log instead: two daemons, sessions on disk and on tmpfs, 8-concurrent
rounds in a seeded random order per round; its own log (bench-results/<commit>/throughput_log_cost_<UTC>.jsonl:
a header with both daemons' command lines, a record per request and per round, an end record), and
``--render`` of that log gives its own block (KEY = ``log-cost`` and the model): medians, the per-round
ratio disk/tmpfs with a 95% interval over rounds (both daemons stay up: no server pairs).
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from _common import (ROOT, JsonLog, Server, commit, completions_burst, free_port, interval_cell, kv_cells,  # noqa: E402
                     llama_server_argv, log_header, log_path, machine, median, model_file,
                     pair_ratios, read_log, round_order, round_orders, run_line, shown, side_rates,
                     superfluid_argv, token_check, versions)
from _common import t975  # noqa: E402,F401  (tests reach it through this module, as before it moved)

PROMPTS = [f"Question {i}: explain topic number {i} in detail, please. Answer:" for i in range(8)]
LANES, CTX = 8, 4096
OURS, THEIRS, BASE = "superfluid", "llama-server", "superfluid-base"
GREEDY: dict[str, Any] = {"temperature": 0}
HUGE = "glibc.malloc.hugetlb"
MARK_BEGIN = "<!-- bench/throughput.py {key}: begin (generated by `python bench/throughput.py --render LOG --doc PATH`) -->"
MARK_END = "<!-- bench/throughput.py {key}: end -->"
MAX_LOAD = 0.5


# -- equal terms ---------------------------------------------------------------------------------------------------

def sampling_body(args: argparse.Namespace) -> dict[str, Any]:
    """The request fields both servers get (``seed`` is offset per prompt)."""
    if args.temperature <= 0:
        return dict(GREEDY)
    return {"temperature": args.temperature, "seed": args.seed, "top_k": args.top_k, "top_p": args.top_p,
            "min_p": args.min_p}


def tunables(huge: bool, operator: str = "") -> str:
    """``GLIBC_TUNABLES`` for both servers: the operator's tunables with malloc's huge pages set on or off."""
    kept = [t for t in operator.split(":") if t and t.split("=", 1)[0] != HUGE]
    return ":".join([*kept, f"{HUGE}={1 if huge else 0}"])


def our_sampler(sampling: dict[str, Any]) -> str:
    """Which path our worker draws with for this body (superfluid/worker/_llamacpp.py ``_LaneSampler``)."""
    if sampling.get("temperature", 1) <= 0:
        return "numpy argmax over the logits (ignore_eos ban added to a copy)"
    return "llama.cpp chain top_k;top_p;min_p;temp;dist"


def batch_sizes() -> tuple[int, int]:
    """Our worker's logical and physical batch (llama-server gets the same ``-b``/``-ub``)."""
    from superfluid.worker._llamacpp import BATCH_TOKENS, UBATCH_TOKENS
    return BATCH_TOKENS, UBATCH_TOKENS


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (our daemon's worker)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += [c for c, pp in parent.items() if pp == p]
    return out


def processes(pid: int) -> list[dict[str, Any]]:
    """What each process of a server has: its command, ``GLIBC_TUNABLES`` and memory in huge pages."""
    out = []
    for p in descendants(pid):
        try:
            env = dict(x.split("=", 1) for x in (Path(f"/proc/{p}/environ").read_bytes().decode(errors="replace")
                                                   .split("\0")) if "=" in x)
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace").split("\0")
            rollup = Path(f"/proc/{p}/smaps_rollup").read_text().splitlines()
        except OSError:
            continue
        kb = {x.split(":")[0]: int(x.split()[1]) for x in rollup if x.endswith(" kB")}
        out.append({"pid": p, "cmd": " ".join(cmd[:4]), "GLIBC_TUNABLES": env.get("GLIBC_TUNABLES"),
                    "rss_kb": kb.get("Rss"), "anon_huge_kb": kb.get("AnonHugePages")})
    return out


def their_sampler(url: str) -> Any:
    """llama-server's sampler chain as its slots report it (the last request's parameters)."""
    try:
        slots = httpx.get(url + "/slots", timeout=10).json()
        params = slots[0].get("params") or {}
        return {k: params.get(k) for k in ("samplers", "temperature", "top_k", "top_p", "min_p")}
    except (httpx.HTTPError, ValueError, IndexError, KeyError, AttributeError) as e:
        return f"unknown ({e!r})"


# -- measuring -----------------------------------------------------------------------------------------------------

def model_id(url: str) -> str:
    return str(httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"])


def burst(url: str, model: str, conc: int, tokens: int, sampling: dict[str, Any]) -> tuple[list[dict[str, Any]], float]:
    return trio.run(lambda: completions_burst(url, model, PROMPTS, tokens, sampling, concurrency=conc))


async def one_round(url: str, model: str, conc: int, tokens: int,
                    sampling: dict[str, Any] | None = None) -> tuple[float, float]:
    """One round of the 8 prompts (bench/monitor_cost.py, ``--log-cost``): tok/s (tokens from usage where
    the server reports it, else chunks) and the median TTFT."""
    results, wall = await completions_burst(url, model, PROMPTS, tokens, sampling or GREEDY, concurrency=conc)
    total = sum((r["usage"] or {}).get("completion_tokens") or r["tokens"] for r in results)
    return total / wall, median([r["ttft"] for r in results])


def start(args: argparse.Namespace, binary: str | None, env: dict[str, str], sides: list[str],
          sessions: Path) -> tuple[dict[str, Server], dict[str, dict[str, str]]]:
    """The pair's servers, and the environment each got over this process's (the same ``env`` for all;
    llama-server also its libraries' directory, a baseline daemon its tree)."""
    servers: dict[str, Server] = {}
    envs: dict[str, dict[str, str]] = {}
    flags = ["--max-batch", str(LANES), "--max-context", str(CTX), "--threads", str(args.threads)]
    for side in sides:
        port = free_port()
        if side == THEIRS:
            assert binary
            b, ub = batch_sizes()
            argv = [*llama_server_argv(binary, args.model, port, lanes=LANES, ctx=CTX, threads=args.threads),
                    "-b", str(b), "-ub", str(ub), *(["--samplers", args.samplers] if args.samplers else []),
                    *args.llama_server_arg]
            envs[side] = {**env, "LD_LIBRARY_PATH": str(Path(binary).parent)}
            servers[side] = Server(side, argv, port, env=envs[side])
            continue
        where = Path(args.sessions) if args.sessions else sessions / side
        where.mkdir(parents=True, exist_ok=True)
        argv = superfluid_argv(args.model, port, *flags, "--sessions", str(where), host_cache_mb=args.host_cache_mb)
        if side == BASE:
            tree = str(Path(args.baseline).resolve())  # ``python -m`` puts the working directory first on sys.path
            envs[side] = {**env, "PYTHONPATH": tree}
            servers[side] = Server(side, argv, port, env=envs[side], cwd=tree)
        else:
            envs[side] = dict(env)
            servers[side] = Server(side, argv, port, env=envs[side])
    return servers, envs


def run_pair(pair: int, args: argparse.Namespace, binary: str | None, env: dict[str, str], sides: list[str],
             sampling: dict[str, Any], concs: tuple[int, ...], rng: random.Random | None, log: Any) -> None:
    write = log.write

    with tempfile.TemporaryDirectory(prefix="bench-throughput-") as tmp:
        servers, envs = start(args, binary, env, sides, Path(tmp))
        try:
            ids = {}
            for side, srv in servers.items():
                srv.wait_ready()
                ids[side] = model_id(srv.url)
            for side, srv in servers.items():
                burst(srv.url, ids[side], 8, 16, sampling)  # warm-up
            for conc in concs:
                for rnd in range(args.rounds):
                    order = round_order(sides, pair, rnd, rng)
                    for pos, side in enumerate(order):
                        results, wall = burst(servers[side].url, ids[side], conc, args.tokens, sampling)
                        counted = 0
                        for r in sorted(results, key=lambda r: r["index"]):
                            n = (r["usage"] or {}).get("completion_tokens")
                            counted += n if n is not None else r["tokens"]
                            write({"kind": "request", "pair": pair, "conc": conc, "side": side, "round": rnd,
                                   "prompt": r["index"], "completion_tokens": n, "chunks": r["tokens"],
                                   "ttft": r["ttft"], "wall": r["wall"]})
                        write({"kind": "round", "pair": pair, "conc": conc, "side": side, "round": rnd,
                               "position": pos, "tokens": counted, "wall": wall, "tok_s": counted / wall})
                    print(f"pair {pair} conc {conc} round {rnd} ({','.join(order)})", file=sys.stderr, flush=True)
            samplers = {side: (their_sampler(srv.url) if side == THEIRS else our_sampler(sampling))
                        for side, srv in servers.items()}
            procs = {side: processes(srv.proc.pid) for side, srv in servers.items()}
        finally:
            for srv in servers.values():
                srv.stop()
    write({"kind": "pair", "pair": pair,
           "servers": {side: {"argv": srv.argv, "env": envs[side], "sampler": samplers[side],
                              "processes": procs[side]} for side, srv in servers.items()}})


def measure(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    load = os.getloadavg()[0]
    if load > MAX_LOAD and not args.allow_busy:
        p.error(f"the machine is busy (1-minute load average {load:.2f}); --allow-busy runs anyway")
    sides = [args.only] if args.only else [OURS, THEIRS, *([BASE] if args.baseline else [])]
    binary = None
    if THEIRS in sides:
        binary = args.llama_server or subprocess.run(
            ["bash", str(ROOT / "bench/build_llama_server.sh")], capture_output=True, text=True, check=True
        ).stdout.strip().splitlines()[-1]
    sampling = sampling_body(args)
    concs = tuple(int(c) for c in args.concurrency.split(","))
    env = {"GLIBC_TUNABLES": tunables(args.huge_pages == "on", os.environ.get("GLIBC_TUNABLES", ""))}
    rng = random.Random(args.order_seed) if args.order_seed is not None else None
    rev = commit()
    out = args.out or log_path("throughput", rev)
    out.parent.mkdir(parents=True, exist_ok=True)
    b, ub = batch_sizes()
    head = log_header(rev, args, load)
    head.update(machine=machine(), versions=versions(binary), sides=sides, concurrency=list(concs),
                prompts=PROMPTS, sampling=sampling, env=env,
                terms={"lanes": LANES, "ctx": CTX, "kv_cells": kv_cells(LANES, CTX), "batch": b, "ubatch": ub,
                       "threads": args.threads, "host_cache_mb": args.host_cache_mb})
    if args.baseline:
        head["baseline_commit"] = commit(Path(args.baseline))
    with JsonLog(out, head) as log:
        for pair in range(args.pairs):
            run_pair(pair, args, binary, env, sides, sampling, concs, rng, log)
        log.end()
    print(f"log: {out}", file=sys.stderr)
    print(render(out)[0], end="")
    return 0


# -- the table, from the log ---------------------------------------------------------------------------------------

def block_key(head: dict[str, Any]) -> str:
    a = head["args"]
    key = (f"{Path(a['model']).name} {'sampled' if a['temperature'] > 0 else 'greedy'} "
           f"huge-pages-{a['huge_pages']}")
    if a.get("samplers"):
        key += f" llama-server-samplers-{a['samplers'].replace(';', '-')}"
    if a.get("only"):
        key += f" only-{a['only']}"
    return key


def _ms(recs: list[dict[str, Any]], conc: int, side: str) -> str:
    ttfts = [r["ttft"] for r in recs if r["kind"] == "request" and r["conc"] == conc and r["side"] == side
             and r["ttft"] is not None]
    return f"{median(ttfts) * 1000:.0f}" if ttfts else "—"


def render(path: Path) -> tuple[str, str]:
    """The docs section for one log, and its block's key (model, greedy/sampled, huge pages; a
    ``--log-cost`` log: ``log-cost`` and the model)."""
    recs = read_log(path)
    head = recs[0]
    if head.get("mode") == "log-cost":
        return render_log_cost(path, recs)
    a, m, t, v = head["args"], head["machine"], head["terms"], head["versions"]
    end = next((r for r in recs if r["kind"] == "end"), None)
    pairs = [r for r in recs if r["kind"] == "pair"]
    sides, concs = head["sides"], head["concurrency"]
    n_pairs = len(pairs)
    rates = side_rates(recs)
    sampled = a["temperature"] > 0
    mode = (f"sampled (temperature {a['temperature']}, seed {a['seed']} + prompt index, top_k {a['top_k']}, "
            f"top_p {a['top_p']}, min_p {a['min_p']})" if sampled else "greedy (temperature 0)")
    first = pairs[0]["servers"] if pairs else {}
    their = first.get(THEIRS, {}).get("sampler")
    if isinstance(their, dict):
        their = f"chain {';'.join(their.get('samplers') or [])} then dist (from its /slots)"
    order = ("a random order per round (seed " + str(a["order_seed"]) + ")" if a.get("order_seed") is not None
             else "A B B A (forward in even rounds, reversed in odd ones; a pair's first side alternating by pair)")
    out = [f"## Throughput, {'sampled' if sampled else 'greedy'}, {Path(a['model']).name}, fresh server pairs "
           f"(`python bench/throughput.py`): issue #42\n",
           f"At `{head['commit']}`, {head['started']}, on {head['cpu']}, {m['mem_gib']} GiB, Linux {m['kernel']}, "
           f"transparent huge pages `{m['thp']}`; 1-minute load average {head['loadavg']:.2f} at the start"
           + (f", {end['loadavg'][0]:.2f} at the end" if end else " (the run did not finish)")
           + f" ({path.name}). Versions: llama-cpp-python {v['llama_cpp_python']}"
           + (f", llama-server {v['llama_server']}" if v.get("llama_server") else "")
           + f". Generated by `python bench/throughput.py --render {shown(path)}` from that log.\n",
           f"Equal terms: model {Path(a['model']).name}; {t['threads']} threads; {t['kv_cells']} KV cells for "
           f"{t['lanes']} lanes (llama-server `-c {t['kv_cells']} -np {t['lanes']}`); batch {t['batch']}, "
           f"micro-batch {t['ubatch']} (llama-server `-b {t['batch']} -ub {t['ubatch']}`); no host prompt cache; "
           f"`GLIBC_TUNABLES={head['env']['GLIBC_TUNABLES']}` in both servers' environment (our daemon passes it "
           f"to its worker); the same {mode} body on /v1/completions with `ignore_eos`, the same "
           f"{len(head['prompts'])} prompts, {a['tokens']}-token replies, tokens counted from each response's "
           f"usage. Draw: superfluid {first.get(OURS, {}).get('sampler', '—')}"
           + (f"; llama-server {their}" if their else "")
           + (f" (`--samplers {a['samplers']}`)" if a.get("samplers") else "") + ".\n",
           f"{n_pairs} fresh server pairs (each side started for its pair and stopped after it), {a['rounds']} "
           f"rounds per concurrency in each, sides in {order}. A side's tok/s in a pair is the median of its rounds; "
           "a pair's ratio is superfluid/llama-server from that pair. Tok/s columns: medians over pairs; ratio: "
           "the median over pairs, and the geometric mean with its 95% interval, a t-interval on the pairs' "
           f"log-ratios ({max(n_pairs - 1, 0)} degrees of freedom), over pairs, not rounds. TTFT: median over "
           "every request.\n"]
    if OURS in sides and THEIRS in sides:
        out += ["| concurrent | superfluid tok/s | llama-server tok/s | ratio, median over pairs "
                "| geometric mean (95% interval) | pairs below 1.00 | superfluid TTFT ms | llama-server TTFT ms "
                "| tokens |",
                "|---|---|---|---|---|---|---|---|---|"]
        for c in concs:
            ratios = pair_ratios(recs, c, OURS, THEIRS)
            ours = median([x for (p, cc, s), x in rates.items() if cc == c and s == OURS])
            theirs = median([x for (p, cc, s), x in rates.items() if cc == c and s == THEIRS])
            out.append(f"| {c} | {ours:.1f} | {theirs:.1f} | {median(ratios):.3f} | {interval_cell(ratios)} | "
                       f"{sum(r < 1 for r in ratios)} of {len(ratios)} | {_ms(recs, c, OURS)} | "
                       f"{_ms(recs, c, THEIRS)} | {token_check(recs, c, [OURS, THEIRS], a['tokens'])} |")
        out += ["", "Each pair's ratio (superfluid/llama-server):", "",
                "| pair | " + " | ".join(f"{c} concurrent" for c in concs) + " |",
                "|---|" + "---|" * len(concs)]
        for p in sorted({r["pair"] for r in recs if r["kind"] == "round"}):
            cells = []
            for c in concs:
                o, th = rates.get((p, c, OURS)), rates.get((p, c, THEIRS))
                cells.append(f"{o / th:.3f}" if o and th else "—")
            out.append(f"| {p} | " + " | ".join(cells) + " |")
        if BASE in sides:
            out += ["", f"Baseline: `{BASE}` = our daemon from another tree (commit "
                    f"`{head.get('baseline_commit', '?')}`), in the same pairs.", "",
                    "| concurrent | superfluid-base tok/s | base/llama-server (median; geometric mean, 95%) "
                    "| superfluid/base (median; geometric mean, 95%) | pairs ours < base |",
                    "|---|---|---|---|---|"]
            for c in concs:
                bt = pair_ratios(recs, c, BASE, THEIRS)
                ob = pair_ratios(recs, c, OURS, BASE)
                base = median([x for (p, cc, s), x in rates.items() if cc == c and s == BASE])
                out.append(f"| {c} | {base:.1f} | {median(bt):.3f}; {interval_cell(bt)} | {median(ob):.3f}; "
                           f"{interval_cell(ob)} | {sum(r < 1 for r in ob)} of {len(ob)} |")
    else:
        out += ["| concurrent | " + " | ".join(f"{s} tok/s | {s} TTFT ms" for s in sides) + " | tokens |",
                "|---|" + "---|---|" * len(sides) + "---|"]
        for c in concs:
            out.append(f"| {c} | " + " | ".join(
                f"{median([x for (p, cc, ss), x in rates.items() if cc == c and ss == s]):.1f} | {_ms(recs, c, s)}"
                for s in sides) + f" | {token_check(recs, c, sides, a['tokens'])} |")
    return "\n".join(out) + "\n", block_key(head)


# -- the session log's cost -----------------------------------------------------------------------------------------

LOG_COST_SIDES = ("disk", "tmpfs")


def log_cost(args: argparse.Namespace) -> int:
    """Two daemons, sessions on disk (a temp dir under $HOME) and on tmpfs (/dev/shm), both up throughout
    (the idle one costs nothing); ``--log-cost`` rounds of 8 prompts at 8 concurrent, each round running
    both in a seeded random order, so drift hits both alike. Writes its own log and prints its table."""
    load = os.getloadavg()[0]
    rev = commit()
    out = args.out or log_path("throughput_log_cost", rev)
    order_seed = args.order_seed if args.order_seed is not None else random.SystemRandom().randrange(1 << 31)
    orders = round_orders(list(LOG_COST_SIDES), args.log_cost, order_seed)
    with tempfile.TemporaryDirectory(dir=Path.home()) as disk, \
            tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        servers = {}
        for name, where in zip(LOG_COST_SIDES, (disk, shm), strict=True):
            port = free_port()
            servers[name] = Server(f"superfluid-{name}", superfluid_argv(
                args.model, port, "--threads", str(args.threads), "--sessions", where,
                host_cache_mb=args.host_cache_mb), port)
        head = log_header(rev, args, load)
        head.update(mode="log-cost", machine=machine(), versions=versions(None), prompts=PROMPTS, sampling=GREEDY,
                    conc=8, order_seed=order_seed, orders=orders,
                    servers={name: {"argv": srv.argv, "sessions": where}
                             for (name, srv), where in zip(servers.items(), (disk, shm), strict=True)})
        log = JsonLog(out, head)
        try:
            ids = {}
            for name, srv in servers.items():
                srv.wait_ready()
                ids[name] = model_id(srv.url)
                burst(srv.url, ids[name], 8, 16, GREEDY)  # warm-up
            for rnd, order in enumerate(orders):
                for pos, name in enumerate(order):
                    results, wall = burst(servers[name].url, ids[name], 8, args.tokens, GREEDY)
                    for rec in _common.round_records(results, wall, round=rnd, position=pos, side=name):
                        log.write(rec)
                print(f"log-cost round {rnd} ({','.join(order)})", file=sys.stderr, flush=True)
            log.end()
        finally:
            log.close()
            for srv in servers.values():
                srv.stop()
    print(f"log: {out}", file=sys.stderr)
    print(render(out)[0], end="")
    return 0


def render_log_cost(path: Path, recs: list[dict[str, Any]]) -> tuple[str, str]:
    """The docs section of a ``--log-cost`` log, and its block's key (``log-cost`` and the model)."""
    head = recs[0]
    a = head["args"]
    rounds = [r for r in recs if r["kind"] == "round"]
    rate = {(r["round"], r["side"]): r["tok_s"] for r in rounds}
    done = sorted({n for n, _ in rate if all((n, s) in rate for s in LOG_COST_SIDES)})
    ratios = [rate[(n, "disk")] / rate[(n, "tmpfs")] for n in done]
    model = Path(a["model"]).name
    out = [f"## The session log's cost, {model} (`python bench/throughput.py --log-cost {a['log_cost']}`): "
           "issue #42\n",
           run_line(recs, path, "bench/throughput.py"),
           f"Two daemons on the same model ({a['threads']} threads, host cache {a['host_cache_mb']} MB), one with its "
           "sessions directory on disk (a temporary directory under the home directory), one on tmpfs "
           f"(/dev/shm); both up throughout. {len(head['orders'])} rounds, each running both once in a seeded random "
           f"order (seed {head['order_seed']}): {len(head['prompts'])} distinct prompts at {head['conc']} "
           f"concurrent, {a['tokens']}-token greedy replies on /v1/completions with `ignore_eos`, tokens counted "
           "from each response's usage. A round's ratio is disk/tmpfs tok/s in that round; tok/s columns are "
           "medians over rounds; the interval is a 95% t-interval on the rounds' log-ratios (both daemons "
           "stay up, so it is over rounds, not server pairs).\n",
           "| log on disk tok/s | log on tmpfs tok/s | disk/tmpfs, median of rounds | geometric mean (95% interval) "
           "| rounds below 1.00 | tokens |",
           "|---|---|---|---|---|---|"]
    med = {s: median([r["tok_s"] for r in rounds if r["side"] == s]) if rounds else float("nan")
           for s in LOG_COST_SIDES}
    out.append(f"| {med['disk']:.1f} | {med['tmpfs']:.1f} | "
               + (f"{median(ratios):.3f}" if ratios else "—") + f" | {_common.interval(ratios)} | "
               f"{sum(r < 1 for r in ratios)} of {len(ratios)} | {_common.tokens_ok(recs, a['tokens'])} |")
    out += ["", "Each round (tok/s; order: the side that ran first named first):", "",
            "| round | order | disk | tmpfs | disk/tmpfs |", "|---|---|---|---|---|"]
    for n in done:
        out.append(f"| {n} | {', '.join(head['orders'][n])} | {rate[(n, 'disk')]:.1f} | {rate[(n, 'tmpfs')]:.1f} | "
                   f"{rate[(n, 'disk')] / rate[(n, 'tmpfs')]:.3f} |")
    return "\n".join(out) + "\n", f"log-cost {model}"


def main() -> int:
    p = argparse.ArgumentParser(prog="python bench/throughput.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(Path.home() / ".superfluid/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    p.add_argument("--llama-server", default="", help="its binary (default: bench/build_llama_server.sh's)")
    p.add_argument("--pairs", type=int, default=8, help="fresh server pairs (default 8)")
    p.add_argument("--rounds", type=int, default=2, help="rounds per side per concurrency in each pair (default 2)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--seed", type=int, default=1, help="sampling seed S (prompt i gets S + i; default 1)")
    p.add_argument("--top-k", type=int, default=40, help="sampled runs, both servers (default 40)")
    p.add_argument("--top-p", type=float, default=0.95, help="sampled runs, both servers (default 0.95)")
    p.add_argument("--min-p", type=float, default=0.05, help="sampled runs, both servers (default 0.05)")
    p.add_argument("--huge-pages", choices=("on", "off"), default="on",
                   help=f"GLIBC_TUNABLES {HUGE}=1 (on, default) or =0 (off) for both servers")
    p.add_argument("--samplers", default="", metavar="SEQ",
                   help="llama-server's --samplers (e.g. 'top_k', with --llama-server-arg=--top-k "
                        "--llama-server-arg=1: a minimal greedy chain); default: its own")
    p.add_argument("--llama-server-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for llama-server, one per use (repeatable; logged with its command line)")
    p.add_argument("--order-seed", type=int, default=None,
                   help="a seeded random order of the sides per round instead of A B B A")
    p.add_argument("--host-cache-mb", type=int, default=0,
                   help="superfluid's host cache for evicted prefixes (default 0: llama-server has none)")
    p.add_argument("--concurrency", default="1,2,4,8", help="comma-separated levels (default 1,2,4,8)")
    p.add_argument("--baseline", default="", metavar="TREE",
                   help="also run our daemon from this source tree (e.g. a git worktree of an earlier commit)")
    p.add_argument("--only", choices=(OURS, THEIRS), help="measure one side (no ratio)")
    p.add_argument("--sessions", default="", help="superfluid's sessions dir (e.g. on tmpfs, to price fsync)")
    p.add_argument("--allow-busy", action="store_true", help=f"run with a load average above {MAX_LOAD}")
    p.add_argument("--out", type=Path, help="the log (default bench-results/<commit>/throughput_<UTC>.jsonl; "
                                            "with --log-cost, throughput_log_cost_<UTC>.jsonl)")
    p.add_argument("--render", type=Path, metavar="LOG", help="print the markdown section of a log and exit")
    p.add_argument("--doc", type=Path, metavar="PATH", help="with --render: write the section into this page")
    p.add_argument("--log-cost", type=int, default=0, metavar="N",
                   help="price the session log: N alternating 8-concurrent rounds each on two daemons, "
                        "sessions on disk (a temp dir) and on tmpfs (/dev/shm)")
    args = p.parse_args()
    if args.render:
        section, key = render(args.render)
        _common.emit("bench/throughput.py", section, key, args.doc)
        return 0
    args.model = model_file(args.model)
    if args.log_cost:
        return log_cost(args)
    if args.baseline and args.only:
        p.error("--baseline compares against our daemon in the same pairs: not with --only")
    return measure(args, p)


if __name__ == "__main__":
    sys.exit(main())
