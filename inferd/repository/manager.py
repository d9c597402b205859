"""The model repository: which models and versions are on disk, loaded, and served.

    repo = ModelRepository(Path("models"))
    await repo.start()                       # load every model folder; failures are logged
    served = repo.get("fraud")               # highest ready version
    response = await served.infer(request)

Layout (Triton's): `ROOT/<model>/config.yaml` and numbered version folders `ROOT/<model>/<n>/`
holding the model file; config.yaml's version_policy picks which numbers are served.

Lifecycle of one model: "" (on disk, never loaded) -> LOADING -> READY, or UNAVAILABLE with the
reason. Loads run on a worker thread (asyncio.to_thread) and a per-model asyncio.Lock serialises
load/unload of the same model. A (re)load builds and starts every selected version first, then
swaps them in with one assignment on the event loop, so a request sees either the old set or
the new one; the old versions are then stopped and their in-flight requests finish. A failed
reload leaves the old versions serving. One model failing never touches another, and nothing
here raises out of `start()` for a bad model: the server stays up and reports it in index().

Readiness (Triton's --strict-readiness): ready() is True iff every model that was asked to load
(by start() or load(), and not unloaded since) has a ready version. A model whose load failed
keeps the server not-ready until it loads or is unloaded, so an orchestrator never routes to a
replica missing a model it is supposed to serve.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inferd.backends.base import BackendOptions
from inferd.batching.pipeline import ServedModel
from inferd.batching.rules import QueueLimits
from inferd.errors import (
    InferdError,
    ModelConfigError,
    ModelLoadError,
    ModelNotFoundError,
    ModelNotReadyError,
)
from inferd.model_config import CONFIG_FILE, ModelRepoConfig, TensorConfig, load_model_config
from inferd.repository.builder import build_model
from inferd.telemetry.model_metrics import ModelObserver
from inferd.tensors import triton_type

logger = logging.getLogger("inferd.repository")

READY, UNAVAILABLE, LOADING, UNLOADING = "READY", "UNAVAILABLE", "LOADING", "UNLOADING"
# Models loaded at once by start(): loading is mostly file reads and graph optimisation, so a
# few in parallel shortens startup without holding every model's peak load memory at once.
_LOAD_CONCURRENCY = 4
_DEFAULT_OPTIONS = BackendOptions()
_DEFAULT_LIMITS = QueueLimits()


@dataclass(eq=False)
class _Model:
    name: str
    path: Path
    served: dict[str, ServedModel] = field(default_factory=dict)  # version -> started model
    stopping: dict[str, ServedModel] = field(default_factory=dict)  # being unloaded
    state: str = ""  # shown while nothing is served: "", LOADING or UNAVAILABLE
    reason: str = ""
    wanted: bool = False  # asked to load and not unloaded since: counts for ready()
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def latest(self) -> ServedModel:
        return self.served[max(self.served, key=int)]


def version_folders(model_dir: Path) -> dict[int, Path]:
    """Numbered version folders (digits only; "0001" is version 1)."""
    return {
        int(p.name): p
        for p in model_dir.iterdir()
        if p.is_dir() and p.name.isascii() and p.name.isdigit()
    }


class ModelRepository:
    def __init__(
        self,
        root: Path | str,
        *,
        options: BackendOptions = _DEFAULT_OPTIONS,
        limits: QueueLimits = _DEFAULT_LIMITS,
        observer: ModelObserver | None = None,
        stop_timeout_s: float = 30.0,
    ) -> None:
        root = Path(root)
        if not root.is_dir():
            raise ModelConfigError(f"model repository {root} is not a folder")
        self.root = root
        self._options = options
        self._limits = limits
        self._observer = observer
        self._stop_timeout_s = stop_timeout_s  # in-flight grace when a reload retires versions
        self._models: dict[str, _Model] = {}
        self._closed = False  # after shutdown(): a load still running must not swap in

    # -- disk ------------------------------------------------------------------------------

    def _is_model_dir(self, name: str) -> bool:
        # The name comes from a URL: no separators or dot-names, so it cannot leave the root.
        if not name or name.startswith(".") or "/" in name or "\\" in name:
            return False
        try:
            return (self.root / name / CONFIG_FILE).is_file()
        except OSError:  # e.g. ENAMETOOLONG, a name past the file system limit: not a model
            return False

    def _on_disk(self) -> list[str]:
        try:
            return sorted(p.name for p in self.root.iterdir() if self._is_model_dir(p.name))
        except OSError as e:
            logger.error("cannot list model repository %s: %s", self.root, e)
            return []

    def _entry(self, name: str) -> _Model:
        """The record of a known model, or a new one for a folder on disk."""
        model = self._models.get(name)
        if model is not None:
            return model
        if not self._is_model_dir(name):
            raise ModelNotFoundError(f"no model {name!r} in repository {self.root}")
        return self._models.setdefault(name, _Model(name, self.root / name))

    # -- load / unload ---------------------------------------------------------------------

    async def start(self, models: Sequence[str] | None = None) -> None:
        """Load every model folder (or the named ones). Failures are logged, never raised."""
        if isinstance(models, str):
            models = [models]
        names = self._on_disk() if models is None else list(models)
        gate = asyncio.Semaphore(_LOAD_CONCURRENCY)

        async def load_logged(name: str) -> None:
            async with gate:
                try:
                    await self.load(name)
                except ModelNotFoundError as e:
                    missing = self._models.setdefault(name, _Model(name, self.root / name))
                    missing.wanted, missing.state, missing.reason = True, UNAVAILABLE, str(e)
                    logger.error("model %s: %s", name, e)
                except ModelLoadError:
                    pass  # logged by load(); index() carries the reason

        await asyncio.gather(*(load_logged(n) for n in names))

    async def load(self, name: str) -> None:
        """(Re)load `name` from disk: build and start the selected versions, swap them in, stop
        the old ones. ModelNotFoundError, or ModelConfigError/ModelLoadError (the old versions
        stay served)."""
        model = self._entry(name)
        async with model.lock:
            model.wanted = True
            if not model.served:
                model.state, model.reason = LOADING, ""
            try:
                fresh = await self._build_versions(model)
                if self._closed:
                    await _stop_all(fresh.values(), 0.0)
                    raise ModelNotReadyError(f"model {name!r}: the server is shutting down")
                await _start_all(fresh)
            except InferdError as e:
                self._record_failure(model, e)
                raise
            except Exception as e:  # out of user code or a runtime: still this model's failure
                error = ModelLoadError(f"{name}: {type(e).__name__}: {e}")
                self._record_failure(model, error)
                raise error from e
            except BaseException:  # cancelled: leave no LOADING behind
                self._record_failure(model, ModelLoadError(f"{name}: load cancelled"))
                raise
            old, model.served = model.served, fresh
            model.state, model.reason = READY, ""
        logger.info("model %s: serving versions %s", name, sorted(fresh, key=int))
        await _stop_all(old.values(), self._stop_timeout_s)

    def _record_failure(self, model: _Model, error: BaseException) -> None:
        if model.served:
            model.reason = f"reload failed: {error}"
            logger.error("model %s: reload failed, old versions stay served: %s", model.name, error)
        else:
            model.state, model.reason = UNAVAILABLE, str(error)
            logger.error("model %s: load failed: %s", model.name, error)

    async def _build_versions(self, model: _Model) -> dict[str, ServedModel]:
        """Every version the policy selects, built (on worker threads) but not started."""
        config = await asyncio.to_thread(load_model_config, model.path)
        folders = await asyncio.to_thread(version_folders, model.path)
        chosen = config.version_policy.select(list(folders))
        if not chosen:
            raise ModelLoadError(
                f"{model.name}: no version folder matches version_policy "
                f"{config.version_policy.triton_json()} (folders: {sorted(folders)})"
            )
        built: dict[str, ServedModel] = {}
        try:
            for number in chosen:
                built[str(number)] = await asyncio.to_thread(
                    self._build_one, model, str(number), config, folders[number]
                )
        except BaseException:
            await _stop_all(built.values(), 0.0)  # a never-started model just closes backends
            raise
        return built

    def _build_one(
        self, model: _Model, version: str, config: ModelRepoConfig, version_dir: Path
    ) -> ServedModel:
        return build_model(
            model.name,
            version,
            config,
            model.path,
            version_dir,
            self._options,
            self._limits,
            self._observer,
        )

    async def unload(self, name: str) -> None:
        """Stop serving `name` (in-flight requests finish). ModelNotFoundError if unknown."""
        model = self._entry(name)
        async with model.lock:
            model.wanted = False
            # Out of `served` first: new requests get ModelNotReadyError at once.
            model.stopping, model.served = model.served, {}
            try:
                await _stop_all(model.stopping.values(), self._stop_timeout_s)
            finally:
                model.stopping = {}
                model.state, model.reason = UNAVAILABLE, "unloaded"
        logger.info("model %s: unloaded", name)

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop every served version, letting in-flight requests finish up to `timeout_s`."""
        self._closed = True
        retiring: list[ServedModel] = []
        for model in self._models.values():
            retiring += model.served.values()
            model.stopping, model.served = model.served, {}
            model.wanted, model.state, model.reason = False, UNAVAILABLE, "server shutting down"
        await _stop_all(retiring, timeout_s)
        for model in self._models.values():
            model.stopping = {}

    # -- lookups ---------------------------------------------------------------------------

    def get(self, name: str, version: str = "") -> ServedModel:
        """The served model; "" -> its highest ready version.

        ModelNotFoundError: no such model or version. ModelNotReadyError: not loaded or failed."""
        model = self._models.get(name)
        if model is None:
            if self._is_model_dir(name):
                raise ModelNotReadyError(f"model {name!r} is not loaded")
            raise ModelNotFoundError(f"unknown model {name!r}")
        if not model.served:
            why = f": {model.reason}" if model.reason else ""
            raise ModelNotReadyError(f"model {name!r} is not ready{why}")
        if not version:
            return model.latest()
        served = model.served.get(_canonical(version))
        if served is None:
            raise ModelNotFoundError(
                f"model {name!r} has no ready version {version!r} "
                f"(ready: {sorted(model.served, key=int)})"
            )
        return served

    def model_names(self) -> list[str]:
        """Models with at least one ready version."""
        return sorted(name for name, m in self._models.items() if m.served)

    def versions(self, name: str) -> list[str]:
        """Ready versions of `name`, ascending; ModelNotFoundError if it is not on disk."""
        model = self._models.get(name)
        if model is None:
            if self._is_model_dir(name):
                return []
            raise ModelNotFoundError(f"unknown model {name!r}")
        return sorted(model.served, key=int)

    def inflight(self) -> dict[str, int]:
        """Accepted requests not yet answered, per model (serving and retiring versions)."""
        return {
            name: sum(v.inflight for v in (*m.served.values(), *m.stopping.values()))
            for name, m in self._models.items()
        }

    def ready(self) -> bool:
        """Every model asked to load has a ready version (see the module docstring)."""
        return all(m.served for m in self._models.values() if m.wanted)

    def embedding_models(self) -> list[str]:
        """Ready models whose config has an `embedding:` section (for /v1/embeddings)."""
        return sorted(
            name
            for name, m in self._models.items()
            if m.served and m.latest().config.embedding is not None
        )

    def index(self) -> list[dict[str, str]]:
        """Triton's repository index: one entry per served version, one per other model."""
        entries: list[dict[str, str]] = []
        for name in sorted(set(self._on_disk()) | set(self._models)):
            model = self._models.get(name)
            if model is None:
                entries.append(_index_entry(name, "", "", ""))
                continue
            for version in sorted(model.served, key=int):
                entries.append(_index_entry(name, version, READY, model.reason))
            for version in sorted(model.stopping, key=int):
                entries.append(_index_entry(name, version, UNLOADING, ""))
            if not model.served and not model.stopping:
                entries.append(_index_entry(name, "", model.state, model.reason))
        return entries

    def metadata(self, name: str, version: str = "") -> dict[str, Any]:
        """KServe model metadata; shapes carry the batch dim as -1 when the model batches."""
        served = self.get(name, version)
        config = served.config
        batch = [-1] if config.max_batch_size > 0 else []
        return {
            "name": name,
            "versions": self.versions(name),
            "platform": served.platform,
            "inputs": [_metadata_tensor(t, batch) for t in config.input],
            "outputs": [_metadata_tensor(t, batch) for t in config.output],
        }

    def config_dict(self, name: str, version: str = "") -> dict[str, Any]:
        """The served config in Triton's JSON form (model_config.proto field names)."""
        served = self.get(name, version)
        return triton_config(served.config, served.platform)


