"""The ASGI app of ``multihead serve``: OpenAI-compatible endpoints over an :class:`~multihead.serve.Engine`
stepped on its own thread (:class:`~multihead.serve.background.EngineThread`).

    GET  /v1/models                the one model served
    POST /v1/completions           a prompt (text or token ids); ``stream: true`` -> server-sent events
    POST /v1/chat/completions      messages rendered with the model's chat template; ``stream: true`` too
    GET  /health                   {"status": "ok"}
    GET  /metrics                  the engine's counts (running, waiting, blocks, preemptions, tokens)

Every refusal is OpenAI's error object with a status: 400 for a bad body (the field and the fix named),
413 for a body over ``max_request_bytes``, 429 past ``max_concurrent`` requests, 500 when a step failed.
A streaming client that goes away ends its request and frees its blocks; so does a waiting one.
FastAPI is imported here only, never by the library.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from ..serve.background import EngineThread
from ..serve.request import Request, RequestOutput
from ..serve.sampling import SamplingParams
from .serve_api import ChatBody, CompletionBody, error_body

__all__ = ["Limits", "build_app"]


@dataclass(frozen=True)
class Limits:
    """What one request may ask for; past these it is refused with an error object, never cut."""

    max_prompt_tokens: int = 4096
    max_tokens: int = 1024
    max_request_bytes: int = 1 << 20
    max_concurrent: int = 64


class _Refused(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def _response(e: _Refused) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.kind, e.param), status_code=e.status)


async def _body(raw: HTTPRequest, limits: Limits, model: type[CompletionBody] | type[ChatBody]) -> Any:
    """The parsed body; refuses one too large, not JSON, or not of the endpoint's fields."""
    cap = limits.max_request_bytes
    declared = raw.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > cap:  # refused before reading it
        raise _Refused(413, f"the request body has {declared} bytes, the limit is {cap}")
    data = b""
    async for piece in raw.stream():  # a body without a length is read up to the limit, no further
        data += piece
        if len(data) > cap:
            raise _Refused(413, f"the request body has more than {cap} bytes, the limit is {cap}")
    try:
        return model.model_validate_json(data)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or None
        raise _Refused(400, f"{field}: {first['msg']}" if field else first["msg"], field) from None


def build_app(runner: EngineThread, name: str, limits: Limits | None = None) -> FastAPI:
    """The app serving ``runner``'s engine as the model ``name`` (the caller starts and stops ``runner``)."""
    limits = limits or Limits()
    engine = runner.engine
    tokenizer = engine.tokenizer
    app = FastAPI(title="multihead serve")
    created = int(time.time())

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> dict:
        return {**engine.stats(), "in_flight": runner.in_flight}

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [{"id": name, "object": "model", "created": created, "owned_by": "multihead"}],
        }

    def params(body: Any, room: int, default: int) -> SamplingParams:
        asked = getattr(body, "max_completion_tokens", None) or body.max_tokens
        n = asked or min(default, limits.max_tokens, max(room, 1))
        if n > limits.max_tokens:
            raise _Refused(
                400, f"max_tokens={n} is over this server's limit of {limits.max_tokens}", "max_tokens"
            )
        greedy = body.temperature == 0  # top_k / top_p have no effect on the argmax
        try:
            return SamplingParams(
                max_tokens=n,
                temperature=body.temperature,
                top_k=None if greedy else body.top_k,
                top_p=None if greedy or body.top_p == 1.0 else body.top_p,
                seed=body.seed,
                stop=body.stops(),
            )
        except ValueError as e:
            raise _Refused(400, str(e)) from None

    def prompt_ids(ids: list[int]) -> list[int]:
        if len(ids) > limits.max_prompt_tokens:
            raise _Refused(
                400,
                f"the prompt has {len(ids)} tokens, this server takes at most {limits.max_prompt_tokens}",
                "prompt",
            )
        if not ids:
            raise _Refused(400, "the prompt is empty; give at least one token", "prompt")
        return ids

    def need_tokenizer(what: str) -> Any:
        if tokenizer is None:
            raise _Refused(400, f"this model has no tokenizer, so {what} cannot be read; send token ids")
        return tokenizer

    async def run(raw: HTTPRequest, ids: list[int], sp: SamplingParams, chat: bool, stream: bool, body: Any):
        if runner.in_flight >= limits.max_concurrent:
            raise _Refused(
                429,
                f"{runner.in_flight} requests are in flight, the limit is {limits.max_concurrent}; "
                "retry later",
                kind="rate_limit_error",
            )
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            queue = runner.submit(Request(ids, sp, id=rid))
        except ValueError as e:
            raise _Refused(400, str(e)) from None
        shape = _Shape(rid, name, chat, int(time.time()))
        if stream:
            usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(_events(runner, queue, shape, usage), media_type="text/event-stream")
        last = await _wait(raw, runner, queue, rid)
        return JSONResponse(shape.whole(last))

    @app.post("/v1/completions")
    async def completions(raw: HTTPRequest) -> Any:
        try:
            body = await _body(raw, limits, CompletionBody)
            text = isinstance(body.prompt, str)
            ids = prompt_ids(
                list(need_tokenizer("a text prompt").encode(body.prompt)) if text else body.prompt
            )
            return await run(
                raw, ids, params(body, engine.model.max_len - len(ids), 16), False, body.stream, body
            )
        except _Refused as e:
            return _response(e)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: HTTPRequest) -> Any:
        try:
            body = await _body(raw, limits, ChatBody)
            tok = need_tokenizer("messages")
            messages = [m.model_dump() for m in body.messages]
            ids = prompt_ids(list(tok.apply_chat_template(messages, add_generation_prompt=True)))
            room = engine.model.max_len - len(ids)
            return await run(raw, ids, params(body, room, limits.max_tokens), True, body.stream, body)
        except _Refused as e:
            return _response(e)

    return app


