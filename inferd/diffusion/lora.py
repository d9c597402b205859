"""Many LoRA styles in one UNet forward: each style adds its low-rank term to its own rows only.

    styles = UNetStyles(unet, lora_config)         # once, after the UNet is loaded
    styles.register(LoRARequest("ink", 1, "/styles/ink"))  # run time; --lora-modules at start
    styles.get("ink")                              # None: unknown style (a 404 before queueing)
    future = styles.load("ink")                    # read in a background thread; it raises
                                                   # InvalidRequestError (400) for a bad file
    # in the step loop, before choosing the next forward's rows:
    styles.take_loaded(in_use={"ink"})             # finished reads into host memory
    if styles.is_loaded("ink"): ...                # admit the request's rows (<= max_loras
                                                   # distinct styles per forward)
    # before each UNet forward, its batch items in batch order: (style or None, items)
    styles.set_rows([("ink", 1), (None, 1), ("ink", 1), (None, 1)])  # CFG: uncond, then cond
    noise = unet(latents, timesteps, encoder_hidden_states).sample
    styles.set_rows([])                            # a forward without styles: the base UNet
    styles.unregister("ink")                       # unload: new requests refused; memory
                                                   # freed once no running request uses it

The UNet is diffusers' own; no module is replaced and no weight is merged. A forward hook on
every `nn.Linear` (attention to_q/to_k/to_v/to_out.0, feed-forward, time embeddings, SD 2.x's
proj_in/proj_out) and every 1x1 `nn.Conv2d` (SD 1.x's proj_in/proj_out, 1x1 shortcuts) adds
the styles' terms after the base layer has run once over every row, through the batched LoRA
layer the LLM lane uses (inferd/lora/layer.py's `LoRALayer`: one shrink GEMM and one expand GEMM
per style present, over that style's rows). A forward with no style rows costs one Python hook
call per hooked layer. The UNet must call those layers as modules: fused q/k/v projections
(`fuse_qkv_projections`) would bypass them, and are refused.

Rows: a UNet layer sees [B, L, C] activations (1x1 convolutions [B, C, H, W], read as
[B, H*W, C]), L tokens per batch item: the image's latent positions at that layer's resolution,
or the prompt's tokens for to_k/to_v of cross-attention, or 1 for a time embedding. Flattened to
[B * L, C], item b is rows [b * L, (b + 1) * L), so a run of items [lo, hi) under one style is
the one contiguous run of rows [lo * L, hi * L): a view, no gather. `set_rows` turns the batch's
item runs into one `LoRABatch` per token count L, built on first use in the forward. A
request's classifier-free-guidance rows run its style too, as diffusers' `load_lora_weights`
applies the adapter to the whole UNet batch.

Styles (registered, read in the background into host memory with an LRU over
`--max-cpu-loras`, and put in one of `--max-loras` slots when a forward needs them) are
inferd/lora/manager.py's `LoRAManager`, reading the files diffusers' `save_lora_weights`
writes (lora_files.py). The step loop admits at most `max_loras` distinct styles per forward.
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from inferd.config import LoRAConfig
from inferd.diffusion.lora_files import read_unet_lora
from inferd.lora.adapter import LoRAAdapter
from inferd.lora.layer import LoRABatch, LoRALayer
from inferd.lora.manager import LoRAManager
from inferd.lora.request import LoRARequest
from inferd.models.linear import LowRankTerm

# One run of the batch: (style, or None for the base UNet, number of batch items).
StyleRows = Sequence[tuple[str | None, int]]


@dataclass
class _Step:
    """The forward being run: its batch items and each style's runs of them (slot, lo, hi)."""

    items: int
    runs: list[tuple[int, int, int]]
    by_tokens: dict[int, LoRABatch] = field(default_factory=dict)

    def batch(self, tokens: int) -> LoRABatch:
        """The runs as rows of a layer that sees `tokens` tokens per item (module docstring)."""
        batch = self.by_tokens.get(tokens)
        if batch is None:
            segments = [(s, slice(lo * tokens, hi * tokens)) for s, lo, hi in self.runs]
            batch = self.by_tokens[tokens] = LoRABatch(list(segments))
        return batch


class _Forward:
    """What every hook reads: the forward's `_Step`, None while no row runs a style."""

    step: _Step | None = None


