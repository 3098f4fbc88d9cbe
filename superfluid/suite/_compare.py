"""``compare``: result directories -> one Markdown report (docs/suite-results.md is this output,
regenerated, never edited by hand).

The commit(s) the cells ran on (each cell records its own; older cells fall
back to their directory's manifest), flagged when they differ; a manifest
bullet per directory; the headline: each system's passes on the scenarios every
system ran (a pass, a fail or an error for each: not ``n/a``, not
``inconclusive``), so systems are scored on one denominator; a grid (scenario x
system: ``pass``, ``**FAIL**``, ``n/a``, ``error``, ``inconclusive``) with that
row, each system's own total (passes over applicable cells) beside it, and its
fails, inconclusives, errors and ``n/a`` counted apart; the feature
rows (reported beside the scored grid, never in its totals: ``agents_interactive``
with QoS headers, ``daemon_restart`` resume by id); then one section per scenario: its pass condition, and per system the mark, the
headline, the one-line reason when it did not pass, the runs where a cell ran
more than once (its verdict is their majority) and the result file.

Every judged run (pass, fail, inconclusive) is judged again from its recorded
numbers under the current checks, so a stricter rule applies to old result
files too; where that changes the recorded verdict the section says so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ._conditions import CONDITIONS, majority, rejudge

__all__ = ["MARKS", "cell_commits", "cell_verdict", "compare", "load_results", "scores"]

MARKS = {"pass": "pass", "fail": "**FAIL**", "unsupported": "n/a", "error": "error", "inconclusive": "inconclusive"}
_ORDER = list(CONDITIONS)


def load_results(dirs: list[Path]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(manifests, cells); each cell carries ``_file`` and ``_column``."""
    manifests: list[dict[str, Any]] = []
    cells: list[dict[str, Any]] = []
    for d in dirs:
        mpath = d / "manifest.json"
        manifest = json.loads(mpath.read_text()) if mpath.exists() else {}
        manifest["_dir"] = str(d)
        manifests.append(manifest)
        for f in sorted(d.glob("*--*.json")):
            try:
                cell = json.loads(f.read_text())
            except ValueError:
                continue
            if not isinstance(cell, dict) or "verdict" not in cell:
                continue
            scenario, _, system = f.stem.partition("--")
            cell.setdefault("scenario", scenario)
            cell.setdefault("system", system)
            cell["_file"] = str(f)
            cell["_dir"] = d.name
            cell.setdefault("rev", (manifest.get("versions") or {}).get("superfluid_rev"))
            cells.append(cell)
    systems_per_dir: dict[str, set[str]] = {}
    for c in cells:
        systems_per_dir.setdefault(c["system"], set()).add(c["_dir"])
    for c in cells:
        c["_column"] = c["system"] if len(systems_per_dir[c["system"]]) == 1 else f"{c['system']} [{c['_dir']}]"
    return manifests, cells


def _manifest_line(m: dict[str, Any]) -> str:
    mach = m.get("machine") or {}
    versions = ", ".join(f"{k} {v}" for k, v in (m.get("versions") or {}).items() if v)
    parts = [f"`{m['_dir']}`", f"box {m.get('box', '?')}", f"scale **{m.get('scale', '?')}**",
             f"{mach.get('cpus', '?')} CPUs, {mach.get('memory_gib', '?')} GiB, {mach.get('platform', '?')}",
             f"systems {', '.join(m.get('systems') or [])}", versions,
             f"{m.get('started', '?')} to {m.get('finished') or 'unfinished'}"]
    if m.get("scale") != "full":
        parts.append("reduced sizes: not the published setup")
    lines = ["- " + "; ".join(p for p in parts if p)]
    for name, argv in (m.get("argv") or {}).items():
        lines.append(f"  - `{name}`: `{' '.join(Path(a).name if '/' in a else a for a in argv)}`")
    return "\n".join(lines)


def cell_commits(cells: list[dict[str, Any]]) -> str:
    """One line: the commit every cell ran on, or each commit with its cell count, marked mixed."""
    counts: dict[str, int] = {}
    for c in cells:
        rev = str(c.get("rev") or "unknown")
        counts[rev] = counts.get(rev, 0) + 1
    if not counts:
        return "No cells."
    if len(counts) == 1:
        rev = next(iter(counts))
        dirty = " (uncommitted changes: not reproducible from the commit)" if rev.endswith("-dirty") else ""
        return f"All {len(cells)} cells ran at commit `{rev}`{dirty}."
    parts = ", ".join(f"`{rev}` ({n} cell{'s' if n != 1 else ''})" for rev, n in sorted(counts.items()))
    return f"**Mixed commits**: {parts}; these cells did not all run on one code version."


