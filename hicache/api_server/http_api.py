"""The HTTP API of the tokenizer process (docs/architecture.md §11), on aiohttp.

Routes::

    POST /generate                  native generation: text or input_ids (greedy by default)
    POST /v1/completions            OpenAI completions; "stream": true -> SSE
    POST /v1/chat/completions       OpenAI chat completions; "stream": true -> SSE
    GET  /v1/models                 the served model names (server.served_model_names)
    GET  /v1/models/{id}            one of them; 404 for any other id
    GET  /health                    readiness: {"status", "processes", "dead", "stale"}; 503 unless "ok"
    GET  /health?live=1             liveness: the same body, always 200
    GET  /metrics                   Prometheus exposition of all processes (the operator's); 404 when disabled
    GET  /openapi.json              the OpenAPI 3.1 document of these routes (hicache.api_server.openapi)
    GET  /cache/stats               AdminRequest op "stats"
    POST /cache/flush               AdminRequest op "flush" (L1 and L2; L3 is kept)
    GET  /cache/storage             AdminRequest op "storage_status"
    PUT  /cache/storage             {"store": NAME}: AdminRequest op "storage_attach", args {"l3": <that
                                    store's resolved section>} (a store the config names)
    DELETE /cache/storage           AdminRequest op "storage_detach"
    POST /cache/storage/clear       AdminRequest op "storage_clear"
    GET  /cache/pinned              AdminRequest op "pins"
    PUT  /cache/pinned              AdminRequest op "pin" (hicache.api_server.pinning)
    DELETE /cache/pinned/{name}     AdminRequest op "unpin"

Who may call which (the operator, a tenant): ``hicache.api_server.access``'s table. A tenant's
``/cache`` calls carry ``args["tenant"]``, which confines them to its namespaces; the
operator's routes answer a tenant 403.

Admin routes answer the ``AdminReply.result`` as JSON; ``ok=false`` becomes an error with
the reply's ``error`` text: 409 when it says "busy", else 500. No reply within
``admin_timeout_s`` -> 504.

Errors of every route have one shape, OpenAI's ``{"error": {"message", "type", "param",
"code"}}`` (``param``: the field at fault or null; ``code``: the HTTP status): 400 for an
invalid body (bad JSON, text that is not valid Unicode, unknown fields, out-of-vocabulary
ids, bad limits or sampling parameters, a prompt too long for the context, a field this
server does not implement set to a value that would change the result), 404 for an OpenAI
``model`` that is not served, 401 without a valid bearer key when keys are configured
(``server.api_key``, ``server.api_keys`` or ``server.operator``; every route but ``/health``),
403 for a tenant's key on the operator's routes,
413 for a body over the size limit (refused from its Content-Length, or as soon as a
chunked body passes the limit), 503 while
shutting down or when the scheduler's queue is full, 500 when the scheduler fails a
request, 501 for a generation route in engine mode (the engines generate). A stream that
fails after its first chunk sends an ``{"error": ...}`` event, then ``data: [DONE]``. What
aiohttp itself refuses gets the same JSON shape: 404 for a path no route has, 405 for a
method the path does not take (with ``Allow``), 400 for a request line or header that
does not parse (``JsonErrorRunner``; that connection is closed).

Slow clients (``server.header_timeout_s``, ``server.body_timeout_s``): a connection that
has not delivered a complete request line and headers within ``header_timeout_s`` of
opening, or of the previous response, is closed without an answer (aiohttp's per-connection
keep-alive deadline, which also closes idle keep-alive connections after that time). A
handler that has not read the whole body ``body_timeout_s`` after the headers answers 408
and closes the connection.

A client that disconnects ends its request: the handler is cancelled (or its next write
fails) and ``generate_steps`` sends ``AbortRequest(rid)``.

Keys (``_auth``): the bearer token is hashed (SHA-256) and compared with the digest of
every configured key with ``hmac.compare_digest``, all of them each time, so neither the
time taken nor anything else tells which key, or how much of one, matched. With
``server.api_keys`` the matching key's tenant namespaces the request's cache
(``PreparedRequest.for_tenant``); a key without a tenant is the operator's. Keys never
reach a log or an error message.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import hmac
import json
import logging
import math
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from contextlib import aclosing
from http import HTTPStatus
from typing import Any

from aiohttp import web

import protos
from hicache.api_server.access import OPEN_PATHS, operator_only, scoped_args
from hicache.api_server.formats import (
    SSE_DONE,
    ChatFormat,
    CompletionFormat,
    GenerateFormat,
    GenerationResult,
    ResponseFormat,
    Step,
    combined_usage,
    error_body,
    sse,
)
from hicache.api_server.generation import GenerationError, generate_steps
from hicache.api_server.openapi import openapi_document
from hicache.api_server.pinning import PIN_TIMEOUT_S, body_args
from hicache.api_server.request_log import RequestLog
from hicache.api_server.scheduler_link import SchedulerLink, SchedulerUnavailable, new_rid
from hicache.api_server.validation import (
    ModelLimits,
    PreparedRequest,
    RequestError,
    parse_chat,
    parse_completion,
    parse_generate,
    parse_json,
    parse_storage_choice,
)
from hicache.config import ENGINE_MODE_ERROR, HicacheConfig
from hicache.config.security import BearerKey, load_api_keys
from hicache.metrics import CONTENT_TYPE, Metrics, RequestTracker, render_metrics
from hicache.text import Tokenizer

log = logging.getLogger("hicache.api_server.http")

TENANT: Any = web.RequestKey("hicache_tenant", str) if hasattr(web, "RequestKey") else "hicache_tenant"
"""Where ``_auth`` leaves the authenticated tenant on the request (absent: no tenant)."""

OFFLOAD_BYTES = 64 * 1024
"""Generation bodies larger than this are parsed and tokenized on a worker thread."""

Parser = Callable[[dict[str, Any], str, Tokenizer, ModelLimits], PreparedRequest]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)


def _json(body: Any, status: int = 200) -> web.Response:
    return web.json_response(body, status=status, dumps=_dumps)


class HealthStatus(enum.Enum):
    """The ``status`` of ``GET /health``."""

    OK = "ok"
    DEGRADED = "degraded"  # a process is dead, or stopped / stuck (its heartbeat is stale)
    DRAINING = "draining"  # shutting down


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class HttpApi:
    """The aiohttp application and its handlers; one per tokenizer process.

    ``pids`` is the live process table of ``/health`` (the process may update it).
    ``draining`` (set by ``begin_drain``) makes new generation requests fail with 503;
    ``wait_idle`` waits until no request is being handled. ``api_keys``: the loaded bearer
    keys (``hicache.daemon.startup_checks.load_api_keys``); None loads them from ``config`` here
    (``ValueError`` naming the problems when they cannot be); empty: no key is needed.
    """

    def __init__(self, *, link: SchedulerLink, tokenizer: Tokenizer, limits: ModelLimits, config: HicacheConfig,
                 pids: dict[str, int], metrics: Metrics, max_body_bytes: int, admin_timeout_s: float,
                 api_keys: tuple[BearerKey, ...] | None = None) -> None:
        self.link = link
        self.tokenizer = tokenizer
        self.limits = limits
        self.config = config
        self.pids = pids
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.admin_timeout_s = admin_timeout_s
        self.body_timeout_s = config.server.body_timeout_s
        self.started = int(time.time())
        self.draining = False
        if api_keys is None:
            api_keys, problems = load_api_keys(config.server)
            if problems:
                raise ValueError("; ".join(str(p) for p in problems))
        self._keys = api_keys
        self._tenants = frozenset(k.tenant for k in api_keys if k.tenant is not None)
        self.request_log = (RequestLog(config.server.request_log, config.cache.page_size)
                            if config.server.request_log else None)
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.app = web.Application(client_max_size=max_body_bytes,
                                   middlewares=[self._errors, self._auth, self._count])
        r = self.app.router
        r.add_post("/generate", self._route(parse_generate, GenerateFormat))
        r.add_post("/v1/completions", self._route(parse_completion, CompletionFormat))
        r.add_post("/v1/chat/completions", self._route(parse_chat, ChatFormat))
        r.add_get("/v1/models", self.models)
        r.add_get("/v1/models/{model_id:.+}", self.model)
        r.add_get("/health", self.health)
        r.add_get("/metrics", self.metrics_route)
        r.add_get("/openapi.json", self.openapi)
        r.add_get("/cache/stats", self._admin_route("stats"))
        r.add_post("/cache/flush", self._admin_route("flush"))
        r.add_get("/cache/storage", self._admin_route("storage_status", operator=True))
        r.add_put("/cache/storage", self.storage_attach)
        r.add_delete("/cache/storage", self._admin_route("storage_detach", operator=True))
        r.add_post("/cache/storage/clear", self._admin_route("storage_clear", operator=True))
        r.add_get("/cache/pinned", self._admin_route("pins"))
        r.add_put("/cache/pinned", self.pin)
        r.add_delete("/cache/pinned/{name}", self.unpin)

    # ---- lifecycle

    def begin_drain(self) -> None:
        self.draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no request is in a handler; False if that took longer than ``timeout_s``."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    # ---- middlewares (outermost first)

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except RequestError as exc:
            resp = self._error(exc.message, exc.status, exc.kind, exc.param)
            if exc.status == HTTPStatus.REQUEST_TIMEOUT:
                return await _answer_and_close(request, resp)
            return resp
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return self._http_error(request, exc)
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            return self._error("internal server error", 500, "server_error")

    def _http_error(self, request: web.Request, exc: web.HTTPException) -> web.Response:
        """aiohttp's own HTTP errors (no route, wrong method, body too large, ...) as the JSON
        error object; keeps the headers they carry (``Allow`` of a 405)."""
        if exc.status == HTTPStatus.NOT_FOUND and request.match_info.route.resource is None:
            message = f"no route {request.method} {request.path}"
        elif exc.status == HTTPStatus.METHOD_NOT_ALLOWED and isinstance(exc, web.HTTPMethodNotAllowed):
            allowed = ", ".join(sorted(exc.allowed_methods))
            message = f"{request.path} does not take {request.method} (it takes {allowed})"
        else:
            message = exc.text or exc.reason
        resp = self._error(message, exc.status)
        for name, value in exc.headers.items():
            if name.lower() not in ("content-type", "content-length"):
                resp.headers[name] = value
        return resp

    @staticmethod
    def _error(message: str, status: int, kind: str | None = None, param: str | None = None) -> web.Response:
        if kind is None:
            kind = "invalid_request_error" if status < 500 else "server_error"
        resp = _json(error_body(message, status, kind, param), status)
        if status == 401:
            resp.headers["WWW-Authenticate"] = "Bearer"
        return resp

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """401 unless the request carries a configured key (routes outside ``OPEN_PATHS``,
        when any key is configured); the key's tenant, if it has one, goes to ``TENANT``."""
        if self._keys and request.path not in OPEN_PATHS:
            matched = self._match(request.headers.get("Authorization", ""))
            if matched is None:
                raise RequestError("missing or wrong API key (send 'Authorization: Bearer <key>')", 401,
                                   "authentication_error")
            if matched.tenant is not None:
                request[TENANT] = matched.tenant
        return await handler(request)

    def _match(self, authorization: str) -> BearerKey | None:
        """The configured key an ``Authorization`` header value carries, or None. The token's
        digest is compared with every key's (fixed-length digests: no length leaks either);
        the loop never stops early."""
        scheme, _, token = authorization.partition(" ")
        # Header bytes that are not UTF-8 arrive surrogate-escaped: encode them back as sent.
        digest = hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).digest()
        matched: BearerKey | None = None
        for key in self._keys:
            if hmac.compare_digest(digest, key.digest):
                matched = key
        return matched if scheme.lower() == "bearer" else None

    @web.middleware
    async def _count(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        self._active += 1
        self._idle.clear()
        try:
            return await handler(request)
        finally:
            self._active -= 1
            if self._active == 0:
                self._idle.set()

    # ---- bodies

    async def _read_json(self, request: web.Request, *, optional: bool = False) -> dict[str, Any]:
        raw = await self._read_body(request)
        if optional and not raw.strip():
            return {}
        return parse_json(raw)

    async def _read_body(self, request: web.Request) -> bytes:
        length = request.content_length
        if length is not None and length > self.max_body_bytes:
            raise RequestError(f"the request body is {length} bytes; the limit is {self.max_body_bytes}", 413)
        try:
            raw = await asyncio.wait_for(request.read(), self.body_timeout_s)
        except web.HTTPRequestEntityTooLarge:
            raise RequestError(f"the request body exceeds the limit of {self.max_body_bytes} bytes", 413) from None
        except asyncio.TimeoutError:
            raise RequestError(f"the request body did not arrive within {self.body_timeout_s:g} s "
                               "(server.body_timeout_s)", 408, "timeout") from None
        return raw

    # ---- generation

    def _route(self, parse: Parser, fmt_cls: type[ResponseFormat]) -> Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            with self.metrics.track_request() as tracker:
                try:
                    if self.draining:
                        raise RequestError("the server is shutting down", 503, "unavailable")
                    raw = await self._read_body(request)
                    if self.engine_mode:  # the engines generate; this daemon holds their KV only
                        raise RequestError(ENGINE_MODE_ERROR, 501, "not_implemented")
                    tenant = request.get(TENANT)
                    if len(raw) > OFFLOAD_BYTES:  # tokenizing a long prompt must not stall the loop
                        req = await asyncio.to_thread(self._parse, parse, raw, tenant)
                    else:
                        req = self._parse(parse, raw, tenant)
                except RequestError as exc:
                    tracker.finish("invalid" if exc.status < 500 else "error")
                    raise
                fmt = fmt_cls(req.rid, req.model or self.limits.name, req.include_usage,
                              cache_details=req.cache_details, tokenizer=self.tokenizer,
                              wants_logprobs=req.logprobs, logprob_text=req.logprob_text)
                return await self._generate(request, req, fmt, tracker)

        return handler

    def _parse(self, parse: Parser, raw: bytes, tenant: str | None) -> PreparedRequest:
        """The body as a request of ``tenant`` (None: no tenant; its ``cache_salt`` as sent)."""
        return parse(parse_json(raw), new_rid(), self.tokenizer, self.limits).for_tenant(tenant)

    async def _generate(self, request: web.Request, req: PreparedRequest, fmt: ResponseFormat,
                        tracker: RequestTracker) -> web.StreamResponse:
        """Run the request's samples (``PreparedRequest.samples``: one, or ``n``) and answer.

        Each sample is its own scheduler request and counts as one request in the metrics
        (sample 0 on the route's ``tracker``). The first step of any sample is awaited
        before a byte is sent, so that a refusal or a failure before the first token is
        still a plain HTTP error; a sample failing later fails the whole response (the
        others are aborted)."""
        samples = req.samples()
        with contextlib.ExitStack() as more:
            trackers = [tracker, *(more.enter_context(self.metrics.track_request()) for _ in samples[1:])]
            streams = [generate_steps(self.link, self.tokenizer, s, t, self.request_log) for s, t in zip(samples, trackers, strict=True)]
            async with aclosing(_merged(streams)) as steps:
                try:
                    first = await anext(steps)
                    if not req.stream:
                        finals = {first[0]: first[1]}
                        async for i, step in steps:
                            finals[i] = step
                except SchedulerUnavailable as exc:
                    raise RequestError(str(exc), 503, "unavailable") from None
                except GenerationError as exc:
                    raise RequestError(str(exc), 500, "server_error") from None
                if not req.stream:
                    return _json(fmt.full([self._result(samples[i], finals.get(i)) for i in range(len(samples))]))
                return await self._stream(request, fmt, first, steps, len(samples))

    @staticmethod
    def _result(sample: PreparedRequest, step: Step | None) -> GenerationResult:
        if step is None or step.finish_reason is None or step.usage is None:  # generate_steps' contract broken
            raise RequestError("the request ended without a final output", 500, "server_error")
        return GenerationResult(sample.rid, step.text, step.token_ids, step.finish_reason, step.usage, step.logprobs)

    async def _stream(self, request: web.Request, fmt: ResponseFormat, first: tuple[int, Step],
                      steps: AsyncIterator[tuple[int, Step]], n: int) -> web.StreamResponse:
        """Send the chunks of every sample as they come, then the format's tail once every
        sample has its usage; a failure after the first chunk is an error event."""
        resp = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        usages: dict[int, protos.Usage] = {}

        async def send(index: int, step: Step) -> None:
            if step.usage is not None:
                usages[index] = step.usage
            for chunk in fmt.chunks(step, index):
                await resp.write(sse(chunk))

        await send(*first)
        try:
            async for index, step in steps:
                await send(index, step)
        except GenerationError as exc:
            await resp.write(sse(error_body(str(exc), 500, "server_error")))
        else:
            if len(usages) == n:
                for chunk in fmt.tail(combined_usage([usages[i] for i in range(n)])):
                    await resp.write(sse(chunk))
        await resp.write(SSE_DONE)
        await resp.write_eof()
        return resp

    # ---- info

    def _model_card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.started, "owned_by": "hicache",
                "max_model_len": self.limits.max_context}

    async def models(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": [self._model_card(n) for n in self.limits.names]})

    async def model(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{id}``: the model object, or 404 (OpenAI's answer) for a name not served."""
        name = request.match_info["model_id"]
        if name not in self.limits.names:
            raise RequestError(f"The model `{name}` does not exist", 404, param="model")
        return _json(self._model_card(name))

    heartbeat_dir: str | None = None
    """The runtime directory whose heartbeats ``/health`` reads (set by the tokenizer
    process); None = no heartbeats, processes are judged by their pids only."""

    async def health(self, request: web.Request) -> web.Response:
        """Readiness, and with ``?live=1`` liveness.

        Readiness (``GET /health``): 200 ``{"status": "ok", "processes": {name: pid}}`` when
        every process is alive and the scheduler and controller heartbeats are at most
        ``server.health_stale_s`` old; else 503 with ``status`` ``degraded`` (``dead``: the
        names whose pid is gone; ``stale``: name -> seconds since its last heartbeat;
        ``stalled``: name -> seconds it has had work without progress, past the same limit:
        ``hicache.runtime.heartbeat``) or ``draining``. Liveness (``?live=1``): the same body, always 200 — this process
        answers; whether a degraded daemon should be restarted is the caller's decision.
        """
        from hicache.runtime.heartbeat import HEARTBEAT_PROCESSES, heartbeat_ages, heartbeat_stalls

        procs: Mapping[str, int] = dict(self.pids)
        dead = sorted(name for name, pid in procs.items() if not _pid_alive(pid))
        limit = self.config.server.health_stale_s
        names = tuple(n for n in HEARTBEAT_PROCESSES if n in procs)
        ages = heartbeat_ages(self.heartbeat_dir, names)
        # tenths rounded up: a stale process never shows an age at or below the limit
        stale = {name: math.ceil(age * 10) / 10 for name, age in sorted(ages.items())
                 if age > limit and name not in dead}
        stalls = heartbeat_stalls(self.heartbeat_dir, names)
        stalled = {name: math.ceil(s * 10) / 10 for name, s in sorted(stalls.items())
                   if s > limit and name not in dead and name not in stale}
        status = HealthStatus.DRAINING if self.draining else \
            HealthStatus.DEGRADED if dead or stale or stalled else HealthStatus.OK
        body: dict[str, Any] = {"status": status.value, "processes": procs}
        if dead:
            body["dead"] = dead
        if stale:
            body["stale"] = stale
        if stalled:
            body["stalled"] = stalled
        live = request.query.get("live", "") not in ("", "0", "false")
        return _json(body, 200 if live or status is HealthStatus.OK else 503)

    async def metrics_route(self, request: web.Request) -> web.Response:
        """``GET /metrics``: every process's metrics, with the scheduler's and controller's
        health read now from the pids and heartbeat files ``/health`` reads
        (``Metrics.set_process_health``). The operator's (``hicache.api_server.access``)."""
        from hicache.runtime.heartbeat import HEARTBEAT_PROCESSES, heartbeat_ages, heartbeat_stalls

        operator_only(request.get(TENANT), "GET /metrics (every tenant's series)")
        procs: Mapping[str, int] = dict(self.pids)
        names = tuple(n for n in HEARTBEAT_PROCESSES if n in procs)
        self.metrics.set_process_health(heartbeat_ages(self.heartbeat_dir, names),
                                        {n: _pid_alive(procs[n]) for n in names}, self.config.server.health_stale_s,
                                        heartbeat_stalls(self.heartbeat_dir, names))
        body = await asyncio.to_thread(render_metrics)
        if body is None:
            return web.Response(status=404, text="metrics are disabled (metrics.enabled: false)\n")
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def openapi(self, request: web.Request) -> web.Response:
        """``GET /openapi.json``: the OpenAPI document for this model (no scheduler involved)."""
        return _json(openapi_document(self.limits))

    # ---- admin

    async def _admin(self, op: str, args: dict[str, Any] | None = None, timeout_s: float | None = None) -> web.Response:
        """An admin op's reply as JSON. A failed op: 400 when the scheduler marks it
        ``refused`` (the request's own fault), 404 ``missing``, 409 busy, else 500."""
        timeout_s = self.admin_timeout_s if timeout_s is None else timeout_s
        try:
            reply = await self.link.admin(op, args, timeout_s)
        except asyncio.TimeoutError:
            raise RequestError(f"the scheduler did not answer {op} within {timeout_s:g} s", 504,
                               "timeout") from None
        except SchedulerUnavailable as exc:
            raise RequestError(str(exc), 503, "unavailable") from None
        if not reply.ok:
            error = reply.error or f"{op} failed"
            if reply.result.get("refused"):
                raise RequestError(error)
            if reply.result.get("missing"):
                raise RequestError(error, 404, "not_found")
            raise RequestError(error, 409 if "busy" in error.lower() else 500,
                               "conflict" if "busy" in error.lower() else "server_error")
        return _json(reply.result)

    @property
    def engine_mode(self) -> bool:
        return self.config.engine.kind != "builtin"

    async def pin(self, request: web.Request) -> web.Response:
        """``PUT /cache/pinned``: pin a prefix (or replace the pin of that name); answered once
        it is pinned (``hicache.api_server.pinning``). A tenant pins in its own namespace; the
        operator in any tenant's (``tenant`` in the body)."""
        tenant = request.get(TENANT)
        scoped_args(tenant, self.engine_mode, "PUT /cache/pinned")
        args = body_args(await self._read_json(request), self.tokenizer, self.limits.vocab_size, tenant, self._tenants)
        return await self._admin("pin", args, max(self.admin_timeout_s, PIN_TIMEOUT_S))

    async def unpin(self, request: web.Request) -> web.Response:
        """``DELETE /cache/pinned/{name}``: let a pinned prefix go (its pages stay cached,
        evictable). A tenant's own pin; the operator's choice (``?tenant=NAME``: that tenant's)."""
        tenant = request.get(TENANT)
        args = scoped_args(tenant, self.engine_mode, "DELETE /cache/pinned", {"name": request.match_info["name"]})
        owner = request.query.get("tenant")
        if owner is not None:
            if tenant is not None and owner != tenant:
                raise RequestError("a tenant unpins only its own pins", 403, "permission_error", "tenant")
            args["owner"] = owner
        return await self._admin("unpin", args)

    def _admin_route(self, op: str, *, operator: bool = False) -> Handler:
        """An admin route without a body: the operator's alone (``operator``), or scoped to
        the calling tenant's namespaces (``hicache.api_server.access``)."""
        async def handler(request: web.Request) -> web.StreamResponse:
            tenant = request.get(TENANT)
            what = f"{request.method} {request.path}"
            if operator:
                operator_only(tenant, what)
            args = scoped_args(tenant, self.engine_mode, what)
            if request.method != "GET":
                data = await self._read_json(request, optional=True)
                if data:
                    raise RequestError(f"{what} takes no body fields, got {', '.join(sorted(data))}")
            return await self._admin(op, args)

        return handler

    async def storage_attach(self, request: web.Request) -> web.Response:
        """``PUT /cache/storage`` ``{"store": NAME}``: attach a store the config names (the operator's)."""
        operator_only(request.get(TENANT), "PUT /cache/storage")
        args = parse_storage_choice(await self._read_json(request), self.config)
        return await self._admin("storage_attach", args)


_DONE = object()


async def _merged(streams: list[AsyncGenerator[Step, None]]) -> AsyncGenerator[tuple[int, Step], None]:
    """The steps of several samples as ``(index, step)``, in the order they come. One stream
    is iterated directly; several run as tasks. The first exception of any ends the merge
    (re-raised here); leaving early cancels the rest, and each stream is closed
    (``aclosing``), which sends its abort."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for step in only:
                yield 0, step
        return
    queue: asyncio.Queue[tuple[int, Step | None, object]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[Step, None]) -> None:
        try:
            async with aclosing(stream) as steps:
                async for step in steps:
                    await queue.put((index, step, None))
        except Exception as exc:  # handed to the consumer, which re-raises it
            await queue.put((index, None, exc))
        else:
            await queue.put((index, None, _DONE))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, got, outcome = await queue.get()
            if outcome is _DONE:
                running -= 1
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                assert got is not None  # pump sends a step with no outcome
                yield index, got
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _answer_and_close(request: web.Request, resp: web.Response) -> web.Response:
    """Send ``resp`` now, then close the connection: a client still sending a body it was
    given too long for does not hold the connection while aiohttp drains the rest."""
    resp.force_close()
    await resp.prepare(request)
    await resp.write_eof()
    transport = request.transport
    if transport is not None:
        transport.close()
    return resp


class _JsonErrorHandler(web.RequestHandler):
    """aiohttp's connection handler, answering what it refuses before any route is found
    (a request line or header that does not parse: 400, ...) with the API's JSON error
    object instead of plain text. The connection is closed after it, as aiohttp does."""

    __slots__ = ()

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs it; raises if bytes went out already
        if status >= 500:
            text, kind = "internal server error", "server_error"
        else:
            text, kind = message or "the request could not be parsed", "invalid_request_error"
        resp = _json(error_body(text, status, kind), status)
        resp.force_close()
        return resp


class _JsonErrorServer(web.Server):
    """``web.Server`` whose connections are ``_JsonErrorHandler``s."""

    def __call__(self) -> web.RequestHandler:
        return _JsonErrorHandler(self, loop=self._loop, **self._kwargs)


class JsonErrorRunner(web.AppRunner):
    """``web.AppRunner`` whose server answers protocol-level errors with the JSON error object.

    ``header_timeout_s`` is the per-connection deadline for a complete request line and
    headers, from the connection's start or its previous response (aiohttp's keep-alive
    deadline: an idle keep-alive connection is closed after it too). Other keyword arguments
    go to ``web.AppRunner``.
    """

    def __init__(self, app: web.Application, *, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(app, keepalive_timeout=header_timeout_s, **kwargs)

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        if type(server) is web.Server:
            server.__class__ = _JsonErrorServer  # only __call__ differs: which handler a connection gets
        else:  # pragma: no cover - an aiohttp whose runner builds another server class
            log.warning("aiohttp built a %s: protocol errors stay plain text", type(server).__name__)
        return server
