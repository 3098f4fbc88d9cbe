"""Aggregate throughput on MLX: superfluid (``--runtime mlx``) vs ``mlx_lm.server`` (same mlx-lm,
same weights, same BLAS), over fresh server pairs, with equal reply lengths on both sides.

    python bench/mlx_vs_server.py [--model DIR] [--variant f32|4bit] [--pairs 4] [--rounds 2] [--tokens 64]
        [--lanes 8] [--concurrency 1,2,4,8] [--prompts 8] [--order-seed N] [--out LOG] [--allow-busy]
    python bench/mlx_vs_server.py --render LOG [--doc docs/benchmarks.md]

**Variants** (one per run and log):

- ``f32`` (the default): ours as shipped on a Linux CPU (the 4-bit directory, dequantized to f32 at
  load over OpenBLAS) vs ``mlx_lm.server`` on an f32 directory ``mlx_lm convert -d --dtype float32``
  makes from the same one (cached under ``~/.cache/superfluid/mlx-f32/``, as bench/rerun_all.sh's
  suite-mlx part makes it): the same numbers through the same kernels.
- ``4bit``: both serve the 4-bit directory with MLX's quantized kernels (ours with
  ``SUPERFLUID_MLX_CPU_WEIGHTS=native``): the serving layers compared on the same compute.

Both sides get the system's OpenBLAS (ours binds it itself; ``mlx_lm.server`` through
``LD_PRELOAD``), ``mlx_lm.server`` ``--decode-concurrency`` and ``--prompt-concurrency`` = ``--lanes``,
ours ``--max-batch`` = ``--lanes``.

**Equal lengths.** ``mlx_lm.server`` ignores ``ignore_eos``: it stops when it draws one of its
tokenizer's ``eos_token_ids`` (the tokenizer's EOS and the model config's / generation config's
``eos_token_id``; mlx-lm 0.32's ``make_stop_sequences``) or a ``stop`` string (none is sent). So both
servers get the same body with ``logit_bias`` -100 on every such id, and on the end-of-turn tokens our
MLX runtime treats as end of generation (``<|im_end|>``, ``<|eot_id|>``, ``<|endoftext|>``,
``<end_of_turn>``, where the vocabulary has them): a greedy draw never picks them, so every reply runs
to ``max_tokens`` (mlx-lm adds the bias to the logits as a logits processor; ours clamps a bias to
[-100, 100] and adds it to a copy of the logits). On our side this is no other path: with
``ignore_eos`` our worker already adds a -inf bias on its end-of-generation ids to that copy
(``_executor._lane_sampling``), and the one thing a request's own ``logit_bias`` turns off,
speculative drafting, is off unless ``--speculate`` is given (it is not here). Every request's
``completion_tokens`` is logged (from ``usage``; a response without one is counted by re-tokenizing its
text with the model's tokenizer, and the log says which) and checked against ``--tokens``; a mismatch
is flagged in the table. Tok/s are each side's own counted tokens over the round's wall time.

**Pairs.** Each pair is a fresh superfluid daemon and a fresh ``mlx_lm.server``, both started for the
pair and stopped after it; each first gets a warm-up round. In a pair, every concurrency level runs
``--rounds`` rounds on each side, the sides alternating A B B A (a pair's first side alternating by
pair; ``--order-seed N``: a seeded random order instead); a round is ``--prompts`` distinct prompts
(bench/throughput.py's), greedy, on ``/v1/completions``, ``conc`` at a time. A side's tok/s in a pair
is the median of its rounds; a pair's ratio is ours/theirs; the table gives the median over pairs and
the geometric mean with a 95% t-interval over pairs (bench/_common.py's ``log_t_interval``).

**Raw log**: JSON lines in bench-results/<commit>/mlx_vs_server_<UTC>.jsonl: a header (the commit,
the arguments, the CPU, the load, the machine, the versions of mlx / mlx-lm / transformers, the body
both sides get, the stop ids, both servers' command lines and environment overrides, the BLAS); one
record per request, per round and per pair (the pair's actual command lines and environments); an end
record. ``--render LOG [--doc PATH]`` prints the table (or writes it into the page between
``<!-- bench/mlx_vs_server.py KEY: begin ... -->`` and ``... end -->`` markers, KEY = ``mlx <model
directory name> <variant>``). Default model: the MLX directory ``python -m superfluid.models --mlx``
builds. Needs a quiet machine for numbers worth publishing; ``--pairs 1 --rounds 1 --concurrency 1
--tokens 8 --allow-busy`` checks that it runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import throughput  # noqa: E402
from _common import (ROOT, JsonLog, Server, commit, completions_burst, free_port, interval_cell, log_header,  # noqa: E402
                     machine, median, pair_ratios, round_order, shown, side_rates, superfluid_argv,
                     token_check)

OURS, THEIRS = "superfluid-mlx", "mlx_lm.server"
SIDES = [OURS, THEIRS]
VARIANTS = ("f32", "4bit")
BIAS = -100  # the OpenAI range's floor; ours clamps to [-100, 100]
# the names superfluid/worker/_mlx.py (MlxEngine._eog) treats as end of generation, besides config ids
EOG_NAMES = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<end_of_turn>")
# inherited variables that change either side's compute, logged as they were
ENV_PREFIXES = ("OPENBLAS_", "OMP_", "MKL_", "MLX_", "SUPERFLUID_", "GLIBC_TUNABLES", "LD_PRELOAD", "LD_LIBRARY_PATH")
MARK_BEGIN = ("<!-- bench/mlx_vs_server.py {key}: begin (generated by `python bench/mlx_vs_server.py --render LOG "
              "--doc PATH`) -->")
MARK_END = "<!-- bench/mlx_vs_server.py {key}: end -->"
MAX_LOAD = 0.5


# -- equal terms ---------------------------------------------------------------------------------------------------

def load_tokenizer(model: str) -> Any:
    """The tokenizer as ``mlx_lm.server`` loads it for ``model`` (its eos ids from the config and the
    generation config too)."""
    from mlx_lm.utils import load_config
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    path = Path(model)
    return mlx_load_tokenizer(path, eos_token_ids=load_config(path).get("eos_token_id"))


def stop_ids(tokenizer: Any) -> list[int]:
    """Every id either server ends a reply on: mlx-lm's ``eos_token_ids`` and the end-of-turn names
    our MLX runtime stops on that this vocabulary has."""
    ids = {int(t) for t in tokenizer.eos_token_ids}
    vocab = tokenizer.get_vocab()
    for name in (tokenizer.eos_token, *EOG_NAMES):
        if name in vocab:
            ids.add(int(vocab[name]))
    return sorted(ids)


def request_fields(ids: list[int]) -> dict[str, Any]:
    """What both servers get in every body besides model, prompt, max_tokens, ``ignore_eos`` and
    ``stream_options``: greedy, and ``ids`` pushed out of reach."""
    return {"temperature": 0, "logit_bias": {str(i): BIAS for i in ids}}


def f32_dir(model: str) -> str:
    """An f32 copy of ``model`` (``mlx_lm convert -d``), cached under ``~/.cache/superfluid``."""
    out = Path.home() / ".cache" / "superfluid" / "mlx-f32" / Path(model).resolve().name
    if not (out / "config.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "mlx_lm", "convert", "--hf-path", model, "--mlx-path", str(out),
                        "-d", "--dtype", "float32"], check=True)
    return str(out)


def mlx_server_argv(model: str, port: int | str, lanes: int) -> list[str]:
    """``mlx_lm.server`` with as many decode and prompt places as our ``--max-batch``."""
    return [sys.executable, "-m", "mlx_lm", "server", "--model", model, "--host", "127.0.0.1", "--port", str(port),
            "--decode-concurrency", str(lanes), "--prompt-concurrency", str(lanes)]


def our_argv(model: str, port: int | str, lanes: int, sessions: str) -> list[str]:
    """Our daemon (``port`` and ``sessions`` may be placeholders, for the log's header)."""
    return superfluid_argv(model, port, "--runtime", "mlx", "--max-batch", str(lanes), "--sessions", sessions)


def setup(args: argparse.Namespace) -> dict[str, Any]:
    """Each side's model directory and environment overrides for ``args.variant``."""
    blas = {"LD_PRELOAD": args.blas} if args.blas else {}
    return {
        OURS: {"model": args.model,
               "env": {"PYTHONPATH": str(ROOT), "SUPERFLUID_MLX_CPU_WEIGHTS": "f32" if args.variant == "f32" else "native"}},
        THEIRS: {"model": f32_dir(args.model) if args.variant == "f32" else args.model, "env": blas},
    }


def versions() -> dict[str, Any]:
    import mlx.core as mx
    import mlx_lm
    import transformers

    return {"superfluid": commit(), "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


# -- measuring -----------------------------------------------------------------------------------------------------

def count(result: dict[str, Any], tokenizer: Any) -> tuple[int, str]:
    """A reply's completion tokens and where the number came from: ``usage``, or its text re-tokenized."""
    n = (result["usage"] or {}).get("completion_tokens")
    if n is not None:
        return int(n), "usage"
    return len(tokenizer.encode(result["text"], add_special_tokens=False)), "retokenized"


def burst(url: str, model: str, prompts: list[str], conc: int, tokens: int,
          fields: dict[str, Any]) -> tuple[list[dict[str, Any]], float]:
    return trio.run(lambda: completions_burst(url, model, prompts, tokens, fields, concurrency=conc,
                                              http_timeout_s=1800))


def run_pair(pair: int, args: argparse.Namespace, sides: dict[str, Any], fields: dict[str, Any],
             prompts: list[str], concs: list[int], rng: random.Random | None, tokenizer: Any, log: Any) -> None:
    write = log.write

    with tempfile.TemporaryDirectory(prefix="bench-mlx-") as tmp:
        servers: dict[str, Server] = {}
        try:
            for side in SIDES:
                port = free_port()
                argv = (our_argv(sides[side]["model"], port, args.lanes, tmp) if side == OURS
                        else mlx_server_argv(sides[side]["model"], port, args.lanes))
                servers[side] = Server(f"{side}-{args.variant}", argv, port, env=sides[side]["env"])
            ids = {}
            for side, srv in servers.items():
                srv.wait_ready()
                # mlx_lm.server's /v1/models lists the Hugging Face cache; "default_model" is its --model
                ids[side] = "default_model" if side == THEIRS else throughput.model_id(srv.url)
            for side, srv in servers.items():
                burst(srv.url, ids[side], prompts, len(prompts), min(args.tokens, 8), fields)  # warm-up
            for conc in concs:
                for rnd in range(args.rounds):
                    order = round_order(SIDES, pair, rnd, rng)
                    for pos, side in enumerate(order):
                        results, wall = burst(servers[side].url, ids[side], prompts, conc, args.tokens, fields)
                        total = 0
                        for r in sorted(results, key=lambda r: r["index"]):
                            n, how = count(r, tokenizer)
                            total += n
                            write({"kind": "request", "pair": pair, "conc": conc, "side": side, "round": rnd,
                                   "prompt": r["index"], "completion_tokens": n, "counted": how,
                                   "chunks": r["tokens"], "ttft": r["ttft"], "wall": r["wall"]})
                        write({"kind": "round", "pair": pair, "conc": conc, "side": side, "round": rnd,
                               "position": pos, "tokens": total, "wall": wall, "tok_s": total / wall})
                        print(f"pair {pair} conc {conc} round {rnd} {side}: {total / wall:.1f} tok/s",
                              file=sys.stderr, flush=True)
        finally:
            for srv in servers.values():
                srv.stop()
    write({"kind": "pair", "pair": pair,
           "servers": {side: {"argv": srv.argv, "env": sides[side]["env"], "log": str(srv.log)}
                       for side, srv in servers.items()}})


def measure(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    load = os.getloadavg()[0]
    if load > MAX_LOAD and not args.allow_busy:
        p.error(f"the machine is busy (1-minute load average {load:.2f}); --allow-busy runs anyway")
    from superfluid.worker._mlx import _OPENBLAS

    args.blas = next((b for b in _OPENBLAS if os.path.exists(b)), None)
    concs = [int(c) for c in args.concurrency.split(",")]
    prompts = throughput.PROMPTS[: args.prompts]
    sides = setup(args)
    tokenizer = load_tokenizer(sides[THEIRS]["model"])
    ids = stop_ids(tokenizer)
    fields = request_fields(ids)
    rng = random.Random(args.order_seed) if args.order_seed is not None else None
    rev = commit()
    out = args.out or ROOT / "bench-results" / rev / f"mlx_vs_server_{datetime.datetime.now(datetime.UTC):%Y%m%dT%H%M%SZ}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    head = log_header(rev, args, load)
    head.update(machine=machine(), versions=versions(), sides=SIDES, concurrency=concs, prompts=prompts,
                body={"max_tokens": args.tokens, **fields, "ignore_eos": True,
                      "stream_options": {"include_usage": True}, "stream": True},
                stop_ids={str(i): tokenizer.convert_ids_to_tokens(i) for i in ids},
                servers={OURS: {"model": sides[OURS]["model"], "env": sides[OURS]["env"],
                                "argv": our_argv(sides[OURS]["model"], "PORT", args.lanes, "SESSIONS")},
                         THEIRS: {"model": sides[THEIRS]["model"], "env": sides[THEIRS]["env"],
                                  "argv": mlx_server_argv(sides[THEIRS]["model"], "PORT", args.lanes)}},
                inherited={k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)})
    with JsonLog(out, head) as log:
        for pair in range(args.pairs):
            run_pair(pair, args, sides, fields, prompts, concs, rng, tokenizer, log)
        log.end()
    print(f"log: {out}", file=sys.stderr)
    print(render(out)[0], end="")
    return 0


# -- the table, from the log ---------------------------------------------------------------------------------------

def block_key(head: dict[str, Any]) -> str:
    return f"mlx {Path(head['args']['model']).name} {head['args']['variant']}"


def lengths(recs: list[dict[str, Any]], conc: int, side: str) -> str:
    """A side's completion tokens per request at ``conc``: the one number, or min-max (median)."""
    ns = [r["completion_tokens"] for r in recs if r["kind"] == "request" and r["conc"] == conc and r["side"] == side]
    if not ns:
        return "—"
    lo, hi = min(ns), max(ns)
    return str(lo) if lo == hi else f"{lo}-{hi} (median {median([float(n) for n in ns]):g})"


def render(path: Path) -> tuple[str, str]:
    """The docs section for one log, and its block's key (``mlx <model directory name> <variant>``)."""
    recs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    head = recs[0]
    a, m, v, srv = head["args"], head["machine"], head["versions"], head["servers"]
    end = next((r for r in recs if r["kind"] == "end"), None)
    n_pairs = len([r for r in recs if r["kind"] == "pair"])
    concs = head["concurrency"]
    rates = side_rates(recs)
    reqs = [r for r in recs if r["kind"] == "request"]
    how = {s: {c: sum(r["side"] == s and r["counted"] == c for r in reqs) for c in ("usage", "retokenized")}
           for s in SIDES}
    counted = "; ".join(f"{s}: {how[s]['usage']} from usage, {how[s]['retokenized']} re-tokenized" for s in SIDES)
    order = ("a random order per round (seed " + str(a["order_seed"]) + ")" if a.get("order_seed") is not None
             else "A B B A (forward in even rounds, reversed in odd ones; a pair's first side alternating by pair)")
    variant = ("ours on the 4-bit directory run as f32 over OpenBLAS (as shipped on a Linux CPU), mlx_lm.server on "
               "its f32 copy (`mlx_lm convert -d --dtype float32`)" if a["variant"] == "f32" else
               "both on the 4-bit directory with MLX's quantized kernels (ours with "
               "`SUPERFLUID_MLX_CPU_WEIGHTS=native`)")
    stops = ", ".join(f"{i} `{t}`" for i, t in head["stop_ids"].items())
    blas = a.get("blas") or "the wheel's own"
    env = {s: " ".join(f"`{k}={x}`" for k, x in srv[s]["env"].items() if k != "PYTHONPATH") or "none"
           for s in SIDES}
    out = [f"## MLX throughput, {Path(a['model']).name} ({a['variant']}), superfluid vs mlx_lm.server, fresh server "
           "pairs (`python bench/mlx_vs_server.py`): issue #42\n",
           f"At `{head['commit']}`, {head['started']}, on {head['cpu']}, {m['mem_gib']} GiB, Linux {m['kernel']}; "
           f"1-minute load average {head['loadavg']:.2f} at the start"
           + (f", {end['loadavg'][0]:.2f} at the end" if end else " (the run did not finish)")
           + f" ({path.name}). Versions: mlx {v['mlx']}, mlx-lm {v['mlx_lm']}, transformers {v['transformers']}, "
           f"Python {v['python']}. Generated by `python bench/mlx_vs_server.py --render {shown(path)}` from that log.\n",
           f"Equal terms: {variant}; `--max-batch {a['lanes']}` / `--decode-concurrency {a['lanes']} "
           f"--prompt-concurrency {a['lanes']}`; BLAS {blas} (ours binds "
           f"it itself; mlx_lm.server by `LD_PRELOAD`); environment overrides: superfluid {env[OURS]}, "
           f"mlx_lm.server {env[THEIRS]}. The same body on /v1/completions: greedy, {a['tokens']}-token replies, "
           f"`ignore_eos` (which mlx_lm.server ignores) and `logit_bias` {BIAS} on every id either side ends a reply "
           f"on ({stops}), so both run to the length; the same {len(head['prompts'])} prompts each round. "
           f"Tokens per request are each side's own completion_tokens ({counted}); tok/s is a round's tokens over "
           "its wall time.\n",
           f"{n_pairs} fresh server pairs (each side started for its pair and stopped after it), {a['rounds']} "
           f"rounds per concurrency in each, sides in {order}. A side's tok/s in a pair is the median of its rounds; "
           "a pair's ratio is superfluid/mlx_lm.server from that pair. Tok/s columns: medians over pairs; ratio: "
           "the median over pairs, and the geometric mean with its 95% interval, a t-interval on the pairs' "
           f"log-ratios ({max(n_pairs - 1, 0)} degrees of freedom), over pairs, not rounds.\n",
           "| concurrent | superfluid tok/s | mlx_lm.server tok/s | ratio, median over pairs "
           "| geometric mean (95% interval) | pairs below 1.00 | superfluid tokens/request "
           "| mlx_lm.server tokens/request | tokens |",
           "|---|---|---|---|---|---|---|---|---|"]
    for c in concs:
        ratios = pair_ratios(recs, c, OURS, THEIRS)
        side = {s: [x for (_p, cc, ss), x in rates.items() if cc == c and ss == s] for s in SIDES}
        cells = [f"{median(side[s]):.1f}" if side[s] else "—" for s in SIDES]
        out.append(f"| {c} | {cells[0]} | {cells[1]} | {f'{median(ratios):.3f}' if ratios else '—'} | "
                   f"{interval_cell(ratios) if ratios else '—'} | {sum(r < 1 for r in ratios)} of {len(ratios)} | "
                   f"{lengths(recs, c, OURS)} | {lengths(recs, c, THEIRS)} | "
                   f"{token_check(recs, c, SIDES, a['tokens'])} |")
    out += ["", "Each pair's ratio (superfluid/mlx_lm.server):", "",
            "| pair | " + " | ".join(f"{c} concurrent" for c in concs) + " |",
            "|---|" + "---|" * len(concs)]
    for p in sorted({r["pair"] for r in recs if r["kind"] == "round"}):
        cells = []
        for c in concs:
            o, th = rates.get((p, c, OURS)), rates.get((p, c, THEIRS))
            cells.append(f"{o / th:.3f}" if o and th else "—")
        out.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n", block_key(head)


def main() -> int:
    p = argparse.ArgumentParser(prog="python bench/mlx_vs_server.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="MLX model directory (default: the SmolLM2 MLX build)")
    p.add_argument("--variant", choices=VARIANTS, default="f32",
                   help="f32: ours as shipped vs mlx_lm.server on an f32 copy (default); 4bit: both quantized")
    p.add_argument("--pairs", type=int, default=4, help="fresh server pairs (default 4)")
    p.add_argument("--rounds", type=int, default=2, help="rounds per side per concurrency in each pair (default 2)")
    p.add_argument("--tokens", type=int, default=64, help="reply length, both sides (default 64)")
    p.add_argument("--lanes", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8, help="distinct prompts a round (at most 8; default 8)")
    p.add_argument("--concurrency", default="1,2,4,8", help="comma-separated levels (default 1,2,4,8)")
    p.add_argument("--order-seed", type=int, default=None,
                   help="a seeded random order of the sides per round instead of A B B A")
    p.add_argument("--allow-busy", action="store_true", help=f"run with a load average above {MAX_LOAD}")
    p.add_argument("--out", type=Path, help="the log (default bench-results/<commit>/mlx_vs_server_<UTC>.jsonl)")
    p.add_argument("--render", type=Path, metavar="LOG", help="print the markdown section of a log and exit")
    p.add_argument("--doc", type=Path, metavar="PATH", help="with --render: write the section into this page")
    args = p.parse_args()
    if not 1 <= args.prompts <= len(throughput.PROMPTS):
        p.error(f"--prompts: 1 to {len(throughput.PROMPTS)}")
    if args.render:
        section, key = render(args.render)
        _common.emit("bench/mlx_vs_server.py", section, key, args.doc)
        return 0
    if args.model is None:
        from superfluid.models._mlx_convert import mlx_test_model_path

        args.model = str(mlx_test_model_path())
    args.model = str(Path(args.model).resolve())
    return measure(args, p)


if __name__ == "__main__":
    sys.exit(main())
