"""A small OpenAI-compatible HTTP endpoint on an engine (aiohttp), so other
routers (sglang-router, vllm-router) and load generators can be pointed at
the very same engines kvmesh's scheduler drives.

POST /v1/completions and /v1/chat/completions (stream true/false; prompt as
text or token ids), GET /v1/models, GET /health, plus what sglang-router asks
workers: GET /model_info, /server_info, /get_load, and what vllm-router's
cache_aware asks: POST /v1/chat/completions/render and /v1/completions/render
(the prompt's token ids, nothing generated). Engine errors map here to
HTTP status + OpenAI error JSON (400 invalid, 503 not accepting).
"""

from __future__ import annotations

import json
import ssl
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from services.engine.backend import GenerationOutput, GenerationRequest, InvalidRequest, Sampling
from services.engine.errors import DuplicateRequest, NotAccepting
from services.engine.runtime import EngineRuntime
from services.engine.tokenizer import TextCodec

__all__ = ["OpenAIHttpServer"]

DEFAULT_MAX_TOKENS = 256
# aiohttp's default backlog of 128 drops connections in bursts (DESIGN.md).
LISTEN_BACKLOG = 4096


class _BadRequest(Exception):
    pass


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


class OpenAIHttpServer:
    def __init__(self, runtime: EngineRuntime, codec: TextCodec, model_name: str) -> None:
        self._runtime = runtime
        self._codec = codec
        self._model = model_name
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
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
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
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

    # ---------------------------------------------------------------- render

    async def _render_chat(self, request: web.Request) -> web.Response:
        return await self._render(request, chat=True)

    async def _render_completion(self, request: web.Request) -> web.Response:
        return await self._render(request, chat=False)

    async def _render(self, request: web.Request, chat: bool) -> web.Response:
        """The prompt's token ids as this engine would run them, nothing
        generated (vLLM's render endpoints: a chat render is one object, a
        completions render a list of one per prompt)."""
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise _BadRequest("the body must be a JSON object")
            gen = self._parse(body, chat)
        except (ValueError, _BadRequest, InvalidRequest) as exc:
            return _error(400, str(exc), "invalid_request_error")
        rendered = {"request_id": gen.request_id, "model": self._model, "token_ids": gen.prompt_token_ids,
                    "sampling_params": {"max_tokens": gen.sampling.max_tokens}}
        return web.json_response(rendered if chat else [rendered])

    # ---------------------------------------------------------------- generation

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise _BadRequest("the body must be a JSON object")
            gen_request = self._parse(body, chat)
            generation = self._runtime.open(gen_request)
        except (ValueError, _BadRequest, InvalidRequest) as exc:
            return _error(400, str(exc), "invalid_request_error")
        except DuplicateRequest as exc:
            return _error(409, str(exc), "invalid_request_error")
        except NotAccepting as exc:
            return _error(503, str(exc), "service_unavailable")
        outputs = generation.outputs()
        try:
            if body.get("stream"):
                return await self._stream(request, outputs, gen_request, chat, body)
            return await self._whole(outputs, gen_request, chat)
        except InvalidRequest as exc:
            return _error(400, str(exc), "invalid_request_error")
        finally:
            await outputs.aclose()
            generation.close()

    def _parse(self, body: dict[str, Any], chat: bool) -> GenerationRequest:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise _BadRequest("messages must be a non-empty list")
            prompt = self._codec.encode(self._codec.render_chat(messages))
        else:
            prompt = self._prompt_ids(body.get("prompt"))
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS
        info = self._runtime.backend.info
        if info.max_model_len and "max_tokens" not in body and "max_completion_tokens" not in body:
            max_tokens = max(1, min(max_tokens, info.max_model_len - len(prompt)))
        sampling = Sampling(
            max_tokens=int(max_tokens), temperature=body.get("temperature"), top_p=body.get("top_p"),
            top_k=body.get("top_k"), min_tokens=int(body.get("min_tokens") or 0), stop=stop,
            stop_token_ids=list(body.get("stop_token_ids") or []), seed=body.get("seed"),
            ignore_eos=bool(body.get("ignore_eos", False)),
        )
        return GenerationRequest(request_id=f"http-{uuid.uuid4().hex}", prompt_token_ids=prompt,
                                 sampling=sampling, priority=int(body.get("priority", 1)))

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self._codec.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) and t >= 0 for t in prompt):
            return prompt
        raise _BadRequest("prompt must be a string or a list of token ids (one prompt per request)")

    def _envelope(self, request_id: str, chat: bool, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
        return {"id": request_id, "object": kind, "created": int(time.time()), "model": self._model}

    @staticmethod
    def _usage(out: GenerationOutput) -> dict[str, Any]:
        return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                "total_tokens": out.prompt_tokens + out.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}

    async def _whole(self, outputs: AsyncIterator[GenerationOutput], req: GenerationRequest,
                     chat: bool) -> web.Response:
        text: list[str] = []
        ids: list[int] = []
        last = GenerationOutput(token_ids=[], text="")
        async for out in outputs:
            text.append(out.text)
            ids.extend(out.token_ids)
            last = out
        choice: dict[str, Any] = {"index": 0, "finish_reason": last.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": "".join(text)}
        else:
            choice["text"] = "".join(text)
        choice["token_ids"] = ids
        body = {**self._envelope(req.request_id, chat, False), "choices": [choice],
                "usage": self._usage(last)}
        return web.json_response(body)

    async def _stream(self, request: web.Request, outputs: AsyncIterator[GenerationOutput],
                      req: GenerationRequest, chat: bool, body: dict[str, Any]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        envelope = self._envelope(req.request_id, chat, True)

        async def send(choice: dict[str, Any], usage: dict[str, Any] | None = None) -> None:
            event = {**envelope, "choices": [choice] if choice else []}
            if usage is not None:
                event["usage"] = usage
            await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")

        if chat:
            await send({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
        async for out in outputs:
            if out.text or out.token_ids or out.finish_reason:
                content = {"delta": {"content": out.text}} if chat else {"text": out.text}
                await send({"index": 0, **content, "token_ids": out.token_ids,
                            "finish_reason": out.finish_reason})
            if out.finish_reason is not None and include_usage:
                await send({}, self._usage(out))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
