"""`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`, as vLLM serves them: bodies
`{"lora_name", "lora_path", "load_inplace"?}` / `{"lora_name", "lora_int_id"?}`, a plain-text 200
(`Success: LoRA adapter '<name>' added successfully.` / `... removed successfully.`), errors as OpenAI-style
JSON naming the field. Off unless `--allow-runtime-lora-updating` or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
(then 404 saying how to turn them on); they also need --enable-lora.

The engine core holds the registry (runtime/lora/registry.py), so with --api-server-count N an adapter
loaded through any API server is listed and accepted by all of them. `lora_path` may also be an hf://, s3://
or file:// URI: the API server downloads it first (runtime/server/lora_fetch.py)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr

from kvserve.runtime.lora.errors import LoraRequestError
from kvserve.runtime.server import lora_fetch, lora_remote
from kvserve.runtime.server.errors import APIError


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: StrictStr
    lora_path: StrictStr
    load_inplace: StrictBool = False  # vLLM's: replace the weights of an already-loaded name


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: StrictStr
    lora_int_id: StrictInt | None = None  # accepted for vLLM clients; kvserve names adapters only


def _api_error(exc: LoraRequestError) -> APIError:
    kind = "not_found_error" if exc.status == 404 else "invalid_request_error" if exc.status < 500 else "server_error"
    return APIError(exc.status, exc.message, type=kind, param=exc.param, code=exc.code)


def add_routes(app: FastAPI, state: Any, serving: Any) -> None:
    def check_allowed(request: Request) -> None:
        serving.check_auth(request)
        if not lora_remote.runtime_updating_allowed(state.config.allow_runtime_lora_updating):
            raise APIError(
                404,
                f"Runtime LoRA loading is off: start kvserve serve with --allow-runtime-lora-updating (or "
                f"{lora_remote.ENV_SWITCH}=True) and --enable-lora: {request.method} {request.url.path}",
                type="not_found_error",
                code="not_found",
            )
        serving.check_ready()
        if not state.lora_enabled:
            raise APIError(
                400,
                "LoRA is off: start the server with --enable-lora to load adapters",
                param="lora_name",
                code="lora_disabled",
            )

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        check_allowed(request)
        body: LoadLoRAAdapterRequest = await serving.parse(request, LoadLoRAAdapterRequest)
        if body.lora_name in state.config.served_model_names:
            raise APIError(
                400,
                f"lora_name {body.lora_name!r} is the base model's served name",
                param="lora_name",
                code="lora_adapter_exists",
            )
        try:
            path = await lora_fetch.local_path(body.lora_path, state.config.lora_download_dir)
            await lora_remote.call(state, "load_lora_adapter", body.lora_name, path, body.load_inplace)
        except LoraRequestError as exc:
            raise _api_error(exc) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        check_allowed(request)
        body: UnloadLoRAAdapterRequest = await serving.parse(request, UnloadLoRAAdapterRequest)
        try:
            await lora_remote.call(state, "unload_lora_adapter", body.lora_name)
        except LoraRequestError as exc:
            raise _api_error(exc) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
