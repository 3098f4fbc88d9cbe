"""Agent-sized prompts: prefill and decode at 2k-12k tokens, superfluid vs llama-server.

    python bench/longctx.py [--model PATH] [--llama-server PATH] [--lengths 2000,6000,12000]
        [--streams 1,4] [--tokens 64] [--temperature 0.8 --seed S] [--order-seed N] [--rounds R]
        [--chat-after S]

Each case sends ``streams`` requests at once, each with its own prompt of ``length`` tokens, give or
take a few (distinct technical prose from the suite's corpus cut at ``length`` tokens of the model,
so nothing is shared between streams), ``--tokens``-token replies with ignore_eos, on
/v1/completions, to both servers in a seeded random order (printed), ``--rounds`` times (a fresh
order each round). Both get the same model, threads, lanes (the largest ``--streams``), context per
lane (the longest prompt + reply, rounded up), KV cells (llama-server ``-c`` = the cells our worker
allocates, ``--cache-ram 0``; ours ``--host-cache-mb 0``) and sampling. Before each case both
servers forget every prompt (a fresh prompt per case and system: the seed of the prose differs), so
every request is a cold prefill.

Per case and system: TTFT of the first and the last stream, aggregate prefill tokens/s (all
prompt tokens over the time until the last first token), decode tokens/s per stream (tokens
after the first, counted from the usage record since a chunk may carry several, over the time from
the first chunk to the last; median over streams), aggregate
decode tokens/s, and the wall time of the case; then the ratio ours/theirs of wall time and
prefill rate. With ``--chat-after S``, a short chat (``x-superfluid-qos: interactive``; llama-server
ignores the header) is sent S seconds into each case, and its first-token time is reported.
Names the commit it ran on. Needs a quiet machine.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

import httpx
import llama_cpp
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (ROOT, Server, commit, completions_burst, free_port, kv_cells,  # noqa: E402
                     llama_server_argv, median, model_file, ratio_cell, stream_request,
                     superfluid_argv)

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
            "agent_walls": sorted(r["wall"] for r in results)}


def fmt_s(x: float | None) -> str:
    return "failed" if x is None else f"{x:.2f} s"


def model_id(url: str) -> str:
    return str(httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    p.add_argument("--rounds", type=int, default=1, help="rounds per case, each in a random order of the systems")
    p.add_argument("--chat-after", type=float, help="also send a short chat (x-superfluid-qos: interactive) this "
                                                     "many seconds into each case and report its first-token time")
    p.add_argument("--only", choices=["superfluid", "llama-server"], help="run one side (a profile, not a comparison)")
    args = p.parse_args()
    args.model = model_file(args.model)
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
    servers: dict[str, Server] = {}
    if args.only != "llama-server":
        port = free_port()
        servers["superfluid"] = Server("superfluid", superfluid_argv(
            args.model, port, "--max-batch", str(lanes), "--max-context", str(ctx), "--threads", str(args.threads)),
            port)
    if args.only != "superfluid":
        port = free_port()
        servers["llama-server"] = Server("llama-server", llama_server_argv(
            args.llama_server, args.model, port, lanes=lanes, ctx=ctx, threads=args.threads), port)
    seed = args.order_seed if args.order_seed is not None else random.SystemRandom().randrange(1 << 31)
    rng = random.Random(seed)
    rows: list[tuple[int, int, dict[str, dict[str, Any]]]] = []
    try:
        for srv in servers.values():
            srv.wait_ready()
        ids = {name: model_id(srv.url) for name, srv in servers.items()}
        for name, srv in servers.items():  # warm-up: load pages, build graphs
            trio.run(one_case, srv.url, ids[name], [document(200, 999)], 8, sampling)
        case_no = 0
        for length in lengths:
            for n in streams:
                got: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
                for rnd in range(args.rounds):
                    for name in rng.sample(list(servers), len(servers)):
                        case_no += 1
                        prompts = [text_of(length, 1000 * case_no + i) for i in range(n)]
                        g = trio.run(one_case, servers[name].url, ids[name], prompts, args.tokens, sampling,
                                     args.chat_after)
                        got[name].append(g)
                        chat = f", chat TTFT {fmt_s(g['chat_ttft'])}" if args.chat_after is not None else ""
                        print(f"  {length} x {n} round {rnd + 1} {name}: wall {g['wall']:.1f} s, TTFT "
                              f"{g['ttft_first']:.1f}-{g['ttft_last']:.1f} s, prefill {g['prefill_tok_s']:.0f} "
                              f"tok/s, decode {g['decode_stream']:.1f} tok/s per stream, agents' walls "
                              f"{', '.join(f'{w:.1f}' for w in g['agent_walls'])} s{chat}", flush=True)
                rows.append((length, n, got))
    finally:
        for srv in servers.values():
            srv.stop()
    mode = "greedy" if args.temperature <= 0 else f"temperature {args.temperature}, seed {args.seed}"
    print(f"\ncommit {commit()}; model {Path(args.model).name}; {args.threads} threads; {lanes} lanes x {ctx} "
          f"context ({kv_cells(lanes, ctx)} KV cells each, no host cache); {args.tokens}-token replies, {mode}; "
          f"order seed {seed}; root {ROOT}")
    chat_col = f" chat TTFT (sent at {args.chat_after:g} s) |" if args.chat_after is not None else ""
    print(f"Medians over {args.rounds} round(s); ratios are medians of the per-round ratios (from 5 rounds on with a "
          "bootstrap 95% interval of that median and the count of rounds at or above parity).")
    print("| prompt tokens x streams | system | TTFT first / last | prefill tok/s | decode tok/s per stream "
          "| decode tok/s total | wall | wall ratio (theirs/ours) | prefill ratio (ours/theirs) "
          "| decode ratio (ours/theirs) | agents' walls, 1st..last to finish | agent wall ratios (ours/theirs, "
          "k-th finisher) |" + chat_col)
    print("|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if chat_col else ""))
    for _length, n, got in rows:
        ours, theirs = got.get("superfluid"), got.get("llama-server")
        for name, gs in got.items():
            def med(key: str, gs: list[dict[str, Any]] = gs) -> float:
                return median([g[key] for g in gs])
            ratios = ["", "", ""]
            walls = ", ".join(f"{median([g['agent_walls'][k] for g in gs]):.1f}" for k in range(n)) + " s"
            agent_ratios = ""
            if name == "superfluid" and ours and theirs:
                pairs = list(zip(ours, theirs, strict=True))
                ratios = [ratio_cell([t['wall'] / o['wall'] for o, t in pairs]),
                          ratio_cell([o['prefill_tok_s'] / t['prefill_tok_s'] for o, t in pairs]),
                          ratio_cell([o['decode_stream'] / t['decode_stream'] for o, t in pairs])]
                # the k-th agent to finish here against the k-th there: "every agent within 10%"
                agent_ratios = ", ".join(
                    f"{median([o['agent_walls'][k] / t['agent_walls'][k] for o, t in pairs]):.2f}" for k in range(n))
            chats = [g["chat_ttft"] for g in gs]
            chat = fmt_s(None if None in chats else median(chats))
            print(f"| {gs[0]['prompt_tokens'] // n} x {n} | {name} | {med('ttft_first'):.1f} / {med('ttft_last'):.1f} s "
                  f"| {med('prefill_tok_s'):.0f} | {med('decode_stream'):.1f} | {med('decode_total'):.1f} "
                  f"| {med('wall'):.1f} s | {' | '.join(ratios)} | {walls} | {agent_ratios} |"
                  + (f" {chat} |" if chat_col else ""))


if __name__ == "__main__":
    main()
