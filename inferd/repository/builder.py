"""From a model folder on disk to a ServedModel: read config.yaml, open backends, build steps.

    config = load_model_config(root / "fraud")          # ModelConfigError names file and field
    served = build_model("fraud", "1", config, root / "fraud", root / "fraud" / "1",
                         BackendOptions(), QueueLimits(), observer=None)
    await served.start()

Runs on a worker thread (the repository calls it through asyncio.to_thread): opening a model
can take seconds and must not stall the event loop. Everything it opens is closed again when a
later part fails, so a failed load leaks no sessions.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from inferd.backends import open_backend
from inferd.backends.base import Backend, BackendOptions, TensorSpec
from inferd.batching.pipeline import ServedModel
from inferd.batching.rules import QueueLimits
from inferd.errors import ModelConfigError
from inferd.model_config import CONFIG_FILE, ModelRepoConfig, TensorConfig, load_model_config
from inferd.steps.base import Step
from inferd.steps.classification import load_labels
from inferd.steps.registry import build_steps
from inferd.telemetry.model_metrics import ModelObserver

__all__ = ["build_model", "check_config", "complete_config", "load_model_config"]


def _strip_batch(spec: TensorSpec, config: ModelRepoConfig, kind: str) -> tuple[int, ...]:
    if config.max_batch_size == 0:
        return spec.shape
    if not spec.shape or spec.shape[0] != -1:
        raise ModelConfigError(
            f"max_batch_size: {config.max_batch_size} but the model's {kind} {spec.name!r} has "
            f"no variable batch dimension (shape {list(spec.shape)}); set max_batch_size: 0"
        )
    return spec.shape[1:]


def _completed(
    specs: list[TensorSpec], config: ModelRepoConfig, kind: str
) -> tuple[TensorConfig, ...]:
    return tuple(
        TensorConfig(name=s.name, data_type=s.datatype, dims=_strip_batch(s, config, kind))
        for s in specs
    )


def complete_config(config: ModelRepoConfig, backend: Backend) -> ModelRepoConfig:
    """Triton's auto-complete: an `input`/`output` list config.yaml leaves out comes from the
    model file (dims without the batch dim when max_batch_size > 0).

    Only on a side without steps: with preprocess steps the client sends something else than
    the model takes (text, not input_ids), so the model file cannot describe it; that list
    stays empty and the pipeline takes whatever the steps make."""
    update: dict[str, Any] = {}
    if not config.input and not config.preprocess:
        update["input"] = _completed(backend.inputs(), config, "input")
    if not config.output and not config.postprocess:
        update["output"] = _completed(backend.outputs(), config, "output")
    return config.model_copy(update=update) if update else config


def _check_against(
    declared: tuple[TensorConfig, ...], actual: list[TensorSpec], kind: str, complete: bool
) -> None:
    """config.yaml tensors vs the model file's: names must exist and data types agree.

    `complete`: every required tensor of the model must be listed (inputs, when no preprocess
    step creates model inputs)."""
    by_name = {s.name: s for s in actual}
    for i, t in enumerate(declared):
        spec = by_name.get(t.name)
        if spec is None:
            raise ModelConfigError(
                f"{kind}[{i}].name: {t.name!r} is not an {kind} of the model "
                f"(it has {sorted(by_name)})"
            )
        if spec.datatype != t.data_type:
            raise ModelConfigError(
                f"{kind}[{i}].data_type: {t.data_type} but the model's {t.name!r} is "
                f"{spec.datatype}"
            )
    missing = sorted(set(by_name) - {t.name for t in declared})
    if complete and missing:
        raise ModelConfigError(f"{kind}: the model also takes {missing}; list them too")


def check_config(config: ModelRepoConfig, backend: Backend, python_steps: bool) -> None:
    """Catch a config.yaml that disagrees with its model file at load time, not per request.

    Steps change what the client sends and gets, so the check only covers the side without
    steps. The pytorch/python backends take their specs from the config itself: nothing to do.
    """
    if config.backend != "onnxruntime":
        return
    if not config.preprocess and not python_steps:
        _check_against(config.input, backend.inputs(), "input", complete=True)
    if not config.postprocess and not python_steps:
        _check_against(config.output, backend.outputs(), "output", complete=False)


def _check_embedding(config: ModelRepoConfig) -> None:
    if config.embedding is None:
        return
    inputs = [t.name for t in config.input]
    outputs = [t.name for t in config.output]
    # An empty list (steps on that side, nothing declared) cannot be checked here.
    if inputs and config.embedding.input not in inputs:
        raise ModelConfigError(
            f"embedding.input: {config.embedding.input!r} is not an input (inputs: {inputs})"
        )
    if outputs and config.embedding.output not in outputs:
        raise ModelConfigError(
            f"embedding.output: {config.embedding.output!r} is not an output (outputs: {outputs})"
        )


def _resolve(name: str, model_dir: Path, version_dir: Path, field: str) -> Path:
    for folder in (version_dir, model_dir):
        if (folder / name).is_file():
            return folder / name
    raise ModelConfigError(f"{field}: {name} is in neither {version_dir} nor {model_dir}")


def _labels(config: ModelRepoConfig, model_dir: Path, version_dir: Path) -> dict[str, list[str]]:
    labels: dict[str, list[str]] = {}
    for i, t in enumerate(config.output):
        if t.label_filename:
            where = f"output[{i}].label_filename"
            labels[t.name] = load_labels(_resolve(t.label_filename, model_dir, version_dir, where))
    return labels


def _python_steps(backend: Backend) -> tuple[list[Step], list[Step]]:
    """The python backend's own preprocess/postprocess methods, if the model class has them."""
    pre = getattr(backend, "preprocess_step", None)
    post = getattr(backend, "postprocess_step", None)
    return ([pre] if pre is not None else []), ([post] if post is not None else [])


