"""``python -m superfluid.worker check superfluid-worker-<id> [--import MODULE]...``

What an install runs before it is made ready, and what ``superfluid runtimes`` asks an
environment: can this interpreter start the runtime's worker? Imports the worker side
and each module the runtime needs (the registry's ``requires``, plus any ``--import``),
then prints one JSON report on stdout::

    {"runtime": "llamacpp", "available": true, "python": "3.11.7", "executable": "...",
     "modules": {"llama_cpp": {"version": "0.3.36", "file": "..."}}, "error": null}

Exit status 0 when available, 1 when a module does not import, 2 for a bad command line.
Never loads a model.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
from typing import Any

__all__ = ["check"]


def check(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="superfluid-worker check")
    parser.add_argument("name", help="superfluid-worker-<runtime>")
    parser.add_argument("--import", dest="modules", action="append", default=[], metavar="MODULE")
    try:
        args = parser.parse_args(argv)
    except SystemExit:
        return 2
    from ..runtime import _registry as registry

    rid = args.name.removeprefix("superfluid-worker-")
    try:
        requires = list(registry.get(rid).requires)
    except registry.UnknownRuntime:
        if not args.modules:
            print(json.dumps({"runtime": rid, "available": False, "error": f"unknown runtime {rid!r}"}))
            return 1
        requires = []
    report: dict[str, Any] = {"runtime": rid, "available": True, "python": platform.python_version(),
                              "executable": sys.executable, "modules": {}, "error": None}
    for name in dict.fromkeys([*requires, *args.modules]):
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any import failure is the answer, reported as a string
            report["available"] = False
            report["error"] = f"import {name}: {type(exc).__name__}: {exc}"
            break
        report["modules"][name] = {"version": str(getattr(module, "__version__", "")),
                                   "file": getattr(module, "__file__", None)}
    print(json.dumps(report))
    return 0 if report["available"] else 1