class _HookedLayer:
    """One UNet layer styles may target (a `LoRATarget`): its shape, its slots (`lora`, set by
    the manager) and the forward hook that adds their terms to its output."""

    def __init__(self, name: str, module: nn.Linear | nn.Conv2d, forward: _Forward) -> None:
        self.conv = isinstance(module, nn.Conv2d)
        if isinstance(module, nn.Conv2d):
            self.in_features, self.out_features = module.in_channels, module.out_channels
        else:
            self.in_features, self.out_features = module.in_features, module.out_features
        # One shard, named so the manager's key for it is the module's own name.
        self.shards = [(name.rpartition(".")[2], self.out_features)]
        self.lora: LowRankTerm | None = None
        self._forward = forward
        module.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> Tensor | None:
        step = self._forward.step
        if step is None:
            return None
        assert isinstance(self.lora, LoRALayer)
        x = args[0]
        if x.shape[0] != step.items:
            raise RuntimeError(
                f"set_rows named {step.items} batch items, the UNet ran {x.shape[0]}"
            )
        if self.conv:  # [B, C, H, W] -> [B * H * W, C]: item-major rows, as for a linear layer
            rows = x.permute(0, 2, 3, 1).reshape(-1, self.in_features)
            delta = output.new_zeros(rows.shape[0], self.out_features)
            self.lora.add_batch(rows, delta, step.batch(rows.shape[0] // step.items))
            b, _, h, w = output.shape
            return output.add_(delta.view(b, h, w, -1).permute(0, 3, 1, 2))
        rows = x.reshape(-1, self.in_features)
        flat = output.reshape(-1, self.out_features)  # a view: F.linear's output is contiguous
        self.lora.add_batch(rows, flat, step.batch(rows.shape[0] // step.items))
        return flat.view(output.shape)


def _hookable(module: nn.Module) -> bool:
    if isinstance(module, nn.Linear):
        return True
    return (
        isinstance(module, nn.Conv2d)
        and module.kernel_size == (1, 1)
        and module.stride == (1, 1)
        and module.groups == 1
        and module.padding == (0, 0)
    )


class UNetStyles:
    """The LoRA styles of one UNet: registry, host memory, slots and the per-forward rows."""

    def __init__(
        self,
        unet: nn.Module,
        config: LoRAConfig,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        """Hooks `unet`'s layers and registers `config.lora_modules` (read on first use).
        `dtype` / `device`: the UNet's, by default."""
        if any(getattr(m, "fused_projections", False) for m in unet.modules()):
            raise ValueError("LoRA styles need the UNet's q/k/v projections unfused")
        weight = next(unet.parameters())
        self._forward = _Forward()
        self.layers: list[tuple[str, _HookedLayer]] = []

        def attach(_: LoRABatch) -> list[tuple[str, _HookedLayer]]:
            self.layers = [
                (name, _HookedLayer(name, module, self._forward))
                for name, module in unet.named_modules()
                if _hookable(module)
            ]
            return self.layers

        unet_config = getattr(unet, "config", None)
        self.manager = LoRAManager(
            config,
            attach,
            dtype or weight.dtype,
            device or weight.device,
            reader=functools.partial(read_unet_lora, unet_config=unet_config),
        )
        for i, module in enumerate(config.lora_modules, start=1):
            self.manager.register(LoRARequest(module.name, i, module.path, module.base_model_name))

    @property
    def max_loras(self) -> int:
        """Distinct styles one forward may run."""
        return self.manager.config.max_loras

    # -- the registry (inferd/lora/manager.py's semantics) -------------------------------------

    def register(self, request: LoRARequest) -> LoRARequest:
        """Makes a style known (nothing read yet); InvalidRequestError for a taken name."""
        return self.manager.register(request)

    def unregister(self, name: str) -> bool:
        """Forgets a style: new requests for it are refused; its memory goes once no unfinished
        request runs it (`take_loaded` / `collect`)."""
        return self.manager.unregister(name)

    def get(self, name: str) -> LoRARequest | None:
        return self.manager.get(name)

    def known(self) -> list[LoRARequest]:
        return self.manager.known()

    def load(self, name: str) -> concurrent.futures.Future[LoRAAdapter]:
        """Starts reading a known style in the background (a done future when it is loaded);
        the future raises InvalidRequestError for a file that is refused."""
        return self.manager.load(name)

    def take_loaded(self, in_use: Iterable[str]) -> None:
        """From the step loop: finished reads into host memory (refused ones unregistered), the
        least recently used over `--max-cpu-loras` dropped, never one in `in_use`."""
        self.manager.take_loaded(in_use)

    def is_loaded(self, name: str) -> bool:
        return self.manager.is_loaded(name)

    # -- the forward ---------------------------------------------------------------------------

    def set_rows(self, rows: StyleRows) -> None:
        """The next UNet forward's batch items in batch order: (style or None, items) runs,
        covering every item. Each style must be loaded; at most `max_loras` distinct."""
        runs: list[tuple[str, int, int]] = []
        item = 0
        for name, count in rows:
            if name is not None and count > 0:
                if runs and runs[-1][0] == name and runs[-1][2] == item:
                    runs[-1] = (name, runs[-1][1], item + count)  # the same style continues
                else:
                    runs.append((name, item, item + count))
            item += count
        if not runs:
            self._forward.step = None
            return
        names = list(dict.fromkeys(name for name, _, _ in runs))
        if len(names) > self.max_loras:
            raise ValueError(
                f"{len(names)} styles in one forward, over --max-loras {self.max_loras}"
            )
        for name in names:
            if not self.manager.is_loaded(name):
                raise RuntimeError(f"style {name!r} is not loaded: load() and take_loaded() first")
        slots = self.manager.place(names)
        self._forward.step = _Step(item, [(slots[name], lo, hi) for name, lo, hi in runs])
