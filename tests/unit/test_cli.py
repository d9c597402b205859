"""`inferd serve`'s flags -> ServeConfig (cli.serve_config): defaults are the config's own,
renamed and derived flags land on their fields, the environment's key joins the flags'."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from inferd.cli import build_parser, main, serve_config
from inferd.config import (
    AdmissionConfig,
    EngineConfig,
    Environment,
    ImageEngineConfig,
    RepositoryConfig,
    ServeConfig,
    ServerConfig,
)
from inferd.engine_args import SECTIONS
from inferd.errors import InferdError

ENV = Environment(cache_dir=Path("/nonexistent/cache"), hf_offline=True)


def config(*argv: str, env: Environment = ENV) -> ServeConfig:
    return serve_config(build_parser().parse_args(["serve", *argv]), env)


def test_no_flags_give_the_config_defaults() -> None:
    assert config() == ServeConfig(env=ENV)
    assert config().engine == EngineConfig()


def test_a_repository_alone_serves_no_llm() -> None:
    cfg = config("--model-repository", "repo", "--load-model", "a", "--load-model", "b")
    assert cfg.engine is None
    assert cfg.repository == RepositoryConfig(path="repo", load_models=("a", "b"))


def test_the_positional_model_names_the_llm_beside_a_repository() -> None:
    cfg = config("m", "--model-repository", "repo")
    assert cfg.engine is not None and cfg.engine.model.model == "m"
    assert config("--model", "x").engine == EngineConfig.from_kwargs(model="x")


def test_renamed_and_derived_flags_land_on_their_fields() -> None:
    cfg = config(
        *("--request-timeout", "3.5", "--shutdown-timeout", "2", "--read-timeout", "1.5"),
        *("--max-queued-requests", "7", "--grpc-port", "-1", "--disable-telemetry"),
    )
    assert cfg.admission == AdmissionConfig(request_timeout_s=3.5, max_queued_requests=7)
    assert cfg.server == ServerConfig(
        shutdown_timeout_s=2.0,
        read_timeout_s=1.5,
        grpc_port=None,
        telemetry=False,
        access_log=False,
    )
    assert config("--disable-access-log").server.telemetry
    assert not config("--disable-dashboard").server.dashboard


def test_the_environment_key_comes_after_the_flags_keys() -> None:
    env = ENV.model_copy(update={"api_key": "from-env"})
    assert config("--api-key", "a", env=env).server.api_keys == ("a", "from-env")
    assert config().server.api_keys == ()


def test_max_body_bytes_bounds_grpc_messages_too() -> None:
    assert config("--max-body-bytes", "1MiB").server.grpc_max_message_bytes == 2**20
    both = config("--max-body-bytes", "1MiB", "--grpc-max-message-bytes", "8MiB")
    assert both.server.grpc_max_message_bytes == 8 * 2**20
    default = ServerConfig().grpc_max_message_bytes
    assert config().server.grpc_max_message_bytes == default  # the default stays


def test_tls_flags_are_checked(tmp_path: Path) -> None:
    with pytest.raises(InferdError, match="given together"):
        config("--ssl-keyfile", __file__)
    with pytest.raises(InferdError, match="is not a file"):
        config("--ssl-keyfile", __file__, "--ssl-certfile", str(tmp_path / "missing"))
    tls = config("--ssl-keyfile", __file__, "--ssl-certfile", __file__).server
    assert (tls.ssl_keyfile, tls.ssl_certfile) == (__file__, __file__)


def test_a_value_the_config_refuses_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "inferd-tiny", "--step-time-target-ms", "-5"]) == 2
    err = capsys.readouterr().err
    assert "scheduler.step_time_target_ms: Input should be greater than or equal to 0" in err
    assert "Traceback" not in err


def test_engine_flags_are_the_config_fields_grouped_by_section() -> None:
    """Each engine field is one flag, in its section's group, with the field's description."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve = sub.choices["serve"]
    groups = {g.title: g for g in serve._action_groups}
    for section in SECTIONS:
        flags = {a.dest: a for a in groups[section.__name__]._group_actions}
        for name, field in section.model_fields.items():
            if name == "enable_chunked_prefill":  # no flag: prefills are always chunked
                continue
            assert field.description and field.description in flags[name].help


