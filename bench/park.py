"""A long conversation's next turn after a daemon restart: --park against a re-prefill.

    python bench/park.py [--model PATH] [--length 7000] [--tokens 16] [--threads 2] [--rounds N] [--no-deterministic]
    python bench/park.py --render LOG [--doc docs/benchmarks.md]

For each of two daemons, one with ``--park`` and one without (each with its own fresh sessions
directory, ``--host-cache-mb 0``, one lane, ``--deterministic`` unless told not to):

1. turn 1: a chat whose user message is ``--length`` tokens of prose (the model's own count),
   ``--tokens`` greedy tokens of reply; its first-token time is a cold prefill;
2. with ``--park``, wait until the park file is on disk (``<sessions>/park/*.park``);
3. SIGKILL the daemon's process group (daemon and worker), start it again on the same sessions
   directory;
4. turn 2: the same messages, the reply, and a short new user message; its first-token time is
   what the restart cost.

Every daemon's record goes to bench-results/<commit>/park_<UTC>.jsonl; the table is rendered from
that log (``--render``), into docs with ``--doc``. Prints both turns' first-token times per daemon, the ratio of turn 2's (no park / park), the
restored tokens, the park's size, export and restore seconds (from ``/metrics``), and whether the
two daemons' turn-2 texts are identical. Names the commit. Needs a quiet machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

import httpx
import llama_cpp
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, Server, commit, free_port, model_file, shown, stream_request, superfluid_argv, write_doc  # noqa: E402
from _common import log_header  # noqa: E402

from superfluid.suite._client import metric_sum  # noqa: E402
from superfluid.suite._corpus import document  # noqa: E402


def turn(url: str, model: str, messages: list[dict[str, str]], tokens: int) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
            return await stream_request(client, "/v1/chat/completions", {
                "model": model, "messages": messages, "max_tokens": tokens, "temperature": 0,
                "stream_options": {"include_usage": True}})
    out = trio.run(go)
    if out["error"]:
        raise SystemExit(f"request failed: {out['error']}")
    return out


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    names = ("superfluid_resumes_total", "superfluid_resume_tokens_total", "superfluid_park_restore_seconds_total",
             "superfluid_park_export_seconds_total", "superfluid_park_bytes", "superfluid_park_fallbacks_total",
             "superfluid_prefill_tokens_total")
    return {n: metric_sum(text, n) or 0.0 for n in names}


def kill(server: Server) -> None:
    try:
        os.killpg(server.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server.proc.wait()


def wait_parked(sessions: Path, timeout: float = 600) -> list[Path]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        park = sessions / "park"
        files = list(park.glob("*.park")) if park.is_dir() else []
        if files and not list(park.glob("*.tmp")):
            return files
        time.sleep(0.1)
    raise SystemExit(f"nothing parked in {sessions / 'park'} after {timeout:g} s")


def run(name: str, args: argparse.Namespace, extra: list[str], first: list[dict[str, str]]) -> dict[str, Any]:
    sessions = Path(tempfile.mkdtemp(prefix=f"bench-park-{name}-"))
    ctx = max(8192, -(-(args.length + 512) // 1024) * 1024)   # (llama.cpp caps it at the model's training window)
    flags = ["--max-batch", "1", "--max-context", str(ctx), "--threads", str(args.threads), "--sessions", str(sessions),
             *(["--deterministic"] if args.deterministic else []), *extra]
    port = free_port()
    srv = Server(name, superfluid_argv(args.model, port, *flags), port)
    out: dict[str, Any] = {"name": name}
    try:
        srv.wait_ready()
        model = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        t1 = turn(srv.url, model, first, args.tokens)
        out["ttft1"], out["prompt1"] = t1["ttft"], (t1["usage"] or {}).get("prompt_tokens")
        if "--park" in extra:
            files = wait_parked(sessions)
            out["park_bytes"] = sum(f.stat().st_size for f in files)
            out["export_s"] = metrics(srv.url)["superfluid_park_export_seconds_total"]
        kill(srv)
        srv = Server(name, superfluid_argv(args.model, port, *flags), port)
        srv.wait_ready()
        second = [*first, {"role": "assistant", "content": t1["text"]},
                  {"role": "user", "content": "Summarise that in one sentence."}]
        t2 = turn(srv.url, model, second, args.tokens)
        usage = t2["usage"] or {}
        out.update(ttft2=t2["ttft"], text2=t2["text"], prompt2=usage.get("prompt_tokens"),
                   cached2=(usage.get("prompt_tokens_details") or {}).get("cached_tokens"), **metrics(srv.url))
    finally:
        srv.stop()
    return out


MARK_BEGIN = "<!-- bench/park.py {model}: begin (generated by `python bench/park.py --render LOG --doc PATH`) -->"
MARK_END = "<!-- bench/park.py {model}: end -->"
MAX_LOAD = 0.5


def render(path: Path) -> tuple[str, str]:
    """The docs section for one log, and the model it measured (the section's key)."""
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    head = recs[0]
    a = head["args"]
    runs = [r for r in recs if r["kind"] == "daemon"]
    model = Path(a["model"]).name
    out = [f"## Park: a {a['length']:,}-token conversation's next turn after a daemon restart, {model} "
           "(`python bench/park.py`): issue #45\n",
           f"At `{head['commit']}`, {head['started']}, on {head['cpu']} ({path.name}), 1-minute load average "
           f"{head['loadavg']:.2f} at the start. Generated by `python bench/park.py --render {shown(path)}` from that "
           "log.\n",
           f"Two daemons per round, one after the other (order alternating by round), each on a fresh sessions "
           f"directory, one lane, `--threads {a['threads']}`, `--host-cache-mb 0`"
           f"{', `--deterministic`' if a['deterministic'] else ''}; the same conversation to both: turn 1 "
           f"({a['length']:,} tokens of prose, {a['tokens']} greedy tokens of reply), then the daemon's process "
           "group is SIGKILLed and started again on the same directory, and turn 2 (turn 1, its reply and a short "
           "question) is sent. `no-park` re-prefills turn 2; `park` (`--park`) restores turn 1's KV from "
           "`<sessions>/park/`. First-token times in seconds, per round.\n",
           "| round | daemon | turn 1 prompt | turn 1 first token (cold) | turn 2 prompt | turn 2 first token "
           "| restored tokens | park file MiB | export s | restore s | fallbacks |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        out.append(f"| {r['round']} | {r['name']} | {r['prompt1']} | {r['ttft1']:.2f} | {r['prompt2']} | "
                   f"{r['ttft2']:.2f} | {int(r['superfluid_resume_tokens_total'])} | "
                   f"{r.get('park_bytes', 0) / 2**20:.1f} | {r.get('export_s', 0):.3f} | "
                   f"{r['superfluid_park_restore_seconds_total']:.3f} | {int(r['superfluid_park_fallbacks_total'])} |")
    ratios, same = [], []
    for rnd in sorted({r["round"] for r in runs}):
        pair = {r["name"]: r for r in runs if r["round"] == rnd}
        if len(pair) == 2:
            ratios.append(pair["no-park"]["ttft2"] / pair["park"]["ttft2"])
            same.append(pair["no-park"]["text2"] == pair["park"]["text2"])
    if ratios:
        out.append(f"\nTurn 2's first token with `--park`: {median(ratios):.1f}x sooner (median over {len(ratios)} "
                   f"round{'s' if len(ratios) > 1 else ''}; range {min(ratios):.1f}x-{max(ratios):.1f}x); turn 2's "
                   f"text identical in {sum(same)} of {len(same)}.")
    return "\n".join(out) + "\n", model


def main() -> int:
    p = argparse.ArgumentParser(prog="python bench/park.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(Path.home() / ".superfluid/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    p.add_argument("--length", type=int, default=7000,
                   help="turn 1's prompt in tokens (SmolLM2's window is 8,192; Gemma 3 270M's 32,768)")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--out", type=Path)
    p.add_argument("--allow-busy", action="store_true")
    p.add_argument("--render", type=Path, metavar="LOG")
    p.add_argument("--doc", type=Path, metavar="PATH")
    args = p.parse_args()
    if args.render:
        section, model = render(args.render)
        if args.doc:
            write_doc(args.doc, section, MARK_BEGIN.format(model=model), MARK_END.format(model=model))
        else:
            print(section, end="")
        return 0
    load = os.getloadavg()[0]
    if load > MAX_LOAD and not args.allow_busy:
        p.error(f"the machine is busy (1-minute load average {load:.2f}); --allow-busy runs anyway")
    args.model = model_file(args.model)
    vocab = llama_cpp.Llama(args.model, vocab_only=True, verbose=False)
    ids = vocab.tokenize(document(args.length * 2, 45).encode(), add_bos=False)[: args.length]
    first = [{"role": "user", "content": vocab.detokenize(ids).decode("utf-8", "ignore")}]
    rev = commit()
    out = args.out or ROOT / "bench-results" / rev / f"park_{datetime.datetime.now(datetime.UTC):%Y%m%dT%H%M%SZ}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as log:
        log.write(json.dumps(log_header(rev, args, load)) + "\n")
        for rnd in range(args.rounds):
            order = [("no-park", []), ("park", ["--park"])]
            for name, extra in (order if rnd % 2 == 0 else order[::-1]):
                r = run(name, args, extra, first)
                log.write(json.dumps({"kind": "daemon", "round": rnd, **r}) + "\n")
                log.flush()
                print(f"round {rnd} {name}: turn 1 {r['ttft1']:.2f} s, turn 2 {r['ttft2']:.2f} s", file=sys.stderr)
    print(f"log: {out}", file=sys.stderr)
    print(render(out)[0], end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
