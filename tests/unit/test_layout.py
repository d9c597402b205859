"""The layout stays the one docs/architecture.md describes: every package is in its table and says
its job in a docstring, and no module grows past 500 lines without saying why."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "inferd"
MAX_LINES = 500
# A long module says why at its top, in a comment starting with this.
LONG_MODULE_REASON = "# Over 500 lines because"
GENERATED = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_descriptors.py")


def _packages() -> list[Path]:
    return sorted(p.parent for p in PACKAGE.glob("*/__init__.py"))


def _documented_names() -> set[str]:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    return set(re.findall(r"^\| `([a-z_]+)/` \|", doc, flags=re.M))


@pytest.mark.parametrize("package", _packages(), ids=lambda p: p.name)
def test_every_package_is_in_the_architecture_table(package: Path) -> None:
    assert package.name in _documented_names()


@pytest.mark.parametrize("package", _packages(), ids=lambda p: p.name)
def test_every_package_says_its_job(package: Path) -> None:
    tree = ast.parse((package / "__init__.py").read_text())
    assert ast.get_docstring(tree), f"inferd/{package.name}/__init__.py has no docstring"


def test_the_table_names_no_package_that_is_gone() -> None:
    assert _documented_names() <= {p.name for p in _packages()}


def test_no_module_over_500_lines_without_a_reason() -> None:
    long = []
    for path in PACKAGE.rglob("*.py"):
        if path.name.endswith(GENERATED):
            continue
        text = path.read_text()
        if text.count("\n") > MAX_LINES and LONG_MODULE_REASON not in text:
            long.append(str(path.relative_to(ROOT)))
    assert not long, f"over {MAX_LINES} lines with no '{LONG_MODULE_REASON} ...' comment: {long}"
