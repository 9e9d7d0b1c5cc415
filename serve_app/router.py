"""The prefill/decode router: one request's chunk stream, through one aggregated replica or a prefill then a decode.

Serve's handles pick the replicas (power of two choices over queue lengths), the prefill and the decode one at once;
the decode replica's engine process registers the prefill peer named in the ticket on first sight, so any decode
replica can take any prefill's ticket.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import AsyncIterator

from actors.worker import rank_actor
from engine.sequence import SamplingParams

log = logging.getLogger(__name__)


class Router:
    def __init__(self, backends: dict, on_transfer=None):
        self.backends = backends
        self.disaggregated = "prefill" in backends
        # Called with the decode's transfer stats (and ``handoff_s``: from the prefill's result here to the decode
        # side's first output here), or None on failure.
        self.on_transfer = on_transfer
        self._handing: set[asyncio.Task] = set()      # tickets on their way to decode engine processes, and drops
        self._hosts: dict[str, object] = {}           # those processes' actors by name

    async def stream(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
                     ) -> AsyncIterator[dict]:
        """Chunks (``token_chunk``/``error_chunk`` dicts); closing the iterator cancels the replica's work."""
        if not self.disaggregated:
            gen = self.backends["aggregated"].options(stream=True).generate.remote(request_id, prompt_token_ids,
                                                                                  params)
            async for chunk in _cancel_on_exit(gen):
                yield chunk
            return
        # The decode call goes out with the prefill: its replica's engine process reserves the prompt's pages while
        # the prefill runs and stands by; its first chunk names that process, to which the ticket then goes in one
        # actor call, not through Serve's routing after the prefill.
        # Awaiting the prefill can be cancelled by a disconnect: Serve then cancels the prefill call,
        # whose replica aborts the request and frees its pages; closing the decode stream ends the stand-by.
        prefill = self.backends["prefill"].prefill.remote(request_id, prompt_token_ids, params)
        gen = self.backends["decode"].options(stream=True).stand_by.remote(request_id, prompt_token_ids, params)
        ticket, handed, completed = None, False, False
        try:
            result = await prefill
            if "chunk" in result:       # the request ends with its first token (or failed): no decode
                # Stopped before the last chunk goes out: a consumer may stop reading at it.
                self._drop(gen, request_id)
                completed = True
                yield result["chunk"]
                return
            ticket, ticket_at = result["ticket"], time.perf_counter()
            # The first token goes out now, while its KV moves (unless it could still be cut by a stop string or
            # end the request, which only the decode side's output settles).
            early = ticket.first_text is not None
            if early:
                yield ticket.first_chunk()
            first = True
            async for chunk in gen:
                if chunk["type"] == "standby":
                    self._hand(chunk["host"], ticket)
                    handed = True
                    continue
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
                if completed and not handed:        # refused before the ticket went anywhere: nothing READs it
                    ticket.cancel()
                yield chunk
            completed = True
        finally:
            if not completed:
                # Closed early (a disconnect, the prefill's failure), maybe before the decode replica ever ran:
                # stop the decode call, and give the held pages back now rather than at the hold timeout. After a
                # READ has begun that only marks the lease.
                if handed:
                    gen.cancel()
                else:
                    self._drop(gen, request_id)
                if ticket is not None:
                    ticket.cancel()

    def _drop(self, gen, request_id: str) -> None:
        """End the decode stand-by of a request that will not be decoded: read its stream to the ``standby`` chunk,
        tell the process it names to stop standing by (it frees the pages it reserved, and the stream ends), and
        read the stream to its end. Not a cancel of the call: Serve can lose one that comes before the call has
        started on its replica, and the stand-by would hold its pages until its ticket timeout."""
        async def drop() -> None:
            try:
                async for chunk in gen:
                    if chunk["type"] == "standby":
                        await (await self._host(chunk["host"])).drop.remote(request_id)
            except Exception:       # the decode replica or its process is gone, and its reservation with it
                log.debug("ending the stand-by of %s", request_id, exc_info=True)

        self._detach(drop())

    async def _host(self, name: str):
        actor = self._hosts.get(name) or await asyncio.to_thread(rank_actor, name)    # (a first one calls the GCS)
        self._hosts[name] = actor
        return actor

    def _detach(self, coroutine) -> None:
        """Run ``coroutine`` apart from the request's task: a cancelled request (a disconnect) must not cancel it."""
        task = asyncio.get_running_loop().create_task(coroutine, context=contextvars.Context())
        self._handing.add(task)
        task.add_done_callback(self._handing.discard)

    def _hand(self, host: str, ticket) -> None:
        """The ticket to the decode engine's process that stands by for it (``EngineHost.hand``), not awaited: the
        request's next chunk comes on the decode stream. A host that is gone gives nothing back: the pages go back
        to the prefill side here, and the decode stream ends with the host's failure."""
        async def hand() -> None:
            try:
                await (await self._host(host)).hand.remote(ticket.handoff())
            except Exception:
                log.warning("handing %s to %s failed; giving its pages back", ticket.request_id, host, exc_info=True)
                ticket.cancel()

        self._detach(hand())


def _last(chunk: dict) -> bool:
    return chunk["type"] == "error" or chunk.get("finished", False)


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
