"""`inferd-tiny`: a small random-weight Llama and a real byte-level BPE tokenizer, built locally.

It lets the engine, the server and the tests run with no download. Everything is deterministic:
the training text comes from built-in word lists and a seeded `random.Random`, the weights from a
seeded `torch.Generator`, so two machines build byte-identical folders.

    path = ensure_tiny_model(Path("~/.cache/inferd").expanduser())
    # ~/.cache/inferd/models/inferd-tiny-v1/{config.json, model.safetensors, tokenizer.json, ...}

The folder is a normal Hugging Face model folder (transformers can load it too). Bump the
`-v1` suffix whenever anything here changes what is written, so old caches are not reused.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from inferd.cache_folders import build_once
from inferd.models.config import ArchConfig
from inferd.models.llama import LlamaForCausalLM

TINY_MODEL_NAME = "inferd-tiny"
TINY_FOLDER = "inferd-tiny-v1"
WEIGHT_SEED = 1234
CORPUS_SEED = 4321

BOS, EOS, IM_START, IM_END, PAD = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|pad|>",
)
# The trainer gives special tokens the first ids, in this order: BOS=0, EOS=1, ..., PAD=4.
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END, PAD]

CHATML_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}\n"
    "{%- if message['content'] is string %}\n"
    "{{- message['content'] }}\n"
    "{%- else %}\n"
    "{%- for part in message['content'] if part['type'] == 'text' %}"
    "{{- part['text'] }}{%- endfor %}\n"
    "{%- endif %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "bos_token_id": 0,
    "eos_token_id": [1, 3],
    "pad_token_id": 4,
    "torch_dtype": "float32",
}

# -- training text -------------------------------------------------------------------------------


def _split(text: str) -> list[str]:
    return text.split()


_WORDS = _split(
    "the of and to in is that it for was on are as with his they at be this from have or by "
    "one had not but what all were when we there can an your which their said if do will each "
    "about how up out them then she many some so these would other into has more her two like "
    "him see time could no make than first been its who now people my made over did down only "
    "way find use may water long little very after words called just where most know model "
    "token request server engine batch cache memory tensor layer attention prompt answer "
    "question world hello thanks please today tomorrow number value result stream fast slow"
)
_ACCENTED = _split(
    "café naïve über señor façade Größe déjà crème brûlée año niño smörgåsbord Ærø Øresund "
    "łódź Škoda São Paulo Zürich résumé fiancée jalapeño"
)
_CJK = _split("你好 世界 模型 推理 日本語 東京 こんにちは ありがとう 한국어 안녕하세요")
_EMOJI = ["😀", "🚀", "🎉", "👍", "❤️", "🌍", "🔥", "✨", "🤖", "🙂"]
_ONSETS = _split("b c d f g h j k l m n p r s t v w z ch sh th st br tr")
_NUCLEI = _split("a e i o u ai ou ee ia")
_END_PUNCT = [".", ".", ".", "?", "!", "...", ":", ";"]
_CODE = [
    "def add(a, b):\n    return a + b\n",
    'print("hello, world")\n',
    "for i in range(10):\n    total += i * 2\n",
    "if x >= 0 and y != 1:\n    z = [x, y, {'k': 3}]\n",
    '{"role": "user", "content": "hi"}\n',
]


def _word(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.62:
        return rng.choice(_WORDS)
    if roll < 0.80:
        return "".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) for _ in range(rng.randint(1, 3)))
    if roll < 0.87:
        return str(
            rng.choice([rng.randint(0, 100), rng.randint(0, 100000), rng.randint(1900, 2100)])
        )
    if roll < 0.93:
        return rng.choice(_ACCENTED)
    if roll < 0.97:
        return rng.choice(_CJK)
    return rng.choice(_EMOJI)


def _sentence(rng: random.Random) -> str:
    words = [_word(rng) for _ in range(rng.randint(3, 14))]
    for i in range(1, len(words) - 1):
        if rng.random() < 0.08:
            words[i] += ","
    text = " ".join(words)
    return text[:1].upper() + text[1:] + rng.choice(_END_PUNCT)


def training_corpus(num_lines: int, seed: int = CORPUS_SEED) -> list[str]:
    """Deterministic text: English-like sentences, made-up words, numbers, code, non-ASCII."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        if rng.random() < 0.05:
            lines.append(rng.choice(_CODE))
        else:
            lines.append(" ".join(_sentence(rng) for _ in range(rng.randint(1, 3))) + "\n")
    return lines