# -- helpers -------------------------------------------------------------------------------


async def _start_all(fresh: dict[str, ServedModel]) -> None:
    try:
        for served in fresh.values():
            await served.start()
    except BaseException:
        # stop() closes the backends of started and never-started models alike.
        await _stop_all(fresh.values(), 0.0)
        raise


async def _stop_all(models: Iterable[ServedModel], timeout_s: float) -> None:
    models = list(models)
    results = await asyncio.gather(*(m.stop(timeout_s) for m in models), return_exceptions=True)
    for served, result in zip(models, results, strict=True):
        if isinstance(result, BaseException):
            logger.error("model %s v%s: stop failed: %s", served.name, served.version, result)


def _canonical(version: str) -> str:
    """ "0002" -> "2": version folders are numbers, as Triton reads them."""
    return str(int(version)) if version.isascii() and version.isdigit() else version


def _index_entry(name: str, version: str, state: str, reason: str) -> dict[str, str]:
    return {"name": name, "version": version, "state": state, "reason": reason}


def _metadata_tensor(t: TensorConfig, batch: list[int]) -> dict[str, Any]:
    return {"name": t.name, "datatype": t.data_type, "shape": [*batch, *t.dims]}


def _triton_tensor(t: TensorConfig) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": t.name,
        "data_type": triton_type(t.data_type),
        "dims": list(t.dims),
    }
    if t.optional:
        out["optional"] = True
    if t.label_filename:
        out["label_filename"] = t.label_filename
    return out


