"""The prefill/decode router: one request's chunk stream, through one aggregated replica or a prefill then a decode.

Serve's handles pick the replicas (power of two choices over queue lengths); the decode replica registers
the prefill peer named in the ticket on first sight, so any decode replica can take any prefill's ticket.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from engine.sequence import SamplingParams


class Router:
    def __init__(self, backends: dict, on_transfer=None):
        self.backends = backends
        self.disaggregated = "prefill" in backends
        # Called with the decode's transfer stats (and ``handoff_s``: from the prefill's result here to the decode
        # side's first output here), or None on failure.
        self.on_transfer = on_transfer

    async def stream(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
                     ) -> AsyncIterator[dict]:
        """Chunks (``token_chunk``/``error_chunk`` dicts); closing the iterator cancels the replica's work."""
        if not self.disaggregated:
            gen = self.backends["aggregated"].options(stream=True).generate.remote(request_id, prompt_token_ids,
                                                                                  params)
            async for chunk in _cancel_on_exit(gen):
                yield chunk
            return
        # Awaiting the prefill can be cancelled by a disconnect: Serve then cancels the prefill call,
        # whose replica aborts the request and frees its pages.
        result = await self.backends["prefill"].prefill.remote(request_id, prompt_token_ids, params)
        if "chunk" in result:
            yield result["chunk"]
            return
        ticket, ticket_at = result["ticket"], time.perf_counter()
        # The decode call is routed while the first token goes out, and the first token goes out now, while its KV
        # moves (unless it could still be cut by a stop string or end the request, which only the decode side's
        # output settles).
        early = ticket.first_text is not None
        completed = False
        gen = self.backends["decode"].options(stream=True).decode.remote(ticket)
        try:
            if early:
                yield ticket.first_chunk()
            first = True
            async for chunk in _cancel_on_exit(gen):
                if first and self.on_transfer is not None:
                    if chunk["type"] == "tokens" and chunk.get("transfer") is not None:
                        self.on_transfer({**chunk["transfer"], "handoff_s": time.perf_counter() - ticket_at})
                    elif chunk.get("error_type") == "transfer_error":
                        self.on_transfer(None)
                if first and early and chunk["type"] == "tokens":
                    chunk = ticket.after_first(chunk)
                if chunk["type"] == "tokens" and chunk["finished"]:
                    chunk = ticket.with_prefill_timing(chunk)
                first = False
                # The last chunk ends the request: a consumer that stops reading after it (and leaves this
                # generator to be closed when collected) cancels nothing.
                completed = _last(chunk)
                yield chunk
            completed = True
        finally:
            if not completed:
                # Closed early (a disconnect), maybe before the decode replica ever ran: stop the decode call and
                # give the held pages back now rather than at the hold timeout. After a READ has begun this only
                # marks the lease.
                gen.cancel()
                ticket.cancel()


def _last(chunk: dict) -> bool:
    return chunk["type"] == "error" or chunk["finished"]


async def _cancel_on_exit(gen) -> AsyncIterator[dict]:
    """``gen``'s chunks; closed before its last chunk (a disconnect), it cancels the replica's call."""
    finished = False
    try:
        async for chunk in gen:
            finished = _last(chunk)
            yield chunk
        finished = True
    finally:
        if not finished:
            gen.cancel()
