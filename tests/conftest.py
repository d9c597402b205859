"""Test tiers by folder, as LitServe marks them: every test under tests/unit is `unit`, under
tests/integration `integration`, under tests/e2e `e2e`, so `pytest -m unit` finds all of them
without a marker line in each file (a file may still add its own, e.g. a timeout)."""

from __future__ import annotations

from pathlib import Path

import pytest

_TIERS = ("unit", "integration", "e2e")
_ROOT = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = Path(item.path).relative_to(_ROOT).parts[0]
        if tier in _TIERS:
            item.add_marker(getattr(pytest.mark, tier))