def test_engine_flags_keep_their_names_and_forms() -> None:
    engine = config(
        *("--scheduling-policy", "priority", "--grammar-compile-timeout", "5"),
        *("--kv-cache-memory", "2GiB", "--no-enable-prefix-caching", "--enforce-eager"),
        *("--enable-lora", "--lora-modules", "a=/a", '{"name": "b", "path": "/b"}'),
    ).engine
    assert engine is not None
    assert engine.scheduler.policy == "priority"
    assert engine.structured_outputs.grammar_compile_timeout_s == 5.0
    assert engine.cache.kv_cache_memory == 2 * 2**30
    assert not engine.cache.enable_prefix_caching and engine.device.enforce_eager
    assert [m.name for m in engine.lora.lora_modules] == ["a", "b"]


def test_an_image_model_as_model_serves_no_llm(tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text("{}")
    cfg = config(str(tmp_path), "--served-model-name", "sd", "--max-image-rows-per-step", "8")
    assert cfg.engine is None
    assert cfg.image == ImageEngineConfig(
        image_model=str(tmp_path), served_model_name="sd", max_image_rows_per_step=8
    )
    assert config("inferd-tiny-sd").image == ImageEngineConfig(image_model="inferd-tiny-sd")


def test_image_model_flag_adds_an_image_model_beside_the_others() -> None:
    cfg = config(
        "m", "--model-repository", "r", "--image-model", "inferd-tiny-sd",
        "--image-scheduler", "EulerDiscreteScheduler",
    )  # fmt: skip
    assert cfg.engine is not None and cfg.engine.model.model == "m"
    assert cfg.repository is not None
    assert cfg.image == ImageEngineConfig(image_scheduler="EulerDiscreteScheduler")
    assert config("--image-model", "inferd-tiny-sd").engine is None
    assert config().image is None


def test_image_flags_are_the_config_fields() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    groups = {g.title: g for g in sub.choices["serve"]._action_groups}
    flags = {a.dest: a for a in groups["ImageEngineConfig"]._group_actions}
    for name, field in ImageEngineConfig.model_fields.items():
        # --served-model-name's when MODEL is the image model; `lora`: the LoRA flags' section
        if name not in ("served_model_name", "lora"):
            assert field.description and field.description in flags[name].help


def test_lora_modules_go_to_the_lane_their_files_are_for(tmp_path: Path) -> None:
    """diffusers / kohya files: the image model's styles; PEFT folders: the LLM's adapters. The
    other LoRA flags apply to both; with one lane served, every module is its."""
    (tmp_path / "ink").mkdir()
    (tmp_path / "ink" / "pytorch_lora_weights.safetensors").write_bytes(b"")
    (tmp_path / "sketch.safetensors").write_bytes(b"")
    (tmp_path / "sql").mkdir()
    (tmp_path / "sql" / "adapter_config.json").write_text("{}")
    (tmp_path / "sql" / "adapter_model.safetensors").write_bytes(b"")
    modules = [f"{n}={tmp_path / p}" for n, p in [("ink", "ink"), ("sk", "sketch.safetensors")]]
    flags = ("--enable-lora", "--max-loras", "2", "--lora-modules", *modules, f"sql={tmp_path}/sql")
    both = config("m", "--image-model", "inferd-tiny-sd", *flags)
    assert both.engine is not None and both.image is not None
    assert [m.name for m in both.engine.lora.lora_modules] == ["sql"]
    assert [m.name for m in both.image.lora.lora_modules] == ["ink", "sk"]
    assert both.image.lora.enable_lora and both.image.lora.max_loras == 2
    only_images = config("inferd-tiny-sd", *flags).image
    assert only_images is not None
    assert [m.name for m in only_images.lora.lora_modules] == ["ink", "sk", "sql"]
    assert config("inferd-tiny-sd").image == ImageEngineConfig(image_model="inferd-tiny-sd")
