"""The cell loop: every (scenario, system) pair, one result file each.

``<out>/<scenario>--<system>.json`` is written atomically when a cell ends;
a cell whose file exists is skipped, so re-running the same command resumes.
``<out>/manifest.json`` records the machine, versions, scale and times; each
cell records the commit it ran on (``rev``, ``-dirty`` with uncommitted
changes) and the manifest lists every commit its cells ran on (``revs``), so a
resumed run that spans commits is visible in the report.
``<out>/.suite.lock`` keeps two drivers out of one directory.

``repeat`` (``--repeat N``) runs each cell N times: the file then lists every run (``runs``:
each its verdict, headline, reason and numbers) and its verdict is the majority of the runs
(``inconclusive`` where no verdict has more than half), its headline and numbers those of the
first run that gave it. The file is rewritten after each run, so a resumed run goes on from the
runs already recorded.
"""

from __future__ import annotations

import datetime as dt
import glob
import json
import os
import platform
import subprocess
import time
import traceback
from importlib import metadata
from pathlib import Path
from typing import Any, Awaitable, Callable

import attrs
import psutil
import trio

from ._behaviour import client_disconnect, tool_session
from ._conditions import majority
from ._corpus import SCALES
from ._faults import daemon_restart, unload_reload, worker_kill
from ._load import agents_interactive, kv_exhaustion, shared_prefix
from ._process import Context, ScenarioError, StartFailed
from ._systems import attached_spec, load_box, system_spec

__all__ = ["SCENARIOS", "RunOptions", "combine_runs", "run"]

SCENARIOS: dict[str, Callable[[Context], Awaitable[dict[str, Any]]]] = {
    "worker_kill": worker_kill, "daemon_restart": daemon_restart, "agents_interactive": agents_interactive,
    "kv_exhaustion": kv_exhaustion, "unload_reload": unload_reload, "tool_session": tool_session,
    "client_disconnect": client_disconnect, "shared_prefix": shared_prefix,
}


@attrs.frozen(kw_only=True)
class RunOptions:
    systems: tuple[str, ...]
    scenarios: tuple[str, ...] = tuple(SCENARIOS)
    scale: str = "full"
    out: Path | None = None
    box: str | None = None
    url: str | None = None
    cooldown_s: float | None = None
    repeat: int = 1


_RUN_KEYS = ("verdict", "headline", "reason", "check", "numbers", "features", "seconds", "therm_after", "finished",
             "rev", "error", "trace")


def combine_runs(runs: list[dict[str, Any]], repeat: int) -> dict[str, Any]:
    """One cell's file from its runs: with ``repeat`` 1 the run itself; else the majority verdict,
    the headline, reason and numbers of the first run that gave it, and every run under ``runs``."""
    if repeat == 1 and len(runs) == 1:
        return runs[0]
    verdicts = [r["verdict"] for r in runs]
    verdict = majority(verdicts)
    chosen = next((r for r in runs if r["verdict"] == verdict), runs[0])
    out = {k: v for k, v in chosen.items() if k not in ("runs",)}
    said = ", ".join(verdicts)
    out.update(verdict=verdict, repeat=repeat, runs=[{k: r[k] for k in _RUN_KEYS if k in r} for r in runs],
               headline=f"{chosen.get('headline') or ''} [runs: {said}]")
    if verdict == "inconclusive" and chosen["verdict"] != "inconclusive":
        out["reason"] = f"no verdict in more than half of {len(runs)} runs ({said})"
    elif verdict == "pass":
        out["reason"] = ""
    return out


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).astimezone().isoformat(timespec="seconds")


def thermal() -> str:
    """Hottest /sys/class/thermal zone, or "n/a"."""
    temps = []
    for path in glob.glob("/sys/class/thermal/thermal_zone*/temp"):
        try:
            temps.append(int(Path(path).read_text().strip()) / 1000.0)
        except (OSError, ValueError):
            continue
    return f"{max(temps):.0f}C" if temps else "n/a"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _git_rev() -> str | None:
    here = Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=False).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{rev}{'-dirty' if dirty else ''}" if rev else None


def machine() -> dict[str, Any]:
    return {"host": platform.node(), "platform": platform.platform(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "python": platform.python_version()}


def _parse_url(url: str) -> int:
    from urllib.parse import urlsplit

    parts = urlsplit(url if "//" in url else f"http://{url}")
    if parts.hostname not in ("127.0.0.1", "localhost") or parts.port is None:
        raise SystemExit(f"--url must be http://127.0.0.1:PORT (the suite only talks to this machine), not {url!r}")
    return parts.port


class _Lock:
    def __init__(self, out: Path) -> None:
        self.path = out / ".suite.lock"

    def __enter__(self) -> _Lock:
        if self.path.exists():
            try:
                pid = int(self.path.read_text().strip() or 0)
            except (OSError, ValueError):
                pid = 0
            if pid and pid != os.getpid() and psutil.pid_exists(pid):
                raise SystemExit(f"another suite run (pid {pid}) is using {self.path.parent}")
        self.path.write_text(str(os.getpid()))
        return self

    def __exit__(self, *exc: object) -> None:
        self.path.unlink(missing_ok=True)


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)


