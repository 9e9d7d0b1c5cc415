"""The OpenAI-compatible HTTP ingress (FastAPI on Ray Serve): validation, tokenization, SSE, errors, /metrics.

A request's path: the guard checks the API key and the body size (401/413), pydantic checks the body (400, as OpenAI and vLLM answer it),
the ingress checks values and model (400/404), admits the request's choices (429 above the in-flight limit),
tokenizes off the event loop, checks the context (400), and asks the ``Router`` for each choice's chunk
stream; replicas report errors as chunks, which become HTTP errors before the first byte is sent, or a final
SSE error event after. Every error body has OpenAI's shape; what a 5xx hides goes to the log under the
request id.
"""


import asyncio
import codecs
import collections
import concurrent.futures
import contextvars
import dataclasses
import email.message
import hmac
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from actors.chunks import error_chunk
from actors.cpus import leave_engine_cpus
from actors.logs import configure_actor_logging
from actors.sink import ChunkSink
from actors.worker import freeze_heap
from engine.sequence import Continuation, SamplingParams, TokenLogprob
from serve_app.config import ServiceConfig
from serve_app.metrics import HubClient, ServiceMetrics
from serve_app.protocol import (APIError, AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                ChatCompletionRequest, ChatCompletionResponse, ChatDelta, ChatLogprobs,
                                ChatTokenLogprob, CompletionChoice, CompletionChunk, CompletionLogprobs,
                                CompletionRequest, CompletionResponse, PromptTokensDetails, RunningUsage,
                                SpecDecodeUsage, TopLogprob, Usage, check_text, max_tokens_field, render_chat,
                                sampling_params)
from serve_app.router import Router, unavailable

log = logging.getLogger("dflash.ingress")
# /docs and /openapi.json are off unless the config turns them on (``Ingress.__init__``).
api = FastAPI(title="dflash-serve", docs_url=None, redoc_url=None, openapi_url=None)
READY_TTL_S = 1.0
# How long /health waits for the metrics hub before it answers from the hub's last answer: a hub that Serve is
# replacing (6-10 s on 2 cores) or that hangs does not stop the service from serving, nor should it stop a load
# balancer's health probe, whose timeout is often a second or two.
HEALTH_HUB_WAIT_S = 1.0
# A choice whose replica failed is sent again, after each of these pauses in turn: a replica that lost a process
# leaves within about two seconds, and the routers then pass it over (``serve_app.replicas``). Before anything of it
# reached the client (before its first token; a request not streamed, at any point) it starts over; a stream that
# gave out tokens goes on from them (``Choice._resume``, or ``Choice._replay`` for one seeded to sample). Only for a
# replica's failures, never for a refusal of the request; and twice at most, so that a request that itself crashes
# an engine's process takes down no more than three replicas.
RETRY_PAUSES_S = (0.5, 2.0)
RETRYABLE = ("unavailable", "transfer_error")
RETRY_AFTER_S = 1
API_KEY_ENV = "DFLASH_API_KEY"

# What a client is told of a server-side failure; the details go to the log under the request id.
PUBLIC_MESSAGES = {
    "overloaded": "the service is overloaded; retry later",
    "unavailable": "no replica is available to serve this request right now; retry later",
    "transfer_error": "moving this request's KV cache from the prefill to the decode replica failed; retry it",
    "server_error": "the server failed while serving this request; retry it",
}


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


@api.exception_handler(APIError)
async def _api_error(_: Request, e: APIError) -> JSONResponse:
    return _error_response(e)


def _is_json(content_type: str | None) -> bool:
    """Whether FastAPI reads a body of this Content-Type as JSON (application/json or application/*+json)."""
    message = email.message.Message()
    message["content-type"] = content_type or ""
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


@api.exception_handler(RequestValidationError)
async def _schema_error(request: Request, e: RequestValidationError) -> JSONResponse:
    content_type = request.headers.get("content-type")
    if request.method == "POST" and not _is_json(content_type):
        # FastAPI leaves such a body unparsed (bytes), which would read as a schema violation.
        return _error_response(APIError(415, f"the request body must be JSON sent with Content-Type: "
                                        f"application/json, got {content_type or 'no Content-Type'}",
                                        code="unsupported_media_type"))
    errors = e.errors() or [{"loc": (), "msg": "invalid request", "type": "value_error"}]
    if any(err.get("type") == "json_invalid" for err in errors):
        return _error_response(APIError(400, "the request body is not valid JSON", code="invalid_json"))
    param = ".".join(str(p) for p in errors[0]["loc"] if p != "body") or None
    # pydantic's messages name the field and the rule, never the value sent.
    message = "; ".join(f"{'.'.join(str(p) for p in err['loc'] if p != 'body') or 'body'}: {err['msg']}"
                        for err in errors)
    # 400, not FastAPI's 422: OpenAI's API and vLLM answer a malformed body so, and OpenAI's SDKs raise their
    # BadRequestError for it, which a client written against them catches.
    return _error_response(APIError(400, message, "invalid_request_error", param, "schema_violation"))


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    messages = {404: f"no such path: {request.method} {request.url.path}",
                405: f"{request.method} is not allowed on {request.url.path}"}
    message = messages.get(e.status_code, str(e.detail))
    kind = "invalid_request_error" if e.status_code < 500 else "server_error"
    return _error_response(APIError(e.status_code, message, kind, headers=dict(e.headers or {}) or None))


