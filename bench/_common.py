"""Shared benchmark plumbing: start a server in its own process group, wait for
it, stream completions with timestamps, stop it. Loopback only.

Equal setups: :func:`llama_server_argv` gives llama-server the KV cells our
worker allocates for the same lanes and context (``kv_cells``: ``max(4,
lanes + 2)`` sequences of ``ctx``), and :func:`superfluid_argv` runs ours
with ``--host-cache-mb 0`` unless a script says otherwise in its table (llama-server
with ``--cache-ram 0``: neither keeps prompts in host memory).
:func:`commit` and :func:`round_orders` name what each printed table ran on.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from superfluid.suite._systems import kv_cells  # noqa: E402  (one sizing rule, shared with the suite)
from superfluid.client import aiter_sse  # noqa: E402  (the one SSE reader)
from superfluid.models import cache_dir  # noqa: E402  (where pulled and embedded models live)


def commit(tree: Path = ROOT) -> str:
    """``git rev-parse --short HEAD`` of this checkout (or ``tree``), ``-dirty`` with uncommitted changes
    outside docs/ (a run of several benches renders each one's table into the docs before the next starts:
    that measures the same code)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True,
                              check=False).stdout.strip()

    rev = git("rev-parse", "--short", "HEAD") or "unknown"
    return rev + ("-dirty" if git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs") else "")


def round_orders(names: list[str], rounds: int, seed: int) -> list[list[str]]:
    """A seeded random order of ``names`` for each round (no side always goes first)."""
    rng = random.Random(seed)
    return [rng.sample(names, len(names)) for _ in range(rounds)]


def round_order(sides: list[str], pair: int, rnd: int, rng: random.Random | None) -> list[str]:
    """A B B A: forward in even rounds, reversed in odd ones, a pair's first round alternating by pair;
    with ``rng``, a random order."""
    if rng is not None:
        return rng.sample(sides, len(sides))
    return list(sides) if (pair + rnd) % 2 == 0 else sides[::-1]


def llama_server_argv(binary: str, model: str, port: int, *, lanes: int, ctx: int, threads: int,
                      slots: int | None = None) -> list[str]:
    """llama-server with as many KV cells as our worker allocates for ``lanes`` x ``ctx``,
    split over ``slots`` (default ``lanes``) parallel slots, and no host-memory prompt cache
    (``--cache-ram 0``; its default is 8 GiB), as ours runs with ``--host-cache-mb 0``."""
    return [binary, "-m", model, "-c", str(kv_cells(lanes, ctx)), "-np", str(slots or lanes), "-t", str(threads),
            "--cache-ram", "0", "--metrics", "--host", "127.0.0.1", "--port", str(port)]


def model_file(arg: str) -> str:
    """A GGUF given as a path, or by its name in the models cache (``~/.superfluid/models``, or
    ``$SUPERFLUID_HOME/models``; with or without ``.gguf``); anything else ends the script with one
    line, not a traceback."""
    home = cache_dir()
    for cand in (Path(arg).expanduser(), home / arg, home / f"{arg}.gguf"):
        if cand.is_file():
            return str(cand)
    raise SystemExit(f"no model file {arg!r} (a path, or a name under {home})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, name: str, argv: list[str], port: int, env: dict[str, str] | None = None,
                 log: Path | None = None, cwd: str | None = None) -> None:
        self.name, self.argv, self.port = name, argv, port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log or Path(f"/tmp/bench-{name}-{port}.log")
        self.proc = subprocess.Popen(argv, stdout=open(self.log, "wb"), stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, **(env or {})}, cwd=cwd)

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited early; see {self.log}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{self.name} not ready after {timeout}s")

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()


def superfluid_argv(model: str, port: int | str, *extra: str, host_cache_mb: int = 0) -> list[str]:
    """Our daemon; its own fresh sessions directory unless ``extra`` names one (the default
    directory may be held by another server on a shared machine)."""
    sessions = [] if "--sessions" in extra else ["--sessions", tempfile.mkdtemp(prefix="bench-sessions-")]
    return [sys.executable, "-m", "superfluid", "serve", model, "--http", f"127.0.0.1:{port}", "--no-tui",
            "--log-level", "WARNING", "--host-cache-mb", str(host_cache_mb), *sessions, *extra]


