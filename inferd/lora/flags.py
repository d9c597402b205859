"""The LoRA flags of `inferd serve` and `inferd generate`, with vLLM's names and forms.

    --enable-lora --lora-modules sql=/adapters/sql chat=/adapters/chat \\
        --max-loras 8 --max-lora-rank 16 --max-cpu-loras 32
    --lora-modules '{"name": "sql", "path": "/adapters/sql", "base_model_name": "Qwen/Qwen3-0.6B"}'

`--lora-modules` takes one or more entries (and may be repeated); each is `name=path` or a JSON
object with `name`, `path` and optionally `base_model_name`: `parse_lora_module` reads one. The
flags themselves are LoRAConfig's fields, declared with the other engine flags
(inferd/engine_args.py).

A server with both an LLM and an image model puts each adapter in the lane its files are for
(`adapter_lane`, also how `/v1/load_lora_adapter` routes): a `.safetensors` file (kohya's single
file), or a folder without PEFT's `adapter_config.json` that holds `pytorch_lora_weights.
safetensors` (diffusers' `save_lora_weights`) or another `.safetensors` file, is a style of the
image model's UNet; anything else (PEFT's `adapter_config.json` + `adapter_model.safetensors`)
is an LLM adapter. The other LoRA flags apply to both lanes.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

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


LoRALane = Literal["llm", "image"]


def adapter_lane(path: str) -> LoRALane:
    """The lane an adapter at `path` is for, by its files (the module docstring's rule)."""
    where = Path(path).expanduser()
    if where.is_file():
        return "image" if where.suffix == ".safetensors" else "llm"
    if not where.is_dir() or (where / "adapter_config.json").is_file():
        return "llm"
    return "image" if any(where.glob("*.safetensors")) else "llm"


def split_lora_modules(
    modules: Iterable[LoRAModule], serves_llm: bool, serves_images: bool
) -> tuple[list[LoRAModule], list[LoRAModule]]:
    """`--lora-modules` as (the LLM's, the image model's): all to the one lane served, by
    `adapter_lane` when both are."""
    llm: list[LoRAModule] = []
    image: list[LoRAModule] = []
    for module in modules:
        to_image = serves_images and (not serves_llm or adapter_lane(module.path) == "image")
        (image if to_image else llm).append(module)
    return llm, image
