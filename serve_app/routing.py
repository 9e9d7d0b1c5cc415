"""Prefix-affine routing of prefill requests: prompts that begin alike go to the same prefill replica.

A prefill replica's prefix cache only helps the requests routed to it. Serve's default router (two random choices,
the shorter queue) sends the turns of one conversation, or the requests of one system prompt, to any replica; with
N prefill replicas a repeated prompt finds its pages about once in N. This router ranks the replicas for a prompt
by rendezvous hashing of its first ``PREFIX_TOKENS`` tokens (stable as replicas come and go: a replica's arrival
or departure moves only the prompts it wins or held), and tries them in that order: the first that accepts takes
the request. A preferred replica whose queue is ``SLACK`` requests longer than the shortest known queue is passed
over for the least loaded one, so one hot prefix (a system prompt every request shares) spreads out instead of
queueing on one replica while the others idle.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

PREFIX_TOKENS = 128     # the prompt tokens that decide the replica: the start a conversation's turns share
SLACK = 4               # a preferred replica this many requests busier than the least busy one is passed over


def prompt_key(pending_request: PendingRequest | None) -> bytes | None:
    """The routing key of a prefill call (``prefill(request_id, prompt_token_ids, params)``), or None for any other
    call (routed by two random choices)."""
    if pending_request is None or len(pending_request.args) < 2:
        return None
    ids = pending_request.args[1]
    if not isinstance(ids, list) or not ids or not isinstance(ids[0], int):
        return None
    return hashlib.blake2b(repr(ids[:PREFIX_TOKENS]).encode(), digest_size=16).digest()


def rank(key: bytes, replica_ids: Sequence[str]) -> list[int]:
    """Indices of ``replica_ids`` by rendezvous weight for ``key``, highest first."""
    weights = [hashlib.blake2b(key + rid.encode(), digest_size=8).digest() for rid in replica_ids]
    return sorted(range(len(replica_ids)), key=lambda i: weights[i], reverse=True)


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = prompt_key(pending_request)
        if key is None or len(candidate_replicas) < 2:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        ranked = [candidate_replicas[i] for i in rank(key, [r.replica_id.unique_id for r in candidate_replicas])]
        # Queue lengths this router last saw (None: not probed lately, counted as idle).
        loads = [self.replica_queue_len_cache.get(r.replica_id) or 0 for r in ranked]
        least = min(range(len(ranked)), key=loads.__getitem__)
        if loads[0] > loads[least] + SLACK:
            ranked.insert(0, ranked.pop(least))
        return [[r] for r in ranked]
