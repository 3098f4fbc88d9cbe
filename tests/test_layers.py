"""The package layering (SPEC.md section 8, "Layers"): import-linter's "package layers" and "api
layers" contracts check the direction of every import; these tests keep the contracts whole and
check, with grimp, that superfluid's packages and the api's modules import no cycle."""

from __future__ import annotations

import functools
import itertools
import re
import tomllib
from collections import defaultdict
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "superfluid"


def _contract(prefix: str) -> dict:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["name"].startswith(prefix)]
    return contract


def _layered(contract: dict) -> list[str]:
    return [name.strip() for layer in contract["layers"] for name in layer.replace(":", "|").split("|")]


@functools.cache
def _graph(exclude_type_checking_imports: bool) -> grimp.ImportGraph:
    # no cache_dir: grimp's cache shares one meta file between the two kinds of graph, and a graph
    # of one kind built after the other has been seen to miss an edit
    return grimp.build_graph("superfluid", exclude_type_checking_imports=exclude_type_checking_imports,
                             cache_dir=None)


def _top_level() -> list[str]:
    """superfluid's packages and modules, as the layers contract names them."""
    names = [p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    names += [p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"]
    return sorted(names)


def test_every_api_module_has_a_place_in_the_layers_contract() -> None:
    modules = sorted(p.stem for p in (PACKAGE / "api").glob("_*.py") if p.stem != "__init__")
    layered = _layered(_contract("api layers"))
    assert sorted(layered) == modules, "a new api module needs its layer in pyproject.toml ('api layers')"


def test_no_api_module_imports_another_that_imports_it_back() -> None:
    """No cycle, TYPE_CHECKING imports included (handlers type against api/_host.App, not _app.App)."""
    graph = _graph(False)
    api = sorted(m for m in graph.modules if m.startswith("superfluid.api."))
    cycles = [(a, b) for a, b in itertools.combinations(api, 2)
              if graph.chain_exists(importer=a, imported=b) and graph.chain_exists(importer=b, imported=a)]
    assert not cycles, cycles


def test_every_package_has_a_place_in_the_package_layers() -> None:
    """The contract is exhaustive too (import-linter says the same), but a test names the fix."""
    layered = _layered(_contract("package layers"))
    assert sorted(layered) == _top_level(), "a new package or top-level module needs its layer in pyproject.toml"


@pytest.mark.parametrize("prefix, source", [("proto is pure", "proto"), ("the defaults are plain", "_defaults")])
def test_the_pure_ones_forbid_every_other_package(prefix: str, source: str) -> None:
    """A forbidden-list names packages: a package added later would slip through unnamed."""
    forbidden = sorted(_contract(prefix)["forbidden_modules"])
    assert forbidden == [f"superfluid.{n}" for n in _top_level() if n not in (source, "__main__")]


def _package_cycles(exclude_type_checking_imports: bool) -> dict[tuple[str, str], list[str]]:
    """Pairs of top-level packages that import each other (directly or through others), each with
    the direct imports from one into the other: ``{(a, b): ["superfluid.a.x:12 -> superfluid.b.y"]}``."""
    graph = _graph(exclude_type_checking_imports)

    def top(module: str) -> str:
        return ".".join(module.split(".")[:2])

    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for importer in graph.modules:
        for imported in graph.find_modules_directly_imported_by(importer):
            a, b = top(importer), top(imported)
            if a != b and "superfluid" not in (a, b):  # root: __version__
                lines = [d["line_number"] for d in graph.get_import_details(importer=importer, imported=imported)]
                edges[a, b].append(f"{importer}:{','.join(map(str, lines))} -> {imported}")
    reach: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        reach[a].add(b)
    changed = True
    while changed:   # transitive closure; a few dozen packages
        changed = False
        for a in list(reach):
            more = set().union(*(reach[b] for b in reach[a] if b in reach)) - reach[a]
            if more:
                reach[a] |= more
                changed = True
    return {(a, b): sorted(lines) for (a, b), lines in sorted(edges.items())
            if a in reach.get(b, set())}


def _describe(cycles: dict[tuple[str, str], list[str]]) -> str:
    return "\n".join(f"{a} -> {b}: {lines}" for (a, b), lines in cycles.items())


@pytest.mark.parametrize("exclude_type_checking_imports", [False, True], ids=["with-typing", "runtime"])
def test_no_two_packages_import_each_other(exclude_type_checking_imports: bool) -> None:
    """No cycle between superfluid's top-level packages, directly or through others, TYPE_CHECKING
    imports included or not (the package layers contract says the same; this names the imports)."""
    cycles = _package_cycles(exclude_type_checking_imports)
    assert not cycles, _describe(cycles)


def test_the_words_table_names_modules_that_exist() -> None:
    """SPEC.md's "Words": every module it points to is there (a rename updates the table)."""
    spec = (ROOT / "SPEC.md").read_text()
    table = spec.split("## Words", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| word")]
    assert len(rows) >= 10, rows
    named = [path for row in rows for path in re.findall(r"`(superfluid/[\w/]+\.py)`", row)]
    assert named and all((ROOT / path).is_file() for path in named), [p for p in named if not (ROOT / p).is_file()]