@api.exception_handler(Exception)
async def _unexpected(request: Request, e: Exception) -> JSONResponse:
    error_id = f"err-{uuid.uuid4().hex[:16]}"
    log.error("%s: %s %s failed", error_id, request.method, request.url.path, exc_info=e)
    return _error_response(APIError(500, f"{PUBLIC_MESSAGES['server_error']} (error id {error_id})",
                                    "server_error"))


def _public(status: int, kind: str, message: str, request_id: str) -> APIError:
    """The error a client sees: 4xx as they are (they are about the request), 5xx without internals."""
    if status < 500:
        return APIError(status, message, kind)
    log.error("%s: %s (%s): %s", request_id, status, kind, message)
    kind = kind if kind in PUBLIC_MESSAGES else "server_error"
    code = kind if kind in ("overloaded", "unavailable", "transfer_error") else None
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return APIError(status, f"{PUBLIC_MESSAGES[kind]} (request {request_id})", kind, code=code, headers=headers)


def _from_chunk(chunk: dict, request_id: str) -> APIError:
    return _public(chunk["status"], chunk.get("error_type", "server_error"), chunk["message"], request_id)


async def _cancel_all(tasks: list[asyncio.Task]) -> None:
    """Cancel the tasks and wait until each has ended, however it ends: only then may the choices they read be
    closed (closing a stream that another task is reading fails)."""
    for t in tasks:
        t.cancel()
    for t in tasks:
        try:
            await t
        except BaseException:       # its own error or its cancellation: the caller reports the first error
            pass


def _error_chunk_from(e: BaseException) -> dict:
    """A Serve or Ray failure (a replica died, none is available, back-pressure) as an error chunk."""
    from ray.serve.exceptions import BackPressureError

    detail = f"{type(e).__name__}: {e}"
    if isinstance(e, BackPressureError):
        return {"type": "error", "status": 503, "message": detail, "error_type": "overloaded"}
    if unavailable(e):
        return {"type": "error", "status": 503, "message": detail, "error_type": "unavailable"}
    return {"type": "error", "status": 500, "message": detail, "error_type": "server_error"}


class Guard:
    """ASGI middleware in front of the routes: the API key (on /v1/*) and the request-body size limit.

    Reads its settings from the app's ``state`` (set by the ingress replica's constructor). Serve runs a copy
    of ``api`` made when the deployment class was defined, so the app is taken from the scope, never from
    this module's global."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        settings = getattr(scope["app"].state, "guard", None)
        if settings is None:
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):       # an application under a route prefix
            path = path[len(root):]
        if settings["api_key"] and path.startswith("/v1/"):
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                     settings["api_key"].encode()):
                return await _send(scope, receive, send, APIError(
                    401, "a valid API key is required (Authorization: Bearer <key>)", code="invalid_api_key"))
        limit = settings["max_request_bytes"]
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await _send(scope, receive, send, _too_large(limit))
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        # Read the body here (it is small: at most the limit) so a chunked body cannot exceed it either.
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return await _send(scope, receive, send, _too_large(limit))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


def api_key(service: ServiceConfig) -> str | None:
    """The key clients must present: the config's, else the ingress's DFLASH_API_KEY, else none (open)."""
    return service.api_key or os.environ.get(API_KEY_ENV) or None


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds the limit of {limit} bytes", code="request_too_large")


async def _send(scope, receive, send, e: APIError) -> None:
    await _error_response(e)(scope, receive, send)


api.add_middleware(Guard)


def _lower_priority() -> None:
    """Run this (tokenizer) thread below the event loop's priority: a huge prompt yields the CPU to the short
    requests the loop is serving (Linux schedules threads by their own nice value)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except OSError:       # not permitted here: the thread keeps the normal priority
        pass


class _Replay:
    """What a replayed stream (``Choice._replay``) must give again before anything new goes to the client: the
    token ids and the text it already has. ``strip`` takes each chunk's part of them away, and says (None) when the
    replay gives something else."""

    def __init__(self, token_ids: list[int], text: str):
        self.token_ids, self.text = list(token_ids), text
        self.ids_seen = self.text_seen = 0

    @property
    def done(self) -> bool:
        return self.ids_seen == len(self.token_ids) and self.text_seen == len(self.text)

    def strip(self, chunk: dict) -> dict | None:
        ids, text = chunk["token_ids"], chunk["text"]
        k = min(len(ids), len(self.token_ids) - self.ids_seen)
        t = min(len(text), len(self.text) - self.text_seen)
        if ids[:k] != self.token_ids[self.ids_seen:self.ids_seen + k] or \
                text[:t] != self.text[self.text_seen:self.text_seen + t]:
            return None
        self.ids_seen, self.text_seen = self.ids_seen + k, self.text_seen + t
        if chunk["finished"] and not self.done:      # it ended before giving again all it had given
            return None
        stripped = {**chunk, "token_ids": ids[k:], "text": text[t:]}
        if "logprobs" in chunk:
            stripped["logprobs"] = chunk["logprobs"][k:]
        return stripped


