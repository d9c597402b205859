"""LoRA's API surface without an engine: flags, messages, the front's cache, the gateway's name
resolution and routes (against test_gateway's fake engine client), labels and timings."""

from __future__ import annotations

import argparse
import asyncio
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest
from fake_llm import FakeLLM
from fastapi.testclient import TestClient

from inferd.cli import build_parser, main, serve_config
from inferd.config import Environment, LoRAConfig, LoRAModule, ServerConfig
from inferd.engine.core_proc import EngineCore
from inferd.engine.info import EngineInfo
from inferd.engine.lora_calls import LoRACalls, raise_for
from inferd.engine.messages import (
    AddLoRA,
    AddRequest,
    CoreReady,
    EngineCoreEvent,
    EngineCoreRequest,
    ListLoRAs,
    LoRAReply,
    RemoveLoRA,
)
from inferd.errors import EngineDeadError, InvalidRequestError
from inferd.gateway import create_app
from inferd.lora.flags import parse_lora_module
from inferd.lora.request import LoRARequest
from inferd.sampling.params import SamplingParams
from inferd.telemetry.metrics import LoRALabels, ServerMetrics, parse_samples
from inferd.telemetry.stages import Stage
from inferd.telemetry.timeline import RequestTimeline
from inferd.types import RequestMetrics

SQL = LoRARequest("sql", 1, "/adapters/sql")

# -- flags ---------------------------------------------------------------------------------------


def test_lora_module_forms() -> None:
    assert parse_lora_module("sql=/a/sql=v2") == LoRAModule(name="sql", path="/a/sql=v2")
    j = parse_lora_module('{"name": "c", "path": "/c", "base_model_name": "Qwen/Qwen3"}')
    assert j == LoRAModule(name="c", path="/c", base_model_name="Qwen/Qwen3")
    for bad in ("sql", "=/x", "sql=", "{bad json", '["a"]', '{"name": "c"}'):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_lora_module(bad)


def _serve(*flags: str) -> LoRAConfig:
    args = build_parser().parse_args(["serve", "inferd-tiny", *flags])
    engine = serve_config(args, Environment(cache_dir=Path("/tmp"), hf_offline=True)).engine
    assert engine is not None
    return engine.lora


def test_lora_flags_build_the_config() -> None:
    assert _serve() == LoRAConfig()  # the defaults are the config's
    lora = _serve(
        "--enable-lora",
        "--lora-modules", "a=/x", "b=/y",
        "--lora-modules", '{"name": "c", "path": "/z", "base_model_name": "m"}',
        "--max-loras", "2", "--max-lora-rank", "32", "--max-cpu-loras", "4",
    )  # fmt: skip
    assert lora.enable_lora and (lora.max_loras, lora.max_lora_rank, lora.cpu_capacity) == (
        2,
        32,
        4,
    )
    assert [(m.name, m.path, m.base_model_name) for m in lora.lora_modules] == [
        ("a", "/x", None),
        ("b", "/y", None),
        ("c", "/z", "m"),
    ]


def test_lora_flag_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--lora-modules", "nopath"])
    assert "not name=path" in capsys.readouterr().err
    # Adapters without --enable-lora: the config tree refuses, main says why (exit 2).
    assert main(["serve", "inferd-tiny", "--lora-modules", "a=/x"]) == 2
    assert "enable_lora" in capsys.readouterr().err


# -- messages and the front's cache ----------------------------------------------------------------


def test_messages_carry_lora_requests() -> None:
    add = AddRequest("r", [1, 2], SamplingParams(), lora_request=SQL)
    wire = msgspec.msgpack.encode(add)
    assert msgspec.msgpack.decode(wire, type=EngineCoreRequest) == add
    info = EngineInfo("/m", "LlamaForCausalLM", "cpu", "float32", 64, 8, 16, 256)
    ready = CoreReady(info, "/tok", loras=[SQL])
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(ready), type=EngineCoreEvent)
    assert isinstance(decoded, CoreReady) and decoded.loras == [SQL]


def test_lora_calls_cache_follows_the_calls() -> None:
    async def run() -> None:
        calls = LoRACalls([SQL])
        assert calls.get("sql") == SQL and calls.next_id() == 2
        chat = LoRARequest("chat", 2, "/adapters/chat")
        message, reply = calls.add(chat)
        assert calls.get("chat") is None  # known once loaded, not before
        calls.on_reply(LoRAReply(message.call_id))
        assert (await reply).error_type is None and calls.all() == [SQL, chat]
        bad, bad_reply = calls.add(LoRARequest("bad", 3, "/nowhere"))
        calls.on_reply(LoRAReply(bad.call_id, "invalid_request", "/nowhere: no such folder"))
        with pytest.raises(InvalidRequestError, match="no such folder"):
            raise_for(await bad_reply)
        assert calls.get("bad") is None
        removal, _ = calls.remove("sql")
        assert calls.get("sql") is None  # refused at once, before the core answers
        _, waiting = calls.list()
        calls.fail_all(EngineDeadError("gone"))
        with pytest.raises(EngineDeadError):
            await waiting
        assert removal.lora_name == "sql"

    asyncio.run(run())


class _Channel:
    def __init__(self) -> None:
        self.sent: list[LoRAReply] = []

    def send(self, payload: bytes) -> None:
        self.sent.append(msgspec.msgpack.decode(payload, type=LoRAReply))


class _Engine:
    """The engine's LoRA contract: add_lora's future, remove_lora's bool, list_loras."""

    def __init__(self) -> None:
        self.loads: dict[str, Future[None]] = {}

    def add_lora(self, lora: LoRARequest) -> Future[None]:
        if lora.lora_path == "/raises":
            raise InvalidRequestError("LoRA is not enabled (--enable-lora)")
        self.loads[lora.lora_name] = Future()
        return self.loads[lora.lora_name]

    def remove_lora(self, name: str) -> bool:
        return name == "sql"

    def list_loras(self) -> list[LoRARequest]:
        return [SQL]


