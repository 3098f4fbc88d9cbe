"""Agent-sized prompts: prefill and decode at 2k-12k tokens, superfluid vs llama-server.

    python bench/longctx.py [--model PATH] [--llama-server PATH] [--lengths 2000,6000,12000]
        [--streams 1,4] [--tokens 64] [--temperature 0.8 --seed S] [--order-seed N] [--rounds R]
        [--chat-after S]

Each case sends ``streams`` requests at once, each with its own prompt of ``length`` tokens, give or
take a few (distinct technical prose from the suite's corpus cut at ``length`` tokens of the model,
so nothing is shared between streams), ``--tokens``-token replies with ignore_eos, on
/v1/completions, to both servers in a seeded random order, ``--rounds`` times: each round a fresh
server pair (both started for it, stopped after it), every case in it, a fresh order per case. Both get the same model, threads, lanes (the largest ``--streams``), context per
lane (the longest prompt + reply, rounded up), KV cells (llama-server ``-c`` = the cells our worker
allocates, ``--cache-ram 0``; ours ``--host-cache-mb 0``) and sampling. Before each case both
servers forget every prompt (a fresh prompt per case and system: the seed of the prose differs), so
every request is a cold prefill.

Per case and system: TTFT of the first and the last stream, aggregate prefill tokens/s (all
prompt tokens over the time until the last first token), decode tokens/s per stream (tokens
after the first, counted from the usage record since a chunk may carry several, over the time from
the first chunk to the last; median over streams), aggregate
decode tokens/s, and the wall time of the case; then the ratios of wall time, prefill and decode
rate per pair (median over pairs, with a 95% t-interval over pairs from two pairs on). With ``--chat-after S``, a short chat (``x-superfluid-qos: interactive``; llama-server
ignores the header) is sent S seconds into each case, and its first-token time is reported.
Names the commit it ran on. Needs a quiet machine.

**Raw log** (issue #42): JSON lines in bench-results/<commit>/longctx_<UTC>.jsonl (``--out LOG``): a
header (the commit, the arguments, the machine, the versions, the lanes, context and KV cells), a
record per pair (both servers' full command lines), per request and per case (its measures), an end
record. ``--render LOG [--doc PATH]`` prints the table (medians over pairs with min-max), or writes
it into the page between ``<!-- bench/longctx.py KEY: begin ... -->`` and ``... end -->`` (KEY: the
model, greedy or sampled).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path
from typing import Any

import httpx
import llama_cpp
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (JsonLog, Server, commit, completions_burst, emit, free_port, interval,  # noqa: E402
                     kv_cells, llama_server_argv, log_header, log_path, machine, median, model_file, read_log,
                     run_line, stream_request, superfluid_argv, tokens_ok, versions)

from superfluid.suite._corpus import document  # noqa: E402


async def one_case(url: str, model: str, prompts: list[str], tokens: int, sampling: dict[str, Any],
                   chat_after: float | None = None) -> dict[str, Any]:
    chat: dict[str, Any] = {}

    async def send_chat() -> None:
        await trio.sleep(chat_after or 0)
        body = {"model": model, "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 8,
                "temperature": 0}
        async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
            chat.update(await stream_request(client, "/v1/chat/completions", body,
                                             headers={"x-superfluid-qos": "interactive"}))

    async with trio.open_nursery() as n:
        if chat_after is not None:
            n.start_soon(send_chat)
        results, wall = await completions_burst(url, model, prompts, tokens, sampling, http_timeout_s=3600)
    ttfts = sorted(r["ttft"] for r in results)
    prompt_tokens = sum((r["usage"] or {}).get("prompt_tokens", 0) for r in results)
    decode = []
    generated = 0
    for r in results:
        # tokens from the usage record: a server may send several tokens in one chunk
        stamps, n = r["stamps"], (r["usage"] or {}).get("completion_tokens") or len(r["stamps"])
        generated += n
        if n > 1 and len(stamps) > 1 and stamps[-1] > stamps[0]:
            decode.append((n - 1) / (stamps[-1] - stamps[0]))
    last_first = ttfts[-1]
    return {"ttft_first": ttfts[0], "ttft_last": last_first, "prompt_tokens": prompt_tokens,
            "prefill_tok_s": prompt_tokens / last_first if last_first else 0.0,
            "decode_stream": median(decode) if decode else 0.0,
            "decode_total": generated / wall if wall else 0.0, "wall": wall, "chat_ttft": chat.get("ttft"),
            "agent_walls": sorted(r["wall"] for r in results),
            "requests": [{"prompt": r["index"], "prompt_tokens": (r["usage"] or {}).get("prompt_tokens"),
                          "completion_tokens": (r["usage"] or {}).get("completion_tokens"), "chunks": r["tokens"],
                          "ttft": r["ttft"], "wall": r["wall"]} for r in sorted(results, key=lambda r: r["index"])]}


def fmt_s(x: float | None) -> str:
    return "failed" if x is None else f"{x:.2f} s"


def model_id(url: str) -> str:
    return str(httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"])


SIDES = ("superfluid", "llama-server")
GEN = "bench/longctx.py"


def measure(args: argparse.Namespace) -> Path:
    """Every case on a fresh server pair per round, into a log; returns its path."""
    load = os.getloadavg()[0]
    lengths = [int(x) for x in args.lengths.split(",")]
    streams = [int(x) for x in args.streams.split(",")]
    lanes = max(streams)
    ctx = -(-(max(lengths) + args.tokens + 64) // 1024) * 1024
    vocab = llama_cpp.Llama(args.model, vocab_only=True, verbose=False)

    def text_of(length: int, seed: int) -> str:
        """Prose of exactly ``length`` tokens (with BOS) of this model (the corpus' own estimate is rough)."""
        ids = vocab.tokenize(document(length * 2, seed).encode(), add_bos=True)[:length]
        return vocab.detokenize(ids[1:]).decode("utf-8", "ignore")
    sampling: dict[str, Any] = ({"temperature": 0} if args.temperature <= 0 else
                                {"temperature": args.temperature, "seed": args.seed, "top_k": 40, "top_p": 0.95,
                                 "min_p": 0.05})
    sides = [s for s in SIDES if args.only in (None, s)]
    seed = args.order_seed if args.order_seed is not None else random.SystemRandom().randrange(1 << 31)
    rng = random.Random(seed)
    rev = commit()
    out = args.out or log_path("longctx", rev)
    head = log_header(rev, args, load)
    head.update(machine=machine(), versions=versions(args.llama_server if "llama-server" in sides else None),
                sides=sides, lengths=lengths, streams=streams, lanes=lanes, ctx=ctx, kv_cells=kv_cells(lanes, ctx),
                sampling=sampling, order_seed=seed)
    log = JsonLog(out, head)
    case_no = 0
    try:
        for pair in range(args.rounds):
            servers: dict[str, Server] = {}
            if "superfluid" in sides:
                port = free_port()
                servers["superfluid"] = Server("superfluid", superfluid_argv(
                    args.model, port, "--max-batch", str(lanes), "--max-context", str(ctx), "--threads",
                    str(args.threads)), port)
            if "llama-server" in sides:
                port = free_port()
                servers["llama-server"] = Server("llama-server", llama_server_argv(
                    args.llama_server, args.model, port, lanes=lanes, ctx=ctx, threads=args.threads), port,
                    env={"LD_LIBRARY_PATH": str(Path(args.llama_server).parent)})
            try:
                log.write({"kind": "pair", "pair": pair, "servers": {
                    name: {"argv": srv.argv, "env": {"LD_LIBRARY_PATH": str(Path(args.llama_server).parent)}
                           if name == "llama-server" else {}} for name, srv in servers.items()}})
                for srv in servers.values():
                    srv.wait_ready()
                ids = {name: model_id(srv.url) for name, srv in servers.items()}
                for name, srv in servers.items():  # warm-up: load pages, build graphs
                    trio.run(one_case, srv.url, ids[name], [document(200, 999)], 8, sampling)
                for length in lengths:
                    for n in streams:
                        order = rng.sample(list(servers), len(servers))
                        for pos, name in enumerate(order):
                            case_no += 1
                            prompts = [text_of(length, 1000 * case_no + i) for i in range(n)]
                            g = trio.run(one_case, servers[name].url, ids[name], prompts, args.tokens, sampling,
                                         args.chat_after)
                            where = {"pair": pair, "length": length, "streams": n, "side": name}
                            for r in g.pop("requests"):
                                log.write({"kind": "request", **where, **r})
                            log.write({"kind": "case", **where, "position": pos, **g})
                            chat = f", chat TTFT {fmt_s(g['chat_ttft'])}" if args.chat_after is not None else ""
                            print(f"  pair {pair} {length} x {n} {name}: wall {g['wall']:.1f} s, TTFT "
                                  f"{g['ttft_first']:.1f}-{g['ttft_last']:.1f} s, prefill {g['prefill_tok_s']:.0f} "
                                  f"tok/s, decode {g['decode_stream']:.1f} tok/s per stream{chat}",
                                  file=sys.stderr, flush=True)
            finally:
                for srv in servers.values():
                    srv.stop()
        log.end()
    finally:
        log.close()
    return out


def _spread(xs: list[float], fmt: str) -> str:
    """The median, and with more than one value its min-max."""
    if not xs:
        return "—"
    cell = format(median(xs), fmt)
    return cell + (f" ({format(min(xs), fmt)}-{format(max(xs), fmt)})" if len(xs) > 1 else "")


def _ratio(xs: list[float]) -> str:
    """The median of per-pair ratios, with 2+ pairs the geometric mean's 95% t-interval over pairs."""
    if not xs:
        return "—"
    return f"{median(xs):.2f}" + (f"; {interval(xs, 2)}" if len(xs) > 1 else "")


def render(path: Path) -> tuple[str, str]:
    """The docs section of a log, and its block's key (the model's file name, greedy or sampled)."""
    recs = read_log(path)
    head = recs[0]
    a = head["args"]
    model = Path(a["model"]).name
    sampled = a["temperature"] > 0
    cases = [r for r in recs if r["kind"] == "case"]
    got = {(r["pair"], r["length"], r["streams"], r["side"]): r for r in cases}
    pairs = sorted({r["pair"] for r in cases})
    sides = head["sides"]
    chat = a.get("chat_after") is not None
    mode = f"temperature {a['temperature']}, seed {a['seed']}" if sampled else "greedy"
    out = [f"## Long prompts, {model}, {'sampled' if sampled else 'greedy'} (`python bench/longctx.py`): "
           "issues #18, #42\n",
           run_line(recs, path, GEN),
           f"Each case sends `streams` requests at once, each with its own cold prompt of `length` tokens of the "
           f"model, {a['tokens']}-token replies ({mode}, `ignore_eos`) on /v1/completions. Both servers: "
           f"{a['threads']} threads, {head['lanes']} lanes x {head['ctx']} context ({head['kv_cells']} KV cells, "
           f"llama-server `--cache-ram 0`, ours `--host-cache-mb 0`). {len(pairs)} fresh server pair(s), each "
           f"running every case on both sides in a seeded random order (seed {head['order_seed']}). Cells: the "
           "median over pairs, (min-max) with more than one; ratios are per pair, their median and, with two "
           "pairs or more, the geometric mean with a 95% t-interval over pairs. Prefill tok/s: all prompt tokens "
           "over the time to the last first token; decode: tokens after the first (from usage) over the time "
           "from the first chunk to the last, median over streams.\n",
           "| prompt tokens x streams | system | TTFT first s | TTFT last s | prefill tok/s | decode tok/s per stream "
           "| wall s | wall ratio (theirs/ours) | prefill ratio (ours/theirs) | decode ratio (ours/theirs) | tokens |"
           + (f" chat TTFT s (sent at {a['chat_after']:g} s) |" if chat else ""),
           "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if chat else "")]
    for length in head["lengths"]:
        for n in head["streams"]:
            both = [p for p in pairs if all((p, length, n, s) in got for s in SIDES)]
            for side in sides:
                rows = [got[(p, length, n, side)] for p in pairs if (p, length, n, side) in got]
                if not rows:
                    continue

                def col(key: str, fmt: str, rows: list[dict[str, Any]] = rows) -> str:
                    return _spread([r[key] for r in rows if r[key] is not None], fmt)
                ratios = ["", "", ""]
                if side == "superfluid" and both:
                    o = [got[(p, length, n, "superfluid")] for p in both]
                    t = [got[(p, length, n, "llama-server")] for p in both]
                    ratios = [_ratio([y["wall"] / x["wall"] for x, y in zip(o, t, strict=True)]),
                              _ratio([x["prefill_tok_s"] / y["prefill_tok_s"] for x, y in zip(o, t, strict=True)
                                      if y["prefill_tok_s"]]),
                              _ratio([x["decode_stream"] / y["decode_stream"] for x, y in zip(o, t, strict=True)
                                      if y["decode_stream"]])]
                tokens = tokens_ok(recs, a["tokens"], length=length, streams=n, side=side)
                out.append(f"| {rows[0]['prompt_tokens'] // n:,} x {n} | {side} | {col('ttft_first', '.2f')} | "
                           f"{col('ttft_last', '.2f')} | {col('prefill_tok_s', '.0f')} | {col('decode_stream', '.1f')} "
                           f"| {col('wall', '.1f')} | {' | '.join(ratios)} | {tokens} |"
                           + (f" {col('chat_ttft', '.2f')} |" if chat else ""))
    return "\n".join(out) + "\n", f"{model} {'sampled' if sampled else 'greedy'}"


def main() -> int:
    p = argparse.ArgumentParser(prog="python bench/longctx.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(Path.home() / ".superfluid/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    p.add_argument("--llama-server", default=str(Path.home() / ".cache/superfluid/llama-server-0.3.36/build/bin/"
                                                               "llama-server"))
    p.add_argument("--lengths", default="2000,6000,12000")
    p.add_argument("--streams", default="1,4")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--order-seed", type=int)
    p.add_argument("--rounds", type=int, default=1,
                   help="fresh server pairs, each running every case on both sides in a random order")
    p.add_argument("--chat-after", type=float, help="also send a short chat (x-superfluid-qos: interactive) this "
                                                     "many seconds into each case and report its first-token time")
    p.add_argument("--only", choices=["superfluid", "llama-server"], help="run one side (a profile, not a comparison)")
    p.add_argument("--out", type=Path, help="the log (default bench-results/<commit>/longctx_<UTC>.jsonl)")
    p.add_argument("--render", type=Path, metavar="LOG", help="print the markdown section of a log and exit")
    p.add_argument("--doc", type=Path, metavar="PATH", help="with --render: write the section into this page")
    args = p.parse_args()
    if args.render:
        emit(GEN, *render(args.render), args.doc)
        return 0
    args.model = model_file(args.model)
    out = measure(args)
    print(f"log: {out}", file=sys.stderr)
    print(render(out)[0], end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
