"""The schema of `DIR/<model>/config.yaml`: Triton's model configuration field names, in YAML.

    name: fraud                       # optional; must equal the folder name when given
    backend: onnxruntime              # onnxruntime | pytorch | python (Triton `platform` accepted)
    default_model_filename: model.onnx
    max_batch_size: 64                # 0: the model takes no batch dimension and is never batched
    input:
      - {name: features, data_type: TYPE_FP32, dims: [30]}   # dims exclude the batch dim; -1 varies
    output:
      - {name: probabilities, data_type: TYPE_FP32, dims: [2], label_filename: labels.txt}
    dynamic_batching:                 # absent: each request runs alone when an instance is free
      max_queue_delay_ms: 2           # Triton's max_queue_delay_microseconds is accepted too
      preferred_batch_sizes: [16, 32] # Triton: preferred_batch_size
      priority_levels: 2
      default_priority_level: 2
      default_queue_policy: {max_queue_size: 256, default_timeout_ms: 0}
      max_padding_ratio: 0.1          # not Triton: buckets' fill when the call cost is unknown
    instance_count: 1                 # Triton's instance_group: [{count: N, kind: KIND_CPU}] too
    version_policy: {latest: {num_versions: 1}}   # or {all: {}} or {specific: {versions: [1, 3]}}
    parameters: {intra_op_threads: 2}  # backend settings: intra_op_threads, inter_op_threads,
                                      # device (cpu|cuda), python_class (python backend)
    preprocess:  [{type: tokenize, ...}]          # steps; see inferd/steps/registry.py
    postprocess: [{type: mean_pool, ...}]
    embedding: {dimensions: [384]}    # marks an embedding model for POST /v1/embeddings

`load_model_config(model_dir)` reads and validates one file. A bad file fails that model's load
with a ModelConfigError naming the file and the field path, e.g.
`fraud/config.yaml: dynamic_batching.max_queue_delay_ms: Input should be greater than or equal
to 0`; it never takes the server down.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from inferd.errors import ModelConfigError
from inferd.tensors import DATATYPES, from_triton_type

CONFIG_FILE = "config.yaml"

BackendName = Literal["onnxruntime", "pytorch", "python"]

# Triton platform strings -> our backend names.
_PLATFORMS = {
    "onnxruntime_onnx": "onnxruntime",
    "onnx": "onnxruntime",
    "pytorch_libtorch": "pytorch",
    "pytorch_torchscript": "pytorch",
    "pytorch_torchexport": "pytorch",
    "torch": "pytorch",
}
PLATFORM_OF: dict[str, str] = {
    "onnxruntime": "onnxruntime_onnx",
    "pytorch": "pytorch_libtorch",
    "python": "python",
}


class _Strict(BaseModel):
    # Unknown keys are errors: a typo must not silently fall back to a default.
    model_config = ConfigDict(extra="forbid", frozen=True)


class TensorConfig(_Strict):
    name: str = Field(min_length=1)
    data_type: str  # KServe name after validation ("FP32", "BYTES")
    dims: tuple[int, ...]
    # Classification extension: one label per line, index = class id.
    label_filename: str | None = None
    optional: bool = False

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        if isinstance(data, dict) and "datatype" in data and "data_type" not in data:
            data = dict(data)
            data["data_type"] = data.pop("datatype")
        if isinstance(data, dict) and "shape" in data and "dims" not in data:
            data = dict(data)
            data["dims"] = data.pop("shape")
        return data

    @field_validator("data_type")
    @classmethod
    def _datatype(cls, v: str) -> str:
        name = from_triton_type(v.upper())
        if name not in DATATYPES:
            raise ValueError(f"unknown data type {v!r}; one of {sorted(DATATYPES)}")
        return name

    @field_validator("dims")
    @classmethod
    def _dims(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if any(d == 0 or d < -1 for d in v):
            raise ValueError("dims are positive sizes or -1 (variable)")
        return v


class QueuePolicy(_Strict):
    # Requests waiting for this model, over which a new one gets 429 at once. Triton: 0 means
    # unbounded; here 0 means the server default (AdmissionConfig.max_queued_requests).
    max_queue_size: int = Field(default=0, ge=0)
    # A request still queued this long after arrival fails with 503 queue_timeout; 0: none.
    default_timeout_ms: float = Field(default=0.0, ge=0.0)
    # Whether the request's `timeout` parameter is honoured (it may only shorten the default).
    allow_timeout_override: bool = True

    @model_validator(mode="before")
    @classmethod
    def _micros(cls, data: Any) -> Any:
        if isinstance(data, dict) and "default_timeout_microseconds" in data:
            data = dict(data)
            data["default_timeout_ms"] = data.pop("default_timeout_microseconds") / 1000.0
        return data


class DynamicBatching(_Strict):
    max_queue_delay_ms: float = Field(default=0.0, ge=0.0)
    preferred_batch_sizes: tuple[int, ...] = ()
    priority_levels: int = Field(default=0, ge=0)  # 0: one level
    default_priority_level: int = Field(default=0, ge=0)
    default_queue_policy: QueuePolicy = QueuePolicy()
    # Not in Triton. For a model whose call cost could not be timed at load (a synthetic batch
    # failed; otherwise batches are cut by cost, inferd.batching.cost): a batch from one length
    # bucket with rows to spare takes requests of other buckets while padded / total elements of
    # its variable-length inputs stays <= this. 0: each bucket alone. Default 0.1: on CPU
    # (MiniLM, ONNX Runtime, 2 cores) a backend call's fixed cost is about 13-31 tokens of
    # compute, so only near-equal lengths across a bucket edge pay off.
    max_padding_ratio: float = Field(default=0.1, ge=0.0, lt=1.0)

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if "max_queue_delay_microseconds" in data:
            data["max_queue_delay_ms"] = data.pop("max_queue_delay_microseconds") / 1000.0
        if "preferred_batch_size" in data:
            data["preferred_batch_sizes"] = data.pop("preferred_batch_size")
        return data

    @model_validator(mode="after")
    def _levels(self) -> DynamicBatching:
        if self.default_priority_level > self.priority_levels:
            raise ValueError("default_priority_level must be <= priority_levels")
        if any(s < 1 for s in self.preferred_batch_sizes):
            raise ValueError("preferred_batch_sizes must be >= 1")
        return self


class LatestVersions(_Strict):
    num_versions: int = Field(default=1, ge=1)


class AllVersions(_Strict):
    pass


class SpecificVersions(_Strict):
    versions: tuple[int, ...] = Field(min_length=1)


class VersionPolicy(_Strict):
    """Exactly one of latest / all / specific (Triton's oneof); none given means latest 1.

    Typed sub-models (not free dicts) so a typo such as `{latest: {num_version: 2}}` is an error
    instead of silently serving one version.
    """

    latest: LatestVersions | None = None
    all: AllVersions | None = None
    specific: SpecificVersions | None = None

    @model_validator(mode="after")
    def _one(self) -> VersionPolicy:
        given = [k for k in ("latest", "all", "specific") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"version_policy takes one of latest/all/specific, got {given}")
        return self

    def select(self, available: list[int]) -> list[int]:
        """The versions to serve out of the numbered folders present, ascending.

        >>> VersionPolicy(latest={"num_versions": 2}).select([3, 1, 2])
        [2, 3]
        """
        ordered = sorted(available)
        if self.all is not None:
            return ordered
        if self.specific is not None:
            wanted = set(self.specific.versions)
            return [v for v in ordered if v in wanted]
        n = 1 if self.latest is None else self.latest.num_versions
        return ordered[-n:]

    def triton_json(self) -> dict[str, Any]:
        """Triton's JSON form, e.g. {"latest": {"num_versions": 1}}."""
        if self.all is not None:
            return {"all": {}}
        if self.specific is not None:
            return {"specific": {"versions": list(self.specific.versions)}}
        return {"latest": {"num_versions": 1 if self.latest is None else self.latest.num_versions}}


class EmbeddingConfig(_Strict):
    # Output sizes a client may ask for with `dimensions` (truncate + renormalize, Matryoshka
    # style); empty: only the model's full size.
    dimensions: tuple[int, ...] = ()
    output: str = "embedding"  # the output tensor that holds the embedding
    input: str = "text"  # the BYTES input the text goes to


# Backend parameters that must be positive integers (thread counts per instance).
_THREAD_PARAMETERS = ("intra_op_threads", "inter_op_threads")


def _bare(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"string_value"}:
        return value["string_value"]
    return value


def _positive_int(key: str, value: Any) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"parameters.{key} must be a positive integer, got {value!r}") from None
    if number < 1 or isinstance(value, bool) or (isinstance(value, float) and value != number):
        raise ValueError(f"parameters.{key} must be a positive integer, got {value!r}")
    return number