# -- tokenizer -----------------------------------------------------------------------------------


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE (GPT-2 / Llama 3 style): all 256 bytes are tokens, so any text encodes."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # More text for bigger vocabularies, so the trainer finds enough merges to fill them.
    tok.train_from_iterator(training_corpus(max(4000, vocab_size * 4)), trainer)
    bos_id = tok.token_to_id(BOS)
    # Llama 3 style: the post-processor prepends BOS when special tokens are requested.
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A",
                pair=f"{BOS} $A {BOS}:1 $B:1",
                special_tokens=[(BOS, bos_id)],
            ),
        ]
    )
    return tok


def build_tokenizer(vocab_size: int, out_dir: Path) -> Tokenizer:
    """Train and write tokenizer.json + tokenizer_config.json (ChatML template) to `out_dir`."""
    tok = train_tokenizer(vocab_size)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": TINY_CONFIG["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_TEMPLATE,
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    return tok


# -- weights and folder --------------------------------------------------------------------------


def random_checkpoint(config: dict[str, Any], seed: int = WEIGHT_SEED) -> dict[str, torch.Tensor]:
    """HF-named float32 tensors for `config`: N(0, 0.02) matrices, norms 1, biases 0."""
    arch = ArchConfig.from_dict(config)
    with torch.device("meta"):
        shapes = _checkpoint_shapes(LlamaForCausalLM(arch, torch.float32))
    gen = torch.Generator().manual_seed(seed)
    std = float(config.get("initializer_range", 0.02))
    out: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        if "norm" in name:
            out[name] = torch.ones(shapes[name])
        elif name.endswith(".bias"):
            out[name] = torch.zeros(shapes[name])
        else:
            out[name] = torch.empty(shapes[name]).normal_(0.0, std, generator=gen)
    return out


def _checkpoint_shapes(model: LlamaForCausalLM) -> dict[str, tuple[int, ...]]:
    params = dict(model.named_parameters(remove_duplicate=False))
    return {
        name: (t.rows, *params[t.param_name].shape[1:])
        for name, t in model.checkpoint_layout().items()
    }


def write_model_folder(
    config: dict[str, Any],
    out_dir: Path,
    tokenizer_vocab: int | None = None,
    seed: int = WEIGHT_SEED,
) -> Path:
    """Write a complete HF folder: config, generation config, random weights, and (if
    `tokenizer_vocab`) a freshly trained tokenizer of that size. Returns `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer_vocab is not None:
        if tokenizer_vocab > config["vocab_size"]:
            raise ValueError(f"tokenizer vocab {tokenizer_vocab} > model vocab_size")
        build_tokenizer(tokenizer_vocab, out_dir)
    _write_json(out_dir / "config.json", config)
    generation = {
        "bos_token_id": config.get("bos_token_id"),
        "eos_token_id": config.get("eos_token_id"),
        "pad_token_id": config.get("pad_token_id"),
    }
    _write_json(out_dir / "generation_config.json", generation)
    save_file(random_checkpoint(config, seed), str(out_dir / "model.safetensors"), {"format": "pt"})
    return out_dir


def ensure_tiny_model(cache_dir: Path) -> Path:
    """The `inferd-tiny` folder under `cache_dir/models`, built on first use (about a second;
    atomically, inferd.cache_folders)."""
    return build_once(
        cache_dir / "models" / TINY_FOLDER,
        lambda tmp: write_model_folder(TINY_CONFIG, tmp, tokenizer_vocab=TINY_CONFIG["vocab_size"]),
    )


def write_truncated_draft(target: Path, out_dir: Path, num_layers: int) -> Path:
    """A draft model for speculative decoding cut from `target`'s folder: its embeddings, its
    first `num_layers` decoder layers, its final norm and lm_head, its tokenizer files. Random
    weights agree with nothing, but a draft that is the target's own first layers agrees with it
    as far as the later layers change little (how far is measured, not assumed: the engine's
    acceptance counters). A normal model folder; returns `out_dir`."""
    config = json.loads((target / "config.json").read_text(encoding="utf-8"))
    total = config["num_hidden_layers"]
    if not 0 < num_layers <= total:
        raise ValueError(f"num_layers {num_layers}: the target has {total}")
    config["num_hidden_layers"] = num_layers
    # Per-layer lists (Qwen3's, Gemma's layer_types) keep their first num_layers entries.
    for key, value in list(config.items()):
        if isinstance(value, list) and len(value) == total and key.startswith("layer"):
            config[key] = value[:num_layers]
    layer = re.compile(r"\.layers\.(\d+)\.")
    state = {
        name: t
        for f in sorted(target.glob("*.safetensors"))
        for name, t in load_file(f).items()
        if (m := layer.search(name)) is None or int(m.group(1)) < num_layers
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out_dir / "model.safetensors"), {"format": "pt"})
    _write_json(out_dir / "config.json", config)
    for f in target.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, out_dir / f.name)
    return out_dir


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
