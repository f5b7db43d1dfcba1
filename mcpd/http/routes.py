"""The OpenAI routes and mcpd's context routes, as aiohttp handlers.

    GET    /v1/models
    GET    /v1/models/{id}
    POST   /v1/chat/completions
    POST   /v1/completions
    POST   /v1/contexts/{id}/chat/completions    only the new messages; the turn is appended
    GET    /v1/contexts/{id}                     its version and token count
    DELETE /v1/contexts/{id}

Request headers (all optional): `Authorization: Bearer <key>` (required with http.auth on: the
key names the tenant), `mcpd-tenant` (with auth off only), `mcpd-priority` (a class name),
`mcpd-timeout-ms` (the daemon's deadline), `mcpd-context-base` (the version a context turn
expects: another one gets 409), `traceparent` (W3C: the parent of the request's spans when
tracing is on; a malformed one is ignored). Answers on a context carry `mcpd-context-version`.

A streamed answer's headers wait for its first chunk, so a refusal before any token (429, 504,
409, ...) still gets its own status; an error after that is sent as a last `data: {"error": ...}`
event. A client that disconnects has its request cancelled (aiohttp cancels the handler).
"""
from __future__ import annotations

import asyncio
import time

import msgspec
from aiohttp import web

from mcpd.client import replies
from mcpd.config import Config
from mcpd.http import openai_request
from mcpd.http.body_budget import BodyBudget
from mcpd.http.frontend_link import Call, FrontendLink
from mcpd.http.errors import HttpError, bad_request
from mcpd.http.openai_reply import Answer
from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.error import ErrorReply
from mcpd.protocol.results import GenerateResult
from mcpd.security.api_keys import ApiKeys
from mcpd.tracing import traceparent

MODELS_TTL_S = 5.0
LOADING_RETRY_MS = 1000   # how soon a request that came before the model was loaded may try again
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"
CONTEXT_VERSION = "mcpd-context-version"
MAX_INT_HEADER_DIGITS = 19   # an int64's, the most any integer the daemon takes has
encode = msgspec.json.encode


