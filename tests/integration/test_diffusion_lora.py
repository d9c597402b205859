"""Many LoRA styles in one UNet forward (inferd/diffusion/lora.py) against diffusers' own LoRA
loading: each row of a batch mixing styles and no style equals the UNet with that style loaded by
`load_lora_into_unet` (what `load_lora_weights` does for the UNet) at scale 1; unstyled rows are
the base UNet's exactly; files inferd cannot apply exactly are refused."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from diffusers.utils.state_dict_utils import (
    convert_state_dict_to_diffusers,
    convert_state_dict_to_kohya,
)
from peft import LoraConfig, get_peft_model_state_dict
from safetensors.torch import load_file, save_file
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from inferd.config import LoRAConfig, LoRAModule
from inferd.diffusion.lora import UNetStyles
from inferd.errors import InvalidRequestError
from inferd.lora.request import LoRARequest

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]
# name -> (targets, rank, alpha, save the LoraConfig as metadata). diffusers' training scripts
# rename attention factors to its own `lora.down` / `lora.up` (convert_state_dict_to_diffusers);
# styles over other layers keep PEFT's `lora_A` / `lora_B`, which diffusers loads as well.
STYLES: dict[str, tuple[list[str], int, int, bool]] = {
    "ink": (ATTENTION, 4, 8, True),
    # 1x1 convolutions (SD 1.x's proj_in / proj_out), feed-forward; no metadata: scale 1.
    "oil": (["to_q", "to_v", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2"], 2, 2, False),
    "pastel": (["to_k", "to_out.0", "time_emb_proj"], 3, 6, True),
}


def tiny_unet() -> Any:
    """diffusers' UNet (Any: diffusers is untyped)."""
    torch.manual_seed(0)
    unet: Any = UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=32,
    )
    return unet.eval()


def save_style(folder: Path, targets: list[str], rank: int, alpha: int, metadata: bool) -> None:
    """A random style, trained-looking (B non-zero), saved as diffusers' training scripts do."""
    unet = tiny_unet()
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
    unet.add_adapter(config)
    state = get_peft_model_state_dict(unet)
    saved = config.to_dict() if metadata else None  # type: ignore[no-untyped-call]
    if targets == ATTENTION:
        state = convert_state_dict_to_diffusers(state)
    StableDiffusionPipeline.save_lora_weights(
        folder,
        unet_lora_layers=state,
        unet_lora_adapter_metadata=saved,
    )


KOHYA_ALPHAS = {"to_v": 2.0, "proj_in": 8.0}


def save_kohya_style(file: Path) -> Any:
    """A random style in kohya / A1111 naming (`lora_unet_..._lora_down.weight`, `.alpha`),
    one file, with an alpha of their own on to_v and proj_in; returns the PEFT model it was
    trained as (the reference: diffusers drops such per-module attention alphas, see
    inferd/diffusion/lora_files.py)."""
    unet = tiny_unet()
    targets = ["to_q", "to_v", "proj_in", "ff.net.2"]
    config = LoraConfig(
        r=4,
        lora_alpha=4,
        alpha_pattern=KOHYA_ALPHAS,
        target_modules=targets,
        init_lora_weights=False,
    )
    unet.add_adapter(config)
    state = {f"unet.{k}": v for k, v in get_peft_model_state_dict(unet).items()}
    kohya = convert_state_dict_to_kohya(state)
    for key in kohya:
        if key.endswith(".alpha"):
            alpha = [a for module, a in KOHYA_ALPHAS.items() if module in key]
            kohya[key] = torch.tensor(alpha[0] if alpha else 4.0)
    save_file(kohya, str(file))
    return unet


@pytest.fixture(scope="module")
def styles_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("styles")
    for i, (name, spec) in enumerate(STYLES.items()):
        torch.manual_seed(100 + i)
        save_style(root / name, *spec)
    return root


@pytest.fixture(scope="module")
def kohya(styles_dir: Path) -> Any:
    """The kohya style "sketch" beside the others; its PEFT original."""
    torch.manual_seed(200)
    (styles_dir / "sketch").mkdir()
    return save_kohya_style(styles_dir / "sketch" / "sketch_v2.safetensors")


