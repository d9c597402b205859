"""The one validated config tree.

Built once (from the CLI, the offline `LLM(...)` keyword arguments, or a file) and never mutated.
Values derived at run time (number of KV blocks, EOS ids, the resolved `max_model_len`) live in
runtime objects, not here. This is also the only module that reads the environment.
"""

# Over 500 lines because it is the one tree: every section's fields beside their descriptions,
# which the flags (engine_args.py) and --help are derived from.

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEFAULT_MODEL = "inferd-tiny"

DType = Literal["auto", "float32", "bfloat16", "float16"]
Device = Literal["auto", "cpu", "cuda"]
LoadFormat = Literal["auto", "safetensors", "dummy"]
# "fp8" is float8_e5m2 (as vLLM's CPU backend), the only float8 format the KV cache takes;
# "int8": per-head-row scales (models/kv_int8.py).
KVCacheDType = Literal["auto", "float32", "bfloat16", "fp8", "fp8_e5m2", "int8"]
# "auto": the native CPU kernel where it builds (inferd/models/kernels), else PyTorch.
AttentionBackend = Literal["auto", "cpu_kernel", "torch"]
# "auto": weights prepacked for oneDNN on CPU, F.linear elsewhere (inferd/models/linear.py).
LinearBackend = Literal["auto", "onednn", "dense"]
# Linear layers of 1-2 rows on the plain weight, kept beside the packed one (models/linear.py).
NativeLinearMode = Literal["auto", "on", "off"]
GreedyScreen = Literal["auto", "off"]
Quantization = Literal["int8"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelConfig(_Frozen):
    """What to load. `model` is a local Hugging Face folder, a hub id, or `inferd-tiny`."""

    model: str = Field(default=DEFAULT_MODEL, description="HF folder, hub id, or inferd-tiny")
    tokenizer: str | None = Field(
        default=None, description="tokenizer folder or hub id (default: the model's)"
    )
    revision: str | None = Field(default=None, description="hub revision: a branch, tag or commit")
    dtype: DType = Field(
        default="auto",
        description="auto: the checkpoint's, where the device runs it well",
    )
    load_format: LoadFormat = Field(
        default="auto",
        description="auto, safetensors: the checkpoint; dummy: random weights of its shape",
    )
    seed: int = Field(default=0, description="torch's seed: unseeded sampling and dummy weights")
    max_model_len: int | None = Field(
        default=None,
        gt=0,
        description="tokens per request, prompt + output (default: the model's context)",
    )
    # Applied at load, as vLLM's --quantization; see inferd/models/linear.py.
    quantization: Quantization | None = Field(
        default=None,
        description="int8: per-channel int8 weights, dynamic int8 activations (CPU, VNNI)",
    )


class CacheConfig(_Frozen):
    """Paged KV cache. One pool of `block_size`-token blocks per device."""

    block_size: int = Field(default=16, gt=0, le=1024, description="tokens per KV cache block")
    # None: 4 GiB on CPU (vLLM's CPU default); on CUDA the pool takes `gpu_memory_utilization` of
    # total memory minus what the weights and activations use.
    kv_cache_memory: int | None = Field(
        default=None, gt=0, description="KV cache bytes, or e.g. 2GiB (default: 4GiB on CPU)"
    )
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0.0, le=1.0, description="CUDA: the share of GPU memory inferd may use"
    )
    enable_prefix_caching: bool = Field(
        default=True, description="reuse the KV blocks of prompt prefixes already computed"
    )
    # bfloat16 halves the bytes attention reads per step (and doubles the blocks a budget holds)
    # at bf16's rounding of K and V.
    kv_cache_dtype: KVCacheDType = Field(
        default="auto", description="KV cache element type; auto: the model dtype"
    )
    # "cpu_kernel" fails at start if it cannot build; "torch" is gather + SDPA (the CUDA path).
    attention_backend: AttentionBackend = Field(
        default="auto", description="auto: the native CPU kernel when it builds, else PyTorch"
    )
    # Blocks stored/removed by stable hash, for a router's exact prefix index (kv_cache/events.py).
    # None: off, and nothing is collected.
    kv_events_endpoint: str | None = Field(
        default=None,
        description="publish KV cache events on this ZeroMQ address, e.g. tcp://*:5557",
    )


