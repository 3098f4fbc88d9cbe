"""What the live monitor of ``serve`` costs the engine: same-run A/B at 8 concurrent.

    python bench/monitor_cost.py [--model PATH] [--rounds 7] [--tokens 128] [--order-seed N]
    python bench/monitor_cost.py --model mock --rounds 2 --tokens 16      # a smoke run (seconds)

Two daemons on the same model, each in its own tmux terminal (160x50), so both have a
terminal for stdout: one with the monitor (the default in a terminal), one with ``--no-tui``.
Both stay up (the idle one costs nothing); each round runs both once, 8 distinct prompts at 8
concurrent, ``--tokens``-token replies with ignore_eos, in a seeded random order per round, so
drift hits both alike. Prints the median aggregate tok/s of each, the median of the per-round
ratios monitor/plain (the cost is 1 - ratio; the contract is <= 1%) with a 95% t-interval over
rounds, and the CPU seconds the daemon process itself (not its worker) and its terminal (a tmux
server each) spent per round. Needs a quiet machine for a number worth keeping; names the commit
it ran on.

**Raw log** (issue #42): JSON lines in bench-results/<commit>/monitor_cost_<UTC>.jsonl (``--out LOG``):
a header (the commit, the arguments, the machine, the versions, the round orders, both daemons' full
command lines), a record per request and per round (tok/s, the CPU seconds), an end record (the load,
the monitor's last screen). ``--render LOG [--doc PATH]`` prints its table, or writes it into the page
between ``<!-- bench/monitor_cost.py MODEL: begin ... -->`` and ``... end -->`` (a new block in
docs/monitor.md goes just above "What the monitor costs").

    python bench/monitor_cost.py --render LOG --doc docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (ROOT, JsonLog, commit, emit, free_port, interval, log_header,  # noqa: E402
                     log_path, machine, median, model_file, read_log, round_orders, round_records, run_line,
                     tokens_ok, versions)
from throughput import GREEDY, PROMPTS, burst, model_id, one_round  # noqa: E402

CONC = 8

class TmuxServer:
    """``superfluid serve`` in a detached tmux session of its own."""

    def __init__(self, name: str, model: str, port: int, *extra: str, threads: int) -> None:
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.session = f"sf-bench-{name}-{os.getpid()}"
        self.socket = self.session  # a tmux server each, so each terminal's CPU is its own
        self.sessions_dir = tempfile.mkdtemp(prefix=f"bench-monitor-{name}-")
        runtime = ["--runtime", "mock"] if model.startswith("mock") else []
        argv = [sys.executable, "-m", "superfluid", "serve", model, *runtime, "--http", f"127.0.0.1:{port}",
                "--sessions", self.sessions_dir, "--host-cache-mb", "0", "--threads", str(threads),
                "--log-level", "WARNING", *extra]
        self.argv = argv
        self.log = Path(self.sessions_dir) / "stderr.log"
        self.command = f"cd {shlex.quote(str(ROOT))} && PYTHONPATH={shlex.quote(str(ROOT))} {shlex.join(argv)} 2>{self.log}"
        subprocess.run(["tmux", "-L", self.socket, "new-session", "-d", "-s", self.session, "-x", "160", "-y", "50", self.command],
                       check=True)
        self.pid: int | None = None
        self.tmux_pid = int(subprocess.run(["tmux", "-L", self.socket, "display-message", "-p", "#{pid}"],
                                           capture_output=True, text=True, check=True).stdout)

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        else:
            raise RuntimeError(f"{self.name} not ready after {timeout}s; see {self.log}")
        for conn in psutil.net_connections("tcp"):
            if conn.laddr and conn.laddr.port == self.port and conn.status == psutil.CONN_LISTEN:
                self.pid = conn.pid
        if self.pid is None:
            raise RuntimeError(f"cannot find the process listening on {self.port}")

    def cpu(self) -> tuple[float, float]:
        """CPU seconds so far of the daemon process (not its worker) and of its tmux server."""
        daemon, tmux = psutil.Process(self.pid).cpu_times(), psutil.Process(self.tmux_pid).cpu_times()
        return daemon.user + daemon.system, tmux.user + tmux.system

    def screen(self) -> str:
        return subprocess.run(["tmux", "-L", self.socket, "capture-pane", "-p", "-t", self.session], capture_output=True,
                              text=True, check=False).stdout

    def stop(self) -> None:
        if self.pid is not None:
            try:
                psutil.Process(self.pid).terminate()
                psutil.Process(self.pid).wait(15)
            except psutil.Error:
                pass
        subprocess.run(["tmux", "-L", self.socket, "kill-session", "-t", self.session], check=False, capture_output=True)
        shutil.rmtree(self.sessions_dir, ignore_errors=True)


SIDES = ("monitor", "plain")
GEN = "bench/monitor_cost.py"
# where a new block goes in a page that has the hand-written table (docs/benchmarks.md: among the generated blocks)
BEFORE = {"monitor.md": "## What the monitor costs"}


def measure(args: argparse.Namespace) -> Path:
    """Run the A/B into a log; returns its path."""
    load = os.getloadavg()[0]
    rev = commit()
    out = args.out or log_path("monitor_cost", rev)
    seed = args.order_seed if args.order_seed is not None else random.SystemRandom().randrange(1 << 31)
    orders = round_orders(list(SIDES), args.rounds, seed)
    servers = {"monitor": TmuxServer("monitor", args.model, free_port(), threads=args.threads),
               "plain": TmuxServer("plain", args.model, free_port(), "--no-tui", threads=args.threads)}
    head = log_header(rev, args, load)
    head.update(machine=machine(), versions=versions(None), prompts=PROMPTS, sampling=GREEDY, conc=CONC,
                order_seed=seed, orders=orders, terminal="tmux 160x50, a tmux server per daemon",
                tmux=subprocess.run(["tmux", "-V"], capture_output=True, text=True, check=False).stdout.strip(),
                servers={name: {"argv": srv.argv, "command": srv.command} for name, srv in servers.items()})
    log = JsonLog(out, head)
    try:
        ids = {}
        for srv in servers.values():
            srv.wait_ready()
            ids[srv.name] = model_id(srv.url)
            trio.run(one_round, srv.url, ids[srv.name], CONC, 16)  # warm-up
        if "lanes " not in servers["monitor"].screen():
            raise RuntimeError("the monitor is not on screen:\n" + servers["monitor"].screen())
        for rnd, order in enumerate(orders):
            for pos, name in enumerate(order):
                srv = servers[name]
                before = srv.cpu()
                results, wall = burst(srv.url, ids[name], CONC, args.tokens, GREEDY)
                after = srv.cpu()
                recs = round_records(results, wall, round=rnd, position=pos, side=name)
                recs[-1].update(daemon_cpu_s=after[0] - before[0], tmux_cpu_s=after[1] - before[1])
                for rec in recs:
                    log.write(rec)
            print(f"  round {rnd} ({','.join(order)})", file=sys.stderr, flush=True)
        log.end(screen=servers["monitor"].screen())
    finally:
        log.close()
        for srv in servers.values():
            srv.stop()
    return out


def render(path: Path) -> tuple[str, str]:
    """The docs section of a log, and its block's key (the model's file name)."""
    recs = read_log(path)
    head = recs[0]
    a = head["args"]
    model = Path(a["model"]).name
    rounds = {(r["round"], r["side"]): r for r in recs if r["kind"] == "round"}
    done = sorted({n for n, _ in rounds if all((n, s) in rounds for s in SIDES)})
    ratios = [rounds[(n, "monitor")]["tok_s"] / rounds[(n, "plain")]["tok_s"] for n in done]

    def med(side: str, key: str) -> str:
        xs = [r[key] for (n, s), r in rounds.items() if s == side and n in done]
        return f"{median(xs):.{1 if key == 'tok_s' else 3}f}" if xs else "—"

    ratio = median(ratios) if ratios else None
    out = [f"## The monitor's cost, {model} (`python bench/monitor_cost.py --rounds {a['rounds']}`): issue #42\n",
           run_line(recs, path, GEN),
           f"Two daemons on the same model ({a['threads'] or 'default'} threads, no host cache), each in its own "
           f"terminal ({head['terminal']}; {head.get('tmux') or 'tmux'}): one draws the monitor, one runs with "
           f"`--no-tui`; both up throughout. {len(head['orders'])} rounds, each running both once in a seeded random "
           f"order (seed {head['order_seed']}): {len(head['prompts'])} distinct prompts at {head['conc']} concurrent, "
           f"{a['tokens']}-token greedy replies on /v1/completions with `ignore_eos`, tokens counted from each "
           "response's usage. A round's ratio is monitor/plain tok/s in that round; the cost is 1 - ratio (the "
           "contract: at most 1%). Tok/s and CPU columns are medians over rounds; the interval is a 95% t-interval "
           "on the rounds' log-ratios (both daemons stay up, so it is over rounds, not server pairs). CPU: seconds "
           "per round of the daemon process itself (not its worker) and of its tmux server.\n",
           "| monitor tok/s | `--no-tui` tok/s | monitor/plain, median of rounds | geometric mean (95% interval) "
           "| rounds below 1.00 | cost | daemon CPU s/round monitor / plain | tmux CPU s/round monitor / plain "
           "| tokens |",
           "|---|---|---|---|---|---|---|---|---|",
           f"| {med('monitor', 'tok_s')} | {med('plain', 'tok_s')} | "
           + (f"{ratio:.4f}" if ratio is not None else "—") + f" | {interval(ratios, 4)} | "
           f"{sum(r < 1 for r in ratios)} of {len(ratios)} | "
           + (f"{(1 - ratio) * 100:+.2f}%" if ratio is not None else "—")
           + f" | {med('monitor', 'daemon_cpu_s')} / {med('plain', 'daemon_cpu_s')} | "
           f"{med('monitor', 'tmux_cpu_s')} / {med('plain', 'tmux_cpu_s')} | {tokens_ok(recs, a['tokens'])} |",
           "", "Each round (order: the side that ran first named first):", "",
           "| round | order | monitor tok/s | plain tok/s | monitor/plain |", "|---|---|---|---|---|"]
    for n in done:
        m, q = rounds[(n, "monitor")]["tok_s"], rounds[(n, "plain")]["tok_s"]
        out.append(f"| {n} | {', '.join(head['orders'][n])} | {m:.1f} | {q:.1f} | {m / q:.4f} |")
    return "\n".join(out) + "\n", model


def main() -> int:
    p = argparse.ArgumentParser(prog="python bench/monitor_cost.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(Path.home() / ".superfluid/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--order-seed", type=int)
    p.add_argument("--out", type=Path, help="the log (default bench-results/<commit>/monitor_cost_<UTC>.jsonl)")
    p.add_argument("--render", type=Path, metavar="LOG", help="print the markdown section of a log and exit")
    p.add_argument("--doc", type=Path, metavar="PATH", help="with --render: write the section into this page")
    args = p.parse_args()
    if args.render:
        section, key = render(args.render)
        emit(GEN, section, key, args.doc, before=BEFORE.get(args.doc.name) if args.doc else None)
        return 0
    if not args.model.startswith("mock"):
        args.model = model_file(args.model)
    if shutil.which("tmux") is None:
        sys.exit("monitor_cost: needs tmux (the monitor draws only on a terminal)")
    out = measure(args)
    print(f"log: {out}", file=sys.stderr)
    print(render(out)[0], end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
