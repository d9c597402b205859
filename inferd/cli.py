"""`inferd` command line. Subcommands: `generate` (offline, streams to stdout), `serve` (HTTP),
`router` (over replicas, inferd/router/command.py), `quantize` (a float checkpoint as int8,
inferd/models/quantize.py)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

from pydantic import ValidationError

from inferd.config import (
    DEFAULT_MODEL,
    AdmissionConfig,
    EngineConfig,
    Environment,
    ImageEngineConfig,
    LoRAConfig,
    RepositoryConfig,
    ServeConfig,
    ServerConfig,
    read_environment,
)
from inferd.engine_args import (
    add_engine_args,
    add_image_args,
    engine_kwargs,
    field_help,
    image_kwargs,
    parse_bytes,
)
from inferd.errors import InferdError
from inferd.lora.flags import split_lora_modules
from inferd.postprocess.tool_parsers import TOOL_PARSERS
from inferd.router.command import add_data_parallel_args, add_router_parser, serve_data_parallel

DEMO_PROMPTS = ("The quick brown fox", "Once upon a time", "def fibonacci(n):")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig.from_kwargs(**engine_kwargs(args))


def _generate(args: argparse.Namespace) -> int:
    from inferd.engine.llm import LLM
    from inferd.sampling.params import SamplingParams

    llm = LLM(**engine_kwargs(args))  # type: ignore[arg-type]
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sample_seed,
        stop=args.stop or None,
        ignore_eos=args.ignore_eos,
    )
    for prompt in args.prompts or DEMO_PROMPTS:
        t0 = time.perf_counter()
        sys.stdout.write(prompt)
        n = 0
        for out in llm.stream(prompt, params):
            sys.stdout.write(out.outputs[0].text)
            sys.stdout.flush()
            n += len(out.outputs[0].token_ids)
        dt = time.perf_counter() - t0
        sys.stdout.write(f"\n[{n} tokens in {dt:.2f} s]\n\n")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from inferd.serve import serve

    if args.ray:
        return _serve_on_ray(args)
    if args.data_parallel_size > 1:
        return serve_data_parallel(args)

    return serve(serve_config(args, read_environment()))


def _serve_on_ray(args: argparse.Namespace) -> int:
    """`inferd serve --ray`: inferd.router.ray_serve takes over (ray is an optional extra)."""
    try:
        from inferd.router.ray_launch import serve_on_ray
    except ImportError as e:
        raise InferdError(f"--ray needs the ray extra ({e.name}): pip install 'inferd[ray]'") from e
    return serve_on_ray(serve_config(args, read_environment()), args.num_replicas)


def serve_config(args: argparse.Namespace, env: Environment) -> ServeConfig:
    """`inferd serve`'s flags and the environment -> the config tree: the one place that maps
    one onto the other. A flag that is None was not given, so its field keeps the config's
    default; flags named like their field need no mapping, the few others are below."""
    model = args.model_pos if args.model_pos is not None else args.model
    image = _image_config(args, model)
    if image is not None and image.image_model == model:
        model = None  # MODEL named the image model, so no LLM is named
    # With a model repository or an image model and no LLM named, the server serves only those.
    serves_llm = model is not None or (args.model_repository is None and image is None)
    engine = {**engine_kwargs(args), "model": model or DEFAULT_MODEL}
    if image is not None:
        image = _with_styles(image, engine, serves_llm)
    return ServeConfig(
        env=env,
        engine=EngineConfig.from_kwargs(**engine) if serves_llm else None,
        admission=_given(AdmissionConfig, args),
        server=_server_config(args, env),
        repository=None if args.model_repository is None else _given(RepositoryConfig, args),
        image=image,
    )


def _image_config(args: argparse.Namespace, model: str | None) -> ImageEngineConfig | None:
    """The image model: MODEL when it is a diffusers folder (model_index.json) or
    inferd-tiny-sd (then --served-model-name names it), else --image-model; None if neither."""
    from inferd.diffusion.loader import is_image_model

    given = image_kwargs(args)
    if model is not None and is_image_model(model):
        if args.image_model is not None:
            raise InferdError(f"MODEL {model!r} is an image model; --image-model names another")
        return ImageEngineConfig.model_validate(
            {**given, "image_model": model, "served_model_name": args.served_model_name}
        )
    if args.image_model is None:
        return None
    return ImageEngineConfig.model_validate(given)


def _with_styles(
    image: ImageEngineConfig, engine: dict[str, object], serves_llm: bool
) -> ImageEngineConfig:
    """The image model gets the LoRA flags and the `--lora-modules` that are UNet styles (the
    rest stay in `engine`, the LLM's): inferd/lora/flags.py's rule."""
    modules = engine.get("lora_modules") or ()
    assert isinstance(modules, list | tuple)
    llm, styles = split_lora_modules(modules, serves_llm, serves_images=True)
    engine["lora_modules"] = llm or None
    lora = {f: engine[f] for f in LoRAConfig.model_fields if engine.get(f) is not None}
    lora["lora_modules"] = styles
    return ImageEngineConfig.model_validate({**image.model_dump(), "lora": lora})


# Config field -> the flag's argparse dest, where the two names differ.
_FLAG_OF = {
    "request_timeout_s": "request_timeout",
    "shutdown_timeout_s": "shutdown_timeout",
    "read_timeout_s": "read_timeout",
    "path": "model_repository",
    "load_models": "load_model",
}
_Section = TypeVar("_Section", AdmissionConfig, ServerConfig, RepositoryConfig)


def _given(section: type[_Section], args: argparse.Namespace, **derived: object) -> _Section:
    """`section` from the flags given for its fields, then the `derived` values."""
    given = {}
    for field in section.model_fields:
        value = getattr(args, _FLAG_OF.get(field, field), None)
        if value is not None:
            given[field] = value
    return section.model_validate({**given, **derived})


def _server_config(args: argparse.Namespace, env: Environment) -> ServerConfig:
    """Keys (--api-key, then INFERD_API_KEY), switches and bounds. --max-body-bytes, when given,
    bounds gRPC messages too (unless --grpc-max-message-bytes says otherwise); left out, both
    keep their defaults (4 MiB HTTP, 64 MiB gRPC)."""
    _check_tls(args)
    _check_tools(args)
    derived: dict[str, object] = {
        "api_keys": (*(args.api_key or ()), *((env.api_key,) if env.api_key else ())),
        "access_log": not (args.disable_access_log or args.disable_telemetry),
        "telemetry": not args.disable_telemetry,
        "dashboard": not args.disable_dashboard,
        "grpc_port": None if args.grpc_port < 0 else args.grpc_port,
    }
    grpc_bytes = args.grpc_max_message_bytes or args.max_body_bytes
    if grpc_bytes is not None:
        derived["grpc_max_message_bytes"] = grpc_bytes
    return _given(ServerConfig, args, **derived)


def _check_tools(args: argparse.Namespace) -> None:
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise InferdError("--enable-auto-tool-choice needs --tool-call-parser")


def _check_tls(args: argparse.Namespace) -> None:
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise InferdError("--ssl-keyfile and --ssl-certfile must be given together")
    for flag in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(args, flag)
        if path is not None and not os.path.isfile(path):
            raise InferdError(f"--{flag.replace('_', '-')} {path!r} is not a file")


def add_security_args(p: argparse.ArgumentParser) -> None:
    """Keys, per-key limits, TLS and hostile-connection bounds (docs/configuration.md)."""
    srv = ServerConfig.model_fields
    g = p.add_argument_group("security (keys, limits, TLS, connections)")
    g.add_argument("--api-key", action="append", help="accepted Bearer key, admin (repeatable)")
    g.add_argument(
        "--api-key-file", default=None, help="keys, one a line: KEY [admin] [name=] [rpm=] ..."
    )
    g.add_argument("--rate-limit-rpm", type=int, default=None, help="requests/min per key")
    g.add_argument("--rate-limit-tpm", type=int, default=None, help="tokens/min per key")
    g.add_argument(
        "--rate-limit-concurrency", type=int, default=None, help="requests at once per key"
    )
    g.add_argument("--ssl-keyfile", default=None, help="TLS private key (PEM), HTTP and gRPC")
    g.add_argument("--ssl-certfile", default=None, help="TLS certificate chain (PEM)")
    g.add_argument("--ssl-ca-certs", default=None, help="CA bundle: require client certs")
    g.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=srv["timeout_keep_alive"].default,
        help=field_help(srv["timeout_keep_alive"]),
    )
    g.add_argument(
        "--read-timeout",
        type=float,
        default=None,
        help="seconds a request's headers and body may take to arrive (default: no limit)",
    )
    g.add_argument(
        "--limit-concurrency", type=int, default=None, help="HTTP connections at once (503 over)"
    )
    g.add_argument(
        "--max-body-bytes",
        type=parse_bytes,
        default=None,
        help=f"request body bound, HTTP and gRPC (default {srv['max_body_bytes'].default})",
    )
    g.add_argument(
        "--grpc-max-message-bytes",
        type=parse_bytes,
        default=None,
        help="gRPC message bound (default: --max-body-bytes when given, else 64 MiB)",
    )


def add_server_args(p: argparse.ArgumentParser) -> None:
    """Server flags, vLLM's names where the concept is the same."""
    adm, srv = AdmissionConfig.model_fields, ServerConfig.model_fields
    p.add_argument("model_pos", nargs="?", default=None, metavar="MODEL", help="same as --model")
    g = p.add_argument_group("server (address, admission queue, telemetry)")
    for flag, field, kind in (
        ("--host", srv["host"], str),
        ("--port", srv["port"], int),
        ("--max-queued-requests", adm["max_queued_requests"], int),
        ("--max-queued-tokens", adm["max_queued_tokens"], int),
        ("--request-timeout", adm["request_timeout_s"], float),
        ("--min-engine-waiting", adm["min_engine_waiting"], int),
        ("--shutdown-timeout", srv["shutdown_timeout_s"], float),
        ("--otlp-traces-endpoint", srv["otlp_traces_endpoint"], str),
        ("--served-model-name", srv["served_model_name"], str),
    ):
        g.add_argument(flag, type=kind, default=field.default, help=field_help(field))
    g.add_argument(
        "--disable-access-log",
        action="store_true",
        help="turn off: " + (srv["access_log"].description or ""),
    )
    g.add_argument(
        "--disable-telemetry",
        action="store_true",
        help="no per-request timings, stage histograms, traces or access log (to measure them)",
    )
    g.add_argument(
        "--disable-dashboard",
        action="store_true",
        help="no /dashboard page, /v1/requests timelines or request log",
    )
    tools = p.add_argument_group("tool calling (vLLM's flags)")
    tools.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='parse tool calls from the model\'s text for tool_choice "auto" (needs the parser)',
    )
    tools.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="the model's tool-call format: hermes (Qwen2.5/3, Hermes), llama3_json, mistral",
    )
    repo = p.add_argument_group("model repository (classic models, Open Inference Protocol)")
    repo.add_argument(
        "--model-repository",
        default=None,
        metavar="DIR",
        help="Triton-style repository DIR/<model>/config.yaml; `examples`: the built-in one",
    )
    repo.add_argument(
        "--load-model",
        action="append",
        metavar="NAME",
        help="load only these models at start (repeatable); default: all",
    )
    repo.add_argument(
        "--grpc-port",
        type=int,
        default=srv["grpc_port"].default,
        help="inference.GRPCInferenceService port; -1: no gRPC",
    )
    repo.add_argument("--allow-pickle", action="store_true", help="allow loading pickled models")
    repo.add_argument(
        "--backend-threads", type=int, default=None, help="intra-op threads per model instance"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inferd", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser(
        "generate",
        help="generate offline and stream the text to stdout",
        usage="inferd generate [PROMPT ...] [options]",
    )
    gen.add_argument("prompts", nargs="*", help="prompts (a few demo prompts when none)")
    add_engine_args(gen)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-p", type=float, default=0.95)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.set_defaults(func=_generate)
    srv = sub.add_parser(
        "serve",
        help="serve LLMs (OpenAI API), classic models (KServe v2) and image models",
        usage="inferd serve [MODEL] [options]",
    )
    add_server_args(srv)
    add_security_args(srv)
    add_engine_args(srv)
    add_image_args(srv)
    srv.set_defaults(model=None)  # resolved in _serve: no LLM when only a repository is given
    srv.set_defaults(func=_serve)
    add_data_parallel_args(srv)
    srv.add_argument(
        "--ray", action="store_true", help="serve on Ray Serve (the ray extra), cache-aware routed"
    )
    srv.add_argument("--num-replicas", type=int, default=1, help="--ray: engine replicas")
    add_router_parser(sub)
    quant = sub.add_parser(
        "quantize",
        help="write a float checkpoint as an int8 one (compressed-tensors int-quantized)",
    )
    quant.add_argument("src", type=Path, help="a Hugging Face model folder (float weights)")
    quant.add_argument("dst", type=Path, help="the new folder")
    quant.add_argument(
        "--ignore",
        action="append",
        metavar="MODULE",
        help="a module kept in float: its name, or re:<pattern> (repeatable; default: lm_head; "
        "--ignore '' quantizes every linear layer)",
    )
    quant.set_defaults(func=_quantize)
    return parser


def _quantize(args: argparse.Namespace) -> int:
    from inferd.models.quantize import quantize_checkpoint

    ignore = ["lm_head"] if args.ignore is None else [m for m in args.ignore if m]
    report = quantize_checkpoint(args.src, args.dst, ignore)
    print(
        f"{args.dst}: {report.quantized} linear weights as int8, {report.kept} tensors kept; "
        f"{report.bytes_in / 2**20:.0f} MiB -> {report.bytes_out / 2**20:.0f} MiB"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # --data-parallel-size's replicas
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.func(args))
    except InferdError as e:
        print(f"inferd: error: {e}", file=sys.stderr)
        return 2
    except ValidationError as e:  # a flag's value the config tree refuses (e.g. a negative count)
        for err in e.errors():
            field = ".".join(str(part) for part in err["loc"])
            print(f"inferd: error: {field}: {err['msg']}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