class SchedulerConfig(_Frozen):
    """Continuous batching limits for one engine step."""

    max_num_batched_tokens: int = Field(default=2048, gt=0, description="tokens one step may run")
    max_num_seqs: int = Field(default=256, gt=0, description="requests one step may run")
    # Prefills longer than the remaining step budget are split across steps (no flag: always on).
    enable_chunked_prefill: bool = Field(
        default=True, description="split long prefills across steps"
    )
    # The halving is predicted from the engine's own step timings (scheduler/step_budget.py);
    # 0 keeps vLLM's behaviour.
    step_time_target_ms: float = Field(
        default=500.0,
        ge=0,
        description="halve the step's budget (to 512) past this time; 0: off",
    )
    policy: Literal["fcfs", "priority"] = Field(
        default="fcfs",
        description="fcfs: by arrival; priority: by priority, then arrival (may preempt)",
    )


class DeviceConfig(_Frozen):
    """Where the model runs and which kernels run its layers."""

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        """`small_batch_gemv`, native_linear's name before it also took large batches."""
        if isinstance(data, dict) and "small_batch_gemv" in data:
            data = {k: v for k, v in data.items() if k != "small_batch_gemv"} | {
                "native_linear": data["small_batch_gemv"]
            }
        return data

    device: Device = Field(default="auto", description="auto: cuda when available, else cpu")
    # None keeps torch's default (one per physical core).
    num_threads: int | None = Field(default=None, gt=0, description="CPU threads for torch")
    # Ignored on CPU.
    enforce_eager: bool = Field(default=False, description="no CUDA graphs for decode batches")
    linear_backend: LinearBackend = Field(
        default="auto",
        description="auto: oneDNN with prepacked weights on CPU; dense: F.linear (reference)",
    )
    # models/linear.py's dispatch plan: panel GEMM (float32; bfloat16 on AVX512_BF16), int8 GEMV.
    native_linear: NativeLinearMode = Field(
        default="auto",
        description="linear layers on native kernels, each weight held once; on: also second"
        " layouts (oneDNN's past 128 rows, int8's GEMV copy); off: oneDNN/fbgemm",
    )
    # The same tokens as the whole lm_head (kernels/greedy.py).
    greedy_screen: GreedyScreen = Field(
        default="auto",
        description="greedy tokens from an int8 screen of the lm_head; auto: with panel GEMM",
    )


class StructuredOutputsConfig(_Frozen):
    """Grammar-constrained outputs (sampling/grammar.py) and the model's reasoning format."""

    # Past it the request is refused (400) and the others never waited on it.
    grammar_compile_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="seconds a request's grammar may compile (then 400)",
    )
    # postprocess/reasoning.py: deepseek_r1, qwen3. None: no reasoning.
    reasoning_parser: str | None = Field(
        default=None,
        description="the model's reasoning format: thinking to `reasoning`, grammars after it",
    )


class SpeculativeConfig(_Frozen):
    """`--speculative-config` (vLLM's keys): how drafts are proposed (inferd/spec_decode).

    "ngram" (prompt lookup) proposes the tokens that followed the latest earlier occurrence of
    the longest suffix n-gram, n in [lookup_min, lookup_max] (one bound given: both are it;
    none: [1, 4]); "draft_model" runs `model`, a smaller model folder with the target's
    vocabulary, k greedy steps a proposal (spec_decode/draft_model.py); vLLM's
    `draft_tensor_parallel_size` is accepted as 1 only. `adaptive` (inferd's own key):
    the engine chooses each request's k per step in [0, num_speculative_tokens] from its
    measured acceptance and the step's cost (spec_decode/policy.py); false: always
    num_speculative_tokens.
    """

    method: Literal["ngram", "draft_model"] = "ngram"
    num_speculative_tokens: int = Field(gt=0, le=16)
    prompt_lookup_min: int | None = Field(default=None, gt=0)
    prompt_lookup_max: int | None = Field(default=None, gt=0)
    model: str | None = None
    draft_tensor_parallel_size: int = 1
    adaptive: bool = True

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        if self.method == "ngram" and self.model is not None:
            raise ValueError("method ngram takes no draft model")
        if self.method == "draft_model" and self.model is None:
            raise ValueError("method draft_model needs `model` (a draft model folder)")
        if self.draft_tensor_parallel_size != 1:
            raise ValueError(
                f"draft_tensor_parallel_size {self.draft_tensor_parallel_size}: only 1 is "
                "supported (the draft runs in the engine process, on the target's device)"
            )
        if self.lookup_max < self.lookup_min:
            raise ValueError(
                f"prompt_lookup_max ({self.lookup_max}) must be >= prompt_lookup_min "
                f"({self.lookup_min})"
            )
        return self

    @property
    def lookup_min(self) -> int:
        """Shortest n-gram matched: prompt_lookup_min, else prompt_lookup_max, else 1."""
        return self.prompt_lookup_min or self.prompt_lookup_max or 1

    @property
    def lookup_max(self) -> int:
        """Longest n-gram matched: prompt_lookup_max, else prompt_lookup_min, else 4."""
        return self.prompt_lookup_max or self.prompt_lookup_min or 4