def reference(base: Any, folder: Path) -> Any:
    """The UNet with the style loaded by diffusers itself."""
    unet = copy.deepcopy(base)
    (file,) = folder.glob("*.safetensors")
    state, alphas, metadata = StableDiffusionPipeline.lora_state_dict(
        str(folder), weight_name=file.name, return_lora_metadata=True
    )
    StableDiffusionPipeline.load_lora_into_unet(state, alphas, unet, metadata=metadata)
    return unet


def served(folder: Path, names: list[str], max_loras: int = 4) -> tuple[Any, UNetStyles]:
    unet = tiny_unet()
    modules = tuple(LoRAModule(name=n, path=str(folder / n)) for n in names)
    config = LoRAConfig(enable_lora=True, lora_modules=modules, max_loras=max_loras)
    styles = UNetStyles(unet, config)
    for name in names:
        styles.load(name).result()
    styles.take_loaded(names)
    return unet, styles


@torch.no_grad()
def test_mixed_styles_in_one_forward_equal_diffusers_row_for_row(
    styles_dir: Path, kohya: Any
) -> None:
    unet, styles = served(styles_dir, [*STYLES, "sketch"])
    base = tiny_unet()
    refs = {name: reference(base, styles_dir / name) for name in STYLES}
    refs["sketch"] = kohya
    # Each item its own style (or none), its own timestep; a style split over two runs.
    rows: list[tuple[str | None, int]] = [("ink", 2), ("oil", 1), (None, 1), ("ink", 1)]
    rows += [("pastel", 1), (None, 1), ("oil", 1), ("sketch", 2)]
    n = sum(count for _, count in rows)
    g = torch.Generator().manual_seed(7)
    sample = torch.randn(n, 4, 8, 8, generator=g)
    timesteps = torch.randint(0, 1000, (n,), generator=g)
    text = torch.randn(n, 5, 32, generator=g)

    styles.set_rows(rows)
    out = unet(sample, timesteps, text).sample
    styles.set_rows([])
    plain = unet(sample, timesteps, text).sample
    assert torch.equal(plain, base(sample, timesteps, text).sample)

    item = 0
    for name, count in rows:
        for i in range(item, item + count):
            one = (sample[i : i + 1], timesteps[i : i + 1], text[i : i + 1])
            if name is None:
                # Rows under no style are the base UNet's, untouched by the others' terms.
                assert torch.equal(out[i], plain[i])
                continue
            want = refs[name](*one).sample[0]
            assert not torch.allclose(want, base(*one).sample[0], atol=1e-3), "a style changes"
            torch.testing.assert_close(out[i], want, rtol=1e-5, atol=2e-5)
        item += count


@torch.no_grad()
def test_a_style_over_every_row_and_slot_reuse(styles_dir: Path) -> None:
    """Two slots for three styles: later forwards reuse the least recently used slot."""
    unet, styles = served(styles_dir, list(STYLES), max_loras=2)
    base = tiny_unet()
    refs = {name: reference(base, styles_dir / name) for name in STYLES}
    g = torch.Generator().manual_seed(3)
    sample, text = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 5, 32, generator=g)
    timesteps = torch.tensor([10, 900])
    for pair in (("ink", "oil"), ("pastel", "ink"), ("oil", "pastel")):
        styles.set_rows([(pair[0], 1), (pair[1], 1)])
        out = unet(sample, timesteps, text).sample
        for i, name in enumerate(pair):
            want = refs[name](sample[i : i + 1], timesteps[i : i + 1], text[i : i + 1]).sample
            torch.testing.assert_close(out[i], want[0], rtol=1e-5, atol=2e-5)


def refused(styles_dir: Path, path: Path, max_rank: int = 16) -> str:
    unet = tiny_unet()
    styles = UNetStyles(unet, LoRAConfig(enable_lora=True, max_lora_rank=max_rank))
    styles.register(LoRARequest("bad", 1, str(path)))
    with pytest.raises(InvalidRequestError) as info:
        styles.load("bad").result()
    return str(info.value)


