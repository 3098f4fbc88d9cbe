"""What the live monitor of ``serve`` costs the engine: same-run A/B at 8 concurrent.

    python bench/monitor_cost.py [--model PATH] [--rounds 7] [--tokens 128] [--order-seed N]
    python bench/monitor_cost.py --model mock --rounds 2 --tokens 16      # a smoke run (seconds)

Two daemons on the same model, each in its own tmux terminal (160x50), so both have a
terminal for stdout: one with the monitor (the default in a terminal), one with ``--no-tui``.
Both stay up (the idle one costs nothing); each round runs both once, 8 distinct prompts at 8
concurrent, ``--tokens``-token replies with ignore_eos, in a seeded random order per round, so
drift hits both alike. Prints the median aggregate tok/s of each, the median of the per-round
ratios monitor/plain (the cost is 1 - ratio; the contract is <= 1%), and the CPU seconds the
daemon process itself (not its worker) and its terminal (a tmux server each) spent per round. Needs a quiet machine for a
number worth keeping; names the commit it ran on.
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
from _common import ROOT, commit, free_port, median, model_file, round_orders  # noqa: E402
from throughput import model_id, one_round  # noqa: E402




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
        self.log = Path(self.sessions_dir) / "stderr.log"
        command = f"cd {shlex.quote(str(ROOT))} && PYTHONPATH={shlex.quote(str(ROOT))} {shlex.join(argv)} 2>{self.log}"
        subprocess.run(["tmux", "-L", self.socket, "new-session", "-d", "-s", self.session, "-x", "160", "-y", "50", command],
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(Path.home() / ".superfluid/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--order-seed", type=int)
    args = p.parse_args()
    args.model = model_file(args.model)
    if shutil.which("tmux") is None:
        sys.exit("monitor_cost: needs tmux (the monitor draws only on a terminal)")
    servers = {"monitor": TmuxServer("monitor", args.model, free_port(), threads=args.threads),
               "plain": TmuxServer("plain", args.model, free_port(), "--no-tui", threads=args.threads)}
    rates: dict[str, list[float]] = {name: [] for name in servers}
    cpu: dict[str, list[float]] = {name: [] for name in servers}
    term: dict[str, list[float]] = {name: [] for name in servers}
    try:
        ids = {}
        for srv in servers.values():
            srv.wait_ready()
            ids[srv.name] = model_id(srv.url)
            trio.run(one_round, srv.url, ids[srv.name], 8, 16)  # warm-up
        if "lanes " not in servers["monitor"].screen():
            raise RuntimeError("the monitor is not on screen:\n" + servers["monitor"].screen())
        seed = args.order_seed if args.order_seed is not None else random.SystemRandom().randrange(1 << 31)
        orders = round_orders(list(servers), args.rounds, seed)
        for order in orders:
            for name in order:
                srv = servers[name]
                before = srv.cpu()
                rates[name].append(trio.run(one_round, srv.url, ids[name], 8, args.tokens)[0])
                after = srv.cpu()
                cpu[name].append(after[0] - before[0])
                term[name].append(after[1] - before[1])
            print("  round: " + ", ".join(f"{n} {rates[n][-1]:.1f} tok/s" for n in servers), flush=True)
    finally:
        for srv in servers.values():
            srv.stop()
    ratios = [m / q for m, q in zip(rates["monitor"], rates["plain"], strict=True)]
    print(f"commit {commit()}; model {Path(args.model).name}; 8 concurrent, {args.tokens}-token replies, "
          f"{args.rounds} rounds; order (seed {seed}): " + " | ".join(",".join(o) for o in orders))
    print("| monitor tok/s | --no-tui tok/s | monitor/plain (median of rounds) | cost | daemon CPU s/round "
          "monitor | plain | terminal (tmux) CPU s/round monitor | plain |")
    print("|---|---|---|---|---|---|---|---|")
    ratio = median(ratios)
    print(f"| {median(rates['monitor']):.1f} | {median(rates['plain']):.1f} | {ratio:.4f} | {(1 - ratio) * 100:+.2f}% "
          f"| {median(cpu['monitor']):.3f} | {median(cpu['plain']):.3f} "
          f"| {median(term['monitor']):.3f} | {median(term['plain']):.3f} |")
    print("rounds:", {name: [round(x, 1) for x in r] for name, r in rates.items()})


if __name__ == "__main__":
    main()