class SpeculativeSection(_Frozen):
    """Speculative decoding: drafts verified in one forward of the model (inferd/spec_decode)."""

    speculative_config: SpeculativeConfig | None = Field(
        default=None,
        description='JSON, e.g. {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4}; off by default',
    )


class LoRAModule(_Frozen):
    """An adapter served from start-up (`--lora-modules name=path`)."""

    name: str = Field(min_length=1)
    path: str = Field(min_length=1)
    # The base model it was trained on, as /v1/models reports it; None: the served model.
    base_model_name: str | None = None


class LoRAConfig(_Frozen):
    """Many LoRA adapters over one base model, batched together (inferd/lora)."""

    enable_lora: bool = Field(
        default=False, description="serve LoRA adapters over the base model, many in one batch"
    )
    lora_modules: tuple[LoRAModule, ...] = Field(
        default=(),
        description="start-up adapters: name=path, or JSON {name, path, base_model_name}",
    )
    # The slots the step's LoRA kernels read.
    max_loras: int = Field(default=8, gt=0, description="distinct adapters one engine step may run")
    # The slots are sized for it.
    max_lora_rank: int = Field(
        default=16,
        gt=0,
        le=512,
        description="the largest adapter rank accepted (larger: 400)",
    )
    max_cpu_loras: int | None = Field(
        default=None,
        gt=0,
        description="adapters in host memory, LRU evicted (default: max_loras or #lora_modules)",
    )

    @model_validator(mode="after")
    def _check(self) -> LoRAConfig:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
        names = [m.name for m in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules names must be distinct, got {names}")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules need enable_lora")
        return self

    @property
    def cpu_capacity(self) -> int:
        """Adapters host memory keeps loaded."""
        return self.max_cpu_loras or max(self.max_loras, len(self.lora_modules))


class EngineConfig(_Frozen):
    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    device: DeviceConfig = DeviceConfig()
    structured_outputs: StructuredOutputsConfig = StructuredOutputsConfig()
    lora: LoRAConfig = LoRAConfig()
    speculative: SpeculativeSection = SpeculativeSection()

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        """Build the tree from flat vLLM-style keyword arguments (`LLM(model=..., dtype=...)`)."""
        sections: dict[str, dict[str, object]] = {name: {} for name in _SECTIONS}
        for key, value in kwargs.items():
            if value is None and key != "max_model_len":
                continue
            section = _FIELD_TO_SECTION.get(key)
            if section is None:
                raise TypeError(f"unknown engine argument {key!r}")
            sections[section][key] = value
        return cls.model_validate(sections)


_SECTIONS: dict[str, type[_Frozen]] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "device": DeviceConfig,
    "structured_outputs": StructuredOutputsConfig,
    "lora": LoRAConfig,
    "speculative": SpeculativeSection,
}
_FIELD_TO_SECTION = {f: s for s, cls in _SECTIONS.items() for f in cls.model_fields}
_FIELD_TO_SECTION["small_batch_gemv"] = "device"  # native_linear's old name


class Environment(_Frozen):
    """Settings that come from the environment, read here and nowhere else."""

    cache_dir: Path
    hf_offline: bool
    # INFERD_DISABLE_KERNELS=1: never build or load native kernels (the PyTorch path runs).
    disable_kernels: bool = False
    # INFERD_API_KEY: one more admin key (like vLLM's VLLM_API_KEY); None when unset or empty.
    api_key: str | None = None
    # INFERD_ROUTER_REPLICA_API_KEY: the key `inferd router` reads replicas' block digests with.
    router_replica_api_key: str | None = None
    # INFERD_ALLOW_RUNTIME_LORA_UPDATING=1 (or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=True):
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter are served (to admin keys).
    allow_runtime_lora_updating: bool = False

    @field_validator("cache_dir")
    @classmethod
    def _expand(cls, v: Path) -> Path:
        return v.expanduser()


def _flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0", "false", "False")


