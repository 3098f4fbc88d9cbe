"""A long conversation's next turn after a daemon restart: --park against a re-prefill.

    python bench/park.py [--model PATH] [--length 7000] [--tokens 16] [--threads 2] [--no-deterministic]

For each of two daemons, one with ``--park`` and one without (each with its own fresh sessions
directory, ``--host-cache-mb 0``, one lane, ``--deterministic`` unless told not to):

1. turn 1: a chat whose user message is ``--length`` tokens of prose (the model's own count),
   ``--tokens`` greedy tokens of reply; its first-token time is a cold prefill;
2. with ``--park``, wait until the park file is on disk (``<sessions>/park/*.park``);
3. SIGKILL the daemon's process group (daemon and worker), start it again on the same sessions
   directory;
4. turn 2: the same messages, the reply, and a short new user message; its first-token time is
   what the restart cost.

Prints both turns' first-token times per daemon, the ratio of turn 2's (no park / park), the
restored tokens, the park's size, export and restore seconds (from ``/metrics``), and whether the
two daemons' turn-2 texts are identical. Names the commit. Needs a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import llama_cpp
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, Server, commit, free_port, model_file, stream_request, superfluid_argv  # noqa: E402

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(Path.home() / ".superfluid/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    p.add_argument("--length", type=int, default=7000,
                   help="turn 1's prompt in tokens (SmolLM2's window is 8,192; Gemma 3 270M's 32,768)")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True)
    args = p.parse_args()
    args.model = model_file(args.model)
    vocab = llama_cpp.Llama(args.model, vocab_only=True, verbose=False)
    ids = vocab.tokenize(document(args.length * 2, 45).encode(), add_bos=False)[: args.length]
    first = [{"role": "user", "content": vocab.detokenize(ids).decode("utf-8", "ignore")}]
    results = [run("no-park", args, [], first), run("park", args, ["--park"], first)]
    cold, parked = results
    print(f"\ncommit {commit()}; model {Path(args.model).name}; {args.threads} threads; one lane; "
          f"{'--deterministic' if args.deterministic else 'not deterministic'}; root {ROOT}")
    print("| daemon | turn 1 prompt | turn 1 TTFT (cold) | turn 2 prompt | turn 2 TTFT after a restart "
          "| restored tokens | park file | export s | restore s | fallbacks |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['name']} | {r['prompt1']} | {r['ttft1']:.2f} s | {r['prompt2']} | {r['ttft2']:.2f} s "
              f"| {int(r['superfluid_resume_tokens_total'])} | {r.get('park_bytes', 0) / 2**20:.1f} MiB "
              f"| {r.get('export_s', 0):.3f} | {r['superfluid_park_restore_seconds_total']:.3f} "
              f"| {int(r['superfluid_park_fallbacks_total'])} |")
    print(f"turn 2 first token: {cold['ttft2'] / parked['ttft2']:.1f}x sooner with --park; "
          f"turn 2 text identical: {cold['text2'] == parked['text2']}")
    if cold["text2"] != parked["text2"]:
        print(f"  no park: {cold['text2']!r}\n  park:    {parked['text2']!r}")


if __name__ == "__main__":
    main()