class Routes:
    def __init__(self, config: Config, link: FrontendLink):
        self.config, self.link = config, link
        self.keys = ApiKeys(config.keys_dir) if config.http_auth else None
        self.model_ids: list[str] = []
        self.models_at = -MODELS_TTL_S
        self.inflight = 0
        self.bodies = BodyBudget(config.limits.max_incoming_bytes)

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{id}", self.model)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/contexts/{id}/chat/completions", self.context_chat)
        app.router.add_get("/v1/contexts/{id}", self.context_show)
        app.router.add_delete("/v1/contexts/{id}", self.context_drop)

    # -- handlers -------------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        header = self.request_header(request)
        return _json({"object": "list", "data": [_model(name) for name in await self._models(header)]})

    async def model(self, request: web.Request) -> web.Response:
        """One served model, as OpenAI's retrieve answers; 404 UNKNOWN_MODEL for any other id."""
        name = request.match_info["id"]
        if name not in await self._models(self.request_header(request)):
            raise HttpError(404, f"the model {name[:100]!r} does not exist", codes.UNKNOWN_MODEL, "model")
        return _json(_model(name))

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        return await self._generate(request, openai_request.chat(body, self.config.limits.max_new_tokens), True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        return await self._generate(request, openai_request.completion(body, self.config.limits.max_new_tokens), False)

    async def context_chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        completion = openai_request.chat(body, self.config.limits.max_new_tokens)
        completion.args["context"] = request.match_info["id"]
        base = _int_header(request, "mcpd-context-base")
        if base is not None:
            completion.args["base"] = base
        return await self._generate(request, completion, True)

    async def context_show(self, request: web.Request) -> web.Response:
        result = await self.link.call("context.open", {"id": request.match_info["id"], "create": False},
                                      self.request_header(request))
        return _json({"id": result["id"], "object": "mcpd.context", "version": result["version"],
                      "tokens": result["tokens"]}, headers={CONTEXT_VERSION: str(result["version"])})

    async def context_drop(self, request: web.Request) -> web.Response:
        result = await self.link.call("context.drop", {"id": request.match_info["id"]},
                                      self.request_header(request))
        return _json({"id": request.match_info["id"], "object": "mcpd.context", "deleted": result["dropped"]})

    # -- generation -----------------------------------------------------------------------------

    async def _generate(self, request: web.Request, completion: openai_request.Completion,
                        chat: bool) -> web.StreamResponse:
        header = self.request_header(request)
        if completion.model not in await self._models(header):
            raise HttpError(404, f"the model {completion.model[:100]!r} does not exist; GET /v1/models lists them",
                            codes.NOT_FOUND, "model")
        if self.config.models:
            completion.args["model"] = completion.model
        answer = Answer(completion.model, chat)
        self.inflight += 1
        call = None
        try:
            call, first = await self._first_reply(completion.args, header)
            if not completion.stream:
                result = _result(first)
                return _json(answer.whole(result), headers=_context_headers(result))
            if call.finished:   # a refusal before any chunk keeps its own status
                _result(first)
            return await self._stream(request, call, first, answer, completion.include_usage)
        finally:
            self.inflight -= 1
            if call is not None:
                call.abandon()   # a disconnect (the handler cancelled) or an error on our side: stop it

    async def _first_reply(self, args: dict, header: dict) -> tuple[Call, dict]:
        """Start generate and wait for its first reply. A turn on a context that does not exist
        yet creates it (the ZeroMQ client's `client.context(id)` does the same), unless the
        client named a base version: then it expected one, and gets the 404."""
        call = await self.link.start("generate", args, header)
        try:
            first = await call.next_reply()
            if call.finished and first.get("code") == codes.NOT_FOUND and "context" in args and "base" not in args:
                await self.link.call("context.open", {"id": args["context"]}, header)
                call = await self.link.start("generate", args, header)
                first = await call.next_reply()
        except BaseException:
            call.abandon()
            raise
        return call, first

    async def _stream(self, request: web.Request, call: Call, reply: dict, answer: Answer,
                      include_usage: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        first = True
        while True:
            if reply["kind"] == "chunk":
                await response.write(_event(answer.chunk(replies.chunk_of(reply), first, include_usage)))
                first = False
            elif reply["kind"] == "ok":
                for chunk in answer.last_chunks(_result(reply), include_usage):
                    await response.write(_event(chunk))
                break
            else:
                error = HttpError.of(ErrorReply.read(reply))
                await response.write(_event(error.body()))
                break
            reply = await call.next_reply()
        await response.write(DONE)
        await response.write_eof()
        return response

    # -- request parts --------------------------------------------------------------------------

    async def _body(self, request: web.Request) -> dict:
        return openai_request.parse_json(await self.read_body(request))

    async def read_body(self, request: web.Request) -> bytes:
        """The body, its size bounded before anything is read and its arrival in time."""
        limit = self.config.http.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise _too_large(limit)
        try:
            with self.bodies.room(_room_for(request, limit)):
                async with asyncio.timeout(self.config.http.body_timeout_s):   # no task per request, as wait_for makes
                    body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise _too_large(limit) from None
        except TimeoutError:
            raise HttpError(408, f"the body did not arrive within http.body_timeout_s "
                                 f"({self.config.http.body_timeout_s:g} s)", codes.TIMEOUT) from None
        except web.RequestPayloadError as e:   # it does not inflate: aiohttp's parser stops there, so must we
            reason = getattr(e.__cause__, "message", "") or str(e)
            raise HttpError(400, f"the body cannot be read: {reason[:200]}", codes.BAD_REQUEST, closes=True) from None
        return body

    def request_header(self, request: web.Request) -> dict:
        """The daemon request header's tenant, priority, deadline and traceparent for this HTTP request."""
        header = {}
        tenant = self._tenant(request)
        if tenant is not None:
            header["tenant"] = tenant
        priority = request.headers.get("mcpd-priority")
        if priority is not None:
            header["priority"] = priority
        timeout_ms = _int_header(request, "mcpd-timeout-ms")
        if timeout_ms is not None:
            header["timeout_ms"] = timeout_ms
        parent = request.headers.get("traceparent")
        if parent is not None and len(parent) <= traceparent.MAX_CHARS and parent.isascii():   # else malformed, ignored
            header["traceparent"] = parent
        return header

    def _tenant(self, request: web.Request) -> str | None:
        if self.keys is None:
            return request.headers.get("mcpd-tenant")
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        tenant = self.keys.tenant(key.strip()) if scheme.lower() == "bearer" and key.strip() else None
        if tenant is None:
            raise HttpError(401, "a valid API key is required: Authorization: Bearer <key> "
                                 "(`mcpctl keys api-add NAME` makes one)", codes.UNAUTHORIZED)
        return tenant

    async def _models(self, header: dict) -> list[str]:
        if self.config.models:   # the model table's names: a request's `model` picks one of them
            return list(self.config.models)
        if self.config.http.model_name:
            return [self.config.http.model_name]
        if time.monotonic() - self.models_at > MODELS_TTL_S or not self.model_ids:
            status = await self.link.call("status", {}, {k: v for k, v in header.items() if k == "tenant"})
            self.model_ids = sorted({w["model"] for w in status.get("workers", []) if w.get("model")})
            self.models_at = time.monotonic()
        if not self.model_ids:   # its one model is named by the worker serving it: none serves yet
            raise HttpError(503, "no model is loaded yet: mcpd is starting, or its worker restarts; retry shortly",
                            codes.UNAVAILABLE, retry_after_ms=LOADING_RETRY_MS)
        return self.model_ids


def _model(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "mcpd"}


def _result(reply: dict) -> GenerateResult:
    """A generate's final reply as its result; an error reply as the HttpError for it."""
    try:
        return replies.generate_result(replies.result_of(reply))
    except MCPDError as e:
        raise HttpError.of(ErrorReply.of(e)) from None


def _context_headers(result: GenerateResult) -> dict:
    return {CONTEXT_VERSION: str(result.context.version)} if result.context else {}


def _event(value: dict) -> bytes:
    return b"data: " + encode(value) + b"\n\n"


def _json(value: dict, headers: dict | None = None) -> web.Response:
    return web.Response(body=encode(value), content_type="application/json", headers=headers)


def _int_header(request: web.Request, name: str) -> int | None:
    """ASCII digits only, at most an int64's 19: int() would also take `1_000`, other scripts'
    digits, a sign and Unicode spaces, and parse a 4,000-digit header."""
    text = request.headers.get(name)
    if text is None:
        return None
    if not (0 < len(text) <= MAX_INT_HEADER_DIGITS and text.isascii() and text.isdigit()):
        raise bad_request(f"header {name!r} must be 1..{MAX_INT_HEADER_DIGITS} ASCII digits, not {text[:40]!r}", name)
    return int(text)


def _room_for(request: web.Request, limit: int) -> int:
    """The most a body may hold once arrived: its Content-Length, or the limit when it is chunked or
    encoded (it inflates as it arrives)."""
    if not request.body_exists:
        return 0
    if request.content_length is None or request.headers.get("Content-Encoding", "identity").lower() != "identity":
        return limit
    return request.content_length


def _too_large(limit: int) -> HttpError:
    return HttpError(413, f"the body is over http.max_body_bytes ({limit} bytes)", codes.TOO_LARGE)