def read_environment() -> Environment:
    default_cache = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "inferd"
    return Environment(
        cache_dir=Path(os.environ.get("INFERD_CACHE_DIR", str(default_cache))),
        hf_offline=_flag("HF_HUB_OFFLINE"),
        disable_kernels=_flag("INFERD_DISABLE_KERNELS"),
        api_key=os.environ.get("INFERD_API_KEY") or None,
        router_replica_api_key=os.environ.get("INFERD_ROUTER_REPLICA_API_KEY") or None,
        allow_runtime_lora_updating=_flag("INFERD_ALLOW_RUNTIME_LORA_UPDATING")
        or _flag("VLLM_ALLOW_RUNTIME_LORA_UPDATING"),
    )


class AdmissionConfig(_Frozen):
    """The front's bounded queue of requests not yet handed to the engine.

    Over either bound a new request is rejected at once (HTTP 429 with Retry-After). Waiting past
    the deadline fails with "queue_timeout"; generating past it finishes with "timeout"."""

    max_queued_requests: int = Field(
        default=1024, gt=0, description="requests waiting in front of the engine (over it: 429)"
    )
    max_queued_tokens: int = Field(
        default=1_048_576, gt=0, description="prompt tokens of the waiting requests (over it: 429)"
    )
    request_timeout_s: float | None = Field(
        default=600.0,
        gt=0,
        description="seconds from arrival; a request may only shorten it",
    )
    # Unread output tokens one stream may buffer before it is aborted as a stalled reader.
    max_pending_output_tokens: int = Field(default=65_536, gt=0)
    # Waiting beyond the free slots lets a slot that frees mid-step be refilled without a round
    # trip; the rest wait in front, where policy applies.
    min_engine_waiting: int = Field(
        default=4,
        ge=0,
        description="requests the engine may hold waiting beyond its free slots "
        "(the rest queue in front)",
    )


class ServerConfig(_Frozen):
    """The HTTP front (`inferd serve`): where it listens and how it protects itself.

    Admission bounds and deadlines live in AdmissionConfig; this is everything else."""

    host: str = Field(default="0.0.0.0", description="address to listen on")
    port: int = Field(default=8000, ge=0, le=65535, description="HTTP port")
    # Bearer keys accepted on every inference route (/v1/*, /v2/*; not health, /metrics, docs);
    # empty (and no api_key_file): no authentication. These keys (--api-key, INFERD_API_KEY)
    # have the admin scope.
    api_keys: tuple[str, ...] = ()
    # More keys, one per line with optional scope, name and limits (docs/api.md).
    api_key_file: str | None = None
    # Per-key limits for keys that do not set their own; None: unlimited.
    rate_limit_rpm: int | None = Field(default=None, gt=0)  # requests per minute
    rate_limit_tpm: int | None = Field(default=None, gt=0)  # prompt + completion tokens
    rate_limit_concurrency: int | None = Field(default=None, gt=0)  # requests at once
    # TLS for HTTP and gRPC (both use the same key and certificate); None: plain text.
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    # CA bundle for client certificates: given, clients must present one it signed (mTLS).
    ssl_ca_certs: str | None = None
    timeout_keep_alive: float = Field(
        default=5.0, gt=0, description="idle seconds before a keep-alive connection is closed"
    )
    # Seconds a request's headers and body may take to arrive (slow clients are cut off);
    # None: no limit.
    read_timeout_s: float | None = Field(default=None, gt=0)
    # HTTP connections (and requests) at once; over it new ones get 503. None: no cap.
    limit_concurrency: int | None = Field(default=None, gt=0)
    # Request bodies over this many bytes get 413 before they are parsed.
    max_body_bytes: int = Field(default=4 * 2**20, gt=0)
    shutdown_timeout_s: float = Field(
        default=30.0,
        ge=0.0,
        description="after SIGTERM: seconds in-flight requests may take before they are aborted",
    )
    otlp_traces_endpoint: str | None = Field(
        default=None,
        description="OTLP/gRPC collector for traces, e.g. http://localhost:4317 (default: off)",
    )
    # Tool calling with tool_choice "auto" (the default when tools are sent): the model's tool
    # calls are parsed from its text by this parser (postprocess/tool_parsers.py), vLLM's flags.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    served_model_name: str | None = Field(
        default=None, description="the model id clients send and /v1/models lists (default: MODEL)"
    )
    access_log: bool = Field(
        default=True, description="one JSON line per request on the `inferd.access` logger"
    )
    # Per-request telemetry: stage timelines, `timings` in responses, stage histograms, traces.
    # Off (`--disable-telemetry`) only to measure what it costs; the engine gauges stay.
    telemetry: bool = True
    # GET /dashboard and /v1/requests (gateway/dashboard.py); off: `--disable-dashboard`.
    dashboard: bool = True
    # The Open Inference Protocol's gRPC service (inference.GRPCInferenceService); None: off.
    # Only started when a model repository is served.
    grpc_port: int | None = Field(default=8001, ge=0, le=65535)
    # Largest gRPC message accepted or sent (tensors travel inline).
    grpc_max_message_bytes: int = Field(default=64 * 2**20, gt=0)