def _open_backends(
    config: ModelRepoConfig, version_dir: Path, options: BackendOptions
) -> tuple[ModelRepoConfig, list[Backend]]:
    """`instance_count` backends; the first one also fills in a config that lists no tensors."""
    backends = [open_backend(config, version_dir, options)]
    try:
        config = complete_config(config, backends[0])
        while len(backends) < config.instance_count:
            backends.append(open_backend(config, version_dir, options))
    except BaseException:
        close_all(backends)
        raise
    return config, backends


def close_all(backends: Sequence[Backend]) -> None:
    for backend in backends:
        backend.close()


def build_model(
    name: str,
    version: str,
    config: ModelRepoConfig,
    model_dir: Path,
    version_dir: Path,
    options: BackendOptions,
    limits: QueueLimits,
    observer: ModelObserver | None,
) -> ServedModel:
    """One version of a model, not yet started. ModelConfigError/ModelLoadError on failure."""
    with _naming_the_file(model_dir):
        config, backends = _open_backends(config, version_dir, options)
        try:
            return _served(
                name, version, config, backends, model_dir, version_dir, limits, observer
            )
        except BaseException:
            close_all(backends)
            raise


@contextmanager
def _naming_the_file(model_dir: Path) -> Iterator[None]:
    # Field paths mean nothing without the file; messages from the config parser have it.
    where = f"{model_dir.name}/{CONFIG_FILE}"
    try:
        yield
    except ModelConfigError as e:
        if str(e).startswith(where):
            raise
        raise ModelConfigError(f"{where}: {e}") from e


def _served(
    name: str,
    version: str,
    config: ModelRepoConfig,
    backends: list[Backend],
    model_dir: Path,
    version_dir: Path,
    limits: QueueLimits,
    observer: ModelObserver | None,
) -> ServedModel:
    pre, post = _python_steps(backends[0])
    check_config(config, backends[0], python_steps=bool(pre or post))
    _check_embedding(config)
    pre += build_steps(
        config.preprocess, stage="preprocess", model_dir=model_dir, version_dir=version_dir
    )
    # The python class's postprocess runs last: after config steps such as softmax.
    post = (
        build_steps(
            config.postprocess,
            stage="postprocess",
            model_dir=model_dir,
            version_dir=version_dir,
        )
        + post
    )
    labels = _labels(config, model_dir, version_dir)
    return ServedModel(
        name,
        version,
        config,
        backends,
        preprocess=pre,
        postprocess=post,
        labels=labels,
        observer=observer,
        limits=limits,
    )