async def stream_request(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                         headers: dict[str, str] | None = None) -> dict[str, Any]:
    """Stream one request; returns ttft, wall, tokens (chunks with text), usage, error, the text and
    our ``superfluid.spec`` (speculation counts) if the server sent one."""
    t0 = trio.current_time()
    out: dict[str, Any] = {"ttft": None, "tokens": 0, "usage": None, "timings": None, "error": None, "stamps": [],
                           "spec": None, "text": []}
    async with client.stream("POST", path, json={**body, "stream": True}, headers=headers or {}) as r:
        if r.status_code != 200:
            out["error"] = f"http {r.status_code}: {(await r.aread())[:200]!r}"
            out["text"] = ""
            return out
        async for event in aiter_sse(r.aiter_bytes()):
            if not event.data or event.data == "[DONE]":
                continue
            obj = event.json()
            if "error" in obj:
                out["error"] = obj["error"]
                continue
            if obj.get("usage"):
                out["usage"] = obj["usage"]
            if obj.get("timings"):  # llama-server: prompt_n = prompt tokens it prefilled
                out["timings"] = obj["timings"]
            out["spec"] = (obj.get("superfluid") or {}).get("spec") or out["spec"]
            for ch in obj.get("choices") or []:
                text = ch.get("text") or (ch.get("delta") or {}).get("content")
                if text:
                    out["text"].append(text)
                    now = trio.current_time()
                    if out["ttft"] is None:
                        out["ttft"] = now - t0
                    out["tokens"] += 1
                    out["stamps"].append(now - t0)
    out["text"] = "".join(out["text"])
    out["wall"] = trio.current_time() - t0
    return out


async def completions_burst(url: str, model: str, prompts: list[str], tokens: int, sampling: dict[str, Any], *,
                            concurrency: int | None = None, http_timeout_s: float = 600) -> tuple[list[dict[str, Any]], float]:
    """Stream one ``/v1/completions`` request per prompt (``ignore_eos``, ``seed`` offset by the
    prompt's index), at most ``concurrency`` at once; returns the results and the wall time.
    No keep-alive: llama-server drops idle connections between rounds, and both sides get the
    same client. Each result names its prompt (``index``). Raises RuntimeError if any request failed."""
    results: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=url, timeout=http_timeout_s,
                                 limits=httpx.Limits(max_keepalive_connections=0)) as client:
        limiter = trio.CapacityLimiter(concurrency or len(prompts))

        async def one(i: int) -> None:
            async with limiter:
                body = {"model": model, "prompt": prompts[i], "max_tokens": tokens, **sampling, "ignore_eos": True,
                        "stream_options": {"include_usage": True}}
                if "seed" in body:
                    body["seed"] += i
                out = await stream_request(client, "/v1/completions", body)
                out["index"] = i
                results.append(out)

        t0 = trio.current_time()
        async with trio.open_nursery() as n:
            for i in range(len(prompts)):
                n.start_soon(one, i)
        wall = trio.current_time() - t0
    errors = [r["error"] for r in results if r["error"]]
    if errors:
        raise RuntimeError(f"{url}: {errors[:2]}")
    return results, wall


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def median_ci(xs: list[float], level: float = 0.95, resamples: int = 10000, seed: int = 0) -> tuple[float, float]:
    """A percentile-bootstrap confidence interval for the median of ``xs`` (seeded, so a report reproduces)."""
    rng = random.Random(seed)
    meds = sorted(median(rng.choices(xs, k=len(xs))) for _ in range(resamples))
    tail = (1 - level) / 2
    return meds[int(tail * resamples)], meds[min(resamples - 1, int((1 - tail) * resamples))]


def median_range(xs: list[float], fmt: str) -> str:
    """A table cell: the median of ``xs`` with its min-max in brackets (one value alone; none: empty)."""
    if not xs:
        return ""
    if len(xs) == 1:
        return format(xs[0], fmt)
    return f"{format(median(xs), fmt)} ({format(min(xs), fmt)}-{format(max(xs), fmt)})"


def ratio_cell(ratios: list[float]) -> str:
    """The median of per-round ratios; from five rounds on, with its 95% interval and how many rounds were >= 1."""
    cell = f"{median(ratios):.2f}"
    if len(ratios) >= 5:
        lo, hi = median_ci(ratios)
        cell += f" (95% CI {lo:.2f}-{hi:.2f}; >= 1 in {sum(r >= 1 for r in ratios)}/{len(ratios)})"
    return cell


