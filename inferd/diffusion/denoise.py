"""Per-request denoising state, and one batched step over many requests at their own timesteps.

    states = start_states(runner, [(request, spec), ...])   # batched text encode, seeded noise
    outputs = denoise_step(runner, states)                   # ONE UNet forward, then each
                                                             # request's own scheduler step

Each request owns what diffusers' pipeline keeps for one call: its scheduler instance (built
from the model's scheduler config, so a multistep solver's history is its own), its timesteps
and step index, its latents [n, C, h, w], its text embeddings, and its `torch.Generator("cpu")`
seeded with the request's seed. The noise is drawn from that generator in the pipeline's order
(timesteps set, then `randn_tensor` of the pipeline's shape, times `init_noise_sigma`; an
ancestral scheduler draws its per-step noise from it too), so a request's images are the ones
`StableDiffusionPipeline(..., generator=torch.Generator("cpu").manual_seed(seed))` (or
`StableDiffusionXLPipeline`) makes, whatever else shares its forwards.

Row layout of a forward, request after request: with guidance, the request's n uncond rows then
its n cond rows (the pipeline's `cat([latents] * 2)` against `cat([negative, prompt])`); without,
its n cond rows. The timestep tensor repeats each request's current timestep over its rows.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers.utils.torch_utils import randn_tensor

from inferd.diffusion.request import ImageRequest
from inferd.diffusion.runner import ImageRunner, TextEmbeddings
from inferd.diffusion.step_scheduler import preview_steps
from inferd.diffusion.validate import ImageSpec


@dataclass(eq=False)
class DenoiseState:
    request: ImageRequest
    spec: ImageSpec
    seq: int  # arrival order
    scheduler: Any
    timesteps: torch.Tensor
    latents: torch.Tensor  # [n, C, h, w]
    embeds: torch.Tensor  # [rows, L, D]: uncond rows (with guidance) then cond rows
    added: dict[str, torch.Tensor] | None  # SDXL: text_embeds [rows, P], time_ids [rows, 6]
    generator: torch.Generator
    step_kwargs: dict[str, Any]
    preview_steps: tuple[int, ...]  # 1-based steps after which a preview is sent
    step_index: int = 0
    # The last step's prediction of the clean latents (schedulers that give one): the preview.
    denoised: torch.Tensor | None = None
    first_step_at: float | None = None
    admitted_at: float = field(default_factory=time.monotonic)

    @property
    def num_steps(self) -> int:
        return len(self.timesteps)

    @property
    def done(self) -> bool:
        return self.step_index >= self.num_steps

    @property
    def rows(self) -> int:
        return self.spec.rows


def start_states(
    runner: ImageRunner, admitted: list[tuple[ImageRequest, ImageSpec, int]]
) -> list[DenoiseState]:
    """States for requests admitted together: their prompts and negative prompts go through
    the text encoder(s) in one batch; each then draws its own noise."""
    zero = runner.parts.zero_empty_negative
    texts: list[str] = []
    for _, spec, _ in admitted:
        if spec.cfg and not (zero and spec.negative_prompt == ""):
            texts.append(spec.negative_prompt)
        texts.append(spec.prompt)
    text = runner.encode_text(texts)
    states, i = [], 0
    for request, spec, seq in admitted:
        rows = []
        if spec.cfg and zero and spec.negative_prompt == "":
            rows.append(-1)  # SDXL's empty negative: zeros
        elif spec.cfg:
            rows.append(i)
            i += 1
        rows.append(i)
        i += 1
        embeds, added = _conditioning(runner, spec, text, rows)
        states.append(_new_state(runner, request, spec, seq, embeds, added))
    return states


def _conditioning(
    runner: ImageRunner, spec: ImageSpec, text: TextEmbeddings, rows: list[int]
) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
    """The request's rows of text conditioning, [uncond x n, cond x n] (the pipeline's order):
    `rows` picks its encoded texts (-1: zeros). SDXL adds the pooled text and the size ids."""

    def pick(t: torch.Tensor) -> torch.Tensor:
        parts = [torch.zeros_like(t[:1]) if r < 0 else t[r : r + 1] for r in rows]
        return torch.cat(parts).repeat_interleave(spec.n, dim=0)

    embeds = pick(text.hidden)
    if text.pooled is None:
        return embeds, None
    h, w = spec.height, spec.width
    # original size, crop top-left, target size: the pipeline's defaults for a txt2img call.
    time_ids = torch.tensor([[h, w, 0, 0, h, w]], dtype=text.hidden.dtype, device=runner.device)
    added = {"text_embeds": pick(text.pooled), "time_ids": time_ids.repeat(spec.rows, 1)}
    return embeds, added


def _new_state(
    runner: ImageRunner,
    request: ImageRequest,
    spec: ImageSpec,
    seq: int,
    embeds: torch.Tensor,
    added: dict[str, torch.Tensor] | None,
) -> DenoiseState:
    scheduler = runner.new_scheduler()
    scheduler.set_timesteps(spec.steps, device=runner.device)
    generator = torch.Generator("cpu").manual_seed(spec.seed)
    factor = runner.parts.vae_scale_factor
    shape = (spec.n, runner.latent_channels, spec.height // factor, spec.width // factor)
    latents = randn_tensor(shape, generator=generator, device=runner.device, dtype=runner.dtype)
    latents = latents * scheduler.init_noise_sigma
    return DenoiseState(
        request=request,
        spec=spec,
        seq=seq,
        scheduler=scheduler,
        timesteps=scheduler.timesteps,
        latents=latents,
        embeds=embeds,
        added=added,
        generator=generator,
        step_kwargs=_step_kwargs(scheduler, generator),
        preview_steps=preview_steps(len(scheduler.timesteps), spec.partial_images),
    )


def _step_kwargs(scheduler: Any, generator: torch.Generator) -> dict[str, Any]:
    """What the pipeline's `prepare_extra_step_kwargs` passes: eta 0 and the generator, to the
    schedulers whose `step` takes them."""
    accepted = inspect.signature(scheduler.step).parameters
    kwargs: dict[str, Any] = {}
    if "eta" in accepted:
        kwargs["eta"] = 0.0
    if "generator" in accepted:
        kwargs["generator"] = generator
    return kwargs


@torch.inference_mode()
def denoise_step(runner: ImageRunner, states: list[DenoiseState]) -> None:
    """Advances every state by one step: one UNet forward over all their rows (one resolution),
    then each request's guidance and its own scheduler step."""
    inputs, steps, embeds = [], [], []
    for s in states:
        t = s.timesteps[s.step_index]
        latent_in = torch.cat([s.latents] * 2) if s.spec.cfg else s.latents
        inputs.append(s.scheduler.scale_model_input(latent_in, t))
        steps.append(t.to(torch.float32).expand(s.rows))
        embeds.append(s.embeds)
    added = None
    if states[0].added is not None:  # SDXL: every request of the model has them
        added = {k: torch.cat([s.added[k] for s in states if s.added]) for k in states[0].added}
    noise = runner.unet_forward(torch.cat(inputs), torch.cat(steps), torch.cat(embeds), added)
    start = 0
    for s, rows in zip(states, (s.rows for s in states), strict=True):
        _advance(s, noise[start : start + rows])
        start += rows


def _advance(state: DenoiseState, noise: torch.Tensor) -> None:
    spec = state.spec
    if spec.cfg:
        uncond, cond = noise.chunk(2)
        noise = uncond + spec.guidance_scale * (cond - uncond)
    t = state.timesteps[state.step_index]
    out = state.scheduler.step(noise, t, state.latents, **state.step_kwargs, return_dict=True)
    state.latents = out.prev_sample
    state.denoised = getattr(out, "pred_original_sample", None)
    state.step_index += 1
