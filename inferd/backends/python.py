"""Python backend: a `model.py` in the version folder defines the model as a class.

    class Model:                                   # parameters.python_class picks another name
        def initialize(self, config: dict, version_dir: Path) -> None: ...     # optional
        def preprocess(self, inputs: dict) -> dict: ...    # optional, per request
        def predict(self, inputs: dict) -> dict: ...       # required, batched numpy in/out
        def postprocess(self, outputs: dict) -> dict: ...  # optional, per request
        def finalize(self) -> None: ...                    # optional, on unload

config.yaml must list `input` and `output` (a Python class declares no tensor types).
`preprocess`/`postprocess` run per request on the pipeline's thread pool, possibly on several
threads at once, while `predict` runs on this instance's worker thread: keep them free of shared
mutable state. model.py is imported under a unique module name per instance, so two versions
(or instances) never share module globals; the repository is trusted code, like Triton's.
The version folder is not put on sys.path: keep the model in model.py (or installed packages);
read data files relative to `version_dir`.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from inferd.backends.base import TensorSpec
from inferd.errors import InferdError, ModelConfigError, ModelLoadError
from inferd.model_config import ModelRepoConfig
from inferd.steps.base import Step

_COUNTER = itertools.count()
TensorDict = dict[str, np.ndarray]


class MethodStep:
    """A model class's preprocess/postprocess method as a pipeline Step."""

    def __init__(self, stage: str, method: Callable[[TensorDict], TensorDict]) -> None:
        self.stage = stage
        self._method = method

    def __call__(self, tensors: TensorDict) -> TensorDict:
        out = self._method(tensors)
        if not isinstance(out, dict):
            raise RuntimeError(f"{self.stage} returned {type(out).__name__}, not a dict of arrays")
        return out


def _import(path: Path) -> ModuleType:
    name = f"inferd_user_model_{next(_COUNTER)}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelLoadError(f"{path}: not an importable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling inside model.py look themselves up here
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(name, None)
        raise ModelLoadError(f"{path}: import failed: {type(e).__name__}: {e}") from e
    return module


def _specs(config: ModelRepoConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
    lists = []
    for kind, tensors in (("input", config.input), ("output", config.output)):
        if not tensors:
            raise ModelConfigError(f"{kind}: the python backend needs config.yaml to list {kind}")
        batch = (-1,) if config.max_batch_size > 0 else ()
        lists.append([TensorSpec(t.name, t.data_type, (*batch, *t.dims)) for t in tensors])
    return lists[0], lists[1]


class PythonBackend:
    platform = "python"

    def __init__(self, path: Path, config: ModelRepoConfig, version_dir: Path) -> None:
        self._inputs, self._outputs = _specs(config)
        self._bytes_outputs = {s.name for s in self._outputs if s.datatype == "BYTES"}
        self._module = _import(path)
        self._model: Any = None
        self._model = self._instantiate(path, config, version_dir)
        self.preprocess_step = self._step("preprocess")
        self.postprocess_step = self._step("postprocess")

    def _instantiate(self, path: Path, config: ModelRepoConfig, version_dir: Path) -> Any:
        class_name = str(config.parameters.get("python_class", "Model"))
        cls = getattr(self._module, class_name, None)
        if cls is None:
            self.close()
            raise ModelLoadError(f"{path}: no class {class_name!r} (parameters.python_class)")
        try:
            model = cls()
            if not callable(getattr(model, "predict", None)):
                raise ModelLoadError(f"{path}: {class_name} has no predict(inputs) method")
            if hasattr(model, "initialize"):
                model.initialize(config.model_dump(mode="json"), version_dir)
        except InferdError:
            self.close()
            raise
        except Exception as e:
            self.close()
            why = f"{type(e).__name__}: {e}"
            raise ModelLoadError(f"{path}: {class_name} failed to load: {why}") from e
        return model

    def _step(self, stage: str) -> Step | None:
        method = getattr(self._model, stage, None)
        return MethodStep(stage, method) if callable(method) else None

    def inputs(self) -> list[TensorSpec]:
        return list(self._inputs)

    def outputs(self) -> list[TensorSpec]:
        return list(self._outputs)

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = self._model.predict(inputs)
        if not isinstance(out, dict):
            raise RuntimeError(f"predict returned {type(out).__name__}, not a dict of arrays")
        bytes_outputs = self._bytes_outputs
        return {k: _bytes_array(v) if k in bytes_outputs else np.asarray(v) for k, v in out.items()}

    def close(self) -> None:
        model, self._model = self._model, None
        if model is not None and callable(getattr(model, "finalize", None)):
            model.finalize()
        sys.modules.pop(self._module.__name__, None)


def _bytes_array(value: Any) -> np.ndarray:
    """BYTES outputs as object arrays of bytes (str encoded as UTF-8), whatever predict built."""
    array = np.asarray(value)
    out = np.empty(array.shape, dtype=object)
    out.flat[:] = [v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in array.flat]
    return out
