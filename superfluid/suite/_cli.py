"""``python -m superfluid.suite``: ``run`` the scenarios, ``compare`` results.

::

    python -m superfluid.suite run --systems superfluid-mock[,llama-server,...]
        [--box BOX.json] [--url URL] [--scenarios a,b] [--scale quick|small|full]
        [--out DIR] [--cooldown S] [--repeat N]
    python -m superfluid.suite compare DIR [DIR ...] [--notes SETUP.md] > docs/suite-results.md
    python -m superfluid.suite systems [--box BOX.json]
    python -m superfluid.suite conditions

``run`` exits 0 when no cell failed or errored (``unsupported`` is not a
failure), 1 otherwise; ``compare`` prints Markdown on stdout.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import trio

from ._compare import compare
from ._conditions import CONDITIONS
from ._corpus import SCALES
from ._runner import SCENARIOS, RunOptions, run
from ._systems import load_box, system_spec

__all__ = ["build_parser", "main"]


def _names(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m superfluid.suite",
                                     description="Serving-semantics scenarios against any OpenAI-compatible server.")
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run scenario x system cells (resumes: finished cells are skipped)")
    r.add_argument("--systems", type=_names, default=None,
                   help="comma list: superfluid-mock, superfluid-llamacpp, superfluid-mlx, llama-server, "
                        "mlx-lm-server, or box extra_systems (with --url: one name, used for capabilities)")
    r.add_argument("--box", help="box JSON: binaries, models, ports, versions, extra systems")
    r.add_argument("--url", help="target an already running server at http://127.0.0.1:PORT")
    r.add_argument("--scenarios", type=_names, default=tuple(SCENARIOS),
                   help=f"comma list (default all, in order): {', '.join(SCENARIOS)}")
    r.add_argument("--scale", choices=list(SCALES), default="full",
                   help="sizes: full (published), small (SmolLM2-135M on 2 cores), quick (CI, mock runtime)")
    r.add_argument("--out", type=Path, help="result directory (default suite-results/<date>-<box>-<scale>)")
    r.add_argument("--cooldown", type=float, default=None, help="idle seconds between cells (default by scale)")
    r.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run each cell N times; its verdict is the majority, every run listed (the published "
                        "run uses 3; default 1)")
    c = sub.add_parser("compare", help="Markdown grid and per-scenario sections from result directories")
    c.add_argument("dirs", nargs="+", type=Path)
    c.add_argument("--notes", type=Path, help="Markdown to put under the header (the setup: box, models, flags); "
                                              "default none")
    sub.add_parser("conditions", help="print each scenario's pass condition")
    y = sub.add_parser("systems", help="show how each system would be started on this box")
    y.add_argument("--box", help="box JSON")
    y.add_argument("--scale", choices=list(SCALES), default="full")
    return parser


def _show_systems(box_path: str | None, scale: str) -> int:
    box = load_box(box_path)
    names = ["superfluid-mock", "superfluid-llamacpp", "llama-server", *(box.data.get("extra_systems") or {})]
    for name in names:
        try:
            spec = system_spec(name, box, mock_spec=SCALES[scale].mock_spec)
        except ValueError as exc:
            print(f"{name}: unavailable: {exc}")
            continue
        caps = spec.caps
        print(f"{name}: port {spec.port}, probe {spec.probe}, worker {caps.worker_pattern or '-'}, "
              f"unload {caps.unload or '-'}, qos header {'yes' if caps.qos_header else 'no'}, "
              f"busy lanes {caps.busy or '-'}")
        print(f"    argv: {' '.join(spec.argv)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "compare":
        missing = [d for d in args.dirs if not d.is_dir()]
        if missing:
            print(f"not a directory: {', '.join(map(str, missing))}", file=sys.stderr)
            return 2
        try:
            notes = args.notes.read_text() if args.notes else ""
        except OSError as exc:
            print(f"--notes: {exc}", file=sys.stderr)
            return 2
        sys.stdout.write(compare(args.dirs, notes=notes, notes_file=args.notes))
        return 0
    if args.command == "systems":
        return _show_systems(args.box, args.scale)
    if args.command == "conditions":
        for name, text in CONDITIONS.items():
            print(f"{name}: {text}")
        return 0
    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown:
        print(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(SCENARIOS)}", file=sys.stderr)
        return 2
    systems = args.systems
    if args.url:
        systems = systems or ("external",)
        if len(systems) != 1:
            print("--url targets one server: give at most one --systems name", file=sys.stderr)
            return 2
    elif not systems:
        print("--systems is required (or --url)", file=sys.stderr)
        return 2
    if args.repeat < 1:
        print("--repeat must be at least 1", file=sys.stderr)
        return 2
    opts = RunOptions(systems=systems, scenarios=args.scenarios, scale=args.scale, out=args.out, box=args.box,
                      url=args.url, cooldown_s=args.cooldown, repeat=args.repeat)
    try:
        bad = trio.run(run, opts)
    except ValueError as exc:
        print(f"suite: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("suite: interrupted; finished cells are kept, re-run to resume", file=sys.stderr)
        return 130
    return 1 if bad else 0