def _features(cells: list[dict[str, Any]], columns: list[str]) -> list[str]:
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for c in cells:
        for label, f in (c.get("features") or {}).items():
            rows.setdefault((c["scenario"], label), {})[c["_column"]] = f
    if not rows:
        return []
    out = ["", "Feature rows (reported beside the grid, not counted in its totals):", "",
           "| feature | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for (scenario, label), by_col in rows.items():
        marks = [MARKS.get(by_col[col]["verdict"], "?") if col in by_col else "" for col in columns]
        out.append(f"| {scenario}: {label} | " + " | ".join(marks) + " |")
    return out


RAN = ("pass", "fail", "error")  # the system ran the scenario to a verdict (n/a and inconclusive did not)


def cell_verdict(cell: dict[str, Any]) -> tuple[str, str, list[str]]:
    """(verdict, why, each run's verdict) of a cell under the current checks: every run re-judged
    from its numbers, the verdict their majority (one run: its own)."""
    runs = cell.get("runs") or [cell]
    judged = [rejudge({**r, "scenario": cell["scenario"]}) for r in runs]
    verdicts = [v for v, _ in judged]
    verdict = majority(verdicts)
    why = next((w for v, w in judged if v == verdict), "")
    if verdict == "inconclusive" and "inconclusive" not in verdicts:
        why = f"no verdict in more than half of {len(runs)} runs ({', '.join(verdicts)})"
    return verdict, why, verdicts


def scores(verdicts: dict[tuple[str, str], str], scenarios: list[str], columns: list[str]) -> dict[str, Any]:
    """The headline and each column's own counts: ``both`` the scenarios every column ran (a pass,
    fail or error each), ``headline`` per column passes on those, ``own`` passes over applicable
    cells, and ``pass``/``fail``/``inconclusive``/``error``/``unsupported`` counted apart."""
    both = [s for s in scenarios if all(verdicts.get((s, col)) in RAN for col in columns)]
    out: dict[str, Any] = {"both": both, "columns": {}}
    for col in columns:
        mine = [verdicts[(s, col)] for s in scenarios if (s, col) in verdicts]
        counts = {k: mine.count(k) for k in ("pass", "fail", "inconclusive", "error", "unsupported")}
        out["columns"][col] = {
            "headline": (sum(1 for s in both if verdicts[(s, col)] == "pass"), len(both)),
            "own": (counts["pass"], len(mine) - counts["unsupported"]), **counts,
        }
    return out


def compare(dirs: list[Path], *, notes: str = "", notes_file: Path | str | None = None) -> str:
    manifests, cells = load_results(dirs)
    columns: list[str] = []
    for c in cells:
        if c["_column"] not in columns:
            columns.append(c["_column"])
    scenarios = [s for s in _ORDER if any(c["scenario"] == s for c in cells)]
    scenarios += sorted({c["scenario"] for c in cells} - set(scenarios))
    grid = {(c["scenario"], c["_column"]): c for c in cells}
    judged = {key: cell_verdict(c) for key, c in grid.items()}
    verdicts = {key: v for key, (v, _, _) in judged.items()}
    said = " ".join(str(d) for d in dirs) + (f" --notes {notes_file}" if notes_file else "")
    out = ["# Serving-semantics suite", "",
           f"Generated from result files by `python -m superfluid.suite compare {said}`; do not edit by hand.",
           "", cell_commits(cells), ""]
    if notes:
        out += [notes.strip(), ""]
    out += [_manifest_line(m) for m in manifests]
    sc = scores(verdicts, scenarios, columns)
    both, per = sc["both"], sc["columns"]
    every = "both systems" if len(columns) == 2 else "every system"
    if len(columns) > 1:
        heads = ", ".join(f"{col} **{per[col]['headline'][0]}/{per[col]['headline'][1]}**" for col in columns)
        owns = ", ".join(f"{col} {per[col]['own'][0]}/{per[col]['own'][1]}" for col in columns)
        out += ["", f"**On the {len(both)} scenario{'s' * (len(both) != 1)} {every} ran** (a pass, a fail or an "
                    f"error for each; `n/a` and `inconclusive` cells left out): {heads}. Each system's own total, "
                    f"passes over the scenarios it could run: {owns}."]
    out += ["", "| scenario | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for s in scenarios:
        marks = [MARKS.get(verdicts[(s, col)], "?") if (s, col) in grid else "" for col in columns]
        out.append(f"| {s} | " + " | ".join(marks) + " |")
    if len(columns) > 1:
        out.append(f"| **passes on the {len(both)} scenarios {'both' if len(columns) == 2 else 'all'} ran** | "
                   + " | ".join(f"{per[col]['headline'][0]}/{per[col]['headline'][1]}" for col in columns) + " |")
    out.append("| **passes / applicable** (own total) | "
               + " | ".join(f"{per[col]['own'][0]}/{per[col]['own'][1]}" for col in columns) + " |")
    out.append("| fail / inconclusive / error / n/a | " + " | ".join(
        f"{per[col]['fail']} / {per[col]['inconclusive']} / {per[col]['error']} / {per[col]['unsupported']}"
        for col in columns) + " |")
    out += _features(cells, columns)
    for s in scenarios:
        out += ["", f"## {s}", ""]
        condition = CONDITIONS.get(s) or next((grid[(s, col)].get("condition") for col in columns
                                               if (s, col) in grid and grid[(s, col)].get("condition")), "?")
        out += [f"Pass condition: {condition}.", ""]
        for col in columns:
            c = grid.get((s, col))
            if c is None:
                continue
            verdict, why, runs = judged[(s, col)]
            mark = MARKS.get(verdict, verdict)
            line = f"- **{col}** ({mark}): {c.get('headline') or ''} — `{c['_file']}`"
            out.append(line)
            if verdict != "pass" and (why or c.get("reason")):
                out.append(f"  - why: {why or c['reason']}")
            recorded = [r.get("verdict") for r in (c.get("runs") or [c])]
            if recorded != runs:
                out.append(f"  - re-judged under the current pass condition: recorded {', '.join(map(str, recorded))}")
            if len(runs) > 1:
                out.append(f"  - {len(runs)} runs ({', '.join(runs)}): the verdict is their majority")
            for label, f in (c.get("features") or {}).items():
                out.append(f"  - {label} ({MARKS.get(f['verdict'], f['verdict'])}): {f.get('why') or ''}")
    return "\n".join(out) + "\n"