async def _cell(ctx: Context, scenario: str) -> dict[str, Any]:
    limit = ctx.scale.cell_limit_s
    try:
        with trio.move_on_after(limit):
            return await SCENARIOS[scenario](ctx)
        why = f"the cell ran past its {limit:.0f} s limit"
        return {"verdict": "error", "headline": f"error: {why}", "reason": why, "numbers": {}}
    except StartFailed as exc:
        return {"verdict": "error", "headline": f"error: did not start: {exc}"[:300],
                "reason": f"did not start: {exc}", "numbers": {}}
    except ScenarioError as exc:
        return {"verdict": "error", "headline": f"error: {exc}"[:300], "reason": str(exc), "numbers": {}}
    except Exception as exc:  # noqa: BLE001 - boundary: one cell; the suite goes on to the next
        return {"verdict": "error", "headline": f"error: {exc!r}"[:300], "reason": repr(exc),
                "error": repr(exc), "trace": traceback.format_exc(), "numbers": {}}


async def run(opts: RunOptions) -> int:
    """Run every cell not already done. Returns the number of cells that did not pass (n/a excluded)."""
    scale = SCALES[opts.scale]
    box = load_box(opts.box)
    url_port = _parse_url(opts.url) if opts.url else None
    out = opts.out or Path("suite-results") / f"{dt.date.today().isoformat()}-{box.name}-{opts.scale}"
    out.mkdir(parents=True, exist_ok=True)
    run_dir = (out / "run").resolve()
    cooldown = scale.cooldown_s if opts.cooldown_s is None else opts.cooldown_s
    specs = {name: (attached_spec(name, url_port) if url_port is not None
                    else system_spec(name, box, mock_spec=scale.mock_spec)) for name in opts.systems}
    bad = 0
    rev = _git_rev()
    with _Lock(out):
        manifest_path = out / "manifest.json"
        resumed = manifest_path.exists()
        manifest = json.loads(manifest_path.read_text()) if resumed else {}
        manifest.update({
            "suite": "superfluid.suite", "box": box.name, "machine": machine(), "scale": opts.scale,
            "versions": {"superfluid": _version("superfluid"), "superfluid_rev": rev, "trio": _version("trio"),
                         "h11": _version("h11"), "llama-cpp-python": _version("llama_cpp_python"),
                         **box.versions},
            "systems": list(opts.systems),
            "argv": {name: [str(a) for a in spec.argv] for name, spec in specs.items()},
            "scenarios": list(opts.scenarios), "url": opts.url, "repeat": opts.repeat,
            "started": manifest.get("started") or _now(), "finished": None,
            "revs": sorted({*manifest.get("revs", []), str(rev)}),  # every commit a cell here ran on
        })
        if resumed:
            manifest["resumed"] = _now()
        _write_json(manifest_path, manifest)
        cells = [(sc, sy) for sc in opts.scenarios for sy in opts.systems]
        for k, (scenario, system) in enumerate(cells):
            path = out / f"{scenario}--{system}.json"
            tag = f"[{scenario} / {system}]"
            prior = json.loads(path.read_text()) if path.exists() else None
            runs: list[dict[str, Any]] = [] if prior is None else list(prior.get("runs") or [prior])
            if prior is not None and len(runs) >= opts.repeat:
                print(f"{tag} done before: {prior.get('verdict')}", flush=True)
                bad += prior.get("verdict") in ("fail", "error")
                continue
            while len(runs) < opts.repeat:
                which = f" run {len(runs) + 1}/{opts.repeat}" if opts.repeat > 1 else ""
                print(f"{tag}{which} start  therm: {thermal()}", flush=True)
                ctx = Context(spec=specs[system], scale=scale, run_dir=run_dir, url_port=url_port,
                              note=lambda line: print(line, flush=True))
                t0 = time.monotonic()
                res = await _cell(ctx, scenario)
                res.update(scenario=scenario, system=system, scale=opts.scale,
                           seconds=round(time.monotonic() - t0, 2), therm_after=thermal(), finished=_now(), rev=rev)
                res["reason"] = " ".join(str(res.get("reason") or "").split())  # one line, always
                runs.append(res)
                _write_json(path, combine_runs(runs, opts.repeat))
                said = res.get("reason") if res["verdict"] in ("fail", "error") else res.get("headline")
                print(f"{tag}{which} {res['verdict']}: {said}", flush=True)
                if cooldown and (k < len(cells) - 1 or len(runs) < opts.repeat):
                    await trio.sleep(cooldown)
            verdict = combine_runs(runs, opts.repeat)["verdict"]
            bad += verdict in ("fail", "error")
            if opts.repeat > 1:
                print(f"{tag} {verdict} (majority of {', '.join(r['verdict'] for r in runs)})", flush=True)
        manifest["finished"] = _now()
        _write_json(manifest_path, manifest)
    print(f"SUITE-DONE {out}", flush=True)
    return bad