class Choice:
    """One choice's stream: chunks from the router, text deltas, and the timings the metrics need."""

    def __init__(self, index: int, request_id: str, prompt_ids: list[int], params: SamplingParams, router: Router,
                 echo: str = "", on_retry=None, restartable: bool = False, on_resume=None):
        self.index, self.request_id, self.prompt_ids, self.params = index, request_id, prompt_ids, params
        self.router, self.echo, self.on_retry, self.on_resume = router, echo, on_retry, on_resume
        # Whether a failure after the first tokens may start it over too (nothing of it has reached the client
        # before it ends: a request not streamed).
        self.restartable = restartable
        self.retries = 0
        self.start = time.perf_counter()
        self.finish_reason: str | None = None
        self.error: str | None = None   # the type of the error that ended it (the request's, for its siblings)
        self.done = False
        self._begin(request_id)

    def _begin(self, request_id: str) -> None:
        """A fresh stream of the choice from the router, and nothing received of it yet."""
        self.gen = self.router.stream(request_id, self.prompt_ids, self.params)
        self.received = 0               # chunks received (not counting errors)
        self.ttft: float | None = None
        self.last_token_time: float | None = None
        self.token_gaps: list[float] = []   # seconds between chunks that carried tokens (inter-token latency)
        self.text = self.echo           # the text so far: the replicas send only final text (stop strings cut)
        self.sent = 0                   # characters of it already sent
        self.token_ids: list[int] = []
        self.ids_sent = 0               # token ids already sent (streams with return_token_ids)
        self.logprobs: list[TokenLogprob] = []    # per token, when params.logprobs is set
        self.logprobs_sent = 0
        self.text_offset = len(self.echo)   # where the next logprobs token begins in the text (completions) ...
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")    # ... counting only whole characters
        self.spec: dict | None = None
        self.timing: dict | None = None      # the engines' queue / prefill / decode seconds (finished requests)
        self.num_cached_tokens = 0
        self.replaying: _Replay | None = None     # a replayed stream's part that the client has already

    def _may_retry(self, chunk: dict) -> bool:
        return chunk["type"] == "error" and chunk.get("error_type") in RETRYABLE \
            and self.retries < len(RETRY_PAUSES_S)

    def _resume(self, request_id: str) -> None:
        """A fresh stream of the choice that goes on from what it received (``Router.stream``'s continuation):
        its text, tokens and timings so far stay. A seeded one that samples is replayed instead (``_replay``): an
        engine that continues it draws with a new generator, not the numbers its seed promises."""
        if self.params.greedy or self.params.seed is None:
            given = Continuation(self.token_ids, self.logprobs, len(self.text) - len(self.echo))
            self.gen = self.router.stream(request_id, self.prompt_ids, self.params, given)
        else:
            self._replay(request_id)
        if self.on_resume is not None:
            self.on_resume()

    def _replay(self, request_id: str) -> None:
        """A fresh stream of a seeded choice from its prompt: its seed draws the same tokens again (as anywhere in
        the service), and what the client already has of them is dropped as it comes again (``_Replay``)."""
        self.gen = self.router.stream(request_id, self.prompt_ids, self.params)
        self.replaying = _Replay(self.token_ids, self.text[len(self.echo):])

    async def next(self) -> dict | None:
        """The next chunk, or None at the end; exceptions from Serve become error chunks. A replica's failure
        before anything of the choice reached the client is met by sending it again (``RETRY_PAUSES_S``)."""
        while (chunk := await self._next()) is not None and self._may_retry(chunk):
            log.warning("%s: %s after %d chunks (%s); sending it again", self.request_id, chunk.get("error_type"),
                        self.received, chunk.get("message"))
            if self.on_retry is not None:
                self.on_retry(chunk.get("error_type"))
            try:
                await self.gen.aclose()
            except Exception:       # the failed attempt's clean-up: logged, and the choice goes on
                log.exception("%s: closing its failed stream failed", self.request_id)
            await asyncio.sleep(RETRY_PAUSES_S[self.retries])
            self.retries += 1
            if self.received == 0 or self.restartable:
                self._begin(f"{self.request_id}.{self.retries}")    # a fresh id: the failed attempt's may linger
            else:       # a stream that gave out tokens: it goes on from them
                self._resume(f"{self.request_id}.{self.retries}")
        if chunk is None:
            self.done = True
            return None
        if chunk["type"] == "error":
            self.done = True
            self.error = chunk.get("error_type", "server_error")
            return chunk
        self.received += 1
        now = time.perf_counter()
        if chunk["token_ids"]:
            if self.ttft is None:
                self.ttft = now - self.start
            else:
                self.token_gaps.append(now - self.last_token_time)
            self.last_token_time = now
        self.token_ids += chunk["token_ids"]
        self.text += chunk["text"]
        self.logprobs += chunk.get("logprobs", ())
        # The prefill side's count (the decode side's request reuses nothing: its KV arrived by READ).
        self.num_cached_tokens = max(self.num_cached_tokens, chunk.get("num_cached_tokens", 0))
        if chunk["finished"]:
            self.done = True
            self.finish_reason = chunk["finish_reason"]
            self.spec = chunk.get("spec")
            self.timing = chunk.get("timing")
        return chunk

    async def _next(self) -> dict | None:
        try:
            chunk = await self.gen.__anext__()
        except StopAsyncIteration:
            return None
        except asyncio.CancelledError:
            raise
        except Exception as e:
            return _error_chunk_from(e)
        if self.replaying is not None and chunk["type"] == "tokens":
            chunk = self.replaying.strip(chunk)
            if chunk is None:
                log.error("%s: its replay gave other tokens than the stream it replays", self.request_id)
                return error_chunk(500, "the replica serving this stream failed, and the stream could not go on")
            if self.replaying.done:
                self.replaying = None
        return chunk

    def delta(self) -> str:
        """Text not sent yet."""
        out = self.text[self.sent:]
        self.sent = len(self.text)
        return out

    async def close(self) -> None:
        if not self.done:
            self.done = True
            self.finish_reason = self.finish_reason or "abort"
            await self.gen.aclose()