def triton_config(config: ModelRepoConfig, platform: str) -> dict[str, Any]:
    """Triton's JSON model config (what GET /v2/models/{m}/config returns)."""
    kind = (
        "KIND_GPU"
        if str(config.parameters.get("device", "cpu")).startswith(("cuda", "gpu"))
        else "KIND_CPU"
    )
    out: dict[str, Any] = {
        "name": config.name,
        "platform": platform,
        "backend": config.backend,
        "max_batch_size": config.max_batch_size,
        "input": [_triton_tensor(t) for t in config.input],
        "output": [_triton_tensor(t) for t in config.output],
        "instance_group": [{"count": config.instance_count, "kind": kind}],
        "version_policy": config.version_policy.triton_json(),
    }
    if config.default_model_filename:
        out["default_model_filename"] = config.default_model_filename
    if config.dynamic_batching is not None:
        out["dynamic_batching"] = _triton_batching(config)
    if config.parameters:
        out["parameters"] = {k: {"string_value": str(v)} for k, v in config.parameters.items()}
    return out


def _triton_batching(config: ModelRepoConfig) -> dict[str, Any]:
    db = config.dynamic_batching
    assert db is not None
    policy = db.default_queue_policy
    return {
        "preferred_batch_size": list(db.preferred_batch_sizes),
        "max_queue_delay_microseconds": round(db.max_queue_delay_ms * 1000),
        "priority_levels": db.priority_levels,
        "default_priority_level": db.default_priority_level,
        "default_queue_policy": {
            "max_queue_size": policy.max_queue_size,
            "default_timeout_microseconds": round(policy.default_timeout_ms * 1000),
            "allow_timeout_override": policy.allow_timeout_override,
        },
    }
