"""`inferd-tiny-sd` (and `inferd-tiny-sdxl`): small random-weight Stable Diffusion pipelines,
built locally.

It lets the image lane, the server and the tests run with no download: a diffusers folder in the
SD 1.x layout (`model_index.json`, `unet/`, `vae/`, `text_encoder/`, `tokenizer/`,
`scheduler/`, safetensors weights), the same classes as SD 1.5 at a fraction of the width. A 64x64
image (8x8 latents: the VAE has SD's four blocks, scale factor 8) with 20 steps takes a fraction
of a second on a CPU. `inferd-tiny-sdxl` is the same in SDXL's layout. Everything is
deterministic: the weights come from a seeded torch RNG, the CLIP tokenizer's merges from a small
BPE run over a built-in word list, so two machines build the same folder.

    path = ensure_tiny_sd(Path("~/.cache/inferd").expanduser())      # or (..., "inferd-tiny-sdxl")
    # ~/.cache/inferd/models/inferd-tiny-sd-v1/{model_index.json, unet/, vae/, ...}

The default scheduler is DDIM (diffusers' `DDIMScheduler` with SD 1.5's betas): deterministic,
one model call per step and no multistep history, so a user who names no scheduler gets the
plainest one (`--image-scheduler` picks another). Bump the `-v1` suffix whenever anything here
changes what is written, so old caches are not reused.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from inferd.cache_folders import build_once

TINY_SD_NAME = "inferd-tiny-sd"
TINY_SD_FOLDER = "inferd-tiny-sd-v1"
# The same, in SDXL's layout (two text encoders, size-conditioned UNet).
TINY_SDXL_NAME = "inferd-tiny-sdxl"
TINY_SDXL_FOLDER = "inferd-tiny-sdxl-v1"
WEIGHT_SEED = 2024
NUM_MERGES = 300

# SD 1.5's noise schedule (its scheduler_config.json), under the DDIM sampler.
SCHEDULER_CONFIG: dict[str, object] = {
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "num_train_timesteps": 1000,
    "clip_sample": False,
    "set_alpha_to_one": False,
    "steps_offset": 1,
    "prediction_type": "epsilon",
}


def _words(text: str) -> list[str]:
    return text.split()


_WORDS = _words(
    "a an the of and in on with at by from to for photo painting drawing portrait landscape "
    "red green blue yellow orange purple black white golden silver dark bright soft sharp "
    "fox cat dog bird horse dragon castle city forest river mountain ocean sky sun moon star "
    "tree flower garden house street night day morning evening winter summer rain snow fog "
    "old young small large tiny giant beautiful detailed realistic cinematic watercolor oil "
    "style art artist light shadow color colorful highly quality render digital sketch"
)


def clip_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A CLIP-style byte-level BPE vocabulary: the 256 byte symbols, each also as a word end
    (`</w>`), `NUM_MERGES` merges learned greedily over `_WORDS` (ties: the smaller pair), and
    the two special tokens last."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = [*alphabet, *(c + "</w>" for c in alphabet)]
    words = [[*w[:-1], w[-1] + "</w>"] for w in _WORDS]
    merges: list[tuple[str, str]] = []
    for _ in range(NUM_MERGES):
        pairs = Counter(p for w in words for p in itertools.pairwise(w))
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        tokens.append(best[0] + best[1])
        words = [_merge(w, best) for w in words]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return {tok: i for i, tok in enumerate(tokens)}, merges


def _merge(word: list[str], pair: tuple[str, str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def write_tiny_sd(out_dir: Path, seed: int = WEIGHT_SEED) -> Path:
    """Writes the SD 1.x pipeline folder to `out_dir` (through diffusers' `save_pretrained`)."""
    import torch
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel

    tokenizer, vocab = _tokenizer()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        unet = UNet2DConditionModel(
            **_UNET,
            cross_attention_dim=32,
            attention_head_dim=8,
        )
        vae = _vae()
        text_encoder = CLIPTextModel(_text_config(vocab))
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=_scheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def write_tiny_sdxl(out_dir: Path, seed: int = WEIGHT_SEED) -> Path:
    """Writes the SDXL pipeline folder: two text encoders (the second with a 32-wide pooled
    projection) side by side in 64-wide cross-attention, and the UNet's added text/time
    embedding (6 size ids x 8 + 32 pooled = 80)."""
    import torch
    from diffusers import StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    tokenizer, vocab = _tokenizer()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        unet = UNet2DConditionModel(
            **_UNET,
            cross_attention_dim=64,
            attention_head_dim=(2, 4),
            use_linear_projection=True,
            addition_embed_type="text_time",
            addition_time_embed_dim=8,
            transformer_layers_per_block=(1, 2),
            projection_class_embeddings_input_dim=80,
        )
        vae = _vae()
        text_encoder = CLIPTextModel(_text_config(vocab))
        text_encoder_2 = CLIPTextModelWithProjection(_text_config(vocab, projection_dim=32))
    pipe = StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer,
        unet=unet,
        scheduler=_scheduler(),
        force_zeros_for_empty_prompt=True,
        add_watermarker=False,
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


# Both UNets: 8x8 latents (64-pixel images), two levels, cross-attention in the lower one.
_UNET: dict[str, Any] = {
    "sample_size": 8,
    "block_out_channels": (32, 64),
    "layers_per_block": 2,
    "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
    "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"),
}


def _tokenizer() -> tuple[Any, dict[str, int]]:
    from transformers import CLIPTokenizer

    vocab, merges = clip_vocab_and_merges()
    # tokenizers' BPE takes the merges as pairs; transformers' annotation names only strings.
    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)  # type: ignore[arg-type]
    return tokenizer, vocab


def _vae() -> Any:
    """SD's four VAE blocks (scale factor 8), narrow."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        block_out_channels=(8, 16, 32, 32),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=8,
        sample_size=64,
    )


def _text_config(vocab: dict[str, int], **extra: Any) -> Any:
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        bos_token_id=vocab["<|startoftext|>"],
        eos_token_id=vocab["<|endoftext|>"],
        pad_token_id=vocab["<|endoftext|>"],
        **extra,
    )


def _scheduler() -> Any:
    from diffusers import DDIMScheduler

    return DDIMScheduler(**SCHEDULER_CONFIG)


# Built-in name -> (versioned folder, writer).
BUILT_IN: dict[str, tuple[str, Callable[[Path], Path]]] = {
    TINY_SD_NAME: (TINY_SD_FOLDER, write_tiny_sd),
    TINY_SDXL_NAME: (TINY_SDXL_FOLDER, write_tiny_sdxl),
}


def ensure_tiny_sd(cache_dir: Path, name: str = TINY_SD_NAME) -> Path:
    """A built-in pipeline's folder under `cache_dir/models` (`inferd-tiny-sd` by default),
    built on first use (about a second; atomically, inferd.cache_folders)."""
    folder, write = BUILT_IN[name]
    return build_once(cache_dir / "models" / folder, write)
