"""``compare``: result directories -> one Markdown report (docs/suite-results.md is this output,
regenerated, never edited by hand).

The commit(s) the cells ran on (each cell records its own; older cells fall
back to their directory's manifest), flagged when they differ; a manifest
bullet per directory; a grid (scenario x system: ``pass``,
``**FAIL**``, ``n/a``, ``error``, ``inconclusive``) with passes over applicable
cells per system (``n/a`` is not applicable and is counted beside); the feature
rows (reported beside the scored grid, never in its totals: ``agents_interactive``
with QoS headers, ``daemon_restart`` resume by id); then one section per scenario: its pass condition, and per system the mark, the
headline, the one-line reason when it did not pass, and the result file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ._conditions import CONDITIONS

__all__ = ["MARKS", "cell_commits", "compare", "load_results"]

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


def compare(dirs: list[Path], *, notes: str = "") -> str:
    manifests, cells = load_results(dirs)
    columns: list[str] = []
    for c in cells:
        if c["_column"] not in columns:
            columns.append(c["_column"])
    scenarios = [s for s in _ORDER if any(c["scenario"] == s for c in cells)]
    scenarios += sorted({c["scenario"] for c in cells} - set(scenarios))
    grid = {(c["scenario"], c["_column"]): c for c in cells}
    dirs_said = " ".join(Path(m["_dir"]).name for m in manifests)
    out = ["# Serving-semantics suite", "",
           f"Generated from result files by `python -m superfluid.suite compare {dirs_said}`; do not edit by hand.",
           "", cell_commits(cells), ""]
    if notes:
        out += [notes.strip(), ""]
    out += [_manifest_line(m) for m in manifests]
    out += ["", "| scenario | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for s in scenarios:
        marks = [MARKS.get(grid[(s, col)]["verdict"], "?") if (s, col) in grid else "" for col in columns]
        out.append(f"| {s} | " + " | ".join(marks) + " |")
    totals = []
    for col in columns:
        mine = [grid[(s, col)] for s in scenarios if (s, col) in grid]
        passed = sum(1 for c in mine if c["verdict"] == "pass")
        na = sum(1 for c in mine if c["verdict"] == "unsupported")
        unsure = sum(1 for c in mine if c["verdict"] == "inconclusive")  # ran, showed nothing: not a pass
        beside = [f"{na} n/a"] * bool(na) + [f"{unsure} inconclusive"] * bool(unsure)
        totals.append(f"{passed}/{len(mine) - na}" + (f" ({', '.join(beside)})" if beside else ""))
    out.append("| **passes / applicable** | " + " | ".join(totals) + " |")
    out += _features(cells, columns)
    for s in scenarios:
        out += ["", f"## {s}", ""]
        condition = next((grid[(s, col)].get("condition") for col in columns
                          if (s, col) in grid and grid[(s, col)].get("condition")), CONDITIONS.get(s, "?"))
        out += [f"Pass condition: {condition}.", ""]
        for col in columns:
            c = grid.get((s, col))
            if c is None:
                continue
            mark = MARKS.get(c["verdict"], c["verdict"])
            line = f"- **{col}** ({mark}): {c.get('headline') or ''} — `{c['_file']}`"
            out.append(line)
            if c["verdict"] != "pass" and c.get("reason"):
                out.append(f"  - why: {c['reason']}")
            for label, f in (c.get("features") or {}).items():
                out.append(f"  - {label} ({MARKS.get(f['verdict'], f['verdict'])}): {f.get('why') or ''}")
    return "\n".join(out) + "\n"
