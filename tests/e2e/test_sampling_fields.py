"""What the request fields that map to sampling parameters do, over HTTP on a real server.

Each test asserts an effect, measured against the same server's greedy output (the tiny model's
weights are random, so no text is known in advance): a stop string cuts the text there, a stop
token id ends the choice on that token, `top_k=1` samples what greedy picks, a penalty makes the
output stop repeating itself, a message's role or content form changes the prompt as specified.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from conftest import Server

from inferd.config import read_environment
from inferd.models.tiny import ensure_tiny_model
from inferd.preprocess.tokenizer import Tokenizer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Tell me about the river."}]


def complete(server: Server, **fields: Any) -> dict[str, Any]:
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **fields}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


def chat(server: Server, **fields: Any) -> dict[str, Any]:
    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **fields}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


def tokens(doc: dict[str, Any]) -> list[str]:
    """The generated tokens' text, from a completion asked with `logprobs=0`."""
    return list(doc["choices"][0]["logprobs"]["tokens"])


@pytest.fixture(scope="module")
def greedy(server: Server) -> dict[str, Any]:
    return complete(server, logprobs=0)


def test_a_stop_string_cuts_the_text_where_it_first_appears(
    server: Server, greedy: dict[str, Any]
) -> None:
    text = greedy["choices"][0]["text"]
    stop = tokens(greedy)[2]
    cut = text.index(stop)
    choice = complete(server, stop=[stop, "never in this text \u2603"])["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (
        text[:cut],
        "stop",
        stop,
    )
    kept = complete(server, stop=stop, include_stop_str_in_output=True)["choices"][0]
    assert kept["text"] == text[: cut + len(stop)]


def test_a_stop_string_cuts_a_stream_the_same_way(server: Server, greedy: dict[str, Any]) -> None:
    text = greedy["choices"][0]["text"]
    stop = tokens(greedy)[2]
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stop": stop, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: {")]
    choices = [json.loads(e.removeprefix("data: "))["choices"][0] for e in events]
    assert "".join(c["text"] for c in choices) == text[: text.index(stop)]
    assert choices[-1]["finish_reason"] == "stop"


def test_min_tokens_holds_back_stop_strings_too(server: Server, greedy: dict[str, Any]) -> None:
    # vLLM's rule: no stop string ends within the first min_tokens tokens' text.
    text, generated = greedy["choices"][0]["text"], tokens(greedy)
    first, stop = next((i, t) for i, t in enumerate(generated) if t in generated[i + 1 :])
    min_tokens = first + 1  # the stop's first occurrence is inside them
    boundary = len("".join(generated[:min_tokens]))
    cut = text.find(stop, boundary - len(stop) + 1)  # the first that ends past them
    assert 0 <= text.index(stop) < cut
    choice = complete(server, stop=stop, min_tokens=min_tokens)["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (text[:cut], "stop")


def test_a_stop_token_id_ends_the_choice_on_that_token(
    server: Server, greedy: dict[str, Any]
) -> None:
    tok = Tokenizer.from_pretrained(ensure_tiny_model(read_environment().cache_dir))
    generated = tokens(greedy)
    # The first generated token after the first that is one id of its own when encoded alone.
    position, token_id = next(
        (i, ids[0])
        for i, t in enumerate(generated)
        if i > 0 and len(ids := tok.encode(t, add_special_tokens=False)) == 1
    )
    first = next(i for i, t in enumerate(generated) if t == generated[position])
    doc = complete(server, stop_token_ids=[token_id])
    choice = doc["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", token_id)
    assert doc["usage"]["completion_tokens"] == first + 1  # the stop token is the last one


def test_max_completion_tokens_bounds_the_answer(server: Server) -> None:
    doc = chat(server, max_completion_tokens=3)
    assert doc["usage"]["completion_tokens"] == 3
    assert doc["choices"][0]["finish_reason"] == "length"
    # OpenAI's newer name wins over the deprecated one.
    assert chat(server, max_completion_tokens=3, max_tokens=6)["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("fields", [{"top_k": 1}, {"min_p": 1.0}, {"top_p": 1e-9}])
def test_a_filter_that_keeps_only_the_top_token_samples_what_greedy_picks(
    server: Server, greedy: dict[str, Any], fields: dict[str, Any]
) -> None:
    sampled = complete(server, temperature=1.0, seed=3, **fields)
    assert sampled["choices"][0]["text"] == greedy["choices"][0]["text"]


def test_unfiltered_sampling_does_differ_from_greedy(
    server: Server, greedy: dict[str, Any]
) -> None:
    # The control for the test above: at temperature 1 the filters are what makes it greedy.
    texts = {complete(server, temperature=1.0, seed=s)["choices"][0]["text"] for s in range(3)}
    assert texts != {greedy["choices"][0]["text"]}


@pytest.mark.parametrize(
    "fields",
    [{"repetition_penalty": 2.0}, {"presence_penalty": 2.0}, {"frequency_penalty": 2.0}],
)
def test_a_strong_penalty_stops_the_output_repeating_itself(
    server: Server, greedy: dict[str, Any], fields: dict[str, Any]
) -> None:
    assert len(set(tokens(greedy))) < len(tokens(greedy))  # greedy repeats itself here
    penalized = tokens(complete(server, logprobs=0, **fields))
    assert len(set(penalized)) == len(penalized)


@pytest.mark.parametrize(
    "fields",
    [{"repetition_penalty": 1.0}, {"presence_penalty": 0.0}, {"frequency_penalty": 0.0}],
)
def test_a_neutral_penalty_changes_nothing(
    server: Server, greedy: dict[str, Any], fields: dict[str, Any]
) -> None:
    assert complete(server, **fields)["choices"][0]["text"] == greedy["choices"][0]["text"]


def test_the_developer_role_is_the_system_role(server: Server) -> None:
    def with_role(role: str) -> dict[str, Any]:
        messages = [{"role": role, "content": "Answer in one line."}, *MESSAGES]
        return chat(server, messages=messages)

    developer, system = with_role("developer"), with_role("system")
    assert developer["usage"]["prompt_tokens"] == system["usage"]["prompt_tokens"]
    assert developer["choices"][0]["message"] == system["choices"][0]["message"]
    # ...and a system message is really part of the prompt.
    assert system["usage"]["prompt_tokens"] > chat(server)["usage"]["prompt_tokens"]


def test_content_as_a_list_of_text_parts_is_their_concatenation(server: Server) -> None:
    parts = [{"type": "text", "text": "Tell me about "}, {"type": "text", "text": "the river."}]
    as_parts = chat(server, messages=[{"role": "user", "content": parts}])
    as_string = chat(server)
    assert as_parts["usage"]["prompt_tokens"] == as_string["usage"]["prompt_tokens"]
    assert as_parts["choices"][0]["message"] == as_string["choices"][0]["message"]


def test_chat_template_kwargs_reach_the_template(server: Server) -> None:
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={
            "messages": MESSAGES,
            "max_tokens": 2,
            "chat_template_kwargs": {"chat_template": "x"},
        },
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "chat_template"
    unread = chat(server, chat_template_kwargs={"a_variable_no_template_reads": 1})
    assert unread["usage"]["prompt_tokens"] == chat(server)["usage"]["prompt_tokens"]


def test_chat_template_kwargs_override_the_generation_prompt(server: Server) -> None:
    without = chat(server, chat_template_kwargs={"add_generation_prompt": False})
    assert without["usage"]["prompt_tokens"] < chat(server)["usage"]["prompt_tokens"]
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"messages": []},
        },
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
