"""The OpenAI-compatible HTTP ingress (FastAPI on Ray Serve): validation, tokenization, SSE, errors, /metrics.

A request's path: pydantic checks the body (422), the ingress checks values, model and context (400/404),
tokenizes, and asks the ``Router`` for each choice's chunk stream; replicas report errors as chunks, which
become HTTP errors before the first byte is sent, or a final SSE error event after.
"""


import asyncio
import dataclasses
import json
import time
import uuid
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve

from engine.sequence import SamplingParams
from serve_app.config import ServiceConfig
from serve_app.metrics import ServiceMetrics, get_hub
from serve_app.protocol import (APIError, AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                ChatCompletionRequest, ChatCompletionResponse, ChatDelta, CompletionChoice,
                                CompletionChunk, CompletionRequest, CompletionResponse, PromptTokensDetails,
                                SpecDecodeUsage, Usage, render_chat, sampling_params)
from serve_app.router import Router

api = FastAPI(title="dflash-serve")
READY_TTL_S = 1.0


@api.exception_handler(APIError)
async def _api_error(_: Request, e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


@api.exception_handler(RequestValidationError)
async def _schema_error(_: Request, e: RequestValidationError) -> JSONResponse:
    first = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
    param = ".".join(str(p) for p in first["loc"] if p != "body") or None
    message = "; ".join(f"{'.'.join(str(p) for p in err['loc'] if p != 'body')}: {err['msg']}" for err in e.errors())
    return JSONResponse(APIError(422, message, "invalid_request_error", param, "schema_violation").body(),
                        status_code=422)


def _from_chunk(chunk: dict) -> APIError:
    return APIError(chunk["status"], chunk["message"], chunk.get("error_type", "server_error"))


def _from_exception(e: BaseException) -> APIError:
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    if isinstance(e, BackPressureError):
        return APIError(503, f"overloaded: {e}", "overloaded", code="overloaded")
    if isinstance(e, DeploymentUnavailableError) or type(e).__name__ in ("RayActorError", "ActorDiedError"):
        return APIError(503, f"no replica is available: {e}", "unavailable", code="unavailable")
    return APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error")


class Choice:
    """One choice's stream: chunks from the router, text deltas, and the timings the metrics need."""

    def __init__(self, index: int, request_id: str, prompt_ids: list[int], params: SamplingParams, router: Router):
        self.index, self.request_id, self.prompt_ids, self.params = index, request_id, prompt_ids, params
        self.gen = router.stream(request_id, prompt_ids, params)
        self.start = time.perf_counter()
        self.ttft: float | None = None
        self.last_token_time: float | None = None
        self.token_gaps: list[float] = []   # seconds between chunks that carried tokens (inter-token latency)
        self.text = ""                  # the text so far: the replicas send only final text (stop strings cut)
        self.sent = 0                   # characters of it already sent
        self.token_ids: list[int] = []
        self.ids_sent = 0               # token ids already sent (streams with return_token_ids)
        self.finish_reason: str | None = None
        self.spec: dict | None = None
        self.num_cached_tokens = 0
        self.done = False

    async def next(self) -> dict | None:
        """The next chunk, or None at the end; exceptions from Serve become error chunks."""
        try:
            chunk = await self.gen.__anext__()
        except StopAsyncIteration:
            self.done = True
            return None
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.done = True
            err = _from_exception(e)
            return {"type": "error", "status": err.status, "message": err.message, "error_type": err.type}
        if chunk["type"] == "error":
            self.done = True
            return chunk
        now = time.perf_counter()
        if chunk["token_ids"]:
            if self.ttft is None:
                self.ttft = now - self.start
            else:
                self.token_gaps.append(now - self.last_token_time)
            self.last_token_time = now
        self.token_ids += chunk["token_ids"]
        self.text += chunk["text"]
        # The prefill side's count (the decode side's request reuses nothing: its KV arrived by READ).
        self.num_cached_tokens = max(self.num_cached_tokens, chunk.get("num_cached_tokens", 0))
        if chunk["finished"]:
            self.done = True
            self.finish_reason = chunk["finish_reason"]
            self.spec = chunk.get("spec")
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
    def __init__(self, service: dict, app_name: str, **backends):
        self.service = ServiceConfig.model_validate(service)
        self.app_name = app_name
        self.model_name = self.service.model.name
        self.metrics = ServiceMetrics(self.model_name)
        self.router = Router(backends, on_transfer=lambda stats: self.metrics.observe_transfer(stats, stats is None))
        self.hub = get_hub(app_name)
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
        self.inflight = 0
        self._ready_at = -1e9
        self._ready = False
        self._created = int(time.time())

    # --- admission --------------------------------------------------------------------------------
    async def _snapshots(self) -> dict[str, dict]:
        snaps = await self.hub.snapshots.remote()
        self._ready = all(any(s["role"] == role for s in snaps.values()) for role in self.roles)
        self._ready_at = time.monotonic()
        return snaps

    async def _check_ready(self) -> None:
        if time.monotonic() - self._ready_at > READY_TTL_S:
            await self._snapshots()
        if not self._ready:
            raise APIError(503, f"no replica is ready (waiting for: {', '.join(self.roles)})", "unavailable",
                           code="unavailable")

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           "invalid_request_error", "model", "model_not_found")

    def _encode(self, prompt, param: str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError(400, "this model has no tokenizer; send token ids", param=param)
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise APIError(400, f"token ids must be in [0, {self.vocab_size})", param=param)
        if not ids:
            raise APIError(400, "the prompt is empty", param=param)
        return ids

    def _check_context(self, ids: list[int], params: SamplingParams, param: str) -> None:
        if len(ids) + params.max_tokens > self.max_model_len:
            raise APIError(400, f"this model's maximum context length is {self.max_model_len} tokens; the request "
                           f"has {len(ids)} prompt tokens and max_tokens {params.max_tokens}", param=param,
                           code="context_length_exceeded")

    # --- endpoints ----------------------------------------------------------------------------------
    @api.get("/health")
    async def health(self):
        await self._snapshots()
        if not self._ready:
            raise APIError(503, f"replicas are starting (waiting for: {', '.join(self.roles)})", "unavailable",
                           code="unavailable")
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self):
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self._created,
                                            "owned_by": "dflash-serve", "max_model_len": self.max_model_len}]}

    @api.get("/metrics")
    async def prometheus(self):
        self.metrics.load_snapshots(await self._snapshots())
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        self._check_model(body.model)
        params = sampling_params(body, default_max_tokens=16)
        prompt = body.prompt
        batch = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
        prompts = [self._encode(p, "prompt") for p in batch]
        for ids in prompts:
            self._check_context(ids, params, "prompt")
        return await self._serve(body, prompts, params, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest):
        self._check_model(body.model)
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer; chat needs one", param="messages")
        special = {k: self.tokenizer.config.get(k) or "" for k in ("bos_token", "eos_token")}
        special = {k: v.get("content", "") if isinstance(v, dict) else v for k, v in special.items()}
        text = render_chat(body.messages, self.tokenizer.chat_template, special)
        ids = self._encode(text, "messages")
        explicit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = sampling_params(body, default_max_tokens=max(1, self.max_model_len - len(ids)))
        self._check_context(ids, params, "messages" if explicit is None else "max_tokens")
        return await self._serve(body, [ids], params, chat=True)

    # --- responses ----------------------------------------------------------------------------------
    async def _serve(self, body, prompts: list[list[int]], params: SamplingParams, chat: bool):
        await self._check_ready()
        if self.inflight >= self.service.max_concurrent_requests:
            raise APIError(503, f"overloaded: {self.inflight} requests in flight (limit "
                           f"{self.service.max_concurrent_requests})", "overloaded", code="overloaded")
        self.inflight += 1
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
        choices = []
        for p, ids in enumerate(prompts):
            for j in range(body.n):
                # Distinct seeds per choice, so n > 1 with a seed gives n different (reproducible) samples.
                choice_params = params if params.seed is None or j == 0 else \
                    dataclasses.replace(params, seed=params.seed + j)
                index = p * body.n + j
                choices.append(Choice(index, f"{request_id}-{index}", ids, choice_params, self.router))
        handed_off = False
        try:
            firsts = await asyncio.gather(*(c.next() for c in choices))
            for chunk in firsts:
                if chunk is not None and chunk["type"] == "error":
                    raise _from_chunk(chunk)
            if body.stream:
                handed_off = True
                return EventSourceResponse(self._sse(body, request_id, choices, firsts, chat))
            await asyncio.gather(*(self._drain(c) for c in choices))
            return self._full_response(body, request_id, choices, chat)
        finally:
            if not handed_off:
                await self._finish(choices)

    async def _drain(self, choice: Choice) -> None:
        while not choice.done:
            chunk = await choice.next()
            if chunk is not None and chunk["type"] == "error":
                raise _from_chunk(chunk)

    async def _finish(self, choices: list[Choice]) -> None:
        self.inflight -= 1
        for c in choices:
            await c.close()
            self.metrics.observe_finished(num_prompt_tokens=len(c.prompt_ids), num_generated=len(c.token_ids),
                                          finish_reason=c.finish_reason or "abort", ttft=c.ttft,
                                          e2e=time.perf_counter() - c.start, spec=c.spec,
                                          token_gaps=c.token_gaps)

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
                           token_ids=ids(c)) for c in choices])
        else:
            response = CompletionResponse(**common, choices=[
                CompletionChoice(index=c.index, text=c.text, finish_reason=c.finish_reason, token_ids=ids(c))
                for c in choices])
        return response.model_dump(mode="json")

    def _event(self, body, request_id: str, chat: bool, choices: list, usage: Usage | None = None) -> bytes:
        cls = ChatCompletionChunk if chat else CompletionChunk
        chunk = cls(id=request_id, created=int(time.time()), model=self.model_name, choices=choices, usage=usage)
        # With include_usage every chunk carries "usage" (null until the last); without it, none does.
        exclude = None if body.include_usage else {"usage"}
        return format_sse_event(data_str=chunk.model_dump_json(exclude=exclude))

    def _choice_event(self, c: Choice, chat: bool, text: str, first: bool, token_ids: bool = False):
        finish = c.finish_reason if c.done else None
        ids = None
        if token_ids:
            ids = c.token_ids[c.ids_sent:]
            c.ids_sent = len(c.token_ids)
        if chat:
            delta = ChatDelta(role="assistant", content=text) if first else ChatDelta(content=text or None)
            return ChatChunkChoice(index=c.index, delta=delta, finish_reason=finish, token_ids=ids)
        return CompletionChoice(index=c.index, text=text, finish_reason=finish, token_ids=ids)

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
                                  [self._choice_event(c, chat, c.delta(), True, body.return_token_ids)])
            tasks = [asyncio.create_task(pump(c)) for c in choices if not c.done]
            remaining = len(tasks)
            while remaining:
                c, chunk = await queue.get()
                if chunk is StopAsyncIteration:
                    remaining -= 1
                    continue
                if chunk is not None and chunk["type"] == "error":
                    yield format_sse_event(data_str=json.dumps(_from_chunk(chunk).body()))
                    continue
                text = c.delta()
                if text or c.done:
                    yield self._event(body, request_id, chat,
                                      [self._choice_event(c, chat, text, False, body.return_token_ids)])
            if body.include_usage:
                yield self._event(body, request_id, chat, [], self._usage(body, choices))
            yield format_sse_event(data_str="[DONE]")
        finally:
            # Reached on completion and on client disconnect (the response task is cancelled).
            for t in tasks:
                t.cancel()
            for t in tasks:
                try:
                    await t
                except BaseException:
                    pass
            await self._finish(choices)
