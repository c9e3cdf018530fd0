"""LoRA adapters at the API: vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`, and
the registration `--lora-modules` shares with them.

An adapter is checked before it is registered (path, PEFT format, rank, target modules, shapes
against the base model when the gateway knows its config), so a bad one is a 400 and nothing
being served changes. Once registered, a request whose `model` names it runs on the base
deployment with the adapter (`ModelRouter.resolve`), and `/v1/models` lists it with `parent`
set to the base. Unloading removes the name at once (new requests get a 404); requests already
running with it carry the adapter themselves and finish normally; the engines' copies age out of
their LRUs.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from tokenpath.api.routes import require_admin
from tokenpath.api.state import AppState, get_state
from tokenpath.engine.lora import check_adapter
from tokenpath.errors import InvalidRequestError, NotFoundError
from tokenpath.protocol.limits import NAME_CHARS, PATH_CHARS
from tokenpath.protocol.lora import LoraRef
from tokenpath.protocol.names import ADAPTER, MODEL, check_name, check_path
from tokenpath.routing.models import ModelRouter

router = APIRouter()


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=NAME_CHARS.value)
    lora_path: str = Field(min_length=1, max_length=PATH_CHARS.value)
    base_model_name: str | None = None  # default: the (first) chat model
    load_inplace: bool = False  # vLLM's: replace an adapter already loaded under this name


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=NAME_CHARS.value)
    lora_int_id: int | None = None  # vLLM's, ignored


async def register_adapter(models: ModelRouter, name: str, path: str, base: str | None = None,
                           replace: bool = False) -> LoraRef:
    """Check an adapter against its base model and register it; LoraError (400) if it cannot run.

    The name and the path are checked first (`protocol.names`: printable, no control or bidi
    characters, no path separators in the name), so `a\\x00b` or `../../x` is never registered and
    a NUL in the path is a 400 naming `lora_path`, not the ValueError the OS layer raises."""
    check_name(name, ADAPTER, "lora_name")
    check_path(path, "lora_path")
    if base is not None:
        check_name(base, MODEL, "base_model_name")
    if base is None:
        dep = next((d for d in models.deployments.values() if d.task != "embedding"), None)
        if dep is None:
            raise InvalidRequestError("no chat model is served here to run a LoRA adapter on", param="lora_name")
    else:
        if base in models.adapters:
            raise InvalidRequestError(f"base_model_name '{base}' is itself a LoRA adapter", param="base_model_name")
        try:
            dep = models.resolve(base, "chat")
        except NotFoundError:
            raise NotFoundError(f"The base model '{base}' does not exist", param="base_model_name",
                                code="model_not_found") from None
    if name in models.adapters and not replace:
        raise InvalidRequestError(f"The lora adapter '{name}' has already been loaded.", param="lora_name",
                                  code="lora_already_loaded")
    if name in models.deployments or name in models.aliases:
        raise InvalidRequestError(f"'{name}' is already the name of a model; pick another lora_name", param="lora_name")
    resolved = Path(path).expanduser().resolve()  # engine processes do not share our working directory
    await asyncio.to_thread(check_adapter, resolved, dep.model_config, dep.max_lora_rank)
    if replace:
        models.adapters.pop(name, None)
    ref = LoraRef(name=name, path=str(resolved), base=dep.name)
    models.add_adapter(ref)
    return ref


@router.post("/v1/load_lora_adapter", responses={400: {"description": "Invalid adapter"}})
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request,
                            state: AppState = Depends(get_state)) -> PlainTextResponse:
    """vLLM's dynamic loading (an admin key when auth is on): checked now, loaded by each engine
    on first use."""
    await require_admin(state, request, "/v1/load_lora_adapter")
    await register_adapter(state.router, body.lora_name, body.lora_path, body.base_model_name, body.load_inplace)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", responses={404: {"description": "Unknown adapter"}})
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request,
                              state: AppState = Depends(get_state)) -> PlainTextResponse:
    """New requests naming it get a 404; those running with it finish."""
    await require_admin(state, request, "/v1/unload_lora_adapter")
    state.router.remove_adapter(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
