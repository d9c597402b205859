"""`echo` on /v1/completions: the prompt's text starts each choice, streamed or not (as vLLM and
OpenAI's legacy completions do); with logprobs it is refused, not ignored."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import Server

from inferd.config import read_environment
from inferd.models.loader import resolve_model_path
from inferd.preprocess.tokenizer import Tokenizer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]
BODY = {"prompt": "Hello there", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def _complete(server: Server, **body: object) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json=BODY | body, timeout=60)


def _streamed_text(server: Server, **body: object) -> str:
    url = f"{server.url}/v1/completions"
    with httpx.stream("POST", url, json=BODY | body | {"stream": True}, timeout=60) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


def test_echo_prepends_the_prompt_streamed_or_not(server: Server) -> None:
    plain = _complete(server).json()["choices"][0]["text"]
    echoed = _complete(server, echo=True, n=2).json()["choices"]
    assert [c["text"] for c in echoed] == ["Hello there" + plain] * 2
    assert _streamed_text(server, echo=True) == "Hello there" + plain


def test_echo_of_token_ids_decodes_them(server: Server) -> None:
    tok = Tokenizer.from_pretrained(resolve_model_path("inferd-tiny", None, read_environment()))
    ids = tok.encode("Hello there")
    r = _complete(server, prompt=ids, echo=True)
    assert r.json()["choices"][0]["text"].startswith(tok.decode(ids))


def test_echo_with_logprobs_is_a_400(server: Server) -> None:
    r = _complete(server, echo=True, logprobs=2)
    assert r.status_code == 400
    assert "echo with logprobs" in r.json()["error"]["message"]
