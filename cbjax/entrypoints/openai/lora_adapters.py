"""The server's LoRA adapters (vLLM's serving models): a request's `model` names one; `--lora-modules
name=path` loads them at start, and /v1/load_lora_adapter and /v1/unload_lora_adapter at run time
when CBJAX_ALLOW_RUNTIME_LORA_UPDATING or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING is set."""

from __future__ import annotations

import os

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from cbjax.entrypoints.openai.errors import APIError
from cbjax.entrypoints.openai.protocol import LoadLoRAAdapterRequest, ModelCard, UnloadLoRAAdapterRequest
from cbjax.entrypoints.openai.serving import ServerState
from cbjax.lora.request import LoRARequest

ALLOW_RUNTIME_UPDATING = "CBJAX_ALLOW_RUNTIME_LORA_UPDATING"
VLLM_ALLOW_RUNTIME_UPDATING = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # a vLLM deployment's environment works unchanged


def parse_lora_modules(specs: list[str]) -> list[tuple[str, str]]:
    """`--lora-modules name=path ...` as (name, path) pairs; ValueError naming a malformed one."""
    pairs = []
    for spec in specs:
        name, _, path = spec.partition("=")
        if not name or not path:
            raise ValueError(f"--lora-modules {spec!r} is not NAME=PATH; give e.g. sql-lora=/adapters/sql")
        pairs.append((name, path))
    return pairs


async def load_adapter(state: ServerState, name: str, path: str) -> LoRARequest:
    """Read `path` into the engine under `name`, a new adapter id (ids are never reused: the engine keys
    cached KV blocks and device slots by id); 400 for a name in use or an adapter the engine refuses."""
    if name in state.lora_adapters or name == state.served_model_name:
        raise APIError(400, f"The model `{name}` is already served; unload it first or pick another lora_name",
                       "lora_name")
    if not state.engine.engine_config.enable_lora:
        raise APIError(400, "This server was started without --enable-lora; restart it with --enable-lora")
    state.last_lora_int_id += 1
    request = LoRARequest(name, state.last_lora_int_id, path)
    try:
        await state.engine.add_lora(request)
    except ValueError as error:
        raise APIError(400, str(error), "lora_path") from error
    state.lora_adapters[name] = request
    return request


def model_cards(state: ServerState) -> list[ModelCard]:
    """The base model's card, then each adapter's with the base as its parent (vLLM's /v1/models)."""
    limit = state.max_model_len
    base = ModelCard(id=state.served_model_name, root=state.engine.engine_config.model, max_model_len=limit)
    return [base, *(ModelCard(id=name, root=request.lora_path, parent=state.served_model_name, max_model_len=limit)
                    for name, request in state.lora_adapters.items())]


def add_runtime_routes(app: FastAPI, state: ServerState) -> None:
    """/v1/load_lora_adapter and /v1/unload_lora_adapter, only where the environment allows them."""
    if not any(os.environ.get(name, "").lower() in ("1", "true") for name in (ALLOW_RUNTIME_UPDATING, VLLM_ALLOW_RUNTIME_UPDATING)):
        return

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> str:
        await load_adapter(state, body.lora_name, body.lora_path)
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> str:
        request = state.lora_adapters.pop(body.lora_name, None)
        if request is None:
            raise APIError(404, f"The LoRA adapter `{body.lora_name}` is not loaded", "lora_name")
        await state.engine.remove_lora(request.lora_int_id)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