class RepositoryConfig(_Frozen):
    """Classic models served from a Triton-style model repository (`--model-repository`)."""

    # DIR/<model>/config.yaml + DIR/<model>/<version>/; "examples": the built-in example repository.
    path: str
    # Models loaded at start; empty: every model in the repository. Others load through
    # POST /v2/repository/models/{name}/load.
    load_models: tuple[str, ...] = ()
    # Unpickling runs arbitrary code: pickled models load only when the operator says so.
    allow_pickle: bool = False
    # ONNX Runtime / torch intra-op threads per model instance when its config does not say.
    backend_threads: int | None = Field(default=None, gt=0)


ImageScheduler = Literal[
    "DDIMScheduler",
    "DDPMScheduler",
    "PNDMScheduler",
    "LMSDiscreteScheduler",
    "EulerDiscreteScheduler",
    "EulerAncestralDiscreteScheduler",
    "DPMSolverMultistepScheduler",
    "UniPCMultistepScheduler",
]


class ImageEngineConfig(_Frozen):
    """The image lane: one diffusers pipeline served with step-level batching (inferd/diffusion)."""

    image_model: str = Field(
        default="inferd-tiny-sd",
        min_length=1,
        description="a diffusers folder (model_index.json), inferd-tiny-sd or inferd-tiny-sdxl",
    )
    # Set from --served-model-name when the image model is the server's MODEL; else the
    # folder's name.
    served_model_name: str | None = None
    image_scheduler: ImageScheduler | None = Field(
        default=None, description="the sampler every request uses (default: the folder's)"
    )
    image_dtype: DType = Field(default="auto", description="auto: float32 on CPU, bfloat16 on CUDA")
    image_device: Device = Field(default="auto", description="auto: cuda when available")
    # The role max_num_batched_tokens plays for the LLM: a request at n images with guidance
    # takes 2n rows, so this also bounds n (to rows // 2, at most 10).
    max_image_rows_per_step: int = Field(
        default=32, gt=1, description="UNet rows (images, x2 with guidance) one forward may run"
    )
    # Admitted requests hold their latents and text embeddings; those past the row budget wait
    # at a step boundary (the step policy picks who runs).
    max_admitted_image_requests: int = Field(
        default=64, gt=0, description="image requests admitted to denoising at once"
    )
    max_queued_image_requests: int = Field(
        default=256, gt=0, description="image requests waiting to be admitted (over it: 429)"
    )
    # The VAE's full-resolution activations are the lane's largest tensors.
    max_image_decode_rows: int = Field(
        default=8, gt=0, description="images one VAE decode call may take"
    )
    image_default_steps: int = Field(
        default=50, gt=0, description="denoising steps when a request names none"
    )
    image_max_steps: int = Field(default=150, gt=0, description="the most steps a request may ask")
    # torch's intra-op pool belongs to the process: the image engine runs in the server's,
    # beside the classic models' PyTorch backends (the LLM engine has a process of its own).
    image_threads: int | None = Field(
        default=None, gt=0, description="torch threads of the image engine (default: one a core)"
    )
    max_image_size: int | None = Field(
        default=None, gt=0, description="longest image side in pixels (default: twice native)"
    )
    # The LLM's LoRA flags, for the UNet's styles (inferd/diffusion/lora.py): `--lora-modules`
    # entries whose folder holds a diffusers or kohya LoRA file (inferd/lora/flags.py's
    # `adapter_lane`), the other flags as given.
    lora: LoRAConfig = LoRAConfig()


class ServeConfig(_Frozen):
    """Everything `inferd serve` runs with: built once, at start-up, from the command line and
    the environment (`inferd.cli.serve_config`, the only place flags become config), then
    handed down whole.

    A server runs any of an LLM (`engine`), a model repository (`repository`) and an image
    model (`image`)."""

    env: Environment
    # None: no LLM; the server serves only the model repository.
    engine: EngineConfig | None = EngineConfig()
    admission: AdmissionConfig = AdmissionConfig()
    server: ServerConfig = ServerConfig()
    repository: RepositoryConfig | None = None
    # None: no image model.
    image: ImageEngineConfig | None = None
