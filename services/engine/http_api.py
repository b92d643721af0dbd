"""A small OpenAI-compatible HTTP endpoint on an engine (aiohttp), so other
routers (sglang-router, vllm-router) and load generators can be pointed at
the very same engines kvmesh's scheduler drives.

POST /v1/completions and /v1/chat/completions (stream true/false; prompt as
text or token ids), GET /v1/models, GET /health, plus what sglang-router asks
workers: GET /model_info, /server_info, /get_load, and what vllm-router's
cache_aware asks: POST /v1/chat/completions/render and /v1/completions/render
(the prompt's token ids, nothing generated).

Parsing, tokenizing and formatting are the gateway's own
(services/common/openai_api/, services/common/tokenizer.py via the engine's
codec), so a chat gets the same prompt token ids here as through kvmesh.
What is this endpoint's alone: `model` may be left out (this engine serves
one), vLLM's sampling extensions and a body `priority` are read, max_tokens
defaults to `DEFAULT_MAX_TOKENS` (within the context), and each choice
carries its token ids. `_errors` is the one place engine errors become HTTP
status + OpenAI error JSON (400 invalid, 409 duplicate id, 503 not accepting).
"""

from __future__ import annotations

import ssl
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

from aiohttp import web

from services.common.openai_api.completions_output import SSE_DONE, ChatFormatter, CompletionFormatter, Formatter, sse
from services.common.openai_api.errors import ApiError, ErrorKind, error_body, error_response
from services.common.openai_api.requests import (
    GenerationInput,
    invalid,
    parse_chat_body,
    parse_completion_body,
    parse_json_body,
)
from services.common.openai_api.structured_outputs import structured_to_proto
from services.common.proto.kvmesh.v1 import engine_pb2
from services.engine.backend import GenerationOutput, GenerationRequest, InvalidRequest
from services.engine.errors import DuplicateRequest, NotAccepting
from services.engine.fencing import OWN_ENDPOINT_PREFIX
from services.engine.grpc_api import request_from_proto
from services.engine.model import TextCodec
from services.engine.runtime import EngineRuntime

__all__ = ["OpenAIHttpServer"]

DEFAULT_MAX_TOKENS = 256
# aiohttp's default backlog of 128 drops connections in bursts (DESIGN.md).
LISTEN_BACKLOG = 4096

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _engine_error(exc: Exception) -> ApiError:
    if isinstance(exc, DuplicateRequest):
        return ApiError(ErrorKind.CONFLICT, str(exc), code="duplicate_request_id")
    if isinstance(exc, NotAccepting):
        return ApiError(ErrorKind.UNAVAILABLE, str(exc), code="not_accepting")
    return ApiError(ErrorKind.INVALID_REQUEST, str(exc))


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc)
    except (InvalidRequest, DuplicateRequest, NotAccepting) as exc:
        return error_response(_engine_error(exc))


def _priority(body: dict[str, Any]) -> int:
    value = body.get("priority", 1)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid("priority must be an integer (0 runs first)", "priority")
    return value


