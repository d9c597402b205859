"""Typed access to a `config.json`'s fields (models/config.py parses them with it)."""

from __future__ import annotations

from typing import Any

from inferd.errors import ModelLoadError

# `get`'s default when a field is required.
MISSING = object()


class Fields:
    """Typed access to config.json fields; every failure names the field and the file."""

    def __init__(self, data: dict[str, Any], source: str) -> None:
        self.data = data
        self.source = source

    def error(self, name: str, problem: str) -> ModelLoadError:
        return ModelLoadError(f"{self.source}: field {name!r} {problem}")

    def get(self, name: str, default: Any = MISSING) -> Any:
        value = self.data.get(name)
        if value is None:
            if default is MISSING:
                raise self.error(name, "is missing")
            return default
        return value

    def get_int(self, name: str, default: int | None = None, minimum: int = 1) -> int:
        value = self.get(name, MISSING if default is None else default)
        return self._check_int(name, value, minimum)

    def opt_int(self, name: str, minimum: int = 1) -> int | None:
        value = self.data.get(name)
        return None if value is None else self._check_int(name, value, minimum)

    def _check_int(self, name: str, value: Any, minimum: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(name, f"must be an integer, got {value!r}")
        if value < minimum:
            raise self.error(name, f"must be >= {minimum}, got {value}")
        return value

    def get_float(self, name: str, default: Any = MISSING) -> float:
        value = self.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise self.error(name, f"must be a positive number, got {value!r}")
        return float(value)

    def get_bool(self, name: str, default: bool) -> bool:
        value = self.get(name, default)
        if not isinstance(value, bool):
            raise self.error(name, f"must be true or false, got {value!r}")
        return value

    def token_ids(self, name: str) -> frozenset[int]:
        value = self.data.get(name)
        items = [] if value is None else value if isinstance(value, list) else [value]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in items):
            raise self.error(name, f"must be a token id or a list of them, got {value!r}")
        return frozenset(items)
