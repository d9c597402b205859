"""LoRA adapters through the real server and the `openai` client: the `model` field picks one,
/v1/models lists them, runtime load and unload (admin routes, on with the environment flag), and
the errors (unknown adapter 404, bad folder 400). One server for the module: inferd-tiny with one
adapter from start-up; the others are loaded by the tests."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from conftest import Server, start_server, stop_server

from inferd.config import read_environment
from inferd.lora.random_adapter import write_random_adapter
from inferd.models.tiny import ensure_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Adapters of different ranks and targets for inferd-tiny, and one over --max-lora-rank."""
    root = tmp_path_factory.mktemp("adapters")
    model = ensure_tiny_model(read_environment().cache_dir)
    write_random_adapter(model, root / "sql", rank=8, targets=("q_proj", "v_proj"), seed=1)
    write_random_adapter(model, root / "chat", rank=4, targets=("o_proj", "down_proj"), seed=2)
    write_random_adapter(model, root / "wide", rank=32, seed=3)
    return root


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory: pytest.TempPathFactory, adapters: Path) -> Iterator[Server]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("INFERD_ALLOW_RUNTIME_LORA_UPDATING", "1")
        s = start_server(
            tmp_path_factory.mktemp("lora-server"),
            "inferd-tiny",
            "--enable-lora",
            "--lora-modules",
            f"sql={adapters / 'sql'}",
            "--max-lora-rank",
            "16",
        )
    yield s
    stop_server(s)


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def load(server: Server, name: str, path: Path | str) -> httpx.Response:
    body = {"lora_name": name, "lora_path": str(path)}
    return httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, timeout=60)


def unload(server: Server, name: str) -> httpx.Response:
    body = {"lora_name": name}
    return httpx.post(f"{server.url}/v1/unload_lora_adapter", json=body, timeout=60)


def test_models_list_the_adapters(lora_server: Server, adapters: Path) -> None:
    models = client(lora_server).models.list().data
    assert [m.id for m in models] == ["inferd-tiny", "sql"]
    extra = models[1].model_extra or {}
    assert (extra["parent"], extra["root"]) == ("inferd-tiny", str(adapters / "sql"))


def test_requests_name_the_adapter(lora_server: Server) -> None:
    c = client(lora_server)
    out = c.completions.create(model="sql", prompt="Hello", max_tokens=6, temperature=0)
    assert out.model == "sql" and out.usage is not None and out.usage.completion_tokens > 0
    msgs: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "Hi"}]
    chat = c.chat.completions.create(model="sql", messages=msgs, max_tokens=4, temperature=0)
    assert chat.model == "sql" and chat.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="no-such-adapter", prompt="Hello", max_tokens=2)
    assert e.value.code == "model_not_found"


def test_load_use_unload(lora_server: Server, adapters: Path) -> None:
    r = load(lora_server, "chat", adapters / "chat")
    assert r.status_code == 200 and "added successfully" in r.text
    c = client(lora_server)
    assert "chat" in [m.id for m in c.models.list().data]
    out = c.completions.create(model="chat", prompt="Hello", max_tokens=4, temperature=0)
    assert out.model == "chat"
    assert unload(lora_server, "chat").status_code == 200
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="chat", prompt="Hello", max_tokens=2)
    again = unload(lora_server, "chat")
    assert again.status_code == 404 and again.json()["error"]["code"] == "model_not_found"


def test_bad_adapters_are_400_with_the_reason(lora_server: Server, adapters: Path) -> None:
    missing = load(lora_server, "missing", adapters / "nowhere")
    assert missing.status_code == 400, missing.text
    assert str(adapters / "nowhere") in missing.json()["error"]["message"]
    wide = load(lora_server, "wide", adapters / "wide")
    assert wide.status_code == 400 and "rank" in wide.json()["error"]["message"]
    names = [m.id for m in client(lora_server).models.list().data]
    assert "missing" not in names and "wide" not in names


def test_unloading_an_adapter_in_use_lets_its_request_finish(
    lora_server: Server, adapters: Path
) -> None:
    assert load(lora_server, "busy", adapters / "chat").status_code == 200
    # Long enough that it is still decoding when the engine is paused below.
    body = {"model": "busy", "prompt": "Once", "max_tokens": 200, "ignore_eos": True}
    url = f"{lora_server.url}/v1/completions"
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["model"] == "busy"
        unloaded: list[httpx.Response] = []
        with lora_server.engine_paused():
            # The front forgets the name as it sends the removal: new requests are refused at
            # once, while the request already running is the engine's to finish.
            thread = threading.Thread(target=lambda: unloaded.append(unload(lora_server, "busy")))
            thread.start()
            deadline = time.monotonic() + 10
            while "busy" in [m.id for m in client(lora_server).models.list().data]:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert httpx.post(url, json=body, timeout=10).status_code == 404
        thread.join(timeout=30)
        assert unloaded and unloaded[0].status_code == 200
        chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    assert finish[-1] == "length"
