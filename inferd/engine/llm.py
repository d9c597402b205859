"""The offline API, in vLLM's shape: `from inferd import LLM, SamplingParams`.

>>> llm = LLM()  # the built-in inferd-tiny model (random weights)
>>> out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
>>> len(out[0].outputs[0].token_ids) <= 8
True

LoRA adapters as vLLM's: `LLM(model, enable_lora=True)`, then
`llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "/adapters/sql"))` (one for
every prompt, or a list with one per prompt, None for the base model).
"""

from __future__ import annotations

import concurrent.futures
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm

from inferd.config import DEFAULT_MODEL, EngineConfig
from inferd.engine.llm_engine import LLMEngine, PromptType
from inferd.engine.output_processor import OutputKind
from inferd.lora.request import LoRARequest
from inferd.preprocess.tokenizer import Tokenizer
from inferd.sampling.params import SamplingParams
from inferd.types import RequestOutput

Message = dict[str, Any]
LoRAArg = LoRARequest | Sequence[LoRARequest | None] | None
# How often `add_lora` looks at its load while the engine has no request to step.
_LOAD_POLL_S = 0.05


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_kwargs: Any) -> None:
        self.llm_engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRAArg = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order."""
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = _per_prompt(sampling_params, len(prompt_list))
        prios = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(prios) != len(prompt_list):
            raise ValueError("priority needs one value per prompt")
        loras = _loras_per_prompt(lora_request, len(prompt_list))
        ids = []
        for prompt, p, prio, lora in zip(prompt_list, params, prios, loras, strict=True):
            rid = str(next(self._ids))
            self.llm_engine.add_request(
                rid,
                prompt,
                p,
                priority=prio,
                output_kind=OutputKind.FINAL_ONLY,
                lora_request=lora,
            )
            ids.append(rid)
        return self._run(ids, use_tqdm)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Registers and loads an adapter, returning once it has loaded (True, as vLLM's);
        raises InvalidRequestError with the reason when it cannot be."""
        engine = self.llm_engine
        future = engine.add_lora(lora_request)
        while not future.done():
            # Requests in flight keep running while it loads (the load never blocks a step).
            if engine.has_unfinished_requests():
                engine.step()
            else:
                concurrent.futures.wait([future], timeout=_LOAD_POLL_S)
        future.result()
        return True

    def remove_lora(self, lora_name: str) -> bool:
        """Unregisters an adapter; False if there is none of that name."""
        return self.llm_engine.remove_lora(lora_name)

    def list_loras(self) -> list[LoRARequest]:
        return self.llm_engine.list_loras()

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        lora_request: LoRAArg = None,
    ) -> list[RequestOutput]:
        """Renders each conversation with the model's chat template, then generates."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        tok = self.llm_engine.tokenizer
        prompts: list[PromptType] = []
        for conv in conversations:
            text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)  # type: ignore[arg-type]
            prompts.append({"prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def stream(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        *,
        lora_request: LoRARequest | None = None,
    ) -> Iterator[RequestOutput]:
        """Yields a RequestOutput with the new text and token ids of each step (delta outputs)."""
        rid = str(next(self._ids))
        engine = self.llm_engine
        engine.add_request(
            rid,
            prompt,
            sampling_params or SamplingParams(),
            output_kind=OutputKind.DELTA,
            lora_request=lora_request,
        )
        try:
            finished = False
            while not finished:
                outputs = engine.step()
                self._raise_refused({rid})
                for out in outputs:
                    if out.request_id == rid:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                engine.abort_request(rid)
                engine.step()

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", disable=not use_tqdm) as bar:
            while len(done) < len(ids):
                outputs = engine.step()
                self._raise_refused(wanted - set(done))
                for out in outputs:
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[i] for i in ids]

    def _raise_refused(self, ids: set[str]) -> None:
        """Raises the error of a request the engine refused after accepting it (a structured
        output whose grammar did not compile), aborting the others of this call first."""
        for rid, error in self.llm_engine.take_refused():
            if rid in ids:
                self.llm_engine.abort_request(list(ids - {rid}))
                self.llm_engine.run_to_completion()
                raise error


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return list(params)


def _loras_per_prompt(lora_request: LoRAArg, n: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    if len(lora_request) != n:
        raise ValueError(f"got {len(lora_request)} LoRA requests for {n} prompts")
    return list(lora_request)
