"""A prefilled request's ticket: what a decode replica needs to take over a request whose prompt a prefill replica
computed and holds (``Ticket``), and the parts of it the engine processes use (``PrefillPages``, ``Handoff``).

The prefill side issues it when the prompt's whole computation and its first token are done (``PrefillOffer.issue``):
in the engine's process when the ticket goes straight to the ingress's sink (``actors.sink``), else in the prefill
replica. Either way the pages are held under one lease per prefill rank, which the side that issued it sends to the
ranks' KV managers right after.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import uuid
from collections.abc import Sequence

from actors.worker import kv_manager
from engine.llm_engine import LLMEngine, RequestOutput
from engine.sequence import SamplingParams, TokenLogprob


def detached(fn, *args):
    """``fn(*args)`` outside the calling Ray task. An async actor finds the task that submits a call through a
    context variable, and cancelling a task cancels what it submitted: a clean-up call made while its request
    is being cancelled (a client went away) would be cancelled with it."""
    return contextvars.Context().run(fn, *args)


@dataclasses.dataclass(frozen=True)
class PrefillPages:
    """A prefilled request's pages on its prefill replica, held under a lease per prefill rank: what a decode
    take-over READs, or gives back (the part of ``actors.replica.Ticket`` the engine's process needs)."""

    request_id: str
    tables: list[list[int]]        # per space: the prefill pages of the prompt (the same ids on every rank)
    leases: list[str]              # per prefill rank: the lease its KV manager holds the pages under
    peer_agents: list[str]         # per prefill rank: its NIXL agent, also its KVManagerActor's name

    async def renew(self) -> list[bool]:
        """``KVManagerActor.renew`` of every prefill rank's lease (False where the lease is gone, or its KV manager)."""
        async def one(agent: str, lease: str) -> bool:
            try:
                return await (await asyncio.to_thread(kv_manager, agent)).renew.remote(lease)
            except Exception:       # that KV manager is gone, and its pages with it
                return False

        return list(await asyncio.gather(*(one(a, lease) for a, lease in zip(self.peer_agents, self.leases))))

    def cancel(self, ranks: Sequence[int] | None = None) -> None:
        """Give the held pages back now (the request will not be decoded), on every prefill rank or on ``ranks``.
        Safe to call from a request that is being cancelled."""
        for rank, (agent, lease) in enumerate(zip(self.peer_agents, self.leases)):
            if ranks is not None and rank not in ranks:
                continue
            try:
                detached(kv_manager(agent).cancel.remote, lease)
            except ValueError:      # that KV manager is gone, and its pages with it
                pass


@dataclasses.dataclass(frozen=True)
class Handoff:
    """What a prefill's ticket brings to a decode take-over standing by for it (``EngineHost.hand``): the pages to
    READ, the first token, and the prefill ranks' descriptions (to register them the first time)."""

    pages: PrefillPages
    first_token: int
    first_logprob: TokenLogprob | None
    rank_infos: list[str]
    sampler_state: bytes | None = None     # a seeded request's generator after the prefill's draw


@dataclasses.dataclass(frozen=True)
class Ticket:
    """What a decode replica needs to take over a prefilled request (plain data and actor handles)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    first_token: int
    tables: list[list[int]]        # per space: the prefill pages of the prompt (the same ids on every rank)
    leases: list[str]              # per prefill rank: the lease its KV manager holds the pages under
    peer_agents: list[str]         # per prefill rank: its NIXL agent, also its KVManagerActor's name
    rank_infos: list[str]          # per prefill rank: its RankInfo JSON
    first_text: str | None = None  # the first token's text as the decode side will emit it (None: not sent early)
    num_cached_tokens: int = 0     # prompt tokens the prefill took from its prefix cache
    prefill_s: float = 0.0
    first_logprob: TokenLogprob | None = None    # the first token's entry, when params.logprobs is set
    timing: dict | None = None     # the prefill engine's RequestTiming (its queue and prefill times)
    hold_s: float = 30.0           # how long the prefill ranks hold the pages unread (``renew`` restarts it)
    sampler_state: bytes | None = None     # a seeded request's generator after the prefill's draw

    def first_chunk(self) -> dict:
        """The first token as a chunk, sent while the KV moves (only when ``first_text`` is not None)."""
        chunk = {"type": "tokens", "token_ids": [self.first_token], "text": self.first_text, "finished": False,
                 "finish_reason": None, "num_cached_tokens": self.num_cached_tokens}
        if self.first_logprob is not None:
            chunk["logprobs"] = [self.first_logprob]
        return chunk

    def with_prefill_timing(self, chunk: dict) -> dict:
        """The decode side's finishing chunk with the request's queue and prefill times from the prefill engine
        (the decode engine's own queue is the wait for pages and their READ, which the transfer stats report)."""
        if chunk.get("timing") is None or self.timing is None:
            return chunk
        return {**chunk, "timing": {**chunk["timing"], "queue_s": self.timing["queue_s"],
                                    "prefill_s": self.timing["prefill_s"]}}

    def after_first(self, chunk: dict) -> dict:
        """The decode side's first chunk without the first token already sent by ``first_chunk``."""
        if chunk["token_ids"][:1] != [self.first_token] or not chunk["text"].startswith(self.first_text):
            raise RuntimeError(f"request {self.request_id}: the decode side's first output "
                               f"({chunk['token_ids'][:1]}, {chunk['text'][:16]!r}) differs from the prefill's "
                               f"({self.first_token}, {self.first_text!r})")
        rest = {**chunk, "token_ids": chunk["token_ids"][1:], "text": chunk["text"][len(self.first_text):],
                "num_cached_tokens": self.num_cached_tokens}
        if "logprobs" in chunk:
            rest["logprobs"] = chunk["logprobs"][1:]
        return rest

    def pages(self) -> PrefillPages:
        """What the decode side's engine process needs to READ the prompt's pages or give them back."""
        return PrefillPages(self.request_id, self.tables, self.leases, self.peer_agents)

    def handoff(self) -> Handoff:
        """What a decode take-over standing by for this request needs from its ticket."""
        return Handoff(self.pages(), self.first_token, self.first_logprob, list(self.rank_infos), self.sampler_state)

    def cancel(self) -> None:
        """Give the held pages back now (the request will not be decoded). Safe to call from a request that
        is being cancelled."""
        self.pages().cancel()

    async def keep_held(self) -> None:
        """While the request waits for its READ (its decode call queued behind others, or its decode replica waiting
        for pages), restart its holds' timers every third of their timeout, so that a request that is alive is not
        failed by its hold expiring; the caller cancels this once the decode side's first chunk has come (the READ
        has ended) or the request has ended. Returns when a hold is gone (its READ will fail and say so)."""
        while True:
            await asyncio.sleep(self.hold_s / 3)
            if not all(await self.pages().renew()):
                return


def handover(request_id: str, prompt_token_ids: list[int], params: SamplingParams, num_pages: int,
              e: LLMEngine, out: RequestOutput):
    """On the prefill engine's thread as the finished output is handed over: what a ticket needs from the engine
    (the pages' tables, the first token's text, a seeded request's sampler state), or None when the request ends
    here."""
    # Only the max_tokens=1 of this side stops a request that goes on to decode.
    if out.finish_reason != "length" or params.max_tokens == 1:
        return None
    try:
        e.sync_ranks()      # ranks > 0 have written their draft layers too before anyone READs them
        return ([e.kv.block_table(request_id, s)[:num_pages] for s in range(len(e.kv.pools))],
                e.first_text_delta(prompt_token_ids, params, out.token_ids[0]), e.sampler_state(request_id))
    except Exception:
        e.release(request_id)        # its stream gets the error: nothing is held for it
        raise




@dataclasses.dataclass(frozen=True)
class PrefillOffer:
    """What a prefill replica's ticket says about the replica itself: its ranks' NIXL agents (also their KV managers'
    names) and ``RankInfo`` JSON, and how long its ranks hold a ticket's pages unread."""

    peer_agents: list[str]
    rank_infos: list[str]
    hold_s: float

    def issue(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, chunk: dict,
              handed: tuple[list[list[int]], str | None, bytes | None], prefill_s: float) -> Ticket:
        """The ticket of a prefill whose finishing output is ``chunk`` (its first token) and whose ``_handover``
        gave ``handed``, under fresh leases (one per rank; the issuer sends the holds)."""
        tables, first_text, sampler_state = handed
        leases = [f"{request_id}#{uuid.uuid4().hex[:8]}" for _ in self.peer_agents]
        return Ticket(request_id, list(prompt_token_ids), params, chunk["token_ids"][0], tables, leases,
                      list(self.peer_agents), list(self.rank_infos), first_text, chunk["num_cached_tokens"],
                      prefill_s, chunk["logprobs"][0] if chunk.get("logprobs") else None, chunk.get("timing"),
                      self.hold_s, sampler_state)


def send_holds(links: Sequence, ticket: Ticket) -> None:
    """Each prefill rank's KV manager holds the ticket's pages under its lease (``links``: ``ActorLink`` per rank;
    not awaited: a READ that overtakes its hold waits for it, or a cancel frees the pages when the hold arrives)."""
    for link, lease in zip(links, ticket.leases):
        link.send("hold", ticket.request_id, lease, ticket.hold_s)
        link.warm()
