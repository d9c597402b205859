"""Structured outputs on the tiny model (random weights): whatever the sampling settings, every
answer that finished matches its schema, regex, choice or grammar."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import torch

from inferd import LLM, SamplingParams
from inferd.config import read_environment
from inferd.errors import InvalidRequestError
from inferd.executor.kv_pool import kv_bytes_per_block
from inferd.models.config import ArchConfig
from inferd.models.loader import resolve_model_path
from inferd.sampling.grammar import RequestGrammar
from inferd.sampling.structured import StructuredOutputsParams as Structured
from inferd.types import RequestOutput

PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
        "role": {"enum": ["admin", "user", "guest"]},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
        "tags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "zip": {"type": "integer", "minimum": 0, "maximum": 99999},
                "home": {"$ref": "#/$defs/flag"},
            },
            "required": ["zip", "home"],
        },
        "either": {"anyOf": [{"type": "integer", "maximum": 9, "minimum": 0}, {"type": "null"}]},
    },
    "required": ["name", "age", "score", "role", "code", "tags", "address", "either"],
    "$defs": {"flag": {"type": "boolean"}},
}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", kv_cache_memory=256 << 20, max_num_batched_tokens=256)


def _finished_texts(outs: list[RequestOutput]) -> list[str]:
    texts = [c.text for o in outs for c in o.outputs if c.finish_reason == "stop"]
    assert texts, "no answer finished: the test proves nothing"
    return texts


def _params(structured: Structured, **kw: Any) -> SamplingParams:
    base: dict[str, Any] = {"temperature": 0.9, "max_tokens": 300, "seed": 7}
    return SamplingParams(structured_outputs=structured, **(base | kw))


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.0},
        {"temperature": 0.9, "top_p": 0.9},
        {"temperature": 1.5, "top_k": 50, "n": 3},
        {"temperature": 1.0, "min_p": 0.05, "logprobs": 2},
        {"temperature": 1.0, "repetition_penalty": 1.3, "presence_penalty": 0.5},
    ],
)
def test_json_schema_every_finished_answer_validates(llm: LLM, sampling: dict[str, Any]) -> None:
    params = _params(Structured(json=PERSON, disable_any_whitespace=True), **sampling)
    outs = llm.generate([f"Person {i}:" for i in range(6)], params, use_tqdm=False)
    for text in _finished_texts(outs):
        jsonschema.validate(json.loads(text), PERSON)


def test_any_whitespace_json_still_validates(llm: LLM) -> None:
    small = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    outs = llm.generate(["a", "b", "c"], _params(Structured(json=small)), use_tqdm=False)
    for text in _finished_texts(outs):
        assert json.loads(text)["ok"] in (True, False)


def test_json_object_is_an_object(llm: LLM) -> None:
    params = _params(Structured(json_object=True), max_tokens=200, temperature=0.7)
    outs = llm.generate([f"x{i}" for i in range(4)], params, use_tqdm=False)
    finished = [c for o in outs for c in o.outputs if c.finish_reason == "stop"]
    for c in finished:
        assert isinstance(json.loads(c.text), dict)
    # Unfinished answers are prefixes of JSON (cut by max_tokens), never free text.
    for o in outs:
        assert o.outputs[0].text.lstrip().startswith("{")


def test_regex_choice_and_grammar(llm: LLM) -> None:
    prompts = [f"p{i}" for i in range(5)]
    regex = r"[0-9]{3}-[a-z]{2,4}"
    outs = llm.generate(prompts, _params(Structured(regex=regex)), use_tqdm=False)
    assert all(re.fullmatch(regex, t) for t in _finished_texts(outs))
    choices = ["yes", "no", 'say "maybe"']
    outs = llm.generate(prompts, _params(Structured(choice=choices), n=2), use_tqdm=False)
    assert set(_finished_texts(outs)) <= set(choices)
    grammar = 'root ::= "(" expr ")"\nexpr ::= [0-9] | [0-9] ("+" | "*") expr'
    outs = llm.generate(prompts, _params(Structured(grammar=grammar)), use_tqdm=False)
    for text in _finished_texts(outs):
        assert re.fullmatch(r"\([0-9]([+*][0-9])*\)", text), text


def test_constrained_and_free_requests_share_batches(llm: LLM) -> None:
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["The quick brown fox"], free, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(
        ["The quick brown fox", "q"],
        [free, _params(Structured(regex=r"[a-c]{1,20}"))],
        use_tqdm=False,
    )
    # The free request's greedy tokens are the same whether or not a masked row shares its step.
    assert mixed[0].outputs[0].token_ids == alone
    assert re.fullmatch(r"[a-c]{1,20}", mixed[1].outputs[0].text)


def test_constraint_survives_preemption() -> None:
    # A cache of a few blocks: running requests preempt each other (recompute) as they grow.
    # 16 blocks of 16 tokens: 8 requests of up to ~130 tokens each cannot all stay.
    arch = ArchConfig.from_json(
        resolve_model_path("inferd-tiny", None, read_environment()) / "config.json"
    )
    block = kv_bytes_per_block(arch, 16, torch.float32)
    llm = LLM(dtype="float32", kv_cache_memory=16 * block, block_size=16)
    params = _params(Structured(regex=r"(ab|cd){20,60}"), max_tokens=130)
    outs = llm.generate([f"x{i}" for i in range(8)], params, use_tqdm=False)
    assert llm.llm_engine.num_preemptions_total > 0, "the test must preempt"
    for text in _finished_texts(outs):
        assert re.fullmatch(r"(ab|cd){20,60}", text)


def test_bad_spec_is_refused_and_cached_specs_hit(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="regex"):
        llm.generate(["x"], _params(Structured(regex="(abc")), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="exactly one"):
        Structured(regex="a", choice=["a"])
    engine = llm.llm_engine
    hits, misses = engine.grammar_cache_counts
    llm.generate(["x"], _params(Structured(regex="[xyz]{3}")), use_tqdm=False)
    llm.generate(["y"], _params(Structured(regex="[xyz]{3}")), use_tqdm=False)
    assert engine.grammar_cache_counts == (hits + 1, misses + 1)
    # Nothing of the refused request is left behind.
    assert not engine.has_unfinished_requests()


def test_slow_grammar_is_refused_after_its_timeout_without_holding_back_others() -> None:
    llm = LLM(dtype="float32", kv_cache_memory=64 << 20, grammar_compile_timeout_s=0.05)
    engine = llm.llm_engine
    # Nested oneOf (vllm#54003's shape): ~1 s to compile here, 20x the timeout.
    nested: dict[str, Any] = {"type": "string"}
    for _ in range(7):
        nested = {
            "oneOf": [
                {"type": "object", "properties": {"a": nested, "b": nested}},
                {"type": "array", "items": nested},
            ]
        }
    engine.add_request("slow", "x", _params(Structured(json=nested)))
    engine.add_request("free", "y", SamplingParams(max_tokens=4, ignore_eos=True))
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    refused = engine.take_refused()
    assert finished == ["free"]
    assert [rid for rid, _ in refused] == ["slow"]
    assert "did not compile within" in str(refused[0][1])


def test_reasoning_gate_opens_after_the_end_marker(llm: LLM) -> None:
    compiled = llm.llm_engine.grammar_compiler().submit(Structured(regex="ab")).result()
    end = [11, 12]
    gate = RequestGrammar(compiled, prompt_token_ids=[1, 2], reasoning_end=end)
    assert not gate.active
    assert gate.accept(11) and not gate.active
    assert gate.accept(12) and gate.active
    # A prompt that already closed its reasoning (thinking off) is constrained from the start.
    closed = RequestGrammar(compiled, [5, 9, 11, 12, 3], reasoning_start=[9], reasoning_end=end)
    assert closed.active
    reopened = RequestGrammar(compiled, [11, 12, 9, 4], reasoning_start=[9], reasoning_end=end)
    assert not reopened.active


def test_ignore_eos_continues_freely_after_the_grammar_ends(llm: LLM) -> None:
    params = _params(Structured(choice=["yes", "no"]), ignore_eos=True, max_tokens=12)
    (out,) = llm.generate(["q"], params, use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 12
    assert c.text.startswith(("yes", "no"))


def test_min_tokens_never_pushes_a_finished_grammar_off_its_answer(llm: LLM) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    for temperature in (0.0, 1.0):
        params = _params(
            Structured(json=schema, disable_any_whitespace=True),
            min_tokens=40,
            temperature=temperature,
        )
        (out,) = llm.generate(["x"], params, use_tqdm=False)
        c = out.outputs[0]
        assert c.finish_reason == "stop"
        assert json.loads(c.text) in ({"a": True}, {"a": False})
