"""Model backends: one factory picks ONNX Runtime, PyTorch or a Python model by `config.backend`.

    backend = open_backend(config, version_dir, BackendOptions())
    backend.infer({"features": batch})

The model file is `config.default_model_filename`, else the backend's default: `model.onnx`
(onnxruntime), `model.pt2` then `model.pt` (pytorch), `model.py` (python).

Pickle policy: unpickling runs whatever code the file names, so `.pkl`, `.pickle` and `.joblib`
files (and torch.save'd modules, see inferd.backends.torch) are refused unless the operator passes
`--allow-pickle` (BackendOptions.allow_pickle). ONNX files are protobuf and load no code.
"""

from __future__ import annotations

from pathlib import Path

from inferd.backends.base import Backend, BackendOptions, TensorSpec
from inferd.errors import ModelLoadError
from inferd.model_config import ModelRepoConfig

__all__ = [
    "PICKLE_SUFFIXES",
    "Backend",
    "BackendOptions",
    "TensorSpec",
    "model_file",
    "open_backend",
    "refuse_pickle",
]

# Tried in order when config.yaml names no default_model_filename.
DEFAULT_FILENAMES: dict[str, tuple[str, ...]] = {
    "onnxruntime": ("model.onnx",),
    "pytorch": ("model.pt2", "model.pt"),
    "python": ("model.py",),
}
PICKLE_SUFFIXES = (".pkl", ".pickle", ".joblib")
ALLOW_PICKLE_HINT = (
    "loading a pickle runs arbitrary code; if you trust this file, start inferd with --allow-pickle"
)


def model_file(config: ModelRepoConfig, version_dir: Path) -> Path:
    """The model file of one version folder; ModelLoadError naming the path when it is missing."""
    if config.default_model_filename:
        path = version_dir / config.default_model_filename
        if not path.is_file():
            raise ModelLoadError(f"model file {path} not found (default_model_filename)")
        return path
    candidates = [version_dir / name for name in DEFAULT_FILENAMES[config.backend]]
    for path in candidates:
        if path.is_file():
            return path
    tried = " or ".join(str(p) for p in candidates)
    raise ModelLoadError(f"model file {tried} not found (default_model_filename names another)")


def refuse_pickle(path: Path, options: BackendOptions) -> None:
    """ModelLoadError for a pickle file unless the operator allowed pickles."""
    if path.suffix.lower() in PICKLE_SUFFIXES and not options.allow_pickle:
        raise ModelLoadError(f"{path} is a pickle file; {ALLOW_PICKLE_HINT}")


def open_backend(config: ModelRepoConfig, version_dir: Path, options: BackendOptions) -> Backend:
    """Load one instance of the model in `version_dir` with the backend config.yaml names.

    Imports each runtime lazily so a repository of ONNX models never imports torch's JIT paths
    (and the gateway process does not pay for runtimes no model uses).
    """
    path = model_file(config, version_dir)
    refuse_pickle(path, options)
    if config.backend == "onnxruntime":
        from inferd.backends.onnx import OnnxBackend

        return OnnxBackend(path, config, options)
    if config.backend == "pytorch":
        from inferd.backends.torch import TorchBackend

        return TorchBackend(path, config, options)
    from inferd.backends.python import PythonBackend

    return PythonBackend(path, config, version_dir)