class ModelRepoConfig(_Strict):
    name: str = ""
    backend: BackendName
    default_model_filename: str | None = None
    max_batch_size: int = Field(default=0, ge=0)
    input: tuple[TensorConfig, ...] = ()
    output: tuple[TensorConfig, ...] = ()
    dynamic_batching: DynamicBatching | None = None
    instance_count: int = Field(default=1, ge=1)
    version_policy: VersionPolicy = VersionPolicy()
    parameters: dict[str, Any] = Field(default_factory=dict)
    preprocess: tuple[dict[str, Any], ...] = ()
    postprocess: tuple[dict[str, Any], ...] = ()
    embedding: EmbeddingConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _triton_aliases(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        platform = data.pop("platform", None)
        if platform is not None and "backend" not in data:
            data["backend"] = _PLATFORMS.get(platform, platform)
        groups = data.pop("instance_group", None)
        if groups is not None and "instance_count" not in data:
            data["instance_count"] = sum(int(g.get("count", 1)) for g in groups)
        return data

    @model_validator(mode="after")
    def _unique_names(self) -> ModelRepoConfig:
        for kind, tensors in (("input", self.input), ("output", self.output)):
            names = [t.name for t in tensors]
            if len(names) != len(set(names)):
                raise ValueError(f"{kind} names must be unique, got {names}")
        return self

    @model_validator(mode="after")
    def _preferred_fit(self) -> ModelRepoConfig:
        # Triton refuses a preferred size the batcher could never form.
        sizes = () if self.dynamic_batching is None else self.dynamic_batching.preferred_batch_sizes
        too_big = [s for s in sizes if s > self.max_batch_size]
        if too_big:
            raise ValueError(
                f"dynamic_batching.preferred_batch_sizes {too_big} exceed "
                f"max_batch_size {self.max_batch_size}"
            )
        return self

    @field_validator("parameters", mode="before")
    @classmethod
    def _parameters(cls, v: Any) -> Any:
        # Triton writes parameters as {key: {string_value: "2"}}; keep the bare value.
        if not isinstance(v, dict):
            return v
        out = {k: _bare(p) for k, p in v.items()}
        for key in _THREAD_PARAMETERS:
            if key in out:
                out[key] = _positive_int(key, out[key])
        return out

    def int_parameter(self, key: str) -> int | None:
        """A positive integer from `parameters` (validated when the file was read), or None."""
        value = self.parameters.get(key)
        return None if value is None else int(value)

    @property
    def platform(self) -> str:
        return PLATFORM_OF[self.backend]

    @property
    def batch_delay_s(self) -> float:
        batching = self.dynamic_batching
        return 0.0 if batching is None else batching.max_queue_delay_ms / 1e3


# -- reading config.yaml ----------------------------------------------------------------------


def _field_path(loc: Sequence[int | str]) -> str:
    """('input', 0, 'data_type') -> 'input[0].data_type'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def describe_validation(where: str, error: ValidationError) -> str:
    """`fraud/config.yaml: dynamic_batching.max_queue_delay_ms: Input should be ...` per problem."""
    parts = []
    for problem in error.errors():
        field = _field_path(problem["loc"])
        message = str(problem["msg"]).removeprefix("Value error, ")
        parts.append(f"{where}: {field}: {message}" if field else f"{where}: {message}")
    return "; ".join(parts)


def _read_yaml(path: Path, where: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ModelConfigError(f"{where}: {at}invalid YAML: {problem}") from e
    except (OSError, UnicodeDecodeError) as e:
        raise ModelConfigError(f"{where}: cannot read: {e}") from e
    if data is None:
        raise ModelConfigError(f"{where}: the file is empty; it needs at least `backend:`")
    if not isinstance(data, dict):
        raise ModelConfigError(f"{where}: expected a mapping of fields, got {type(data).__name__}")
    return data


def load_model_config(model_dir: Path) -> ModelRepoConfig:
    """The validated config.yaml of one model folder, with `name` set to the folder name."""
    where = f"{model_dir.name}/{CONFIG_FILE}"
    data = _read_yaml(model_dir / CONFIG_FILE, where)
    try:
        config = ModelRepoConfig.model_validate(data)
    except ValidationError as e:
        raise ModelConfigError(describe_validation(where, e)) from e
    if config.name and config.name != model_dir.name:
        raise ModelConfigError(
            f"{where}: name: {config.name!r} must equal the folder name {model_dir.name!r}"
        )
    return config.model_copy(update={"name": model_dir.name})
