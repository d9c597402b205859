"""Grammar-constrained sampling (xgrammar): compile once per spec off the step loop, mask each step.

    compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
    future = compiler.submit(params.structured_outputs)   # a thread compiles; the loop goes on
    grammar = RequestGrammar(future.result(), ...)        # once done: one matcher per sequence
    masks = GrammarMasks(vocab_size)
    masks.apply(logits, [(row, grammar, drafts), ...])    # refused tokens' logits -> -inf
    held = grammar.rollback_drafts(num_kept)              # after sampling: the drafts kept,
    grammar.accept(t) for t in new_tokens[held:]          # then the step's other new tokens

Compilation: xgrammar builds the grammar and its per-token mask cache for this tokenizer (~1 ms
for a small schema, seconds for a deeply nested `oneOf`). It releases the GIL, so the engine keeps
stepping while a request waits for its grammar (LLMEngine holds such requests back, with a
deadline: `StructuredOutputsConfig.compile_timeout_s`). Results (and failures) are cached by the
spec's canonical text, least recently used out; a request for a spec that is still compiling
waits on the same future.

Masks: one int32 bitmask [rows, ceil(V / 32)] filled for the batch's constrained rows in one call
(xgrammar's BatchGrammarMatcher), then applied to the float32 logits before the sampler, so every
sampling path (greedy, top-k/p, seeds, logprobs) only ever sees allowed tokens. A finished grammar
allows only the stop tokens (the engine's EOS ids), so the request ends as any other does.

Speculative decoding: a request's d drafts sample d + 1 rows, and row j gets the mask of the state
after drafts[:j], as decoding token by token would apply. `fill_draft_masks` advances the matcher
through the drafts, one mask per row; at a draft the grammar refuses it stops, so that draft's
row refuses it (verification rejects it and everything after it) and the rows after it stay
unmasked (their tokens are discarded). `rollback_drafts` then rolls the matcher back to the
drafts verification kept (xgrammar's rollback is unlimited), and the step's other new tokens
are accepted as usual.

Reasoning models: with a reasoning parser the constraint applies from the end of the reasoning
(its end marker, e.g. `</think>`, in the prompt's tail or the output), not before.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import tokenizers
import xgrammar as xgr
from torch import Tensor

from inferd.errors import InvalidRequestError
from inferd.sampling.structured import StructuredOutputsParams

logger = logging.getLogger("inferd.grammar")

_CACHE_ENTRIES = 512
# Compiler threads: a CPU server's cores belong to the forward; two let a slow compile not hold
# back every other new schema.
_COMPILE_WORKERS = 2

CompiledGrammar = xgr.CompiledGrammar
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer in a thread pool, with an LRU cache.

    `hits` / `misses` count submits that found the spec cached (done or compiling) or not."""

    def __init__(
        self, tokenizer: tokenizers.Tokenizer, vocab_size: int, stop_token_ids: Iterable[int]
    ) -> None:
        # xgrammar reads the vocabulary's type (byte-level, byte fallback, raw) from a
        # transformers tokenizer; wrapping ours copies no files.
        from transformers import PreTrainedTokenizerFast

        wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer)  # type: ignore[no-untyped-call]
        self.info = xgr.TokenizerInfo.from_huggingface(
            wrapped, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._pool = ThreadPoolExecutor(_COMPILE_WORKERS, thread_name_prefix="inferd-grammar")
        self._cache: OrderedDict[tuple[str, str], Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def submit(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """The compiled grammar's future; raises InvalidRequestError (through `result()`) when
        the spec does not compile."""
        key = params.spec()
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return future
            self.misses += 1
            future = self._pool.submit(self._compile, key)
            self._cache[key] = future
            if len(self._cache) > _CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return future

    def _compile(self, key: tuple[str, str]) -> CompiledGrammar:
        kind, text = key
        try:
            return self._compile_kind(kind, text)
        except Exception as e:  # xgrammar raises RuntimeError/ValueError with the reason
            what = kind.split(":")[0].replace("_", " ")
            raise InvalidRequestError(
                f"cannot compile the {what}: {_first_line(e)}", "structured_outputs"
            ) from e

    def _compile_kind(self, kind: str, text: str) -> CompiledGrammar:
        compiler = self._compiler
        if kind.startswith(("json:", "json_object")) or kind == "json":
            # json_object is any JSON object (OpenAI's meaning), not any JSON value.
            schema = '{"type": "object"}' if kind.startswith("json_object") else text
            any_whitespace = not kind.endswith(":compact")
            grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace)
            return compiler.compile_grammar(_escape_control_characters(str(grammar)))
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "choice":
            options = " | ".join(_ebnf_string(c) for c in json.loads(text))
            return compiler.compile_grammar(f"root ::= {options}")
        if kind == "grammar":
            return compiler.compile_grammar(text)
        if kind == "structural_tag":
            return compiler.compile_structural_tag(text)
        raise ValueError(f"unknown structured output kind {kind!r}")

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# xgrammar 0.2.9 writes a string with maxLength/minLength as characters `[^"\\\r\n]`, which
# lets a raw control character (U+0000-U+001F) into the JSON: RFC 8259 requires those escaped,
# and strict parsers (Python's json, JSON.parse) refuse the answer. Its other strings exclude them.
_LOOSE_CHARACTERS = r"[^\"\\\r\n]"
_STRICT_CHARACTERS = r"[^\0-\x1f\"\\\r\n]"


def _escape_control_characters(ebnf: str) -> str:
    return ebnf.replace(_LOOSE_CHARACTERS, _STRICT_CHARACTERS)


def _ebnf_string(text: str) -> str:
    """An EBNF string literal: JSON's escapes are EBNF's (xgrammar reads \\" \\\\ \\n \\uXXXX)."""
    return json.dumps(text, ensure_ascii=False)


def _first_line(e: Exception) -> str:
    """xgrammar's message without its log prefix ("[04:23:54] /project/cpp/x.cc:94: ")."""
    text = str(e).strip() or type(e).__name__
    return _LOG_PREFIX.sub("", text.splitlines()[-1])[:500]


class RequestGrammar:
    """One sequence's grammar state: an xgrammar matcher, and the reasoning gate.

    `reasoning_end`: the token ids that end a reasoning section (e.g. `</think>`), or empty when
    the constraint applies from the first token. The gate opens when the prompt's tail (after
    its last `reasoning_start`) or the output contains them."""

    def __init__(
        self,
        compiled: CompiledGrammar,
        prompt_token_ids: Sequence[int] = (),
        reasoning_start: Sequence[int] = (),
        reasoning_end: Sequence[int] = (),
    ) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        # Drafts the matcher accepted in fill_draft_masks, for rollback_drafts.
        self._num_draft_tokens = 0
        self._end = list(reasoning_end)
        self._recent: list[int] = []
        self._active = not self._end or _reasoning_ended(
            prompt_token_ids, list(reasoning_start), self._end
        )

    @property
    def active(self) -> bool:
        """Masks apply: the reasoning is over and the grammar has not ended yet (once it has, only
        `ignore_eos` keeps the sequence going, and what follows is free)."""
        return self._active and not self.matcher.is_terminated()

    @property
    def finished(self) -> bool:
        return self.matcher.is_terminated()

    def accept(self, token_id: int) -> bool:
        if self._active:
            return self.matcher.is_terminated() or bool(self.matcher.accept_token(token_id))
        self._recent = [*self._recent, token_id][-len(self._end) :]
        self._active = self._recent == self._end
        return True

    def fill_draft_masks(self, bitmask: Tensor, row: int, drafts: Sequence[int]) -> list[int]:
        """Fills `bitmask` rows row, row + 1, ... with the mask after drafts[:j], accepting each
        draft into the matcher; returns the rows filled. Stops after the row of a draft the
        grammar refuses (that row refuses it), and where the grammar has ended (what follows is
        free, as `active` says). Only for an active grammar (the engine drafts no reasoning)."""
        assert self.active and self._num_draft_tokens == 0, "drafts of a step left accepted"
        rows = []
        for j in range(len(drafts) + 1):
            if not self.active:
                break
            self.matcher.fill_next_token_bitmask(bitmask, row + j)
            rows.append(row + j)
            if j == len(drafts) or not self.matcher.accept_token(drafts[j]):
                break
            self._num_draft_tokens += 1
        return rows

    def rollback_drafts(self, num_kept: int) -> int:
        """Rolls the matcher back to the first `num_kept` drafts of `fill_draft_masks`; returns
        how many of them it holds (fewer when kept drafts went past the grammar's end: free
        tokens, which `accept` passes)."""
        held = min(num_kept, self._num_draft_tokens)
        if self._num_draft_tokens > held:
            self.matcher.rollback(self._num_draft_tokens - held)
        self._num_draft_tokens = 0
        return held


def _reasoning_ended(prompt: Sequence[int], start: list[int], end: list[int]) -> bool:
    """Whether the prompt already closed its reasoning: `end` after the last `start`."""
    last_start = _rfind(prompt, start) if start else -1
    last_end = _rfind(prompt, end)
    return last_end >= 0 and last_end > last_start


def _rfind(seq: Sequence[int], sub: list[int]) -> int:
    n = len(sub)
    for i in range(len(seq) - n, -1, -1):
        if list(seq[i : i + n]) == sub:
            return i
    return -1


class GrammarMasks:
    """Applies a batch's grammars to its logits (the runner advances them after sampling)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._bitmask = xgr.allocate_token_bitmask(8, vocab_size)
        # One thread: the bitmask fill runs between two forwards that want every core.
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)

    def apply(
        self, logits: Tensor, rows: Sequence[tuple[int, RequestGrammar, Sequence[int]]]
    ) -> None:
        """Refused tokens' logits -> -inf for each active (first row, grammar, drafts): one row
        without drafts, else the draft rows (`fill_draft_masks`); `logits` is float32 [N, V]."""
        if logits.shape[0] > self._bitmask.shape[0]:
            self._bitmask = xgr.allocate_token_bitmask(2 * logits.shape[0], self.vocab_size)
        bitmask = self._bitmask[: logits.shape[0]]
        plain = [(r, g) for r, g, drafts in rows if not drafts]
        indices = [r for r, _ in plain]
        if plain:
            self._batch.batch_fill_next_token_bitmask(
                [g.matcher for _, g in plain], bitmask, indices
            )
        for r, g, drafts in rows:
            if drafts:
                indices += g.fill_draft_masks(bitmask, r, drafts)
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=self.vocab_size, indices=indices
        )