def test_core_answers_lora_calls_without_waiting_on_loads() -> None:
    engine, channel = _Engine(), _Channel()
    core = EngineCore.__new__(EngineCore)  # no process, no socket: just the LoRA calls
    core.engine, core.channel = cast(Any, engine), cast(Any, channel)
    core.encoder, core.loading = msgspec.msgpack.Encoder(), {}
    wire = msgspec.msgpack.encode(AddLoRA(1, SQL))
    core.handle(msgspec.msgpack.decode(wire, type=EngineCoreRequest))
    core.handle(AddLoRA(2, LoRARequest("bad", 2, "/bad")))
    core.handle(AddLoRA(3, LoRARequest("off", 3, "/raises")))
    core.handle(RemoveLoRA(4, "nope"))
    core.handle(ListLoRAs(5))
    assert [(r.call_id, r.error_type) for r in channel.sent] == [(4, "not_found"), (5, None)]
    assert channel.sent[1].loras == [SQL]
    core.answer_loaded()  # the failed add (3) is answered; the loading ones wait
    assert channel.sent[-1].call_id == 3 and "not enabled" in channel.sent[-1].message
    engine.loads["sql"].set_result(None)
    engine.loads["bad"].set_exception(InvalidRequestError("/bad: rank 64 > --max-lora-rank 16"))
    core.answer_loaded()
    replies = {r.call_id: r for r in channel.sent}
    assert replies[1].error_type is None and replies[2].error_type == "invalid_request"
    assert "rank 64" in replies[2].message and not core.loading


# -- the gateway -----------------------------------------------------------------------------------


def _client(lora_updates: bool = False, **server: object) -> tuple[TestClient, FakeLLM]:
    fake = FakeLLM(adapters={"sql": SQL})
    config = ServerConfig(access_log=False, **server)  # type: ignore[arg-type]
    app = create_app(fake, config, lora_updates=lora_updates)
    return TestClient(app, raise_server_exceptions=False), fake


def test_model_field_picks_the_adapter() -> None:
    c, fake = _client()
    r = c.post("/v1/completions", json={"model": "sql", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "sql" and fake.seen[-1]["lora_request"] == SQL
    chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    assert c.post("/v1/chat/completions", json=chat).status_code == 200
    assert fake.seen[-1]["lora_request"] is None
    r = c.post("/v1/completions", json={"model": "nope", "prompt": "hi"})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"


def test_models_list_adapters_after_the_base_model() -> None:
    c, _ = _client()
    data = c.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["fake-model", "sql"]
    assert (data[1]["parent"], data[1]["root"]) == ("fake-model", "/adapters/sql")


def test_load_and_unload_routes() -> None:
    c, fake = _client()
    absent = c.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"})
    assert absent.status_code == 404
    c, fake = _client(lora_updates=True)
    r = c.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": "/adapters/c"})
    assert r.status_code == 200 and "added successfully" in r.text
    assert fake.adapters["chat"].lora_path == "/adapters/c"
    r = c.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/missing"})
    assert r.status_code == 400 and "no adapter_config.json" in r.json()["error"]["message"]
    again = c.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/o"})
    assert again.status_code == 400 and "already been loaded" in again.text
    assert c.post("/v1/load_lora_adapter", json={"lora_name": "sql"}).status_code == 400
    r = c.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert r.status_code == 200 and "removed successfully" in r.text and "chat" not in fake.adapters
    r = c.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_load_needs_the_admin_scope(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-user name=user\nsk-ops admin name=ops\n")
    c, _ = _client(lora_updates=True, api_key_file=str(keys))
    body = {"lora_name": "chat", "lora_path": "/adapters/c"}
    user = {"Authorization": "Bearer sk-user"}
    assert c.post("/v1/load_lora_adapter", json=body, headers=user).status_code == 403
    ops = {"Authorization": "Bearer sk-ops"}
    assert c.post("/v1/load_lora_adapter", json=body, headers=ops).status_code == 200


# -- telemetry ------------------------------------------------------------------------------------


def test_lora_labels_are_bounded() -> None:
    label = LoRALabels(limit=2)
    assert [label(n) for n in (None, "a", "b", "c", "a", "")] == ["", "a", "b", "other", "a", ""]


def test_lora_load_stage_and_label() -> None:
    tl = RequestTimeline("r", arrival=0.0)
    tl.lora_name = "sql"
    tl.mark_enqueued(1.0)
    metrics = RequestMetrics(1.0, first_scheduled_time=4.0, first_token_time=5.0, lora_load_s=2.0)
    metrics.finished_time = 6.0
    tl.update_from_engine(metrics, "r")
    tl.on_tokens(1, 5.0)
    tl.finish(6.5)
    stages = tl.engine_stages()
    assert stages.get(Stage.LORA_LOAD) == 2.0 and stages.get(Stage.QUEUE) == 1.0
    assert stages.starts[Stage.LORA_LOAD] == 2.0
    assert list(tl.as_dict())[:2] == ["lora_load", "queue"]
    m = ServerMetrics()
    m.observe_request(tl, 3, ["stop"])
    samples = parse_samples(m.render().decode())
    assert samples['inferd_requests_finished_total{lora="sql",reason="stop"}'] == 1.0
    assert samples['inferd_prompt_tokens_total{lora="sql"}'] == 3.0
    assert samples['inferd_time_to_first_token_seconds_count{lora="sql"}'] == 1.0
    assert samples["inferd_request_lora_load_seconds_count"] == 1.0
