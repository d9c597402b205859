"""One structured JSON line per HTTP request on the `inferd.access` logger.

    {"ts": "2026-11-21T01:02:03.456Z", "request_id": "3f2a...", "method": "POST",
     "path": "/v1/completions", "status": 200, "duration_ms": 35.2, "bytes_out": 812,
     "client": "127.0.0.1:51234", "prompt_tokens": 5, "completion_tokens": 16, ...}

The line is the log record's message, so any handler or formatter can ship it; routes add
fields (token counts, finish reasons) through `scope["state"]["access_extra"]`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson

logger = logging.getLogger("inferd.access")


@dataclass
class AccessRecord:
    request_id: str
    method: str
    path: str
    client: str
    arrival: float  # time.monotonic()
    status: int = 0  # 0: no response was started (the client left first)
    bytes_out: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self, now: float) -> dict[str, Any]:
        return {
            "ts": datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "request_id": self.request_id,
            "method": self.method,
            "path": self.path,
            "status": self.status,
            "duration_ms": round((now - self.arrival) * 1000, 3),
            "bytes_out": self.bytes_out,
            "client": self.client,
            **self.extra,
        }


def log_access(record: AccessRecord) -> None:
    if not logger.isEnabledFor(logging.INFO):
        return
    line = orjson.dumps(record.as_dict(time.monotonic()), default=str).decode()
    logger.info(line)
