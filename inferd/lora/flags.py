"""The LoRA flags of `inferd serve` and `inferd generate`, with vLLM's names and forms.

    --enable-lora --lora-modules sql=/adapters/sql chat=/adapters/chat \\
        --max-loras 8 --max-lora-rank 16 --max-cpu-loras 32
    --lora-modules '{"name": "sql", "path": "/adapters/sql", "base_model_name": "Qwen/Qwen3-0.6B"}'

`--lora-modules` takes one or more entries (and may be repeated); each is `name=path` or a JSON
object with `name`, `path` and optionally `base_model_name`: `parse_lora_module` reads one. The
flags themselves are LoRAConfig's fields, declared with the other engine flags
(inferd/engine_args.py).
"""

from __future__ import annotations

import argparse
import json

from pydantic import ValidationError

from inferd.config import LoRAModule


def parse_lora_module(text: str) -> LoRAModule:
    """One `--lora-modules` entry: `name=path` or a JSON object.

    >>> parse_lora_module("sql=/adapters/sql")
    LoRAModule(name='sql', path='/adapters/sql', base_model_name=None)
    """
    text = text.strip()
    if text.startswith("{"):
        return _from_json(text)
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not name=path or a JSON object with name and path"
        )
    return LoRAModule(name=name, path=path)


def _from_json(text: str) -> LoRAModule:
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid JSON: {e.msg}") from None
    if not isinstance(fields, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a JSON object")
    try:
        return LoRAModule.model_validate(fields)
    except ValidationError as e:
        problems = "; ".join(f"{err['loc'][0]}: {err['msg']}" for err in e.errors())
        raise argparse.ArgumentTypeError(f"{text!r}: {problems}") from None