# Student's t, 97.5th percentile, by degrees of freedom (beyond 30: the Cornish-Fisher expansion)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def log_t_interval(ratios: list[float]) -> tuple[float, float, float] | None:
    """The geometric mean of ``ratios`` (one per pair) and its 95% t-interval: the mean of the
    log-ratios +- t(0.975, n-1) x their standard error, exponentiated. None under two pairs."""
    n = len(ratios)
    if n < 2:
        return None
    logs = [math.log(r) for r in ratios]
    mean = sum(logs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    half = t975(n - 1) * sd / math.sqrt(n)
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def interval_cell(ratios: list[float]) -> str:
    """A table cell: the geometric mean of per-pair ratios and its 95% interval (one pair: none)."""
    return "— (one pair)" if len(ratios) < 2 else interval(ratios)


def side_rates(recs: list[dict[str, Any]]) -> dict[tuple[int, int, str], float]:
    """(pair, concurrency, side) -> the median of that side's rounds' tok/s in that pair (a log's
    ``round`` records: pair, conc, side, tok_s)."""
    got: dict[tuple[int, int, str], list[float]] = {}
    for r in recs:
        if r["kind"] == "round":
            got.setdefault((r["pair"], r["conc"], r["side"]), []).append(r["tok_s"])
    return {k: median(v) for k, v in got.items()}


def pair_ratios(recs: list[dict[str, Any]], conc: int, ours: str, theirs: str) -> list[float]:
    """One ratio per pair at ``conc``: ``ours``'s tok/s over ``theirs``'s, both from that pair."""
    rates = side_rates(recs)
    pairs = sorted({p for p, c, _s in rates if c == conc})
    return [rates[(p, conc, ours)] / rates[(p, conc, theirs)] for p in pairs
            if (p, conc, ours) in rates and (p, conc, theirs) in rates]


def token_check(recs: list[dict[str, Any]], conc: int, sides: list[str], want: int) -> str:
    """A table cell: every ``request`` record's completion_tokens at ``conc`` against ``want``
    ("ok: N of N = want"), or a bold MISMATCH naming how many each side got wrong."""
    reqs = [r for r in recs if r["kind"] == "request" and r["conc"] == conc]
    bad = {s: sum(r["completion_tokens"] != want for r in reqs if r["side"] == s) for s in sides}
    if not any(bad.values()):
        return f"ok: {len(reqs)} of {len(reqs)} = {want}"
    return "**MISMATCH**: " + ", ".join(
        f"{s} {n} of {sum(r['side'] == s for r in reqs)} ≠ {want}" for s, n in bad.items() if n)


def machine() -> dict[str, Any]:
    """Cores, memory, kernel, transparent huge pages and the load averages now (a log's header)."""
    def read(path: str) -> str:
        try:
            return Path(path).read_text().strip()
        except OSError:
            return "?"

    mem = next((int(x.split()[1]) for x in read("/proc/meminfo").splitlines() if x.startswith("MemTotal:")), 0)
    return {"cores": os.cpu_count(), "mem_gib": round(mem / 2**20, 1), "kernel": platform.release(),
            "thp": read("/sys/kernel/mm/transparent_hugepage/enabled"),
            "thp_defrag": read("/sys/kernel/mm/transparent_hugepage/defrag"), "loadavg": list(os.getloadavg())}


def shown(path: Path) -> str:
    """A log's path as a generated docs block names it: relative to the repository when inside it."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def write_doc(doc: Path, section: str, begin: str, end: str, before: str | None = None) -> None:
    """Put ``section`` between the markers ``begin`` and ``end`` in ``doc`` (replacing what is
    there), or, for a new block, just before the line ``before`` where the page has it, else first
    after the preamble."""
    text = doc.read_text()
    block = f"{begin}\n{section}{end}\n"
    at = text.find("\n" + before + "\n") if before else -1
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1].lstrip("\n")
    elif at >= 0:
        text = text[:at + 1] + block + "\n" + text[at + 1:]
    else:
        # before the first section, or the first generated block if one comes sooner (never inside it)
        found = [i for i in (text.find("\n## "), text.find("\n<!-- bench/")) if i >= 0]
        at = min(found) if found else -1
        text = text + "\n" + block if at < 0 else text[:at + 1] + block + "\n" + text[at + 1:]
    doc.write_text(text)


def log_header(rev: str, args: Any, load: float) -> dict[str, Any]:
    """The first record of a bench's JSON-lines log: the commit, the arguments (paths as text;
    not the output and render ones), when, the CPU and the load it started under."""
    cpu = next((x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines()
                if x.startswith("model name")), "?")
    return {"kind": "header", "commit": rev,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                     if k not in ("out", "render", "doc")},
            "started": f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M:%S} UTC",
            "cpu": f"{cpu} ({os.cpu_count()} cores)", "loadavg": load}


# -- raw logs and their generated blocks (issue #42) --------------------------------------------------------------

def interval(ratios: list[float], digits: int = 3) -> str:
    """``log_t_interval`` as a table cell: ``gm (lo-hi)``, or a dash under two ratios."""
    ci = log_t_interval(ratios)
    return f"— (one {'ratio' if ratios else 'none'})" if ci is None else (
        f"{ci[0]:.{digits}f} ({ci[1]:.{digits}f}-{ci[2]:.{digits}f})")


def utc(stamp: str = "%Y-%m-%d %H:%M:%S UTC") -> str:
    return f"{datetime.datetime.now(datetime.UTC):{stamp}}"


def log_path(name: str, rev: str) -> Path:
    """Where a bench's raw log goes by default: bench-results/<commit>/<name>_<UTC>.jsonl."""
    return ROOT / "bench-results" / rev / f"{name}_{utc('%Y%m%dT%H%M%SZ')}.jsonl"


