"""The api package's layering (SPEC.md section 8, "Layers"): import-linter's "api layers"
contract checks the direction of every import; these tests keep the contract whole."""

from __future__ import annotations

import itertools
import tomllib
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent


def _api_layers() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["name"].startswith("api layers")]
    return [name.strip() for layer in contract["layers"] for name in layer.replace(":", "|").split("|")]


def test_every_api_module_has_a_place_in_the_layers_contract() -> None:
    modules = sorted(p.stem for p in (ROOT / "superfluid" / "api").glob("_*.py") if p.stem != "__init__")
    layered = _api_layers()
    assert sorted(layered) == modules, "a new api module needs its layer in pyproject.toml ('api layers')"


def test_no_api_module_imports_another_that_imports_it_back() -> None:
    """No cycle, TYPE_CHECKING imports included (handlers type against api/_host.App, not _app.App)."""
    graph = grimp.build_graph("superfluid")
    api = sorted(m for m in graph.modules if m.startswith("superfluid.api."))
    cycles = [(a, b) for a, b in itertools.combinations(api, 2)
              if graph.chain_exists(importer=a, imported=b) and graph.chain_exists(importer=b, imported=a)]
    assert not cycles, cycles
