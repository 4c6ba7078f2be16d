"""vLLM's runtime LoRA routes (issue 43): ``POST /v1/load_lora_adapter`` (``lora_name``, ``lora_path``)
and ``POST /v1/unload_lora_adapter`` (``lora_name``, optionally ``lora_int_id``), answered as vLLM
answers them (a plain-text success line; a 400 naming the problem, a 404 for an adapter it does not
know). They change the server's adapters only when runtime updating is allowed
(``PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING``, or vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, true) and the
engine serves adapters (``--enable-lora``); otherwise they answer a 400 saying which is missing.

Source: vLLM's ``OpenAIServingModels.load_lora_adapter`` / ``unload_lora_adapter`` as documented.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

import pagedllm.envs as envs
from pagedllm.server.base import ServingContext
from pagedllm.server.errors import APIError


class LoadLoRAAdapterRequest(BaseModel):
    """``/v1/load_lora_adapter``'s body (vLLM's fields; any other is a 400 naming it)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """``/v1/unload_lora_adapter``'s body (vLLM's fields)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


def _check_updatable(ctx: ServingContext) -> None:
    """Raises a 400 unless the engine serves adapters and runtime updating is allowed."""
    if not ctx.adapters.enabled:
        raise APIError(400, "LoRA adapters need a server started with --enable-lora", None, code="invalid_request")
    if not envs.PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING:
        raise APIError(400, "loading and unloading LoRA adapters at run time is off: start the server with "
                       "PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING=True (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)", None,
                       code="invalid_request")


def lora_router(ctx: ServingContext) -> APIRouter:
    """The two runtime adapter routes over ``ctx.adapters`` (``server.lora_adapters.LoRAAdapters``)."""
    router = APIRouter()

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        """Add an adapter by name; 400 naming the problem (a bad directory: rank, target module, file)."""
        _check_updatable(ctx)
        try:
            await ctx.offload(ctx.adapters.add, body.lora_name, body.lora_path)  # reads the directory
        except ValueError as e:
            param = "lora_name" if "already been loaded" in str(e) or "base model" in str(e) else "lora_path"
            raise APIError(400, str(e), param, code="invalid_value") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        """Take an adapter's name away (requests running with it finish with it); 404 if unknown."""
        _check_updatable(ctx)
        try:
            ctx.adapters.remove(body.lora_name, body.lora_int_id)
        except KeyError:
            raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", "lora_name",
                           code="not_found") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return router