def versions(binary: str | None, packages: tuple[str, ...] = ()) -> dict[str, Any]:
    """This checkout's commit, llama-cpp-python's and Python's versions, each of ``packages`` installed
    (by its distribution name; absent ones left out), and ``binary --version`` (a llama-server) if given."""
    import llama_cpp

    out: dict[str, Any] = {"superfluid": commit(), "llama_cpp_python": llama_cpp.__version__,
                           "python": platform.python_version()}
    for name in packages:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    if binary:
        got = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False,
                             env={**os.environ, "LD_LIBRARY_PATH": str(Path(binary).parent)})
        out["llama_server"] = " / ".join(x.strip() for x in (got.stdout + got.stderr).splitlines() if x.strip())
    return out


class JsonLog:
    """A bench's raw log, JSON lines: ``head`` first, then a record per :meth:`write` (flushed, so a
    run cut short keeps what it measured), and an end record (the load, the time) on :meth:`end`."""

    def __init__(self, path: Path, head: dict[str, Any]) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "w")
        self.write(head)

    def write(self, rec: dict[str, Any]) -> None:
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()

    def end(self, **extra: Any) -> None:
        self.write({"kind": "end", "loadavg": list(os.getloadavg()), "ended": utc(), **extra})
        self._f.close()

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> JsonLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()   # a run cut short keeps its records, without an end record


def read_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def marks(gen: str, key: str = "") -> tuple[str, str]:
    """The begin and end markers of ``gen``'s generated block (``gen``: ``bench/X.py``) keyed ``key``."""
    name = f"{gen} {key}".rstrip()
    return (f"<!-- {name}: begin (generated by `python {gen} --render LOG --doc PATH`) -->",
            f"<!-- {name}: end -->")


def emit(gen: str, section: str, key: str, doc: Path | None, before: str | None = None) -> None:
    """Print ``section``, or with ``doc`` write it into that page as ``gen``'s block keyed ``key``."""
    if doc is None:
        print(section, end="")
        return
    write_doc(doc, section, *marks(gen, key), before=before)


def run_line(recs: list[dict[str, Any]], path: Path, gen: str) -> str:
    """The sentence naming a log's commit, time, machine, load and versions, and how its block was made
    (``recs``: the log's records, its header first)."""
    head = recs[0]
    m, v = head["machine"], head["versions"]
    end = next((r for r in recs if r["kind"] == "end"), None)
    return (f"At `{head['commit']}`, {head['started']}, on {head['cpu']}, {m['mem_gib']} GiB, Linux {m['kernel']}, "
            f"transparent huge pages `{m['thp']}`; 1-minute load average {head['loadavg']:.2f} at the start"
            + (f", {end['loadavg'][0]:.2f} at the end" if end else " (the run did not finish)")
            + f" ({path.name}). Versions: llama-cpp-python {v['llama_cpp_python']}, Python {v['python']}"
            + (f", llama-server {v['llama_server']}" if v.get("llama_server") else "")
            + f". Generated by `python {gen} --render {shown(path)}` from that log.\n")


def round_records(results: list[dict[str, Any]], wall: float, **where: Any) -> list[dict[str, Any]]:
    """A measured round as log records: one per request (prompt index, ``completion_tokens`` from its
    usage, chunks, TTFT, wall), then the round's (tokens, wall, tok/s, median TTFT), each with ``where``
    (round, side, ...). Tokens are the usage's count where the server sent one, else chunks."""
    recs, counted = [], 0
    for r in sorted(results, key=lambda r: r.get("index", 0)):
        n = (r["usage"] or {}).get("completion_tokens")
        counted += n if n is not None else r["tokens"]
        recs.append({"kind": "request", **where, "prompt": r.get("index"), "completion_tokens": n,
                     "chunks": r["tokens"], "ttft": r["ttft"], "wall": r["wall"]})
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    recs.append({"kind": "round", **where, "tokens": counted, "wall": wall, "tok_s": counted / wall,
                 "ttft_median": median(ttfts) if ttfts else None})
    return recs


def tokens_ok(recs: list[dict[str, Any]], want: int, **where: Any) -> str:
    """``ok: n of n = want`` when every request record matching ``where`` got ``want`` tokens, else the misses."""
    reqs = [r for r in recs if r["kind"] == "request" and all(r.get(k) == v for k, v in where.items())]
    bad = [r for r in reqs if r["completion_tokens"] != want]
    if not bad:
        return f"ok: {len(reqs)} of {len(reqs)} = {want}"
    return f"**MISMATCH**: {len(bad)} of {len(reqs)} ≠ {want}"
