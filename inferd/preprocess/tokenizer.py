"""Text <-> token ids and chat templates, from a Hugging Face folder, without transformers.

    tok = Tokenizer.from_pretrained(path)
    ids = tok.encode("Hello")                        # BOS added when the tokenizer says so
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    ids = tok.encode(prompt, add_special_tokens=False)   # the template already has its specials

Reads tokenizer.json (the `tokenizers` model), tokenizer_config.json (special tokens,
`add_bos_token`, chat template), chat_template.jinja / chat_template.json when present, and
generation_config.json (extra EOS ids).

Which specials `encode` adds: tokenizer.json's post-processor (as in transformers 5), plus BOS
when tokenizer_config.json sets `add_bos_token: true` and the post-processor does not add it
(transformers 4's Llama tokenizers honoured that flag). BOS is never added twice.
`add_eos_token` is ignored, as transformers 5 does: a prompt must not end the sequence.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from inferd.errors import InvalidRequestError, ModelLoadError

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class NoChatTemplateError(InvalidRequestError):
    """The model has no chat template, so chat requests cannot be formatted (HTTP 400)."""


@dataclass(frozen=True)
class TokenizerFiles:
    """Everything read from the folder besides tokenizer.json."""

    special_tokens: dict[str, str] = field(default_factory=dict)  # "bos_token" -> "<s>", ...
    add_bos_token: bool | None = None  # None: not set, the post-processor decides
    chat_templates: dict[str, str] = field(default_factory=dict)  # name -> template
    generation_eos_ids: frozenset[int] = frozenset()


class Tokenizer:
    def __init__(self, hf: HFTokenizer, files: TokenizerFiles, source: str = "<memory>") -> None:
        self.hf = hf
        self.files = files
        self.source = source
        self.special_tokens = {
            name: tok
            for name, tok in files.special_tokens.items()
            if hf.token_to_id(tok) is not None
        }
        # encode() prepends BOS only when the config asks for it and tokenizer.json's
        # post-processor does not already add it (it adds its specials even to empty text).
        bos = self.bos_token_id
        post_adds_bos = bos is not None and bos in hf.encode("", add_special_tokens=True).ids
        self._bos_id = -1 if bos is None else bos
        self._prepend_bos = bool(files.add_bos_token) and bos is not None and not post_adds_bos

    @classmethod
    def from_pretrained(cls, path: Path) -> Tokenizer:
        tokenizer_json = path / "tokenizer.json"
        if not tokenizer_json.is_file():
            raise ModelLoadError(
                f"{path}: no tokenizer.json (only Hugging Face fast tokenizers are supported; "
                "a sentencepiece tokenizer.model alone is not)"
            )
        try:
            hf = HFTokenizer.from_file(str(tokenizer_json))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise ModelLoadError(f"{tokenizer_json}: cannot load tokenizer: {e}") from e
        # Some tokenizer.json files were saved with truncation/padding on; a prompt must never be
        # cut or padded silently (length limits are checked against max_model_len instead).
        hf.no_truncation()
        hf.no_padding()
        return cls(hf, read_tokenizer_files(path), str(path))

    # -- special tokens ----------------------------------------------------------------------

    def _id_of(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.hf.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id_of("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id_of("pad_token")

    @cached_property
    def eos_token_ids(self) -> frozenset[int]:
        """The tokenizer's EOS plus every EOS id in generation_config.json."""
        eos = self._id_of("eos_token")
        return self.files.generation_eos_ids | (frozenset() if eos is None else {eos})

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    @cached_property
    def all_special_ids(self) -> list[int]:
        ids = {i for i, tok in self.hf.get_added_tokens_decoder().items() if tok.special}
        ids |= {i for name in _SPECIAL_NAMES if (i := self._id_of(name)) is not None}
        return sorted(ids)

    # -- text <-> ids ------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos:
            return [self._bos_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    # -- chat --------------------------------------------------------------------------------

    def get_chat_template(self, name: str | None = None, has_tools: bool = False) -> str:
        """The template to use: `name` if given, "tool_use" with tools if there is one, else
        "default" (the only one, for most models)."""
        templates = self.files.chat_templates
        if not templates:
            raise NoChatTemplateError(
                f"the tokenizer at {self.source} has no chat template; send a plain "
                "completion prompt instead",
                "messages",
            )
        if name is not None:
            if name not in templates:
                raise InvalidRequestError(
                    f"no chat template named {name!r}; available: {sorted(templates)}",
                    "chat_template",
                )
            return templates[name]
        if has_tools and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        raise NoChatTemplateError(
            f"{self.source} has several chat templates and no default: {sorted(templates)}",
            "chat_template",
        )

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` to the prompt text, as transformers' apply_chat_template(...,
        tokenize=False) does. Extra keyword arguments (e.g. `enable_thinking`) reach the template.
        Template errors (such as `raise_exception("roles must alternate")`) are InvalidRequestError.
        """
        if not messages:
            raise InvalidRequestError("messages must not be empty", "messages")
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError(
                "continue_final_message and add_generation_prompt cannot both be set", "messages"
            )
        template = compile_chat_template(self.get_chat_template(chat_template, tools is not None))
        # Like transformers 5: keys set to None (OpenAI's content=None) are dropped, since many
        # templates test for a key's presence, not its value.
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = {**self.special_tokens, **template_kwargs}
        try:
            rendered = template.render(
                messages=chat,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"chat template error: {e}", "messages") from e
        return _cut_after_final(rendered, chat[-1]) if continue_final_message else rendered


def _cut_after_final(rendered: str, final: dict[str, Any]) -> str:
    # The final (assistant) message is left open so the model continues it: drop whatever the
    # template put after its content (end-of-turn tokens).
    content = final.get("content")
    if not isinstance(content, str) or not content.strip():
        raise InvalidRequestError(
            "continue_final_message needs a final message with text", "messages"
        )
    end = rendered.rfind(content.strip())
    return rendered if end < 0 else rendered[: end + len(content.strip())]


# -- templates -----------------------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; for inference it renders its body unchanged."""

    tags = {"generation"}  # noqa: RUF012 (jinja's Extension API)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters (<, >, &), which would change prompts.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_compiled: dict[str, jinja2.Template] = {}


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile (once per template text) in the sandbox transformers uses: templates come from the
    Hub and are untrusted code."""
    template = _compiled.get(source)
    if template is None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ModelLoadError(f"chat template does not compile: {e}") from e
        _compiled[source] = template
    return template


# -- files ---------------------------------------------------------------------------------------


def read_tokenizer_files(path: Path) -> TokenizerFiles:
    config = _read_json(path / "tokenizer_config.json")
    return TokenizerFiles(
        special_tokens={
            name: tok for name in _SPECIAL_NAMES if (tok := _token_content(config.get(name)))
        },
        add_bos_token=_opt_bool(config, "add_bos_token", path),
        chat_templates=_chat_templates(path, config),
        generation_eos_ids=_eos_ids(load_generation_config(path).get("eos_token_id")),
    )


def load_generation_config(path: Path) -> dict[str, Any]:
    """generation_config.json as a dict ({} when the folder has none)."""
    return _read_json(path / "generation_config.json")


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {file}: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{file} is not a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    # Special tokens are saved either as strings or as AddedToken dicts {"content": ..., ...}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _opt_bool(config: dict[str, Any], key: str, path: Path) -> bool | None:
    value = config.get(key)
    if value is not None and not isinstance(value, bool):
        raise ModelLoadError(f"{path / 'tokenizer_config.json'}: {key!r} must be true or false")
    return value


def _eos_ids(value: Any) -> frozenset[int]:
    items = value if isinstance(value, list) else [] if value is None else [value]
    return frozenset(v for v in items if isinstance(v, int) and not isinstance(v, bool))


def _chat_templates(path: Path, config: dict[str, Any]) -> dict[str, str]:
    """Named templates. Precedence as in transformers: chat_template.jinja (+ the
    additional_chat_templates/ folder), then chat_template.json, then tokenizer_config.json."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        templates = {"default": jinja_file.read_text(encoding="utf-8")}
        for extra in sorted((path / "additional_chat_templates").glob("*.jinja")):
            templates[extra.stem] = extra.read_text(encoding="utf-8")
        return templates
    legacy = _read_json(path / "chat_template.json").get("chat_template")
    return _named_templates(legacy if legacy is not None else config.get("chat_template"), path)


def _named_templates(value: Any, path: Path) -> dict[str, str]:
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(
        isinstance(t, dict)
        and isinstance(t.get("name"), str)
        and isinstance(t.get("template"), str)
        for t in value
    ):
        return {t["name"]: t["template"] for t in value}
    raise ModelLoadError(
        f"{path}: chat_template must be a string or a list of {{name, template}} objects"
    )
