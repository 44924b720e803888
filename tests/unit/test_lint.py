"""Pyflakes over the project's Python: an undefined name, an unused import or
a name assigned and never read fails the fast tier, before the Spark tiers
would run the line (a NameError in a rarely taken branch once passed every
pure test)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyflakes.api import checkPath
from pyflakes.reporter import Reporter

ROOT = Path(__file__).resolve().parents[2]
TREES = ("dbt_ivm", "dbt", "tests", "bench", "integration_tests")


class _Collect(Reporter):
    def __init__(self):
        self.found: list[str] = []

    def unexpectedError(self, filename, msg):  # noqa: N802 - pyflakes' names
        self.found.append(f"{filename}: {msg}")

    def syntaxError(self, filename, msg, lineno, offset, text):  # noqa: N802
        self.found.append(f"{filename}:{lineno}: {msg}")

    def flake(self, message):
        self.found.append(str(message))


def _files() -> list[Path]:
    return sorted(p for tree in TREES for p in (ROOT / tree).rglob("*.py") if ".venv" not in p.parts)


def test_the_tree_has_python_files():
    assert len(_files()) > 50


@pytest.mark.parametrize("tree", TREES)
def test_pyflakes_finds_nothing(tree):
    report = _Collect()
    for path in _files():
        if path.relative_to(ROOT).parts[0] == tree:
            checkPath(str(path), report)
    assert report.found == [], "\n".join(report.found)
