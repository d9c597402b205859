"""The offline API on the built-in tiny model: vLLM shapes, sampling, streaming, errors."""

from __future__ import annotations

import random
import subprocess
import sys
import time

import pytest
import torch

from inferd import LLM, SamplingParams
from inferd.config import read_environment
from inferd.engine.llm_engine import TokensPrompt
from inferd.errors import InvalidRequestError
from inferd.models import kernels
from inferd.models.kernels.greedy import GreedyHead
from inferd.types import RequestStatus


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", kv_cache_memory=256 << 20, max_num_batched_tokens=256)


def _greedy(max_tokens: int = 24, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)  # type: ignore[arg-type]


def _random_prompts(n: int, seed: int) -> list[TokensPrompt]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(10, 4000) for _ in range(rng.randint(2, 60))]}
        for _ in range(n)
    ]


def test_generate_shapes(llm: LLM) -> None:
    outs = llm.generate(["Hello there", "The quick brown fox"], _greedy(8), use_tqdm=False)
    assert [o.prompt for o in outs] == ["Hello there", "The quick brown fox"]
    for o in outs:
        assert o.finished and o.prompt_token_ids
        (c,) = o.outputs
        assert len(c.token_ids) == 8 and c.finish_reason == "length"
        assert c.text == llm.get_tokenizer().decode(c.token_ids)


def test_per_prompt_params_and_n(llm: LLM) -> None:
    params = [_greedy(3), SamplingParams(n=3, max_tokens=5, seed=11, ignore_eos=True)]
    a, b = llm.generate(["one", "two"], params, use_tqdm=False)
    assert len(a.outputs) == 1 and len(a.outputs[0].token_ids) == 3
    assert [c.index for c in b.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 5 for c in b.outputs)
    assert len({tuple(c.token_ids) for c in b.outputs}) > 1, "n choices should differ"


def test_seed_reproducible_regardless_of_batch(llm: LLM) -> None:
    target: TokensPrompt = {"prompt_token_ids": [5, 17, 99, 300, 42]}
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=1234, ignore_eos=True)
    alone = llm.generate([target], params, use_tqdm=False)[0].outputs[0].token_ids
    others = _random_prompts(6, seed=5)
    other_params = [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)] * 6
    batched = llm.generate(
        [*others[:3], target, *others[3:]],
        [*other_params[:3], params, *other_params[3:]],
        use_tqdm=False,
    )
    assert batched[3].outputs[0].token_ids == alone


def test_stream_deltas_concatenate_to_final_text(llm: LLM) -> None:
    final = llm.generate(["Once upon a time"], _greedy(30), use_tqdm=False)[0].outputs[0]
    deltas = list(llm.stream("Once upon a time", _greedy(30)))
    assert deltas[-1].finished
    assert "".join(d.outputs[0].text for d in deltas) == final.text
    assert [t for d in deltas for t in d.outputs[0].token_ids] == final.token_ids


