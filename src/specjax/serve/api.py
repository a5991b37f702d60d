"""OpenAI-compatible HTTP API (FastAPI): /v1/completions, /v1/chat/completions (stream and not), /v1/models,
/health, /metrics.  `create_app(service, ...)` is a factory: no module-level app or engine."""

from __future__ import annotations

import json
import time
import uuid
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from specjax.engine.engine import RequestError
from specjax.sampling import SamplingError, SamplingParams
from specjax.serve.replicas import DataParallelService
from specjax.serve.service import EngineService


class OpenAIError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def error_response(message: str, param: str | None = None, status: int = 400, code: str | None = None):
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(default=None)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = 1
    logprobs: bool | int | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False  # extension (as in vLLM): also return the generated token ids

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v):
        if not 0 <= v <= 2:
            raise ValueError(f"temperature must be between 0 and 2, got {v}")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v):
        if not 0 < v <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {v}")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v):
        if v is not None and v < 1:
            raise ValueError(f"max_tokens must be at least 1, got {v}")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v):
        if v != 1:
            raise ValueError(f"only n=1 is supported, got n={v}")
        return v

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v):
        if v not in (None, False, 0):
            raise ValueError("logprobs are not supported by this server")
        return v

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if len(stops) > 4:
            raise OpenAIError("at most 4 stop sequences are allowed", "stop")
        return stops


class CompletionRequest(SamplingFields):
    prompt: str | list[int]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


def create_app(service: EngineService | DataParallelService, model_name: str, default_max_tokens: int = 256) -> FastAPI:
    app = FastAPI(title="specjax", version="0.1.0")
    tokenizer = service.tokenizer

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        service.count_rejected()
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return error_response(f"malformed JSON body: {first.get('ctx', {}).get('error', 'invalid JSON')}")
        loc = [str(x) for x in first.get("loc", []) if x != "body"]
        msg = first.get("msg", "invalid request").removeprefix("Value error, ")
        return error_response(f"{'.'.join(loc) + ': ' if loc else ''}{msg}", ".".join(loc) or None)

    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError):
        service.count_rejected()
        return error_response(exc.message, exc.param, exc.status, exc.code)

    def check_model(name: str) -> None:
        if name != model_name:
            raise OpenAIError(f"model {name!r} does not exist; this server serves {model_name!r}", "model",
                              code="model_not_found")

    def build(req: SamplingFields, prompt_ids: list[int], max_tokens: int | None):
        try:
            params = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                    max_new_tokens=max_tokens or default_max_tokens, seed=req.seed,
                                    ignore_eos=req.ignore_eos)
            service.validate_request(prompt_ids, params)
        except (SamplingError, RequestError) as e:
            raise OpenAIError(str(e)) from None
        if service.error is not None:
            raise OpenAIError(f"the engine stopped: {service.error}", status=500)
        return params

    @app.get("/health")
    async def health():
        if service.error is not None:
            return error_response(f"engine stopped: {service.error}", status=500)
        return {"status": "ok", **service.health()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "specjax"}]}

    @app.get("/metrics")
    async def metrics():
        return Response(service.metrics_text(), media_type="text/plain; version=0.0.4")

    async def run(request: Request, req: SamplingFields, prompt_ids: list[int], params: SamplingParams, chat: bool):
        state = service.submit(prompt_ids, params, req.stops())
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"

        def choice(text: str, finish: str | None, delta: bool):
            reason = None if finish is None else ("length" if finish == "length" else "stop")
            if chat:
                body = {"delta": {"content": text}} if delta else {"message": {"role": "assistant", "content": text}}
                return {"index": 0, **body, "finish_reason": reason, "logprobs": None}
            return {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}

        def usage(ev):
            return {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
                    "total_tokens": ev.prompt_tokens + ev.completion_tokens}

        if not req.stream:
            text, token_ids = [], []
            try:
                while True:
                    ev = await state.events.get()
                    text.append(ev.text)
                    token_ids += ev.token_ids
                    if ev.finished:
                        break
            except BaseException:
                service.abort(state)
                raise
            if ev.finish_reason == "error":
                return error_response("the engine failed while generating", status=500)
            out = choice("".join(text), ev.finish_reason, False)
            if req.return_token_ids:
                out["token_ids"] = token_ids
            return {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [out],
                    "usage": usage(ev)}

        include_usage = bool((req.stream_options or {}).get("include_usage"))

        async def sse():
            chunk_obj = obj + ".chunk" if chat else obj
            try:
                if chat:
                    first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                    yield f"data: {json.dumps({'id': rid, 'object': chunk_obj, 'created': created, 'model': model_name, 'choices': [first]})}\n\n"  # noqa: E501
                while True:
                    ev = await state.events.get()
                    if ev.text or ev.finished or (req.return_token_ids and ev.token_ids):
                        out = choice(ev.text, ev.finish_reason if ev.finished else None, True)
                        if req.return_token_ids:
                            out["token_ids"] = ev.token_ids
                        body = {"id": rid, "object": chunk_obj, "created": created, "model": model_name,
                                "choices": [out]}
                        yield f"data: {json.dumps(body)}\n\n"
                    if ev.finished:
                        if include_usage:
                            body = {"id": rid, "object": chunk_obj, "created": created, "model": model_name,
                                    "choices": [], "usage": usage(ev)}
                            yield f"data: {json.dumps(body)}\n\n"
                        yield "data: [DONE]\n\n"
                        return
            finally:  # client went away (generator cancelled/closed) before the end: free the request's pages
                service.abort(state)

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request, req: CompletionRequest):
        check_model(req.model)
        if isinstance(req.prompt, str):
            if tokenizer is None:
                raise OpenAIError("this model has no tokenizer: send the prompt as a list of token ids", "prompt")
            prompt_ids = tokenizer.encode(req.prompt)
        else:
            prompt_ids = list(req.prompt)
        return await run(request, req, prompt_ids, build(req, prompt_ids, req.max_tokens), chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request, req: ChatRequest):
        check_model(req.model)
        if tokenizer is None or not tokenizer.chat_template:
            raise OpenAIError("this model has no chat template: use /v1/completions", "messages")
        try:
            prompt_ids = tokenizer.encode_chat([m.model_dump() for m in req.messages])
        except Exception as e:  # a template rejecting the conversation (e.g. roles out of order)
            raise OpenAIError(f"chat template failed on these messages: {e}", "messages") from None
        max_tokens = req.max_completion_tokens or req.max_tokens
        return await run(request, req, prompt_ids, build(req, prompt_ids, max_tokens), chat=True)

    return app
