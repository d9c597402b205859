"""PyTorch backend: torch.export programs (`.pt2`) and TorchScript (`.pt`).

Tensor names: a TorchScript or exported module takes positional arguments and returns a tensor
or a tuple, so the names come from config.yaml: `input` lists the arguments in call order and
`output` names the returned tensors in order (a dict return is read by those names). config.yaml
must therefore list both, with data types and dims (there is nothing in the file to auto-complete
them from reliably).

Why these two formats load without --allow-pickle:
- TorchScript (`torch.jit.load`) reads its tensors and constants with TorchScript's own C++
  unpickler, which only rebuilds tensors and TorchScript types and cannot import Python globals;
  the code in the archive is TorchScript, run by the TorchScript interpreter, not Python.
- torch.export (`torch.export.load`) stores the graph as JSON and plain tensors as raw bytes.
  But torch unpickles some parts of a `.pt2` (tensor subclasses, opaque objects, legacy weight
  files, and example inputs when a weights-only load of them fails; torch's own docs warn about
  it). So before loading, `pt2_pickle_reason` checks the archive holds only the parts that load
  without pickle; anything else needs --allow-pickle.
A `torch.save`d module (`torch.save(model)`) is a pickle of arbitrary Python objects and is
refused unless the operator allows pickles; re-export it with torch.jit.script or torch.export.

Threads: `parameters.intra_op_threads` (else the server option) calls torch.set_num_threads,
which is process-wide: every torch model in this process shares that setting.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inferd.backends.base import BackendOptions, TensorSpec
from inferd.errors import ModelConfigError, ModelLoadError
from inferd.model_config import ModelRepoConfig
from inferd.tensors import DATATYPES

_HINT = (
    "loading it runs arbitrary code; if you trust this file, start inferd with --allow-pickle, "
    "or re-export the model with torch.export.save or torch.jit.script(...).save"
)


def _check_config(config: ModelRepoConfig) -> None:
    for kind, tensors in (("input", config.input), ("output", config.output)):
        if not tensors:
            raise ModelConfigError(
                f"{kind}: the pytorch backend needs config.yaml to list every {kind} "
                "(name, data_type, dims) in call/return order"
            )
        for i, t in enumerate(tensors):
            if t.data_type == "BYTES":
                raise ModelConfigError(f"{kind}[{i}].data_type: torch tensors cannot hold BYTES")


def _device(config: ModelRepoConfig) -> torch.device:
    try:
        device = torch.device(str(config.parameters.get("device", "cpu")))
    except RuntimeError as e:
        raise ModelConfigError(f"parameters.device: {e}") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("parameters.device: cuda requested but torch sees no CUDA device")
    return device


def _pt2_member_reason(zf: zipfile.ZipFile, name: str, rel: str) -> str | None:
    """Why one archive member would be unpickled (None: it loads without pickle)."""
    plain = ("archive_format", "archive_version", ".data/version", ".data/serialization_id")
    if rel in plain or rel == "byteorder" or rel.startswith(("models/", "extra/")):
        return None
    if rel.startswith(("data/weights/weight_", "data/constants/tensor_")):
        return None  # raw tensor bytes, read with as_strided
    if rel.endswith(("_weights_config.json", "_constants_config.json")):
        payloads = json.loads(zf.read(name)).get("config", {}).values()
        pickled = [p["path_name"] for p in payloads if p.get("use_pickle")]
        unknown = [
            p["path_name"]
            for p in payloads
            if not str(p.get("path_name", "")).startswith(("weight_", "tensor_"))
        ]
        return f"{rel} lists pickled payloads {pickled + unknown}" if pickled or unknown else None
    if rel.startswith("data/sample_inputs/"):
        try:
            torch.load(zf.open(name), weights_only=True)
        except Exception:  # torch would retry with weights_only=False, i.e. unpickle freely
            return f"{rel} does not load with weights_only=True"
        return None
    return f"{rel} is not a part torch.export.load reads without pickle"


def pt2_pickle_reason(path: Path) -> str | None:
    """Why loading this `.pt2` would unpickle something, or None when it is pickle-free."""
    try:
        with zipfile.ZipFile(path) as zf:
            for name in zf.namelist():
                if name.endswith("/"):
                    continue
                rel = name.split("/", 1)[1] if "/" in name else name
                reason = _pt2_member_reason(zf, name, rel)
                if reason is not None:
                    return reason
    except (zipfile.BadZipFile, ValueError, KeyError, OSError) as e:
        raise ModelLoadError(f"{path}: not a torch.export archive ({e})") from e
    return None


def _load_pt2(path: Path, options: BackendOptions, device: torch.device) -> Callable[..., Any]:
    if not options.allow_pickle:
        reason = pt2_pickle_reason(path)
        if reason is not None:
            raise ModelLoadError(f"{path}: {reason}; {_HINT}")
    try:
        module = torch.export.load(path).module()
    except Exception as e:
        raise ModelLoadError(f"{path}: torch.export.load failed: {e}") from e
    # No .eval(): exported programs refuse train()/eval(); they were traced in eval mode.
    return module.to(device) if device.type != "cpu" else module


def _is_pickled_module(path: Path) -> bool:
    """torch.save output: a zip with data.pkl but no TorchScript constants, or a legacy pickle."""
    if not zipfile.is_zipfile(path):
        return True
    with zipfile.ZipFile(path) as zf:
        rels = {n.split("/", 1)[-1] for n in zf.namelist()}
    return "data.pkl" in rels and "constants.pkl" not in rels


def _load_pickled(path: Path, device: torch.device) -> Callable[..., Any]:
    try:
        obj = torch.load(path, map_location=device, weights_only=False)
    except Exception as e:
        raise ModelLoadError(f"{path}: torch.load failed: {e}") from e
    if not isinstance(obj, torch.nn.Module):
        raise ModelLoadError(
            f"{path} holds a {type(obj).__name__}, not a torch.nn.Module (a state_dict needs "
            "the model's code: export the model with torch.export.save instead)"
        )
    return obj.eval()


def _load_torchscript(
    path: Path, options: BackendOptions, device: torch.device
) -> Callable[..., Any]:
    try:
        module = torch.jit.load(str(path), map_location=device)  # type: ignore[no-untyped-call]
    except Exception as e:
        if not _is_pickled_module(path):
            raise ModelLoadError(f"{path}: torch.jit.load failed: {e}") from e
        if not options.allow_pickle:
            raise ModelLoadError(f"{path} is a torch.save'd (pickled) module; {_HINT}") from e
        return _load_pickled(path, device)
    return module.eval()


def load_module(path: Path, options: BackendOptions, device: torch.device) -> Callable[..., Any]:
    """The callable model in `path`: `.pt2` via torch.export.load, anything else TorchScript."""
    if path.suffix == ".pt2":
        return _load_pt2(path, options, device)
    return _load_torchscript(path, options, device)


def _as_tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    # from_numpy shares memory (no copy); it needs non-negative strides and warns on read-only
    # arrays (raw request bytes are), so only those are copied.
    array = np.ascontiguousarray(array)
    if not array.flags.writeable:
        array = array.copy()
    tensor = torch.from_numpy(array)
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)


def _batched(config: ModelRepoConfig, dims: Sequence[int]) -> tuple[int, ...]:
    return (-1, *dims) if config.max_batch_size > 0 else tuple(dims)


class TorchBackend:
    platform = "pytorch_libtorch"

    def __init__(self, path: Path, config: ModelRepoConfig, options: BackendOptions) -> None:
        _check_config(config)
        self._device = _device(config)
        threads = config.int_parameter("intra_op_threads") or options.intra_op_threads
        if threads is not None:
            torch.set_num_threads(threads)
        self._module: Callable[..., Any] | None = load_module(path, options, self._device)
        self._inputs = [
            TensorSpec(t.name, t.data_type, _batched(config, t.dims)) for t in config.input
        ]
        self._outputs = [
            TensorSpec(t.name, t.data_type, _batched(config, t.dims)) for t in config.output
        ]

    def inputs(self) -> list[TensorSpec]:
        return list(self._inputs)

    def outputs(self) -> list[TensorSpec]:
        return list(self._outputs)

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._module is None:
            raise RuntimeError("the torch module is closed")
        with torch.inference_mode():
            # Positional, in config order; a missing optional input is passed as None.
            args = [
                _as_tensor(inputs[s.name], self._device) if s.name in inputs else None
                for s in self._inputs
            ]
            result = self._module(*args)
            return self._to_numpy(result)

    def _to_numpy(self, result: Any) -> dict[str, np.ndarray]:
        names = [s.name for s in self._outputs]
        if isinstance(result, torch.Tensor):
            tensors = [result]
        elif isinstance(result, dict):
            tensors = [result[n] for n in names if n in result]
        else:
            tensors = list(result)
        if len(tensors) != len(names):
            raise RuntimeError(
                f"the model returned {len(tensors)} tensors but config.yaml lists outputs {names}"
            )
        out: dict[str, np.ndarray] = {}
        for spec, tensor in zip(self._outputs, tensors, strict=True):
            array = tensor.detach().cpu().numpy()
            if array.dtype != DATATYPES[spec.datatype]:
                raise RuntimeError(
                    f"output {spec.name!r} is {array.dtype} but config.yaml says {spec.datatype}"
                )
            out[spec.name] = array
        return out

    def close(self) -> None:
        self._module = None
