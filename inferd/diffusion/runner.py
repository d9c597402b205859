"""The image lane's model calls: text encoder, the UNet forward, VAE decode (the only code here
that runs a model; the engine thread calls it).

    runner = ImageRunner(parts, max_decode_rows=8)
    embeds = runner.encode_text(["a red fox", ""])          # [2, 77, D]
    noise = runner.unet_forward(sample, timesteps, embeds)   # one forward, a timestep per row
    pixels = runner.decode(latents)                          # uint8 [N, H, W, 3]

Each mirrors what diffusers' `StableDiffusionPipeline` does for one request, so the images are
its images: prompts padded to the tokenizer's max length, the text encoder's last hidden state;
latents divided by the VAE's scaling factor, decoded, mapped from [-1, 1] to [0, 1] and rounded to
uint8 as its PIL output is. Every call runs under `torch.inference_mode`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from inferd.diffusion.loader import PipelineParts
from inferd.diffusion.request import Pixels


class ImageRunner:
    def __init__(self, parts: PipelineParts, max_decode_rows: int) -> None:
        self.parts = parts
        self.max_decode_rows = max_decode_rows
        self.latent_channels = int(parts.unet.config.in_channels)
        self._use_mask = bool(getattr(parts.text_encoder.config, "use_attention_mask", False))

    @property
    def device(self) -> torch.device:
        return self.parts.device

    @property
    def dtype(self) -> torch.dtype:
        return self.parts.dtype

    def new_scheduler(self) -> Any:
        """A fresh scheduler of the template's class and config: one per request."""
        template = self.parts.scheduler_template
        return type(template).from_config(template.config)

    @torch.inference_mode()
    def encode_text(self, texts: list[str]) -> torch.Tensor:
        """[len(texts), max_length, D] hidden states, one batch through the text encoder."""
        tokenizer = self.parts.tokenizer
        tokens = tokenizer(
            texts,
            padding="max_length",
            max_length=tokenizer.model_max_length,
            truncation=True,
            return_tensors="pt",
        )
        mask = tokens.attention_mask.to(self.device) if self._use_mask else None
        hidden = self.parts.text_encoder(tokens.input_ids.to(self.device), attention_mask=mask)[0]
        return hidden.to(dtype=self.dtype)

    @torch.inference_mode()
    def unet_forward(
        self, sample: torch.Tensor, timesteps: torch.Tensor, embeds: torch.Tensor
    ) -> torch.Tensor:
        """The one UNet forward of an engine step.

        sample: [R, C, h, w] (every row of one resolution), timesteps: [R] (each row its own
        request's timestep), embeds: [R, L, D]. Returns the predicted noise, [R, C, h, w]."""
        return self.parts.unet(sample, timesteps, encoder_hidden_states=embeds, return_dict=False)[
            0
        ]

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> Pixels:
        """uint8 [N, H, W, 3] RGB; at most `max_decode_rows` latents per VAE call (its
        activations at full resolution are the largest tensors of the lane)."""
        vae = self.parts.vae
        images = []
        for chunk in torch.split(latents, self.max_decode_rows):
            image = vae.decode(chunk / vae.config.scaling_factor, return_dict=False)[0]
            image = (image * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float()
            images.append((image * 255).round().to(torch.uint8).cpu())
        out: Pixels = torch.cat(images).numpy().astype(np.uint8, copy=False)
        return out
