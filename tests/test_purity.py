"""``superfluid/proto`` is pure: no trio, no sockets, no clocks, no processes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import superfluid.proto

PROTO = Path(superfluid.proto.__file__).resolve().parent
FORBIDDEN = ("trio", "socket", "time", "os", "subprocess", "asyncio", "threading", "select", "selectors")
IMPORT_RE = re.compile(
    r"^\s*(?:import\s+(?P<names>[\w., ]+)|from\s+(?P<module>[\w.]+)\s+import\b)", re.MULTILINE
)


def proto_sources() -> list[Path]:
    return sorted(p for p in PROTO.rglob("*.py") if "__pycache__" not in p.parts)


def imported_modules(source: str) -> set[str]:
    found = set()
    for m in IMPORT_RE.finditer(source):
        if m.group("module"):
            found.add(m.group("module"))
        else:
            found.update(part.split(" as ")[0].strip() for part in m.group("names").split(","))
    return found


def test_proto_imports_without_trio() -> None:
    code = (
        "import sys\n"
        "for name in ('trio', 'trio.lowlevel', 'socket', 'subprocess', 'asyncio'):\n"
        "    sys.modules[name] = None\n"
        "import superfluid.proto\n"
        "assert 'superfluid.nursery' not in sys.modules and 'superfluid.sched' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("path", proto_sources(), ids=lambda p: p.name)
def test_proto_source_is_pure(path: Path) -> None:
    source = path.read_text(encoding="utf-8")
    bad = sorted(m for m in imported_modules(source) if m.split(".")[0] in FORBIDDEN)
    assert not bad, f"{path.name} imports {bad}"
    assert not re.search(r"\basync\s+def\b", source), f"{path.name} defines a coroutine"


@pytest.mark.parametrize("path", proto_sources(), ids=lambda p: p.name)
def test_proto_imports_nothing_else_from_superfluid(path: Path) -> None:
    # import-linter style: proto is the bottom layer
    source = path.read_text(encoding="utf-8")
    for module in imported_modules(source):
        assert not module.startswith(".."), f"{path.name} imports {module}"
        assert not module.startswith("superfluid"), f"{path.name} imports {module}"


def test_import_scanner_sees_the_forms_we_forbid() -> None:
    src = "import os\nimport json, time as t\nfrom socket import socket\n    import trio.lowlevel\nfrom . import _x\n"
    assert imported_modules(src) >= {"os", "json", "time", "socket", "trio.lowlevel", "."}
