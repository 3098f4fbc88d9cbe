"""Prompt-lookup speculative decoding, superfluid vs llama-server's n-gram drafting, same-run ratios.

    python bench/speculation.py [--model PATH] [--llama-server PATH] [--rounds 3] [--tokens 256]
        [--concurrency 1,2,4,8] [--workloads code-edit,quote,free-chat] [--systems plain,lookup,...]
        [--llama-spec-args="--spec-type ngram-simple ..." | none] [--order-seed N] [--quick]
        [--runtime mlx --model DIR]

Five systems, each its own server process started once and kept up, same model, ``--threads 2``,
8 lanes (ours ``--max-batch 8 --max-context 4096 --host-cache-mb 0``; llama-server ``-c`` = the KV
cells our worker allocates for that, ``-np 8 --cache-ram 0``):

    plain               ours, --speculate off
    lookup              ours, --speculate prompt-lookup with every gate off (no throughput gate, no
                        adaptive depth, yield floor 0): the raw strategy at depth 4
    auto                ours, --speculate auto (all gates on, defaults)
    llama-server        llama-server, no speculation
    llama-server-ngram  llama-server with --llama-spec-args (default ngram-simple, n 3, m 4, 1 hit)

Three workloads of 8 distinct prompts each (prompt i is request i), greedy, streamed
``/v1/chat/completions`` with ``max_tokens`` --tokens (replies may end earlier at EOS):
``code-edit`` (a ~60-line Python module and "return the whole file with one function renamed":
the reply copies its context), ``quote`` (a ~300-word passage, "quote the second paragraph, then
summarise it") and ``free-chat`` (short open questions, little to copy).

Each server is warmed up once. For each (workload, concurrency) level, --rounds rounds; in each
round every system sends the 8 prompts once, at most ``concurrency`` at once, in an order drawn
per round from --order-seed (printed). A burst's tokens/s is its completion tokens (``usage`` of
the last chunk) over the burst's wall time; the table gives the median over rounds (and how many
reported, if not all), and each ratio is the median of the per-round ratios, which cancels drift
slower than a round. Acceptance is accepted/proposed draft tokens summed over every reply of every
round: ours from ``superfluid.spec`` on the last chunk (absent: nothing drafted), llama-server's
from ``timings.draft_n``/``draft_n_accepted``. Anything a system did not report, and every
system that failed to start or failed a burst, is "n/a". A last table says how much of each reply
is copied from its prompt (word 4-grams) and whether ours replied the same text as plain. A
system whose warm-up fails is n/a throughout.

``--runtime mlx`` serves an MLX directory (``--model``, default the SmolLM2 directory
``python -m superfluid.models --mlx`` builds) with ours only: llama-server cannot load it and
``mlx_lm.server`` has no prompt-lookup drafting, so those columns are n/a.

``--quick``: 1 round, concurrency 1 and 2, 64 tokens (explicit options still win): a smoke run.
"""

from __future__ import annotations

import argparse
import random
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (ROOT, Server, commit, free_port, kv_cells, llama_server_argv, median,  # noqa: E402
                     round_orders, stream_request, superfluid_argv)


LANES, CTX = 8, 4096
OURS = {"plain": ["--speculate", "off"],
        "lookup": ["--speculate", "prompt-lookup", "--no-spec-throughput-gate", "--no-spec-adaptive",
                   "--spec-min-yield", "0", "--spec-draft-tokens", "4"],
        "auto": ["--speculate", "auto"]}
SYSTEMS = [*OURS, "llama-server", "llama-server-ngram"]
SPECULATING = ["lookup", "auto", "llama-server-ngram"]
NGRAM = "llama-server-ngram"
RATIOS = [("lookup", "plain"), ("auto", "plain"), ("auto", NGRAM), (NGRAM, "llama-server"), ("plain", "llama-server")]
DEFAULT_SPEC = ("--spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 4 "
                "--spec-ngram-simple-min-hits 1")

# -- workloads ---------------------------------------------------------------------------------