class OpenAIHttpServer:
    def __init__(self, runtime: EngineRuntime, codec: TextCodec, model_name: str) -> None:
        self._runtime = runtime
        self._codec = codec
        self._model = model_name
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_errors], client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/model_info", self._model_info)
        app.router.add_get("/server_info", self._model_info)
        app.router.add_get("/get_load", self._get_load)
        # vllm-router's cache_aware asks every worker for a request's token ids.
        app.router.add_post("/v1/chat/completions/render", self._render_chat)
        app.router.add_post("/v1/completions/render", self._render_completion)
        return app

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> None:
        self._runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port, backlog=LISTEN_BACKLOG, ssl_context=ssl_context).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---------------------------------------------------------------- info

    async def _health(self, _r: web.Request) -> web.Response:
        return web.Response(status=200 if self._runtime.serving else 503)

    async def _models(self, _r: web.Request) -> web.Response:
        info = self._runtime.backend.info
        return web.json_response({"object": "list", "data": [{
            "id": self._model, "object": "model", "created": 0, "owned_by": "kvmesh",
            "root": self._codec.path or self._model, "max_model_len": info.max_model_len}]})

    async def _model_info(self, _r: web.Request) -> web.Response:
        info = self._runtime.backend.info
        path = self._codec.path or self._model
        return web.json_response({"model_path": path, "tokenizer_path": path, "is_generation": True,
                                  "served_model_name": self._model, "max_model_len": info.max_model_len,
                                  "page_size": info.block_size})

    async def _get_load(self, _r: web.Request) -> web.Response:
        load = self._runtime.load()
        return web.json_response({"load": load.running + load.waiting, "running": load.running,
                                  "waiting": load.waiting, "blocks_used": load.blocks_used})

    # ---------------------------------------------------------------- requests

    async def _parse(self, request: web.Request, chat: bool) -> tuple[GenerationInput, GenerationRequest]:
        body = parse_json_body(await request.read())
        if isinstance(body, dict) and not body.get("model"):
            body = {**body, "model": self._model}  # this engine serves one model: naming it is optional
        parse = parse_chat_body if chat else parse_completion_body
        parsed = parse(body, vllm_extensions=True)
        if parsed.n > 1 or parsed.echo:
            name = "n" if parsed.n > 1 else "echo"
            raise ApiError(ErrorKind.INVALID_REQUEST, f"{name} is served by the gateway, not an engine's own "
                           "endpoint", param=name, code="unsupported_value")
        if parsed.tools:  # tool calls are read out of the text by the gateway only
            raise ApiError(ErrorKind.INVALID_REQUEST, "tools are served by the gateway's API, not by an engine's "
                           "own endpoint", param="tools", code="unsupported_parameter")
        prompt = self._prompt_ids(parsed)
        max_tokens = parsed.sampling.max_tokens
        if max_tokens is None:
            max_tokens = DEFAULT_MAX_TOKENS
            context = self._runtime.backend.info.max_model_len
            if context:
                max_tokens = max(1, min(max_tokens, context - len(prompt)))
        # Logprobs are not served here: the engine is not asked for them.
        sampling = replace(parsed.sampling, logprobs=None).to_proto(max_tokens)
        if parsed.structured is not None:
            sampling.structured.CopyFrom(structured_to_proto(parsed.structured))
        message = engine_pb2.EngineRequest(request_id=f"{OWN_ENDPOINT_PREFIX}{uuid.uuid4().hex}",
                                           prompt_token_ids=prompt,
                                           sampling=sampling, priority=_priority(body))
        return parsed, request_from_proto(message)

    def _prompt_ids(self, parsed: GenerationInput) -> list[int]:
        if parsed.messages is not None:
            return self._codec.chat_prompt(parsed.messages).token_ids
        if parsed.prompt_text is not None:
            return self._codec.text_prompt(parsed.prompt_text).token_ids
        return list(parsed.prompt_ids or [])

    # ---------------------------------------------------------------- render

    async def _render_chat(self, request: web.Request) -> web.Response:
        return await self._render(request, chat=True)

    async def _render_completion(self, request: web.Request) -> web.Response:
        return await self._render(request, chat=False)

    async def _render(self, request: web.Request, chat: bool) -> web.Response:
        """The prompt's token ids as this engine would run them, nothing
        generated (vLLM's render endpoints: a chat render is one object, a
        completions render a list of one per prompt)."""
        _, gen = await self._parse(request, chat)
        rendered = {"request_id": gen.request_id, "model": self._model, "token_ids": gen.prompt_token_ids,
                    "sampling_params": {"max_tokens": gen.sampling.max_tokens}}
        return web.json_response(rendered if chat else [rendered])

    # ---------------------------------------------------------------- generation

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        parsed, gen_request = await self._parse(request, chat)
        generation = self._runtime.open(gen_request)
        formatter_cls: type[Formatter] = ChatFormatter if chat else CompletionFormatter
        formatter = formatter_cls(gen_request.request_id, self._model, parsed.include_usage, token_ids=True)
        outputs = generation.outputs()
        try:
            if parsed.stream:
                return await self._stream(request, outputs, formatter)
            return await self._whole(outputs, formatter)
        finally:
            await outputs.aclose()
            generation.close()

    @staticmethod
    async def _whole(outputs: AsyncIterator[GenerationOutput], formatter: Formatter) -> web.Response:
        text: list[str] = []
        ids: list[int] = []
        last = GenerationOutput(token_ids=[], text="")
        async for out in outputs:
            text.append(out.text)
            ids.extend(out.token_ids)
            last = out
        return web.json_response(formatter.response("".join(text), (), last.finish_reason, last, ids))

    @staticmethod
    async def _stream(request: web.Request, outputs: AsyncIterator[GenerationOutput],
                      formatter: Formatter) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        first = formatter.first_chunk()
        if first is not None:
            await response.write(sse(first))
        try:
            async for out in outputs:
                if out.text or out.token_ids:
                    await response.write(formatter.delta_sse(out.text, (), out.token_ids))
                if out.finish_reason is not None:
                    await response.write(sse(formatter.final_chunk(out.finish_reason)))
                    if formatter.include_usage:
                        await response.write(sse(formatter.usage_chunk(out)))
        except InvalidRequest as exc:  # refused after the stream started: the error is an event
            await response.write(sse(error_body(_engine_error(exc))))
        await response.write(SSE_DONE)
        await response.write_eof()
        return response