def test_stop_string_truncates(llm: LLM) -> None:
    full = llm.generate(["A story:"], _greedy(40), use_tqdm=False)[0].outputs[0].text
    stop = next(
        full[i : i + 2]
        for i in range(3, len(full) - 2)
        if full[i : i + 2].isascii() and full[i : i + 2].strip() == full[i : i + 2]
    )
    out = llm.generate(["A story:"], _greedy(40, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[: full.index(stop)]


def test_stop_token_ids(llm: LLM) -> None:
    ids = llm.generate(["Tokens"], _greedy(12), use_tqdm=False)[0].outputs[0].token_ids
    stop_id = ids[4]
    out = llm.generate(["Tokens"], _greedy(12, stop_token_ids=[stop_id]), use_tqdm=False)
    c = out[0].outputs[0]
    assert c.token_ids == ids[: ids.index(stop_id) + 1]
    assert c.finish_reason == "stop" and c.stop_reason == stop_id


def test_logprobs(llm: LLM) -> None:
    c = llm.generate(["Logprobs"], _greedy(6, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == 6
    for tok, lp in zip(c.token_ids, c.logprobs, strict=True):
        assert tok in lp and lp[tok].rank == 1  # greedy picks the most likely token
        assert 3 <= len(lp) <= 4 and all(v.logprob <= 0.0 for v in lp.values())
    assert c.cumulative_logprob == pytest.approx(
        sum(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True))
    )


def _uncached_llm(dtype: str) -> LLM:
    # The greedy screen off, and prefix caching too: the second generate of the same prompts
    # would hit the cache, and a cached prompt's last token is then recomputed in a batch of a
    # few rows (the panel GEMM) instead of with the whole prompt (oneDNN's GEMM, on AMX where the
    # CPU has it), which sum bfloat16 products in another order; a near-tie of the random model's
    # logits can then flip. These tests compare the argmax paths, not the cache.
    return LLM(
        dtype=dtype,
        kv_cache_memory=64 << 20,
        max_num_batched_tokens=256,
        greedy_screen="off",
        enable_prefix_caching=False,
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plain_greedy_rows_take_the_native_argmax(dtype: str) -> None:
    # Greedy rows with nothing to apply to their logits skip the sampler: the native argmax on
    # the model-dtype logits. Asking for logprobs sends the same rows through the sampler (a
    # float32 copy, torch's argmax): the tokens must not change. (The greedy screen, off here,
    # would take the plain rows before the sampler: the next test.)
    llm = _uncached_llm(dtype)
    sampler = llm.llm_engine.runner.sampler
    if sampler.argmax is None:
        pytest.skip("no native kernels here")
    calls: list[int] = []
    native = sampler.argmax

    def counted(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        assert x.dtype == getattr(torch, dtype)
        return native(x)

    sampler.argmax = counted
    prompts = _random_prompts(5, seed=3)
    plain = llm.generate(prompts, _greedy(12), use_tqdm=False)
    assert calls and sum(calls) == 5 * 12
    calls.clear()
    sampled = llm.generate(prompts, _greedy(12, logprobs=1), use_tqdm=False)
    assert not calls
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in sampled]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_screen_gives_the_full_lm_heads_tokens(dtype: str) -> None:
    # The engine runs without its screen first (the tokens of the whole lm_head), then the test
    # builds one for every row count: plain greedy steps take their tokens from it, and they must
    # be the same.
    llm = _uncached_llm(dtype)
    runner = llm.llm_engine.runner
    native = kernels.load(read_environment().cache_dir) if kernels.kernel_available() else None
    head = runner.model.logits_head()
    if native is None or head is None or head.panel_copy() is None:
        pytest.skip("no native kernels or panel copies here")
    assert runner.greedy_head is None
    prompts = _random_prompts(6, seed=21)
    want = llm.generate(prompts, _greedy(16), use_tqdm=False)
    greedy = GreedyHead.of(
        native.screen,
        native.gemv.panel_rows,
        head.panel_copy(),
        head.plain_weight(),
        min_columns=0,
        max_rows={torch.float32: 128, torch.bfloat16: 128},
    )
    assert greedy is not None
    asked: list[int] = []
    calls: list[int] = []  # rows whose tokens came from the screen

    def counted(x: torch.Tensor) -> torch.Tensor | None:
        asked.append(x.shape[0])
        out = greedy(x)
        if out is not None:
            calls.append(x.shape[0])
        return out

    runner.greedy_head = counted  # type: ignore[assignment]
    got = llm.generate(prompts, _greedy(16), use_tqdm=False)
    assert sum(calls) == 6 * 16  # every token, prefill steps' first tokens included
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    asked.clear()
    llm.generate(prompts, _greedy(4, logprobs=1), use_tqdm=False)
    assert not asked  # logprobs need the logits: the screen is not asked


def test_prefix_cache_hit_gives_same_output(llm: LLM) -> None:
    prompt = _random_prompts(1, seed=9)[0]
    prompt["prompt_token_ids"] = prompt["prompt_token_ids"] * 3  # several full blocks
    first = llm.generate([prompt], _greedy(10), use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate([prompt], _greedy(10), use_tqdm=False)[0].outputs[0].token_ids
    assert again == first


def test_chat(llm: LLM) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    (out,) = llm.chat(msgs, _greedy(5), use_tqdm=False)
    text = llm.get_tokenizer().apply_chat_template(msgs, add_generation_prompt=True)
    assert out.prompt_token_ids == llm.get_tokenizer().encode(text, add_special_tokens=False)
    assert len(out.outputs[0].token_ids) == 5


def test_engine_abort_mid_flight(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.add_request("abort-me", "Hello", _greedy(50))
    engine.step()
    engine.abort_request("abort-me")
    outs = engine.run_to_completion()
    assert [o.outputs[0].finish_reason for o in outs if o.request_id == "abort-me"] == ["abort"]
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_offline_engine_honours_deadlines(llm: LLM) -> None:
    engine = llm.llm_engine
    now = time.monotonic()
    engine.add_request("expired", "Hello", _greedy(50), deadline=now)
    deadline = now + 1.0
    engine.add_request("generating", "Hello there", _greedy(2000), deadline=deadline)
    first = engine.step()  # "expired" ends before it is scheduled; "generating" gets a token
    # The offline engine steps only when called: the deadline passes between two steps, so the
    # request has exactly its first token however fast the machine decodes.
    time.sleep(max(0.0, deadline - time.monotonic()))
    outs = {o.request_id: o for o in [*first, *engine.run_to_completion()] if o.finished}
    queued, late = outs["expired"].outputs[0], outs["generating"].outputs[0]
    assert queued.finish_reason == "timeout" and not queued.token_ids
    assert queued.status is RequestStatus.FINISHED_EXPIRED_WAITING
    assert late.finish_reason == "timeout" and len(late.token_ids) == 1
    assert late.status is RequestStatus.FINISHED_TIMEOUT
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize(
    ("prompt", "params"),
    [
        ({"prompt_token_ids": []}, _greedy(4)),
        ({"prompt_token_ids": [1, 2, 10**9]}, _greedy(4)),
        ({"prompt_token_ids": [1] * 5000}, _greedy(4)),
        ("hello", SamplingParams(max_tokens=100_000)),
    ],
)
def test_invalid_requests(llm: LLM, prompt: object, params: SamplingParams) -> None:
    with pytest.raises(InvalidRequestError):
        llm.generate([prompt], params, use_tqdm=False)  # type: ignore[list-item]
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "bad", [{"temperature": -1.0}, {"top_p": 0.0}, {"max_tokens": 0}, {"temperature": float("nan")}]
)
def test_invalid_sampling_params(bad: dict[str, float]) -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(**bad)  # type: ignore[arg-type]


def test_cli_generate() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "inferd.cli",
            "generate",
            "Hi",
            "--max-tokens",
            "4",
            "--temperature",
            "0",
            "--kv-cache-memory",
            "64MiB",
            "--ignore-eos",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Hi") and "[4 tokens in" in proc.stdout