@serve.ingress(api)
class Ingress:
    def __init__(self, service: dict, hub, **backends):
        configure_actor_logging()
        leave_engine_cpus()
        self.service = ServiceConfig.model_validate(service)
        self.model_name = self.service.model.name
        self.metrics = ServiceMetrics(self.model_name, ("aggregated",) if self.service.mode == "aggregated"
                                      else ("prefill", "decode"))
        self.ingress_id = f"ingress-{uuid.uuid4().hex[:8]}"
        self.sink = ChunkSink(self.ingress_id) if self.service.direct_chunks else None
        self.router = Router(backends, on_transfer=lambda stats: self.metrics.observe_transfer(stats, stats is None),
                             sink=self.sink, stream_interval=self.service.stream_interval,
                             on_chunk=lambda path: self.metrics.stream_chunks.labels(self.model_name, path).inc(),
                             healthy=self._healthy_replicas,
                             on_whole=lambda role: self.metrics.requests_whole.labels(self.model_name, role).inc())
        self.hub = hub
        self._hub_client = HubClient(hub)      # for the reporter thread
        self._closed = threading.Event()
        threading.Thread(target=self._report, name="metrics-reporter", daemon=True).start()
        self.roles = self.service.engine_roles()
        model_dir = Path(self.service.model.resolved(self.service.model.model))
        self.tokenizer = None
        if (model_dir / "tokenizer.json").is_file():
            from engine.tokenizer import Tokenizer
            self.tokenizer = Tokenizer(model_dir)
        hf = json.loads((model_dir / "config.json").read_text())
        self.vocab_size = hf["vocab_size"]
        self.max_model_len = min(self.service.model.max_model_len or hf["max_position_embeddings"],
                                 hf["max_position_embeddings"])
        self.inflight = 0               # choices (prompts x n) admitted and not finished
        self._ready_at = -1e9
        self._ready = False
        self._refresh: asyncio.Task | None = None      # a readiness refresh running in the background
        self._unready: list[str] = list(self.roles)
        self._healthy: dict[str, int] | None = None      # healthy replicas per role (None until the hub answered)
        self._created = int(time.time())
        # Tokenizing a large prompt takes a second: never on the event loop, which serves every other request.
        self._cpu = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize",
                                                          initializer=_lower_priority)
        api.state.guard = {"api_key": api_key(self.service), "max_request_bytes": self.service.max_request_bytes}
        if self.service.enable_docs and api.openapi_url is None:
            api.openapi_url, api.docs_url = "/openapi.json", "/docs"
            api.setup()
        freeze_heap()

    def _report(self) -> None:
        """Push this ingress's request metrics to the hub, so a scrape of any ingress counts them."""
        interval = self.service.metrics_report_interval_s
        while not self._closed.wait(interval):
            try:
                self._hub_client.report(self.ingress_id, self.metrics.report(interval))
            except Exception:      # a missed report only ages this ingress's share of /metrics
                log.exception("metrics report failed")

    def __del__(self):
        self._closed.set()
        try:
            self._hub_client.forget(self.ingress_id)
        except Exception:
            pass

    # --- admission --------------------------------------------------------------------------------
    async def _snapshots(self) -> dict[str, dict]:
        snaps = await self.hub.snapshots.remote()
        self._healthy = collections.Counter(s["role"] for s in snaps.values() if s.get("healthy", True))
        self._unready = [role for role in self.roles if not self._healthy[role]]
        # Ready while a role serves: a disaggregated service with one role down runs requests whole on the other.
        self._ready = len(self._unready) < len(self.roles)
        self._ready_at = time.monotonic()
        return snaps

    async def _check_ready(self) -> None:
        """Refuse (503) while no role has a healthy replica, as the hub last said. The hub is asked at most every
        READY_TTL_S, and a request never waits for it while every role is known to be up: a stale answer is
        refreshed in the background (a Serve call, milliseconds on every request's time to first token otherwise).
        Only a service not known to be whole waits for a fresh answer once it is stale."""
        if self._refresh_if_stale() and (not self._ready or self._unready):
            # Never refused, nor run whole (``Router.whole_on``), on a stale answer that a role is down (another
            # ingress may already have seen it recover): wait for the refresh in flight, one per ingress however
            # many requests wait on it.
            await asyncio.shield(self._refresh)
        if not self._ready:
            raise APIError(503, f"no healthy replica for: {', '.join(self._unready)}; retry later", "unavailable",
                           code="unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})

    def _refresh_if_stale(self) -> bool:
        """Ask the hub again, in the background, when its last answer is older than READY_TTL_S or said no role
        can serve; whether it did (or a refresh is in flight: ``self._refresh``)."""
        stale = time.monotonic() - self._ready_at > READY_TTL_S or not self._ready
        if stale:
            self._ask_hub()
        return stale

    def _ask_hub(self) -> asyncio.Task:
        """The hub's answer on its way (asked now unless a call is already in flight), refreshing this view."""
        if self._refresh is None or self._refresh.done():
            # In a context of its own: not this request's call (its cancellation must not cancel the refresh).
            self._refresh = asyncio.get_running_loop().create_task(self._refresh_ready(),
                                                                   context=contextvars.Context())
        return self._refresh

    def _healthy_replicas(self) -> dict[str, int] | None:
        """The router's view: healthy replicas per role, as the hub last said (refreshed when stale)."""
        self._refresh_if_stale()
        return self._healthy

    async def _refresh_ready(self) -> bool:
        """Whether the hub answered."""
        try:
            await self._snapshots()
            return True
        except Exception:      # the hub did not answer: keep the last answer, ask again at the next request
            log.warning("readiness refresh from the metrics hub failed", exc_info=True)
            return False

    def _admit(self, num_choices: int, param: str) -> None:
        """Count the request's choices against the in-flight limit (``_finish`` gives them back)."""
        limit = self.service.max_concurrent_requests
        if num_choices > limit:
            raise APIError(400, f"the request asks for {num_choices} choices (prompts x n); at most {limit} are "
                           "served at once", param=param)
        if self.inflight + num_choices > limit:
            raise APIError(429, f"overloaded: {self.inflight} choices in flight, the limit is {limit}; retry later",
                           "overloaded", code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})
        self.inflight += num_choices

    async def _offload(self, fn):
        return await asyncio.get_running_loop().run_in_executor(self._cpu, fn)

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           "invalid_request_error", "model", "model_not_found")

    def _encode(self, prompt, param: str, literal: Sequence[tuple[int, int]] = ()) -> list[int]:
        """Token ids of a prompt (text or ids; in ``literal`` spans of a text, control tokens' text is plain
        text); runs on the tokenizer pool."""
        if isinstance(prompt, str):
            check_text(prompt, param)
            if self.tokenizer is None:
                raise APIError(400, "this model has no tokenizer; send token ids", param=param)
            ids = self.tokenizer.encode(prompt, literal)
        else:
            ids = list(prompt)
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise APIError(400, f"token ids must be in [0, {self.vocab_size})", param=param)
        if not ids:
            raise APIError(400, "the prompt is empty", param=param)
        return ids

    def _check_context(self, ids: list[int], params: SamplingParams, body, prompt_param: str) -> None:
        """400 naming the prompt when it alone fills the context, else the max_tokens field that overflows it."""
        if len(ids) + params.max_tokens > self.max_model_len:
            max_field = max_tokens_field(body)
            param = prompt_param if len(ids) >= self.max_model_len or max_field is None else max_field
            raise APIError(400, f"this model's maximum context length is {self.max_model_len} tokens; the request "
                           f"has {len(ids)} prompt tokens and {max_field or 'max_tokens'} {params.max_tokens}",
                           param=param, code="context_length_exceeded")

    # --- endpoints ----------------------------------------------------------------------------------
    @api.get("/health")
    async def health(self):
        """200 ``ok``; 200 ``degraded`` while one role of a disaggregated service has no healthy replica (the
        other runs requests whole meanwhile, ``serve_app.router``); 503 while no role can serve. The hub is asked
        afresh; one that has not answered within HEALTH_HUB_WAIT_S (Serve replacing it, or hung) leaves its last
        answer standing, which the body's ``message`` says (requests are served meanwhile)."""
        asked = self._ask_hub()
        answered = False
        try:
            # Until the hub's first answer there is nothing to stand on: wait for it.
            wait_s = HEALTH_HUB_WAIT_S if self._healthy is not None else None
            answered = await asyncio.wait_for(asyncio.shield(asked), wait_s)
        except asyncio.TimeoutError:
            pass
        note = {} if answered else {"message": "the metrics hub did not answer; its last answer stands"}
        if not self._ready:
            raise APIError(503, f"no healthy replica for: {', '.join(self._unready)}", "unavailable",
                           code="unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})
        whole = self.router.whole_on()      # (the hub's view, and the calls that failed here)
        if whole is not None:
            down = [role for role in self.roles if role != whole]
            message = f"no healthy replica for: {', '.join(down)}; requests run whole on the {whole} replicas"
            return {"status": "degraded", "unavailable": down,
                    "message": f"{message} ({note['message']})" if note else message}
        return {"status": "ok", **note}

    @api.get("/v1/models")
    async def models(self):
        return {"object": "list", "data": [self._model_card()]}

    @api.get("/v1/models/{model:path}")      # a served name may hold a "/" (org/name)
    async def model(self, model: str):
        self._check_model(model)
        return self._model_card()

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self._created, "owned_by": "dflash-serve",
                "max_model_len": self.max_model_len}

    @api.get("/metrics")
    async def prometheus(self):
        # This ingress's counts reach the hub first (calls from one process run in order), then the page shows
        # the hub's view of every ingress (``ServiceMetrics.render``).
        await self.hub.report.remote(self.ingress_id, self.metrics.report(self.service.metrics_report_interval_s))
        snapshots = await self._snapshots()
        return Response(self.metrics.render(snapshots), media_type=CONTENT_TYPE_LATEST)

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        self._check_model(body.model)
        params = sampling_params(body, default_max_tokens=16, vocab_size=self.vocab_size)
        prompt = body.prompt
        batch = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
        await self._check_ready()
        self._admit(len(batch) * body.n, "n" if body.n > 1 else "prompt")
        try:
            prompts = await self._offload(lambda: [self._encode(p, "prompt") for p in batch])
            for ids in prompts:
                self._check_context(ids, params, body, "prompt")
            echoes = None
            if body.echo:
                if self.tokenizer is None:
                    raise APIError(400, "this model has no tokenizer; echo needs one", param="echo")
                echoes = [p if isinstance(p, str) else self.tokenizer.decode(ids, params.skip_special_tokens)
                          for p, ids in zip(batch, prompts)]
        except BaseException:
            self.inflight -= len(batch) * body.n
            raise
        return await self._serve(body, prompts, params, chat=False, echoes=echoes)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest):
        self._check_model(body.model)
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer; chat needs one", param="messages")
        # Bad values are refused before any work (the default max_tokens depends on the prompt: its bound here).
        sampling_params(body, default_max_tokens=self.max_model_len, vocab_size=self.vocab_size)
        await self._check_ready()
        self._admit(body.n, "n")
        try:
            ids = await self._offload(lambda: self._encode_chat(body))
            params = sampling_params(body, default_max_tokens=max(1, self.max_model_len - len(ids)),
                                     vocab_size=self.vocab_size)
            self._check_context(ids, params, body, "messages")
        except BaseException:
            self.inflight -= body.n
            raise
        return await self._serve(body, [ids], params, chat=True)

    def _encode_chat(self, body: ChatCompletionRequest) -> list[int]:
        text, literal = self._render(body)
        return self._encode(text, "messages", literal)

    def _render(self, body: ChatCompletionRequest) -> tuple[str, list[tuple[int, int]]]:
        """The prompt's text, and the spans where a message's content wrote a control token's text."""
        for i, m in enumerate(body.messages):
            check_text(m.text, f"messages.{i}.content")
        special = {k: self.tokenizer.config.get(k) or "" for k in ("bos_token", "eos_token")}
        special = {k: v.get("content", "") if isinstance(v, dict) else v for k, v in special.items()}
        return render_chat(body.messages, self.tokenizer.chat_template, special, self.tokenizer.special_tokens,
                           add_generation_prompt=body.add_generation_prompt,
                           continue_final_message=body.continue_final_message,
                           template_kwargs=body.chat_template_kwargs)

    # --- responses ----------------------------------------------------------------------------------
    async def _serve(self, body, prompts: list[list[int]], params: SamplingParams, chat: bool,
                     echoes: list[str] | None = None):
        """Stream or collect every choice; the choices were admitted by the caller, ``_finish`` releases them.
        ``echoes``: per prompt, the text each of its choices begins with (completions with ``echo``)."""
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
        choices = []
        for p, ids in enumerate(prompts):
            for j in range(body.n):
                # Distinct seeds per choice, so n > 1 with a seed gives n different (reproducible) samples.
                choice_params = params if params.seed is None or j == 0 else \
                    dataclasses.replace(params, seed=params.seed + j)
                index = p * body.n + j
                choices.append(Choice(index, f"{request_id}-{index}", ids, choice_params, self.router,
                                      echoes[p] if echoes else "", on_retry=self._count_retry,
                                      restartable=not body.stream, on_resume=self._count_resume))
        handed_off, error = False, None
        try:
            firsts = await asyncio.gather(*(c.next() for c in choices))
            for chunk in firsts:
                if chunk is not None and chunk["type"] == "error":
                    raise _from_chunk(chunk, request_id)
            if body.stream:
                handed_off = True
                return EventSourceResponse(self._sse(body, request_id, choices, firsts, chat))
            tasks = [asyncio.create_task(self._drain(c, request_id)) for c in choices]
            try:
                await asyncio.gather(*tasks)
            finally:        # one failed (or the client left): the others stop before their streams are closed
                await _cancel_all(tasks)
            return self._full_response(body, request_id, choices, chat)
        except Exception as e:
            error = e.type if isinstance(e, APIError) else "server_error"
            raise
        finally:
            if not handed_off:
                await self._finish(choices, error)

    async def _drain(self, choice: Choice, request_id: str) -> None:
        while not choice.done:
            chunk = await choice.next()
            if chunk is not None and chunk["type"] == "error":
                raise _from_chunk(chunk, request_id)

    async def _finish(self, choices: list[Choice], error: str | None = None) -> None:
        """Close every choice (aborting what still runs) and count it: a success, or an error when it or its
        request (``error``) ended in one."""
        self.inflight -= len(choices)
        for c in choices:
            try:
                await c.close()
            except Exception:
                log.exception("%s: closing its stream failed", c.request_id)
            self.metrics.observe_finished(num_prompt_tokens=len(c.prompt_ids), num_generated=len(c.token_ids),
                                          finish_reason=c.finish_reason or "abort", ttft=c.ttft,
                                          e2e=time.perf_counter() - c.start, spec=c.spec,
                                          token_gaps=c.token_gaps, timing=c.timing,
                                          num_cached_tokens=c.num_cached_tokens, error=c.error or error)

    def _count_retry(self, error_type: str) -> None:
        self.metrics.request_retries.labels(self.model_name, error_type).inc()

    def _count_resume(self) -> None:
        self.metrics.request_resumes.labels(self.model_name).inc()

    def _usage(self, body, choices: list[Choice]) -> Usage:
        prompt_tokens = sum(len(c.prompt_ids) for c in choices[::body.n])
        completion = sum(len(c.token_ids) for c in choices)
        specs = [c.spec for c in choices if c.spec]
        drafts = sum(s["num_drafts"] for s in specs)
        accepted = sum(s["num_accepted_tokens"] for s in specs)
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion,
                     total_tokens=prompt_tokens + completion,
                     prompt_tokens_details=PromptTokensDetails(
                         cached_tokens=sum(c.num_cached_tokens for c in choices[::body.n])),
                     spec_decode=SpecDecodeUsage(
                         num_drafts=drafts, draft_tokens=sum(s["num_draft_tokens"] for s in specs),
                         accepted_tokens=accepted, mean_acceptance_length=(1.0 + accepted / drafts) if drafts else None,
                         acceptance_lengths=[(c.spec or {}).get("acceptance_lengths", []) for c in choices]))

    def _full_response(self, body, request_id: str, choices: list[Choice], chat: bool) -> dict:
        ids = (lambda c: list(c.token_ids)) if body.return_token_ids else (lambda c: None)
        common = {"id": request_id, "created": int(time.time()), "model": self.model_name,
                  "usage": self._usage(body, choices)}
        if chat:
            response = ChatCompletionResponse(**common, choices=[
                ChatChoice(index=c.index, message=AssistantMessage(content=c.text), finish_reason=c.finish_reason,
                           token_ids=ids(c), logprobs=self._logprobs(c, chat)) for c in choices])
        else:
            response = CompletionResponse(**common, choices=[
                CompletionChoice(index=c.index, text=c.text, finish_reason=c.finish_reason, token_ids=ids(c),
                                 logprobs=self._logprobs(c, chat)) for c in choices])
        return response.model_dump(mode="json")

    def _token(self, token_id: int) -> tuple[str, list[int]]:
        """A token as logprobs report it: its text and its own bytes. A token whose bytes are not UTF-8 on their
        own (a byte-level piece of a character) reads ``bytes:\\xNN...`` (vLLM's form): distinct tokens keep
        distinct texts, and a client rebuilds the character from the bytes."""
        if self.tokenizer is None:
            text = f"token_id:{token_id}"
            return text, list(text.encode())
        raw = self.tokenizer.token_bytes(token_id)
        try:
            return raw.decode(), list(raw)
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)

    def _text_offset(self, c: Choice, token_id: int) -> int:
        """Where the token begins in the choice's text: a piece of a character begins where the character does."""
        offset = min(c.text_offset, len(c.text))
        if self.tokenizer is not None:       # (without one there is no text)
            skip = c.params.skip_special_tokens
            c.text_offset += len(c.utf8.decode(self.tokenizer.token_bytes(token_id, skip_special_tokens=skip)))
        return offset

    def _logprobs(self, c: Choice, chat: bool) -> CompletionLogprobs | ChatLogprobs | None:
        """The logprobs of the choice's tokens not reported yet, in the endpoint's shape (None: not asked for)."""
        if c.params.logprobs is None:
            return None
        entries = c.logprobs[c.logprobs_sent:]
        c.logprobs_sent = len(c.logprobs)
        if chat:
            def top(token_id: int, logprob: float) -> TopLogprob:
                text, raw = self._token(token_id)
                return TopLogprob(token=text, logprob=logprob, bytes=raw)
            content = []
            for e in entries:
                text, raw = self._token(e.token_id)
                content.append(ChatTokenLogprob(token=text, logprob=e.logprob, bytes=raw,
                                                top_logprobs=[top(t, v) for t, v in e.top]))
            return ChatLogprobs(content=content)
        tokens = [self._token(e.token_id)[0] for e in entries]
        offsets = [self._text_offset(c, e.token_id) for e in entries]
        tops = []
        for e in entries:
            alternatives: dict[str, float] = {}
            for t, v in e.top:           # best first: where two tokens share a text, the key keeps the better
                alternatives.setdefault(self._token(t)[0], v)
            tops.append(alternatives)
        return CompletionLogprobs(tokens=tokens, token_logprobs=[e.logprob for e in entries], top_logprobs=tops,
                                  text_offset=offsets)

    def _event(self, body, request_id: str, chat: bool, choices: list, usage: Usage | None = None) -> bytes:
        cls = ChatCompletionChunk if chat else CompletionChunk
        chunk = cls(id=request_id, created=int(time.time()), model=self.model_name, choices=choices, usage=usage)
        # With include_usage every chunk carries "usage" (null until the last); without it, none does.
        exclude = None if body.include_usage else {"usage"}
        return format_sse_event(data_str=chunk.model_dump_json(exclude=exclude))

    @staticmethod
    def _running_usage(body, c: Choice) -> RunningUsage | None:
        """The choice's tokens so far, on each of its chunks when asked (vLLM's ``continuous_usage_stats``)."""
        if not body.continuous_usage:
            return None
        return RunningUsage(prompt_tokens=len(c.prompt_ids), completion_tokens=len(c.token_ids),
                            total_tokens=len(c.prompt_ids) + len(c.token_ids))

    def _choice_event(self, c: Choice, chat: bool, text: str, first: bool, token_ids: bool = False):
        finish = c.finish_reason if c.done else None
        ids = None
        if token_ids:
            ids = c.token_ids[c.ids_sent:]
            c.ids_sent = len(c.token_ids)
        logprobs = self._logprobs(c, chat)
        if chat:
            delta = ChatDelta(role="assistant", content=text) if first else ChatDelta(content=text or None)
            return ChatChunkChoice(index=c.index, delta=delta, finish_reason=finish, token_ids=ids, logprobs=logprobs)
        return CompletionChoice(index=c.index, text=text, finish_reason=finish, token_ids=ids, logprobs=logprobs)

    async def _sse(self, body, request_id: str, choices: list[Choice], firsts: list[dict | None], chat: bool):
        """SSE events from every choice as its chunks arrive; a disconnect cancels and aborts them all."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(c: Choice):
            try:
                while not c.done:
                    chunk = await c.next()
                    await queue.put((c, chunk))
            finally:
                await queue.put((c, StopAsyncIteration))

        tasks = []
        try:
            for c, chunk in zip(choices, firsts):
                yield self._event(body, request_id, chat,
                                  [self._choice_event(c, chat, c.delta(), True, body.return_token_ids)],
                                  self._running_usage(body, c))
            tasks = [asyncio.create_task(pump(c)) for c in choices if not c.done]
            remaining = len(tasks)
            while remaining:
                c, chunk = await queue.get()
                if chunk is StopAsyncIteration:
                    remaining -= 1
                    continue
                if chunk is not None and chunk["type"] == "error":
                    yield format_sse_event(data_str=json.dumps(_from_chunk(chunk, request_id).body()))
                    continue
                text = c.delta()
                if text or c.done or len(c.logprobs) > c.logprobs_sent:
                    yield self._event(body, request_id, chat,
                                      [self._choice_event(c, chat, text, False, body.return_token_ids)],
                                      self._running_usage(body, c))
            if body.include_usage:
                yield self._event(body, request_id, chat, [], self._usage(body, choices))
            yield format_sse_event(data_str="[DONE]")
        finally:
            # Reached on completion and on client disconnect (the response task is cancelled).
            await _cancel_all(tasks)
            await self._finish(choices)
