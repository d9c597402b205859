"""The engine flags of `inferd serve` and `inferd generate`, derived from EngineConfig's fields.

Every field of EngineConfig's sections is one flag, declared nowhere else: its name is the
field's (`max_num_seqs` -> `--max-num-seqs`), its type and choices come from the annotation
(`int`, `float`, `str`, a `Literal`, each optionally `| None`), its default and its help from the
field itself (`Field(default=..., description=...)`), and `--help` lists the flags in one group
per section, as vLLM's does. A boolean is a switch that turns its default over: `--enforce-eager`
(default off), `--no-enable-prefix-caching` (default on). `_FORMS` holds the few flags whose
name or parsing differ from that rule, as vLLM spells them.

The argparse dest is always the field's name, so `engine_kwargs` hands the flags' values to
`EngineConfig.from_kwargs` as they are.
"""

from __future__ import annotations

import argparse
import json
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from inferd.config import (
    CacheConfig,
    DeviceConfig,
    ImageEngineConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeSection,
    StructuredOutputsConfig,
)
from inferd.lora.flags import parse_lora_module
from inferd.postprocess.reasoning import REASONING_PARSERS


def parse_bytes(text: str) -> int:
    """A byte count, plain or with a unit.

    >>> parse_bytes("4GiB"), parse_bytes("1.5kb"), parse_bytes("512")
    (4294967296, 1500, 512)
    """
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    low = text.strip().lower()
    for suffix, mult in units.items():
        if low.endswith(suffix):
            return int(float(low[: -len(suffix)]) * mult)
    return int(low)


def parse_json_object(text: str) -> dict[str, Any]:
    """A JSON object flag (`--speculative-config '{"method": "ngram", ...}'`); its keys are
    checked by the config section it fills."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


@dataclass(frozen=True)
class FlagForm:
    """How one field's flag differs from the one its annotation gives; None: as derived."""

    name: str | None = None
    type: Callable[[str], Any] | None = None
    choices: Sequence[str] | None = None
    nargs: str | None = None
    action: str | None = None
    metavar: str | None = None
    # Older names the flag still answers to.
    aliases: tuple[str, ...] = ()


_FORMS: dict[str, FlagForm] = {
    "policy": FlagForm(name="--scheduling-policy"),
    "grammar_compile_timeout_s": FlagForm(name="--grammar-compile-timeout"),
    "kv_cache_memory": FlagForm(type=parse_bytes),
    "native_linear": FlagForm(aliases=("--small-batch-gemv",)),
    "reasoning_parser": FlagForm(choices=sorted(REASONING_PARSERS)),
    # One or more entries per use, and the flag may be repeated (vLLM's form).
    "lora_modules": FlagForm(
        type=parse_lora_module, nargs="+", action="extend", metavar="NAME=PATH"
    ),
    "speculative_config": FlagForm(type=parse_json_object, metavar="JSON"),
}
# Fields with no flag: prefills have always been chunked, and no flag has turned that off; the
# image model's served name is --served-model-name's when it is the server's MODEL, and
# --image-model has no default (add_image_args).
_NO_FLAG = frozenset({"enable_chunked_prefill", "served_model_name", "image_model", "lora"})

SECTIONS: tuple[type[BaseModel], ...] = (
    ModelConfig,
    CacheConfig,
    SchedulerConfig,
    DeviceConfig,
    StructuredOutputsConfig,
    LoRAConfig,
    SpeculativeSection,
)
# The argparse dests, named like the fields (engine_kwargs passes them on as they are).
ENGINE_ARGS = tuple(
    name for section in SECTIONS for name in section.model_fields if name not in _NO_FLAG
)


# The image lane's flags (`inferd serve`), from ImageEngineConfig's fields by the same rule.
IMAGE_ARGS = (
    "image_model",
    *(name for name in ImageEngineConfig.model_fields if name not in _NO_FLAG),
)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """One argument group per config section, one flag per field."""
    for section in SECTIONS:
        _add_section(p, section)


def add_image_args(p: argparse.ArgumentParser) -> None:
    """The image lane's group. --image-model has no default: no image model unless one is named
    (as the server's MODEL, or with the flag)."""
    group = _add_section(p, ImageEngineConfig)
    group.add_argument(
        "--image-model",
        default=None,
        metavar="NAME_OR_FOLDER",
        help=f"serve this image model: {ImageEngineConfig.model_fields['image_model'].description}",
    )


def _add_section(p: argparse.ArgumentParser, section: type[BaseModel]) -> argparse._ArgumentGroup:
    doc = (section.__doc__ or "").strip().split("\n")[0]
    group = p.add_argument_group(section.__name__, doc)
    for name, field in section.model_fields.items():
        if name not in _NO_FLAG:
            _add_flag(group, name, field, _FORMS.get(name, FlagForm()))
    return group


def _add_flag(group: argparse._ArgumentGroup, name: str, field: FieldInfo, form: FlagForm) -> None:
    flag = form.name or "--" + name.replace("_", "-")
    help_text = field_help(field, with_default=False)
    if field.annotation is bool:
        on_by_default = bool(field.default)
        if on_by_default:
            flag, help_text = form.name or f"--no-{flag[2:]}", f"turn off: {help_text}"
        action = "store_false" if on_by_default else "store_true"
        group.add_argument(flag, dest=name, action=action, help=help_text)
        return
    typed = {} if form.type is not None else _typed(name, field.annotation)
    kwargs: dict[str, Any] = {**typed, "default": field.default}
    if form.nargs is not None:  # an action that gathers a list: it starts from None
        kwargs.update(nargs=form.nargs, action=form.action, default=None)
    for key in ("type", "choices", "metavar"):
        if getattr(form, key) is not None:
            kwargs[key] = getattr(form, key)
    if form.name is not None and "choices" not in kwargs and "metavar" not in kwargs:
        kwargs["metavar"] = form.name[2:].upper().replace("-", "_")  # not the field's name
    # A choice field's help names its default ("auto: ..."): the line stays one line.
    if "choices" not in kwargs:
        help_text = field_help(field, with_default=kwargs["default"] is not None)
    group.add_argument(flag, *form.aliases, dest=name, help=help_text, **kwargs)


def field_help(field: FieldInfo, with_default: bool = True) -> str:
    """A flag's one line of help: its config field's description (argparse-escaped), then its
    default where it has one."""
    text = (field.description or "").replace("%", "%%")
    if with_default and field.default is not None:
        text += f" (default: {field.default})"
    return text


def _typed(name: str, annotation: Any) -> dict[str, Any]:
    """argparse's `type` or `choices` for a field's annotation, `| None` stripped."""
    if get_origin(annotation) in (Union, types.UnionType):
        annotation = next(a for a in get_args(annotation) if a is not type(None))
    if get_origin(annotation) is Literal:
        return {"choices": get_args(annotation)}
    if annotation in (int, float):
        return {"type": annotation}
    if annotation is str:
        return {}
    raise TypeError(f"{name}: {annotation} has no flag form; give it one in _FORMS")


def engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """The engine flags' values by field name, for `EngineConfig.from_kwargs` / `LLM(...)`."""
    return {name: getattr(args, name) for name in ENGINE_ARGS}


def image_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """The image flags that were given (not None), by field name, for ImageEngineConfig."""
    values = {name: getattr(args, name, None) for name in IMAGE_ARGS}
    return {name: value for name, value in values.items() if value is not None}