NOUNS = ["invoice", "sensor", "order", "ticket", "parcel", "recipe", "account", "flight"]
VERBS = ["total", "score", "weigh", "price", "rank", "tally", "audit", "grade"]
MODULE = '''"""Helpers for {noun} records read from a CSV-like text file."""

from __future__ import annotations

from dataclasses import dataclass

MAX_{NOUNS} = {limit}
DEFAULT_RATE = {rate:.2f}
SEPARATOR = "{sep}"


@dataclass
class {Noun}:
    name: str
    amount: float
    count: int = 0

    def value(self) -> float:
        return self.amount * self.count


def parse_{noun}(line: str) -> {Noun}:
    name, amount, count = line.split(SEPARATOR)
    return {Noun}(name.strip(), float(amount), int(count))


def load_{noun}s(lines: list[str]) -> list[{Noun}]:
    out = []
    for line in lines:
        if not line.strip() or line.startswith("#"):
            continue
        out.append(parse_{noun}(line))
        if len(out) >= MAX_{NOUNS}:
            break
    return out


def {verb}_{noun}s(items: list[{Noun}], rate: float = DEFAULT_RATE) -> float:
    total = 0.0
    for item in items:
        total += item.value() * (1 + rate)
    return round(total, {digits})


def largest_{noun}(items: list[{Noun}]) -> {Noun} | None:
    best = None
    for item in items:
        if best is None or item.value() > best.value():
            best = item
    return best


def summary(items: list[{Noun}]) -> str:
    top = largest_{noun}(items)
    name = top.name if top else "none"
    return f"{{len(items)}} {noun}s, {verb} {{{verb}_{noun}s(items)}}, largest {{name}}"


if __name__ == "__main__":
    with open("{noun}s.txt") as f:
        print(summary(load_{noun}s(f.read().splitlines())))
'''


def code_edit(i: int) -> str:
    noun, verb = NOUNS[i], VERBS[i]
    src = MODULE.format(noun=noun, NOUNS=noun.upper() + "S", Noun=noun.capitalize(), verb=verb, limit=100 + 37 * i,
                        rate=0.05 + 0.01 * i, sep=",;|:"[i % 4], digits=2 + i % 3)
    return (f"```python\n{src}```\n\nReturn the whole file again with one change: rename function "
            f"load_{noun}s to read_{noun}s. Output only the code.")


PLACES = [("Harwick", "cheese", "Marta Lind", "cheese making", "October"),
          ("Sorrel Bay", "salted fish", "Tomas Reyes", "net mending", "June"),
          ("Ellingford", "wool", "Agnes Pike", "weaving", "March"),
          ("Calder Cross", "apples", "Joseph Amadi", "cider pressing", "September"),
          ("Wrenmoor", "honey", "Ilse Varga", "beekeeping", "May"),
          ("Dunmere", "slate", "Owen Price", "stone splitting", "April"),
          ("Tollbridge", "rope", "Clara Dunn", "rope walking", "August"),
          ("Fennick", "pottery", "Samuel Osei", "potting", "November")]
PASSAGE = (
    "The town of {place} sits where the old road meets the river, and for most of its history it was known "
    "for one thing: {thing}. Travellers who stopped there in {year} wrote about the smell of it drifting across "
    "the square, and about the long tables where people argued over prices until the lamps were lit. The trade "
    "shaped the streets, the names of the families, and even the bells of the church, which were paid for by a "
    "tax on every cart that left the gates. Few of those travellers guessed how quickly it would change.\n\n"
    "The change came with {person}, who arrived in {year2} with a notebook full of figures and very little "
    "money. {first} spent the first winter watching how the work was done and counting what was wasted. By "
    "spring there was a plan: share the tools, keep careful records, and sell directly to the cities "
    "downstream instead of waiting for buyers to come. Some neighbours laughed, others joined quietly, and "
    "within {n} years the cooperative employed more people than the mill. The records {first} kept are still "
    "in the town hall, written in a small, careful hand.\n\n"
    "Today {place} is quieter. The {craft} is done by a handful of families who still follow the old methods, "
    "and visitors come mostly in summer to walk along the river and buy small things to take home. The town "
    "hall holds an exhibition every year in {month}, and children from the school read aloud from the "
    "notebooks. Ask anyone in the square about the old days and they will tell you the same story, with small "
    "differences, and they will insist that their version is the true one.")


def quote(i: int) -> str:
    place, thing, person, craft, month = PLACES[i]
    text = PASSAGE.format(place=place, thing=thing, person=person, first=person.split()[0], craft=craft,
                          month=month, year=1790 + 7 * i, year2=1802 + 5 * i, n=3 + i % 5)
    return f"{text}\n\nQuote the second paragraph exactly, then summarise it in one sentence."


