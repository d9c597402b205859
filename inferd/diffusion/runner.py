"""The image lane's model calls: text encoder, the UNet forward, VAE decode (the only code here
that runs a model; the engine thread calls it).

    runner = ImageRunner(parts, max_decode_rows=8)
    text = runner.encode_text(["a red fox", ""])       # hidden [2, 77, D] (+ pooled for SDXL)
    noise = runner.unet_forward(sample, timesteps, hidden, added)   # one forward, a timestep a row
    pixels = runner.decode(latents)                    # uint8 [N, H, W, 3]

Each mirrors what diffusers' pipelines do for one request, so the images are theirs: prompts
padded to the tokenizer's max length; SD's text encoder's last hidden state, or SDXL's two
encoders' penultimate hidden states side by side and the second's pooled projection; latents
un-scaled by the VAE's config, decoded, mapped from [-1, 1] to [0, 1] and rounded to uint8 as the
pipelines' PIL output is. Every call runs under `torch.inference_mode`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from inferd.diffusion.loader import PipelineParts
from inferd.diffusion.request import Pixels


@dataclass
class TextEmbeddings:
    hidden: torch.Tensor  # [N, L, D]
    pooled: torch.Tensor | None  # [N, P]: SDXL's pooled projection, None for SD


class ImageRunner:
    def __init__(self, parts: PipelineParts, max_decode_rows: int) -> None:
        self.parts = parts
        self.max_decode_rows = max_decode_rows
        self.latent_channels = int(parts.unet.config.in_channels)
        first = parts.text_encoders[0][1]
        self._use_mask = bool(getattr(first.config, "use_attention_mask", False))

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
    def encode_text(self, texts: list[str]) -> TextEmbeddings:
        """The texts through the text encoder(s) in one batch each."""
        if not self.parts.sdxl:
            tokenizer, encoder = self.parts.text_encoders[0]
            ids, mask = self._tokens(tokenizer, texts)
            hidden = encoder(ids, attention_mask=mask if self._use_mask else None)[0]
            return TextEmbeddings(hidden.to(dtype=self.dtype), None)
        hiddens, pooled = [], None
        for tokenizer, encoder in self.parts.text_encoders:
            out = encoder(self._tokens(tokenizer, texts)[0], output_hidden_states=True)
            if pooled is None and out[0].ndim == 2:  # the projection's pooled output
                pooled = out[0]
            hiddens.append(out.hidden_states[-2])
        assert pooled is not None
        return TextEmbeddings(torch.cat(hiddens, dim=-1).to(self.dtype), pooled.to(self.dtype))

    def _tokens(self, tokenizer: Any, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = tokenizer(
            texts,
            padding="max_length",
            max_length=tokenizer.model_max_length,
            truncation=True,
            return_tensors="pt",
        )
        return tokens.input_ids.to(self.device), tokens.attention_mask.to(self.device)

    @torch.inference_mode()
    def unet_forward(
        self,
        sample: torch.Tensor,
        timesteps: torch.Tensor,
        embeds: torch.Tensor,
        added: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The one UNet forward of an engine step.

        sample: [R, C, h, w] (every row of one resolution), timesteps: [R] (each row its own
        request's timestep), embeds: [R, L, D]; SDXL's `added`: text_embeds [R, P] and time_ids
        [R, 6]. Returns the predicted noise, [R, C, h, w]."""
        out = self.parts.unet(
            sample,
            timesteps,
            encoder_hidden_states=embeds,
            added_cond_kwargs=added,
            return_dict=False,
        )
        return out[0]

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> Pixels:
        """uint8 [N, H, W, 3] RGB; at most `max_decode_rows` latents per VAE call (its
        activations at full resolution are the largest tensors of the lane)."""
        vae = self.parts.vae
        config = vae.config
        latents = latents.to(vae.dtype)
        if config.get("latents_mean") is not None and config.get("latents_std") is not None:
            mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1).to(latents)
            std = torch.tensor(config.latents_std).view(1, -1, 1, 1).to(latents)
            latents = latents * std / config.scaling_factor + mean
        else:
            latents = latents / config.scaling_factor
        images = []
        for chunk in torch.split(latents, self.max_decode_rows):
            image = vae.decode(chunk, return_dict=False)[0]
            image = (image * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float()
            images.append((image * 255).round().to(torch.uint8).cpu())
        out: Pixels = torch.cat(images).numpy().astype(np.uint8, copy=False)
        return out