@dataclass
class _Shape:
    """How one request's answer is written: OpenAI's completion or chat completion objects."""

    id: str
    model: str
    chat: bool
    created: int

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    @staticmethod
    def usage(o: RequestOutput) -> dict:
        n = len(o.token_ids)
        return {"prompt_tokens": o.prompt_tokens, "completion_tokens": n, "total_tokens": o.prompt_tokens + n}

    def whole(self, o: RequestOutput) -> dict:
        if self.chat:
            choice: dict = {"index": 0, "message": {"role": "assistant", "content": o.text}}
        else:
            choice = {"index": 0, "text": o.text, "logprobs": None}
        choice["finish_reason"] = o.finish_reason
        return {**self._head(False), "choices": [choice], "usage": self.usage(o)}

    def chunk(self, text: str | None, finish: str | None, first: bool = False) -> dict:
        if self.chat:
            delta: dict = (
                {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
            )
            choice: dict = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**self._head(True), "choices": [choice]}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _events(
    runner: EngineThread, queue: asyncio.Queue, shape: _Shape, usage: bool
) -> AsyncIterator[str]:
    """Server-sent events of one request; a client gone away (the generator closed) aborts it."""
    done = False
    try:
        if shape.chat:
            yield _sse(shape.chunk(None, None, first=True))
        while True:
            o = await queue.get()
            if isinstance(o, Exception):
                done = True
                yield _sse(error_body(f"the engine failed: {o}", "server_error"))
                break
            if o.new_text:
                yield _sse(shape.chunk(o.new_text, None))
            if o.finished:
                done = True
                yield _sse(shape.chunk(None, o.finish_reason))
                if usage:
                    yield _sse({**shape._head(True), "choices": [], "usage": shape.usage(o)})
                break
        yield "data: [DONE]\n\n"
    finally:
        if not done:
            runner.abort(shape.id)


async def _wait(raw: HTTPRequest, runner: EngineThread, queue: asyncio.Queue, rid: str) -> RequestOutput:
    """The final output of a non-streamed request; a client gone away meanwhile aborts it."""
    while True:
        try:
            o = await asyncio.wait_for(queue.get(), 0.5)
        except asyncio.TimeoutError:
            if await raw.is_disconnected():
                runner.abort(rid)
                raise _Refused(499, "the client went away") from None
            continue
        if isinstance(o, Exception):
            raise _Refused(500, f"the engine failed: {o}", kind="server_error")
        if o.finished:
            return o
