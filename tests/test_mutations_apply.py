"""The mutation harness (tests/mutations.py) still points at the code and at SPEC.md's tests.

Cheap checks on every mutation, so that a refactor that moves a rule's code, renames a cited
test or drops a citation fails the normal test run, not only CI's mutation step (which runs
the tests under each mutation: ``python -m tests.mutations``)."""

from __future__ import annotations

import ast
import re
from functools import cache

import pytest

from .mutations import MUTATIONS, ROOT, Mutation

SPEC = (ROOT / "SPEC.md").read_text(encoding="utf-8")


@cache
def top_level_names(test_file: str) -> dict[str, set[str]]:
    """A test file's functions and classes (a class's name maps to its methods)."""
    tree = ast.parse((ROOT / test_file).read_text(encoding="utf-8"))
    return {node.name: {n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
            for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}


def test_there_are_at_least_30_mutations_with_distinct_names() -> None:
    names = [m.name for m in MUTATIONS]
    assert len(names) >= 30
    assert len(set(names)) == len(names)


@pytest.mark.parametrize("m", MUTATIONS, ids=lambda m: m.name)
def test_the_snippet_occurs_exactly_once_and_the_mutant_compiles(m: Mutation) -> None:
    source = (ROOT / m.file).read_text(encoding="utf-8")
    assert source.count(m.old) == 1, f"{m.file}: the snippet occurs {source.count(m.old)} times (re-point it)"
    assert m.new != m.old
    compile(source.replace(m.old, m.new), m.file, "exec")  # a mutant that does not import proves nothing


@pytest.mark.parametrize("m", MUTATIONS, ids=lambda m: m.name)
def test_the_cited_tests_exist_and_spec_cites_them(m: Mutation) -> None:
    assert m.tests
    for test in m.tests:
        file, *path = test.split("::")
        assert (ROOT / file).is_file(), test
        if path:
            names = top_level_names(file)
            assert path[0] in names, f"{test}: no such test"
            assert len(path) == 1 or path[1] in names[path[0]], f"{test}: no such test"
        # SPEC.md names the test, or cites its whole file (the path not followed by "::")
        assert (path and path[-1] in SPEC) or re.search(re.escape(file) + "(?!::)", SPEC), (
            f"{test} is not cited in SPEC.md")