FREE = ["Give me three ideas for a birthday party.", "What makes a good morning routine?",
        "Suggest a name for a small bakery and explain why.", "How do I start learning to draw?",
        "What are some fun things to do on a rainy weekend?", "Write a short poem about autumn.",
        "Why do people enjoy travelling?", "Give me tips for a first job interview."]
WORKLOADS = {"code-edit": [code_edit(i) for i in range(8)], "quote": [quote(i) for i in range(8)],
             "free-chat": FREE}

# -- measuring ---------------------------------------------------------------------------------


async def stream_chat(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    return await stream_request(client, "/v1/chat/completions", body)


def drafts(r: dict[str, Any], ours: bool) -> tuple[int, int] | None:
    """(proposed, accepted) of one reply; None if the server does not say."""
    if r["spec"]:
        return int(r["spec"]["proposed"]), int(r["spec"]["accepted"])
    if ours:  # superfluid.spec is on every reply that drafted
        return 0, 0
    if r["timings"] is not None:  # llama-server leaves draft_n out when it drafted nothing
        return int(r["timings"].get("draft_n", 0)), int(r["timings"].get("draft_n_accepted", 0))
    return None


async def burst(url: str, model: str, prompts: list[str], tokens: int, conc: int,
                ours: bool) -> dict[str, Any]:
    """Every prompt once, at most ``conc`` at once (no keep-alive, as ``completions_burst``)."""
    results: dict[int, dict[str, Any]] = {}
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as c:
        limiter = trio.CapacityLimiter(conc)

        async def one(i: int) -> None:
            async with limiter:
                results[i] = await stream_chat(c, {
                    "model": model, "messages": [{"role": "user", "content": prompts[i]}], "max_tokens": tokens,
                    "temperature": 0, "stream_options": {"include_usage": True}})

        t0 = trio.current_time()
        async with trio.open_nursery() as n:
            for i in range(len(prompts)):
                n.start_soon(one, i)
        wall = trio.current_time() - t0
    replies = [results[i] for i in range(len(prompts))]
    if errors := [r["error"] for r in replies if r["error"]]:
        raise RuntimeError(f"{url}: {errors[:2]}")
    counts = [(r["usage"] or {}).get("completion_tokens") for r in replies]
    total = None if None in counts else sum(counts)
    got = [drafts(r, ours) for r in replies]
    return {"tok_s": total / wall if total is not None else None, "tokens": total,
            "drafts": None if None in got else tuple(map(sum, zip(*got, strict=True))),
            "texts": [r["text"] for r in replies]}


def model_id(url: str) -> str:
    return str(httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"])


async def attempt(name: str, srv: Server, model: str, prompts: list[str], tokens: int,
                  conc: int) -> dict[str, Any] | None:
    try:
        return await burst(srv.url, model, prompts, tokens, conc, ours=name in OURS)
    except Exception as exc:  # noqa: BLE001  (a failed burst is n/a, the run goes on)
        print(f"  {name}: burst failed: {exc!r}"[:300], flush=True)
        return None


async def run(servers: dict[str, Server], names: list[str], levels: list[tuple[str, int]], rounds: int,
              tokens: int, order_seed: int) -> tuple[dict[Any, dict[str, list[Any]]], dict[Any, list[list[str]]]]:
    """name -> round results per (workload, concurrency) level, and the order each round ran in."""
    ids: dict[str, str] = {}
    for name, srv in servers.items():
        try:
            await trio.to_thread.run_sync(srv.wait_ready)
            ids[name] = model_id(srv.url)
        except Exception as exc:  # noqa: BLE001  (a system that cannot start is n/a)
            print(f"{name} did not start: {exc}", flush=True)
            continue
        if await attempt(name, srv, ids[name], FREE, 16, LANES) is None:  # warm-up
            print(f"{name}: warm-up failed; n/a from here", flush=True)
            del ids[name]
    every: dict[Any, dict[str, list[Any]]] = {}
    orders: dict[Any, list[list[str]]] = {}
    for k, (workload, conc) in enumerate(levels):
        orders[workload, conc] = round_orders(names, rounds, order_seed + k)
        runs: dict[str, list[Any]] = {name: [] for name in names}
        for order in orders[workload, conc]:
            for name in order:
                runs[name].append(await attempt(name, servers[name], ids[name], WORKLOADS[workload], tokens, conc)
                                  if name in ids else None)
        every[workload, conc] = runs
        print(f"  {workload}, {conc} concurrent: " + ", ".join(
            f"{name} " + " ".join(fmt(r and r["tok_s"], ".0f") for r in runs[name]) for name in names), flush=True)
    return every, orders


# -- report ------------------------------------------------------------------------------------


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "n/a" if x is None else format(x, spec)


def med_rate(runs: list[Any]) -> str:
    """The median over the rounds that reported; says so when some did not."""
    rates = [r["tok_s"] for r in runs if r and r["tok_s"]]
    return fmt(median(rates) if rates else None) + (f" ({len(rates)} of {len(runs)})" if 0 < len(rates) < len(runs)
                                                    else "")


def paired(a: list[Any], b: list[Any]) -> float | None:
    ratios = [x["tok_s"] / y["tok_s"] for x, y in zip(a, b, strict=True) if x and y and x["tok_s"] and y["tok_s"]]
    return median(ratios) if ratios else None


def acceptance(runs: list[Any]) -> str:
    got = [r["drafts"] for r in runs if r]
    if not got or None in got:
        return "n/a"
    p, a = sum(g[0] for g in got), sum(g[1] for g in got)
    return f"{a / p:.0%} ({a}/{p})" if p else "0/0"


def copied(prompt: str, reply: str) -> float | None:
    """The share of the reply's word 4-grams that occur in the prompt."""
    def grams(s: str) -> list[tuple[str, ...]]:
        w = s.split()
        return [tuple(w[i:i + 4]) for i in range(len(w) - 3)]

    have, got = set(grams(prompt)), grams(reply)
    return sum(g in have for g in got) / len(got) if got else None


def report(args: argparse.Namespace, names: list[str], levels: list[tuple[str, int]],
           every: dict[Any, dict[str, list[Any]]], orders: dict[Any, list[list[str]]], order_seed: int) -> None:
    ratios = [(a, b) for a, b in RATIOS if a in names and b in names]
    print()
    print(f"commit {commit()}; model {Path(args.model).name} ({args.runtime}); greedy chat, streamed, max_tokens {args.tokens}; "
          f"8 prompts per burst; median of {args.rounds} rounds; ratio: median of per-round ratios")
    print(f"memory: {kv_cells(LANES, CTX)} KV cells each (ours --max-batch {LANES} --max-context {CTX} "
          f"--host-cache-mb 0, llama-server -c {kv_cells(LANES, CTX)} -np {LANES} --cache-ram 0); --threads "
          f"{args.threads}")
    print("systems: " + "; ".join(f"{n}: " + (" ".join(OURS[n]) if n in OURS else args.llama_spec_args
                                              if n == NGRAM else "no speculation") for n in names))
    print(f"round order (seed {order_seed}): " + "; ".join(
        f"{w} {c}: " + " | ".join(",".join(o) for o in orders[w, c]) for w, c in levels))
    print("\ntokens/s (completion tokens / burst wall)")
    print("| workload | concurrent | " + " | ".join(names) + " | " + " | ".join(f"{a}/{b}" for a, b in ratios) + " |")
    print("|---|---|" + "---|" * (len(names) + len(ratios)))
    for w, c in levels:
        runs = every[w, c]
        print(f"| {w} | {c} | " + " | ".join(med_rate(runs[n]) for n in names) + " | "
              + " | ".join(fmt(paired(runs[a], runs[b]), ".2f") for a, b in ratios) + " |")
    spec = [n for n in SPECULATING if n in names]
    print("\nacceptance (accepted/proposed draft tokens, all rounds) and completion tokens per burst (median)")
    print("| workload | concurrent | " + "".join(f"{n} acceptance | " for n in spec)
          + " | ".join(f"{n} tokens" for n in names) + " |")
    print("|---|---|" + "---|" * (len(spec) + len(names)))
    for w, c in levels:
        runs = every[w, c]
        toks = [[r["tokens"] for r in runs[n] if r and r["tokens"] is not None] for n in names]
        print(f"| {w} | {c} | " + "".join(f"{acceptance(runs[n])} | " for n in spec)
              + " | ".join(fmt(median(t) if t else None, ".0f") for t in toks) + " |")
    print(f"\ncopy: median share of a reply's word 4-grams found in its prompt (first round, concurrency {min(c for _, c in levels)})"
          + ("; ours: replies with the same text as plain" if "plain" in names else ""))
    print("| workload | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for w in dict.fromkeys(w for w, _ in levels):
        runs = every[w, min(c for x, c in levels if x == w)]
        first = {n: runs[n][0] for n in names}
        cells = []
        for n in names:
            shares = [s for p, t in zip(WORKLOADS[w], first[n]["texts"], strict=True)
                      if (s := copied(p, t)) is not None] if first[n] else []
            cell = fmt(median(shares) if shares else None, ".0%")
            if n in OURS and n != "plain" and first[n] and first.get("plain"):
                same = sum(a == b for a, b in zip(first[n]["texts"], first["plain"]["texts"], strict=True))
                cell += f", same {same}/8"
            cells.append(cell)
        print(f"| {w} | " + " | ".join(cells) + " |")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="", help="default: the SmolLM2 GGUF (llamacpp) or MLX directory (mlx)")
    p.add_argument("--runtime", choices=("llamacpp", "mlx"), default="llamacpp")
    p.add_argument("--llama-server", default="", help="its binary (default: bench/build_llama_server.sh)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per level (default 3; --quick 1)")
    p.add_argument("--tokens", type=int, default=None, help="max_tokens of a reply (default 256; --quick 64)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--concurrency", default=None, help="comma-separated levels (default 1,2,4,8; --quick 1,2)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {', '.join(WORKLOADS)}")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    p.add_argument("--llama-spec-args", default=DEFAULT_SPEC,
                   help=f"llama-server's speculation flags for {NGRAM}, given as --llama-spec-args='...' ('none' "
                        f"drops the column; default: {DEFAULT_SPEC})")
    p.add_argument("--order-seed", type=int, default=None,
                   help="seed of the per-round random order of the systems (default: drawn, and printed)")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 round, concurrency 1,2, 64 tokens")
    args = p.parse_args()
    models = Path.home() / ".superfluid/models"
    args.model = args.model or str(models / ("SmolLM2-135M-Instruct-mlx" if args.runtime == "mlx"
                                             else "SmolLM2-135M-Instruct.Q4_1.gguf"))
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.tokens = args.tokens or (64 if args.quick else 256)
    concs = [int(c) for c in (args.concurrency or ("1,2" if args.quick else "1,2,4,8")).split(",")]
    names = [n for n in args.systems.split(",") if n]
    workloads = [w for w in args.workloads.split(",") if w]
    if bad := [n for n in names if n not in SYSTEMS] + [w for w in workloads if w not in WORKLOADS]:
        p.error(f"unknown system or workload: {', '.join(bad)}")
    if args.llama_spec_args.strip().lower() == "none":
        names = [n for n in names if n != NGRAM]
    if args.runtime == "mlx" and (gone := [n for n in names if n not in OURS]):
        print(f"{', '.join(gone)}: n/a on an MLX directory", flush=True)
        names = [n for n in names if n in OURS]
    levels = [(w, c) for w in workloads for c in concs]
    order_seed = args.order_seed if args.order_seed is not None else random.SystemRandom().randrange(1 << 31)
    binary = args.llama_server
    if not binary and any(n.startswith("llama-server") for n in names):
        try:
            binary = subprocess.run(["bash", str(ROOT / "bench/build_llama_server.sh")], capture_output=True,
                                    text=True, check=True).stdout.strip().splitlines()[-1]
        except (subprocess.CalledProcessError, IndexError) as exc:
            print(f"no llama-server ({exc!r}): its columns are n/a", flush=True)
    servers: dict[str, Server] = {}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM still stops the servers
    try:
        for name in names:
            port = free_port()
            spec = shlex.split(args.llama_spec_args) if name == NGRAM else []
            try:
                servers[name] = (Server(name, superfluid_argv(
                    args.model, port, "--max-batch", str(LANES), "--max-context", str(CTX), "--threads",
                    str(args.threads), "--runtime", args.runtime, *OURS[name]), port) if name in OURS else Server(name, llama_server_argv(
                        binary, args.model, port, lanes=LANES, ctx=CTX, threads=args.threads) + spec, port,
                        env={"LD_LIBRARY_PATH": str(Path(binary).parent)}))
            except OSError as exc:  # no binary: n/a, like a server that exits early
                print(f"{name} did not start: {exc!r}", flush=True)
        every, orders = trio.run(run, servers, names, levels, args.rounds, args.tokens, order_seed)
    finally:
        for srv in servers.values():
            srv.stop()
    report(args, names, levels, every, orders, order_seed)


if __name__ == "__main__":
    main()
