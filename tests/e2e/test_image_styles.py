"""LoRA styles of an image model over a real `inferd serve inferd-tiny --image-model
inferd-tiny-sd --enable-lora --lora-modules ink=DIR sql=PEFT_DIR`: each module goes to the lane
its files are for, the `model` field picks the style, /v1/models lists styles with their parent,
an unknown style is OpenAI's 404, KServe v2 serves a style under its name, and styles load
and unload at run time (the runtime-update environment gate on) through the LLM adapters'
routes. About 25 s on 2 busy cores, most of it the server's start.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from conftest import Server, start_server, stop_server
from PIL import Image

from inferd.config import read_environment
from inferd.lora.random_adapter import write_random_adapter
from inferd.models.tiny import ensure_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
random_style = pytest.importorskip("inferd.diffusion.random_style")
tiny = pytest.importorskip("inferd.diffusion.tiny")

MODEL = "inferd-tiny-sd"


@pytest.fixture(scope="module")
def styles(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two image styles, a PEFT adapter for the LLM, and a style file that is not one."""
    root = tmp_path_factory.mktemp("styles")
    cache = read_environment().cache_dir
    folder = tiny.ensure_tiny_sd(cache)
    random_style.write_random_style(folder, root / "ink", seed=1)
    random_style.write_random_style(folder, root / "oil", rank=2, seed=2)
    write_random_adapter(ensure_tiny_model(cache), root / "sql", rank=4, seed=3)
    (root / "bad").mkdir()
    (root / "bad" / "pytorch_lora_weights.safetensors").write_bytes(b"not safetensors")
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, styles: Path) -> Iterator[Server]:
    modules = [f"ink={styles / 'ink'}", f"sql={styles / 'sql'}"]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("INFERD_ALLOW_RUNTIME_LORA_UPDATING", "1")
        s = start_server(
            tmp_path_factory.mktemp("styles-server"),
            *("inferd-tiny", "--image-model", MODEL, "--image-threads", "1"),
            *("--enable-lora", "--lora-modules", *modules),
            timeout_s=300,
        )
    yield s
    stop_server(s)


def image(server: Server, model: str, seed: int = 7) -> httpx.Response:
    body = {"prompt": "a fox", "model": model, "size": "64x64", "num_inference_steps": 3}
    return httpx.post(
        f"{server.url}/v1/images/generations", json={**body, "seed": seed}, timeout=120
    )


def pixels(response: httpx.Response) -> np.ndarray[Any, np.dtype[np.int64]]:
    assert response.status_code == 200, response.text
    data = base64.b64decode(response.json()["data"][0]["b64_json"])
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(np.int64)


def models(server: Server) -> dict[str, dict[str, Any]]:
    data = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]
    return {m["id"]: m for m in data}


def adapter(server: Server, route: str, **body: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}_lora_adapter", json=body, timeout=120)


def test_modules_go_to_their_lane_and_models_list_them(server: Server) -> None:
    listed = models(server)
    assert listed["ink"]["parent"] == MODEL and listed["ink"]["kind"] == "image"
    assert listed["sql"]["parent"] == "inferd-tiny"


def test_the_model_field_picks_the_style(server: Server) -> None:
    base, ink = pixels(image(server, MODEL)), pixels(image(server, "ink"))
    assert np.abs(base - ink).max() > 3  # the style changes the image, same seed
    assert np.abs(pixels(image(server, "ink")) - ink).max() <= 3  # and it is reproducible
    # KServe v2 serves the style as a model of its name: the same image for the same request.
    inputs = [{"name": "prompt", "shape": [1], "datatype": "BYTES", "data": ["a fox"]}]
    for name, value in (("steps", 3), ("seed", 7), ("width", 64), ("height", 64)):
        inputs.append({"name": name, "shape": [1], "datatype": "INT64", "data": [value]})
    kserve = httpx.post(f"{server.url}/v2/models/ink/infer", json={"inputs": inputs}, timeout=120)
    assert kserve.status_code == 200, kserve.text
    out = kserve.json()["outputs"][0]
    assert np.abs(np.asarray(out["data"]).reshape(out["shape"])[0] - ink).max() <= 3
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    with c, pytest.raises(openai.NotFoundError) as e:
        c.images.generate(prompt="a fox", model="no-such-style", size="64x64")
    assert e.value.code == "model_not_found"


def test_styles_load_and_unload_at_run_time(server: Server, styles: Path) -> None:
    loaded = adapter(server, "load", lora_name="oil", lora_path=str(styles / "oil"))
    assert loaded.status_code == 200 and "added successfully" in loaded.text
    assert models(server)["oil"]["parent"] == MODEL
    pixels(image(server, "oil"))
    taken = adapter(server, "load", lora_name="ink", lora_path=str(styles / "oil"))
    assert taken.status_code == 400
    bad = adapter(server, "load", lora_name="bad", lora_path=str(styles / "bad"))
    assert bad.status_code == 400 and "could not be read" in bad.json()["error"]["message"]
    assert "bad" not in models(server)
    assert adapter(server, "unload", lora_name="oil").status_code == 200
    gone = image(server, "oil")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    again = adapter(server, "unload", lora_name="oil")
    assert again.status_code == 404 and again.json()["error"]["code"] == "model_not_found"
    # A PEFT folder is the LLM's.
    chat = adapter(server, "load", lora_name="chat", lora_path=str(styles / "sql"))
    assert chat.status_code == 200 and models(server)["chat"]["parent"] == "inferd-tiny"
    assert adapter(server, "unload", lora_name="chat").status_code == 200
