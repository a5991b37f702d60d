"""OpenAI-compatible HTTP API (FastAPI): /v1/completions, /v1/chat/completions (stream and not), /v1/models,
/health, /metrics.  `create_app(service, ...)` is a factory: no module-level app or engine."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from specjax.engine.engine import RequestError
from specjax.sampling import MAX_LOGPROBS, SamplingError, SamplingParams
from specjax.serve.choices import Choice, merged
from specjax.serve.logprobs import TokenText
from specjax.serve.replicas import DataParallelService
from specjax.serve.service import EngineService

MAX_N = 16  # most samples one request may ask for


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
        if v is not None and v < 0:
            raise ValueError(f"max_tokens must be at least 0 (0 only with echo), got {v}")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v):
        if not 1 <= v <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {v}")
        return v

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if len(stops) > 4:
            raise OpenAIError("at most 4 stop sequences are allowed", "stop")
        return stops


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]  # one prompt, or a batch (choices i * n .. i * n + n - 1)
    echo: bool = False  # the prompt before the completion (with its tokens' logprobs when logprobs is set)

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v):
        if v is not None and (isinstance(v, bool) or not 0 <= v <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v):
        if v is not None and not 0 <= v <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {v}")
        return v

    def wanted_logprobs(self) -> int | None:
        """The engine's SamplingParams.logprobs for this request (None: off)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError("top_logprobs needs logprobs: true", "top_logprobs")
        if self.logprobs not in (None, False, True):
            raise OpenAIError(f"logprobs must be a boolean in chat completions, got {self.logprobs!r}", "logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    tokens: list[int]


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

    def build(req: SamplingFields, prompt_ids: list[int], max_tokens: int | None, logprobs: int | None = None,
              prompt_logprobs: int | None = None):
        """Validated SamplingParams of a request.  `max_tokens` 0 (echo only) generates one token that is not sent;
        unset, it is the server's default cut to what the context holds; set, prompt + max_tokens must fit."""
        room = service.max_model_len - len(prompt_ids)
        if max_tokens is not None and max_tokens > room:
            raise OpenAIError(f"this model's context holds {service.max_model_len} tokens: the prompt has "
                              f"{len(prompt_ids)} and max_tokens asks for {max_tokens} more", "max_tokens")
        if max_tokens is None:
            max_tokens = min(default_max_tokens, max(room, 1))
        try:
            params = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                    max_new_tokens=max(max_tokens, 1), seed=req.seed, ignore_eos=req.ignore_eos,
                                    logprobs=logprobs, prompt_logprobs=prompt_logprobs)
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

    # vLLM's tokenizer endpoints (lm-evaluation-harness's `tokenizer_backend=remote` uses them: a GGUF model has no
    # Hugging Face tokenizer directory for the client to load)
    def need_tokenizer():
        if tokenizer is None:
            raise OpenAIError("this model has no tokenizer", code="no_tokenizer")
        return tokenizer

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        tok = need_tokenizer()
        return {"tokenizer_class": "specjax", "bos_token": tok.bos_token, "eos_token": tok.eos_token,
                "pad_token": None, "chat_template": tok.chat_template, "model_max_length": service.max_model_len}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        tok = need_tokenizer()
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError("give exactly one of prompt and messages", "prompt")
        ids = (tok.encode(req.prompt, add_special_tokens=req.add_special_tokens) if req.prompt is not None
               else tok.encode_chat([m.model_dump() for m in req.messages]))
        return {"tokens": ids, "count": len(ids), "max_model_len": service.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        tok = need_tokenizer()
        bad = [t for t in req.tokens if not 0 <= t < tok.vocab_size]
        if bad:
            raise OpenAIError(f"token ids {bad[:5]} are outside the vocabulary [0, {tok.vocab_size})", "tokens")
        return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}

    @app.get("/metrics")
    async def metrics():
        return Response(service.metrics_text(), media_type="text/plain; version=0.0.4")

    async def run(req: SamplingFields, prompts: list[list[int]], params: list[SamplingParams], chat: bool,
                  echo: list[str] | None = None, send_tokens: bool = True):
        """Serve one request: n engine requests per prompt (the first's prefill shared by the others), streamed or
        not.  `echo`: each prompt's text, sent before its completions; `send_tokens` False (max_tokens 0): the one
        token generated is not sent or counted."""
        states = []
        for prompt_ids, prompt_params in zip(prompts, params):
            first = None
            for i in range(req.n):  # sample i of a seeded request draws from seed + i
                seeded = (prompt_params if prompt_params.seed is None or i == 0
                          else dataclasses.replace(prompt_params, seed=prompt_params.seed + i))
                states.append(service.submit(prompt_ids, seeded, req.stops(), after=first))
                first = first or states[-1]
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        token_text = TokenText(tokenizer)
        choices = [Choice(i, st, chat, token_text, echo[i // req.n] if echo else None, send_tokens,
                          req.return_token_ids) for i, st in enumerate(states)]

        def usage() -> dict:
            completion = sum(c.completion_tokens for c in choices)
            prompt = sum(map(len, prompts))  # each prompt counts once, whatever n, as OpenAI counts it
            return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

        if not req.stream:
            try:
                async for i, ev in merged(states):
                    choices[i].add(ev)
            except BaseException:
                for st in states:
                    service.abort(st)
                raise
            if any(c.last.finish_reason == "error" for c in choices):
                return error_response("the engine failed while generating", status=500)
            return {"id": rid, "object": obj, "created": created, "model": model_name,
                    "choices": [c.whole() for c in choices], "usage": usage()}

        include_usage = bool((req.stream_options or {}).get("include_usage"))
        chunk_obj = obj + ".chunk" if chat else obj

        def chunk(choice_bodies: list, **extra) -> str:
            body = {"id": rid, "object": chunk_obj, "created": created, "model": model_name, "choices": choice_bodies}
            return f"data: {json.dumps({**body, **extra})}\n\n"

        async def sse():
            try:
                if chat:
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                                 for i in range(len(choices))])
                async for i, ev in merged(states):
                    if ev.finish_reason == "error":
                        body = {"error": {"message": "the engine failed while generating", "type": "server_error"}}
                        yield f"data: {json.dumps(body)}\n\n"
                        return
                    out = choices[i].chunk(ev)
                    if out is not None:
                        yield chunk([out])
                if include_usage:
                    yield chunk([], usage=usage())
                yield "data: [DONE]\n\n"
            finally:  # client went away (generator cancelled/closed) before the end: free the requests' pages
                for st in states:
                    service.abort(st)

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request, req: CompletionRequest):
        check_model(req.model)
        batch = req.prompt if isinstance(req.prompt, list) and req.prompt and not isinstance(req.prompt[0], int) \
            else [req.prompt]
        if any(isinstance(p, str) for p in batch) and tokenizer is None:
            raise OpenAIError("this model has no tokenizer: send the prompt as a list of token ids", "prompt")
        prompts = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in batch]
        if req.max_tokens == 0 and not req.echo:
            raise OpenAIError("max_tokens must be at least 1 (0 only with echo)", "max_tokens")
        echo = None
        if req.echo:
            echo = [p if isinstance(p, str) else (tokenizer.decode(p) if tokenizer else "") for p in batch]
        prompt_logprobs = req.logprobs if req.echo else None
        params = [build(req, ids, req.max_tokens, req.logprobs, prompt_logprobs) for ids in prompts]
        return await run(req, prompts, params, False, echo, send_tokens=req.max_tokens != 0)

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
        if max_tokens == 0:
            raise OpenAIError("max_tokens must be at least 1", "max_tokens")
        return await run(req, [prompt_ids], [build(req, prompt_ids, max_tokens, req.wanted_logprobs())], chat=True)

    return app
