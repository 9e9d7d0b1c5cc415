"""What crosses from an engine to its consumers: chunks, plain dicts that cross Ray and Serve.

``token_chunk``: a request's new token ids and the text that became final (the last one with the finish reason,
speculative statistics and timing); ``error_chunk``: status, message, type. The engine host sends a step's
outputs as chunks (never whole token lists or texts); replicas merge what piled up and stream it on.
"""

from __future__ import annotations

import dataclasses

from actors.engine_loop import EngineStopped
from actors.nixl_transfer import TransferError
from engine.llm_engine import RequestOutput


def token_chunk(out: RequestOutput, **extra) -> dict:
    chunk = {"type": "tokens", "token_ids": list(out.new_token_ids), "text": out.text_delta,
             "finished": out.finished, "finish_reason": out.finish_reason,
             "num_cached_tokens": out.num_cached_tokens, **extra}
    if out.new_logprobs is not None:
        chunk["logprobs"] = list(out.new_logprobs)       # TokenLogprob per token of token_ids
    if out.finished:
        chunk["spec"] = dataclasses.asdict(out.spec)
        if out.timing is not None:
            chunk["timing"] = dataclasses.asdict(out.timing)
    return chunk


def error_chunk(status: int, message: str, error_type: str = "server_error") -> dict:
    return {"type": "error", "status": status, "message": message, "error_type": error_type}


class RequestRefused(Exception):
    """The engine would not add a request (bad input it found: too long for the context, ...): a 400."""


def error_from(e: BaseException) -> dict:
    """The error chunk a client sees for an engine-side failure."""
    if isinstance(e, RequestRefused):
        return error_chunk(400, str(e), "invalid_request_error")
    if isinstance(e, EngineStopped):
        return error_chunk(503, str(e), "unavailable")
    if isinstance(e, TransferError):
        return error_chunk(500, str(e), "transfer_error")
    return error_chunk(500, f"engine step failed: {type(e).__name__}: {e}")


def merge_chunks(first: dict, later: dict) -> dict:
    """Two consecutive token chunks of one request as one (the later one's state wins)."""
    merged = {**first, **later}
    merged["token_ids"] = first["token_ids"] + later["token_ids"]
    merged["text"] = first["text"] + later["text"]
    if "logprobs" in first or "logprobs" in later:
        merged["logprobs"] = first.get("logprobs", []) + later.get("logprobs", [])
    return merged


def ended_chunk() -> dict:
    """The replica's last item of a request whose chunks went straight to its caller's sink (``actors.sink``)."""
    return {"type": "ended"}


def ends(item) -> bool:
    """Whether ``item`` (a chunk, a finishing pair, an exception) is the last a request's stream receives."""
    return not isinstance(item, dict) or item["type"] != "tokens" or item["finished"]


class Batcher:
    """A request's chunks on their way to its consumer: what piled up goes as one chunk (token chunks merge, an error
    chunk takes the place of what was not sent), and after the first tokens one goes every ``interval`` steps (the
    last at once)."""

    def __init__(self, interval: int = 1):
        self.interval = interval
        self.pending: dict | None = None
        self.steps = 0
        self.first = True       # until tokens went out
        self.finished = False

    def add(self, item: dict) -> bool:
        """The request's next chunk; True if it ends the request."""
        if item["type"] == "error":
            self.pending = item
            self.finished = True
        else:
            self.pending = item if self.pending is None else merge_chunks(self.pending, item)
            self.finished = item["finished"]
        self.steps += 1
        return self.finished

    def take(self) -> dict | None:
        """The chunk to send now, if one is due."""
        chunk = self.pending
        if chunk is None or not (self.first or self.finished or self.steps >= self.interval):
            return None
        self.first = self.first and not (chunk["type"] == "tokens" and chunk["token_ids"])
        self.pending, self.steps = None, 0
        return chunk
