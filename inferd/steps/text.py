"""`tokenize`: BYTES text -> token id tensors, with Hugging Face `tokenizers`.

    - {type: tokenize, tokenizer: tokenizer.json, input: text, max_length: 256,
       outputs: [input_ids, attention_mask]}          # + token_type_ids if the model takes it

text [n] or [n, 1] (UTF-8 bytes) -> input_ids, attention_mask (, token_type_ids) INT64 [n, L],
plus `__num_tokens__` INT64 [n] (real tokens per row, after truncation, for usage reporting).
L is the longest row of *this request*: the dynamic batcher pads across requests, so padding
here to a fixed length would only add work. `outputs` may also map a role to the model's own
input name: {input_ids: ids, attention_mask: mask}.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import Field, field_validator
from tokenizers import Tokenizer

from inferd.errors import InvalidRequestError, ModelConfigError
from inferd.steps.base import StepContext, StepOptions

ROLES = ("input_ids", "attention_mask", "token_type_ids")
NUM_TOKENS = "__num_tokens__"


class TokenizeOptions(StepOptions):
    tokenizer: str = "tokenizer.json"
    input: str = "text"
    # None: no truncation (the model must then accept the longest text a client sends).
    max_length: int | None = Field(default=None, gt=0)
    outputs: dict[str, str] = Field(
        default_factory=lambda: {"input_ids": "input_ids", "attention_mask": "attention_mask"}
    )
    # None: tokenizer.json's padding id when it sets one, else 0.
    pad_id: int | None = Field(default=None, ge=0)

    @field_validator("outputs", mode="before")
    @classmethod
    def _roles(cls, v: Any) -> Any:
        if isinstance(v, list | tuple):
            v = {role: role for role in v}
        if isinstance(v, dict):
            unknown = sorted(set(v) - set(ROLES))
            if unknown:
                raise ValueError(f"unknown roles {unknown}; roles are {list(ROLES)}")
            if "input_ids" not in v:
                raise ValueError("must include input_ids")
        return v


class TokenizeStep:
    def __init__(self, options: TokenizeOptions, ctx: StepContext) -> None:
        self.stage: str = ctx.stage
        self.ctx = ctx
        self.options = options
        path = ctx.resolve(options.tokenizer, "tokenizer")
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on a bad file
            raise ModelConfigError(f"{ctx.where}.tokenizer: cannot load {path}: {e}") from e
        padding = self.tokenizer.padding
        self.pad_id = (
            options.pad_id if options.pad_id is not None else (padding or {}).get("pad_id", 0)
        )
        # Files saved with fixed padding (MiniLM's pads to 128) would pad every row; padding is
        # done here per request instead, and truncation follows the config, not the file.
        self.tokenizer.no_padding()
        if options.max_length is None:
            self.tokenizer.no_truncation()
        else:
            self.tokenizer.enable_truncation(options.max_length)

    def __call__(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        name = self.options.input
        texts = decode_texts(self.ctx.take_rows(tensors, name, "text"), name)
        encodings = self.tokenizer.encode_batch(texts)
        lengths = np.array([len(e.ids) for e in encodings], dtype=np.int64)
        width = int(lengths.max(initial=0))
        ids = np.full((len(texts), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(texts), width), dtype=np.int64)
        types = np.zeros((len(texts), width), dtype=np.int64)
        for row, enc in enumerate(encodings):
            ids[row, : lengths[row]] = enc.ids
            mask[row, : lengths[row]] = 1
            types[row, : lengths[row]] = enc.type_ids
        by_role = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        out = {k: v for k, v in tensors.items() if k != self.options.input}
        for role, name in self.options.outputs.items():
            out[name] = by_role[role]
        out[NUM_TOKENS] = lengths
        return out


def decode_texts(rows: np.ndarray, name: str) -> list[str]:
    """BYTES elements -> strings (UTF-8; a `str` element passes through)."""
    texts = []
    for item in rows:
        if isinstance(item, bytes | bytearray | np.bytes_):
            try:
                texts.append(bytes(item).decode("utf-8"))
            except UnicodeDecodeError as e:
                raise InvalidRequestError(f"input {name!r}: text is not UTF-8: {e}", name) from e
        elif isinstance(item, str):
            texts.append(item)
        else:
            raise InvalidRequestError(f"input {name!r}: expected BYTES text elements", name)
    return texts
