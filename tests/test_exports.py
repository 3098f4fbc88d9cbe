"""The public/private split (after trio's ``test_exports.py``).

Implementation lives in ``_underscore.py`` modules; each package ``__init__``
re-exports its public names with ``from ._x import Name as Name`` and nothing
else is public.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import types
from pathlib import Path

import pytest

import superfluid

ROOT = Path(superfluid.__file__).resolve().parent
PUBLIC_PACKAGES = ["superfluid.proto", "superfluid.sched", "superfluid.nursery", "superfluid.chat", "superfluid.api"]
ALLOWED_PUBLIC_MODULES = {"__init__.py", "__main__.py"}
FUTURE_FEATURES = {"annotations"}  # bound by ``from __future__ import annotations``


def package_init(modname: str) -> Path:
    return ROOT.parent.joinpath(*modname.split("."), "__init__.py")


def reexports(modname: str) -> dict[str, tuple[str, str]]:
    """``{public name: (source module, source name)}`` from the package's ``__init__``."""
    tree = ast.parse(package_init(modname).read_text(encoding="utf-8"))
    out: dict[str, tuple[str, str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            source = importlib.util.resolve_name("." * node.level + (node.module or ""), modname)
            for alias in node.names:
                out[alias.asname or alias.name] = (source, alias.name)
    return out


def layout_violations() -> list[str]:
    """Public modules outside ``__init__``/``__main__``, and implementation in ``__init__`` files."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent)
        if "__pycache__" in rel.parts:
            continue
        if not path.name.startswith("_") and path.name not in ALLOWED_PUBLIC_MODULES:
            found.append(f"{rel}: public module name (rename it to _{path.name} and re-export)")
        if path.name == "__init__.py":
            for node in ast.parse(path.read_text(encoding="utf-8")).body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    found.append(f"{rel}:{node.lineno}: {node.name} is implemented in an __init__")
    return found


@pytest.mark.parametrize("modname", PUBLIC_PACKAGES)
def test_every_reexport_imports(modname: str) -> None:
    module = importlib.import_module(modname)
    names = reexports(modname)
    assert names, f"{modname} re-exports nothing"
    for name, (source, source_name) in names.items():
        assert getattr(module, name) is getattr(importlib.import_module(source), source_name), name
        # and the ordinary import statement works
        namespace: dict[str, object] = {}
        exec(f"from {modname} import {name}", namespace)
        assert namespace[name] is getattr(module, name)


@pytest.mark.parametrize("modname", PUBLIC_PACKAGES)
def test_reexports_are_explicit_and_private_sourced(modname: str) -> None:
    tree = ast.parse(package_init(modname).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            assert node.level == 1 and (node.module or "").startswith("_"), (
                f"{modname} re-exports from {node.module!r}: public names come from ._private modules"
            )
            for alias in node.names:
                assert alias.asname == alias.name, f"{modname}: write 'import {alias.name} as {alias.name}'"


@pytest.mark.parametrize("modname", PUBLIC_PACKAGES)
def test_nothing_else_is_public(modname: str) -> None:
    module = importlib.import_module(modname)
    public = {
        name for name, value in vars(module).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType) and name not in FUTURE_FEATURES
    }
    assert public == set(reexports(modname))


def test_layout_has_no_public_implementation_modules() -> None:
    violations = layout_violations()
    assert not violations, "layout violations:\n" + "\n".join(violations)
