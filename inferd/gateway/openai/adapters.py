"""LoRA adapters on the OpenAI API, as vLLM serves them.

- A request's `model` names the served model or a registered adapter (`resolve_adapter`); an
  unknown name is a 404 `model_not_found`. Names resolve from the engine client's cache, never
  with a round trip to the engine.
- GET /v1/models lists each adapter after the base model, with `parent` (the served model's
  name) and `root` (its folder) (`adapter_cards`).
- POST /v1/load_lora_adapter {"lora_name", "lora_path"} and POST /v1/unload_lora_adapter
  {"lora_name"} (`router`): only when the environment allows runtime updates
  (INFERD_ALLOW_RUNTIME_LORA_UPDATING=1 or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; otherwise the
  routes do not exist: 404), and only to admin keys (gateway/middleware.py). Success is a 200
  with a plain-text message (vLLM's); a bad adapter is a 400 with the engine's reason.
- The same two routes load and unload an image model's LoRA styles: a `lora_path` whose files
  are a diffusers or kohya LoRA (inferd/lora/flags.py's `adapter_lane`), or any path when the
  server serves no LLM, goes to the image model; unloading finds the name among the image
  models' styles first, then the LLM's adapters. vLLM's body has no field naming the lane.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import Field
from starlette.responses import PlainTextResponse, Response

from inferd.diffusion.request import ImageEngine
from inferd.gateway.contract import openai_errors
from inferd.gateway.errors import APIError, bad_request, model_not_found
from inferd.gateway.images import find_image_model
from inferd.gateway.openai.protocol import _Body
from inferd.gateway.state import GatewayState, gateway
from inferd.lora.flags import adapter_lane
from inferd.lora.request import LoRARequest

router = APIRouter()


def resolve_adapter(state: GatewayState, model: str | None) -> LoRARequest | None:
    """The adapter `model` names; None for the served model (or no `model` at all)."""
    if model is None or model == state.model_name:
        return None
    lora = state.engine().lora(model)
    if lora is None:
        raise model_not_found(model)
    return lora


def adapter_cards(state: GatewayState) -> list[dict[str, object]]:
    """The /v1/models entries of the registered adapters, in registration order."""
    llm = state.llm
    if llm is None:
        return []
    return [
        {
            "id": lora.lora_name,
            "object": "model",
            "created": int(state.started),
            "owned_by": "inferd",
            "root": lora.lora_path,
            "parent": lora.base_model_name or state.model_name,
            "max_model_len": llm.info.max_model_len,
        }
        for lora in llm.loras()
    ]


class LoadLoRAAdapterRequest(_Body):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(_Body):
    lora_name: str = Field(min_length=1)
    # vLLM's body has it; names identify adapters here, so it is accepted and not needed.
    lora_int_id: int | None = None


@router.post(
    "/v1/load_lora_adapter",
    response_class=PlainTextResponse,
    responses=openai_errors(400, 403, 503),
)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> Response:
    """Loads a PEFT folder as the adapter `lora_name`, or a diffusers / kohya LoRA as an image
    model's style (returns once it has loaded)."""
    state = gateway(request)
    state.admitting()
    name = body.lora_name
    images = _style_lane(state, body.lora_path)
    if images is not None:
        if find_image_model(state, name) is not None or _llm_knows(state, name):
            raise bad_request(f"The lora adapter {name!r} has already been loaded", "lora_name")
        await images.add_style(name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")
    llm = state.engine()
    if name == state.model_name:
        raise bad_request(f"{name!r} is the served model's name", "lora_name")
    known = llm.lora(name)
    if known is not None:
        raise bad_request(
            f"The lora adapter {name!r} has already been loaded (from {known.lora_path!r})",
            "lora_name",
        )
    await llm.add_lora(LoRARequest(name, llm.next_lora_id(), body.lora_path))
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post(
    "/v1/unload_lora_adapter",
    response_class=PlainTextResponse,
    responses=openai_errors(400, 403, 404, 503),
)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> Response:
    """Unregisters `lora_name` at once; requests already using it finish first."""
    state = gateway(request)
    name = body.lora_name
    found = find_image_model(state, name)
    if found is not None and found[1] is not None:
        removed = await found[0].remove_style(name)
    else:
        removed = state.serves_llm and _llm_knows(state, name)
        removed = removed and await state.engine().remove_lora(name)
    if not removed:
        raise APIError(
            404,
            f"The lora adapter {name!r} cannot be found",
            type="not_found_error",
            param="lora_name",
            code="model_not_found",
            reason="not_found",
        )
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _style_lane(state: GatewayState, path: str) -> ImageEngine | None:
    """The image engine a loaded `path` is a style of (the module docstring's rule); None: an
    LLM adapter."""
    if not state.images or (state.serves_llm and adapter_lane(path) != "image"):
        return None
    return next(iter(state.images.values()))


def _llm_knows(state: GatewayState, name: str) -> bool:
    return state.serves_llm and (name == state.model_name or state.engine().lora(name) is not None)
