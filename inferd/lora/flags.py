"""The LoRA flags of `inferd serve` and `inferd generate`, with vLLM's names and forms.

    --enable-lora --lora-modules sql=/adapters/sql chat=/adapters/chat \\
        --max-loras 8 --max-lora-rank 16 --max-cpu-loras 32
    --lora-modules '{"name": "sql", "path": "/adapters/sql", "base_model_name": "Qwen/Qwen3-0.6B"}'

`--lora-modules` takes one or more entries (and may be repeated); each is `name=path` or a JSON
object with `name`, `path` and optionally `base_model_name`. Defaults come from LoRAConfig, so
the flags and the config tree cannot disagree.
"""

from __future__ import annotations

import argparse
import json

from pydantic import ValidationError

from inferd.config import LoRAConfig, LoRAModule

# The argparse dests, named like LoRAConfig's fields (cli.engine_kwargs passes them on as is).
LORA_ARGS = ("enable_lora", "lora_modules", "max_loras", "max_lora_rank", "max_cpu_loras")


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


def add_lora_args(p: argparse.ArgumentParser) -> None:
    """The LoRA group of the engine flags."""
    fields = LoRAConfig.model_fields
    g = p.add_argument_group("LoRA adapters (vLLM's flags)")
    g.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters over the base model, many in one batch",
    )
    g.add_argument(
        "--lora-modules",
        type=parse_lora_module,
        nargs="+",
        action="extend",
        default=None,
        metavar="NAME=PATH",
        help="adapters served from start-up: name=path (PEFT folders), or JSON "
        '{"name": ..., "path": ..., "base_model_name": ...}; the request\'s `model` picks one',
    )
    g.add_argument(
        "--max-loras",
        type=int,
        default=fields["max_loras"].default,
        help="distinct adapters one engine step may run",
    )
    g.add_argument(
        "--max-lora-rank",
        type=int,
        default=fields["max_lora_rank"].default,
        help="the largest adapter rank accepted (a larger one is refused with 400)",
    )
    g.add_argument(
        "--max-cpu-loras",
        type=int,
        default=fields["max_cpu_loras"].default,
        help="adapters kept loaded in host memory, least recently used evicted "
        "(default: --max-loras, or the number of --lora-modules when larger)",
    )