def test_refusals(styles_dir: Path, tmp_path: Path) -> None:
    ink = styles_dir / "ink" / "pytorch_lora_weights.safetensors"
    tensors = load_file(str(ink))
    key = next(k for k in tensors if k.endswith("to_q.lora.down.weight"))

    def variant(name: str, changed: dict[str, torch.Tensor]) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        save_file({**tensors, **changed}, str(folder / "pytorch_lora_weights.safetensors"))
        return folder

    assert "only the UNet's" in refused(
        styles_dir,
        variant("te", {"text_encoder.layers.0.q_proj.lora.down.weight": tensors[key].clone()}),
    )
    dora = key.replace("lora.down.weight", "lora_magnitude_vector")
    assert "DoRA" in refused(styles_dir, variant("dora", {dora: torch.ones(32)}))
    conv = "unet.down_blocks.0.resnets.0.conv1.lora.down.weight"
    up = conv.replace("down", "up", 1).replace("lora.down", "lora.up")
    assert "3x3 convolution" in refused(
        styles_dir, variant("locon", {conv: torch.ones(4, 32, 3, 3), up: torch.ones(32, 4, 1, 1)})
    )
    assert "another base model" in refused(styles_dir, variant("shape", {key: torch.ones(4, 48)}))
    assert "over --max-lora-rank 2" in refused(styles_dir, styles_dir / "ink", max_rank=2)
    pickle = tmp_path / "pickle"
    pickle.mkdir()
    (pickle / "pytorch_lora_weights.bin").write_bytes(b"")
    assert "safetensors only" in refused(styles_dir, pickle)
    assert "neither a folder nor a file" in refused(styles_dir, tmp_path / "missing")


def test_set_rows_refuses_unloaded_styles_too_many_and_a_wrong_count(styles_dir: Path) -> None:
    unet, styles = served(styles_dir, ["ink", "oil"], max_loras=1)
    with pytest.raises(RuntimeError, match="not loaded"):
        styles.set_rows([("pastel", 1)])
    with pytest.raises(ValueError, match="over --max-loras 1"):
        styles.set_rows([("ink", 1), ("oil", 1)])
    styles.set_rows([("ink", 1), (None, 2)])
    with pytest.raises(RuntimeError, match="named 3 batch items"):
        unet(torch.zeros(2, 4, 8, 8), torch.tensor([1, 2]), torch.zeros(2, 5, 32))


def tiny_pipeline(unet: Any, folder: Path) -> Any:
    """A StableDiffusionPipeline of random tiny parts around `unet` (DDIM, 16x16 images)."""
    chars = list(bytes_to_unicode().values())  # type: ignore[no-untyped-call]
    words = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
    (folder / "vocab.json").write_text(json.dumps({w: i for i, w in enumerate(words)}))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(
        str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=12
    )
    torch.manual_seed(1)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(words),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=12,
            bos_token_id=len(words) - 2,
            eos_token_id=len(words) - 1,
        )
    )
    vae: Any = AutoencoderKL(
        block_out_channels=(32, 64),
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        latent_channels=4,
        norm_num_groups=32,
    )
    return StableDiffusionPipeline(
        vae=vae.eval(),
        text_encoder=text_encoder.eval(),  # type: ignore[no-untyped-call]
        tokenizer=tokenizer,
        unet=unet,
        scheduler=DDIMScheduler(steps_offset=1, clip_sample=False),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


@torch.no_grad()
def test_pipeline_image_equals_load_lora_weights(styles_dir: Path, tmp_path: Path) -> None:
    """The whole denoising loop, guidance rows included: the served UNet under a style gives
    diffusers' image with `load_lora_weights`."""
    unet, styles = served(styles_dir, ["ink"])
    reference_pipe = tiny_pipeline(tiny_unet(), tmp_path)
    reference_pipe.load_lora_weights(str(styles_dir / "ink"))
    served_pipe = tiny_pipeline(unet, tmp_path)
    args = {"prompt": "a red fox", "num_inference_steps": 3, "output_type": "np"}
    want = reference_pipe(**args, generator=torch.Generator().manual_seed(5)).images
    styles.set_rows([("ink", 2)])  # the unconditional row and the prompt's
    got = served_pipe(**args, generator=torch.Generator().manual_seed(5)).images
    styles.set_rows([])
    plain = served_pipe(**args, generator=torch.Generator().manual_seed(5)).images
    assert not np.allclose(plain, want, atol=1e-3), "the style changes the image"
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
