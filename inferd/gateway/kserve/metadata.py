"""Server metadata of the Open Inference Protocol, shared by the HTTP routes and gRPC.

`EXTENSIONS` lists only what inferd implements, so a client probing for an extension (shared
memory, sequences) learns up front that it is absent instead of failing later:
- binary_tensor_data: the HTTP binary tensor extension (gRPC always carries raw tensors)
- classification: `classification: k` on a requested output
- model_repository: POST /v2/repository/index, .../models/{m}/load and /unload
- model_configuration: GET /v2/models/{m}[/versions/{v}]/config
- parameters: the request parameters `priority`, `timeout` and `binary_data_output`
- statistics: GET /v2/models[/{m}[/versions/{v}]]/stats and gRPC ModelStatistics (Triton's JSON)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from inferd.errors import ModelNotFoundError

if TYPE_CHECKING:
    from inferd.repository.manager import ModelRepository

from importlib import metadata
from typing import Any

SERVER_NAME = "inferd"
EXTENSIONS = (
    "binary_tensor_data",
    "classification",
    "model_repository",
    "model_configuration",
    "parameters",
    "statistics",
)


def server_version() -> str:
    try:
        return metadata.version("inferd")
    except metadata.PackageNotFoundError:  # running from a source tree that is not installed
        return "0.0.0"


def server_metadata() -> dict[str, Any]:
    """`{"name": "inferd", "version": "0.1.0", "extensions": [...]}` (GET /v2)."""
    return {"name": SERVER_NAME, "version": server_version(), "extensions": list(EXTENSIONS)}


def stats_targets(repo: ModelRepository, model: str, version: str) -> list[tuple[str, str]]:
    """(name, version) pairs for Triton's statistics: every ready model at its latest version,
    or the one asked for (ModelNotFoundError when it is not served)."""
    if not model:
        return [(name, repo.versions(name)[-1]) for name in repo.model_names()]
    versions = repo.versions(model)
    if not version:
        if not versions:
            raise ModelNotFoundError(f"model {model!r} has no ready version")
        return [(model, versions[-1])]
    if not (version.isascii() and version.isdigit()) or str(int(version)) not in versions:
        raise ModelNotFoundError(f"model {model!r} has no ready version {version!r}")
    return [(model, str(int(version)))]
