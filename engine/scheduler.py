"""Continuous batching in one token budget: no prefill phase and no decode phase.

Each request has ``num_computed_tokens`` and a target (all its tokens); a step gives each running
request the tokens it still needs (a prefill chunk, or one token plus the drafts to verify) until the
budget is spent, then admits waiting requests. When pages run out, the newest running request is
preempted by recompute: its pages are freed and it waits again at the front of the queue.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.sequence import Request, RequestStatus
from kv.manager import KVCacheManager


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int           # tokens from the request's history to compute this step
    num_spec_tokens: int = 0      # drafts to propose and verify after them (decode rows only)

    @property
    def is_decode(self) -> bool:
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens \
            and self.num_new_tokens == 1

    @property
    def completes_history(self) -> bool:
        """After this step every history token is computed, so the step samples a new token."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens + s.num_spec_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 num_spec_tokens: int = 0, max_model_len: int | None = None):
        if max_num_seqs < 1 or max_num_batched_tokens < 1 + num_spec_tokens:
            raise ValueError("max_num_seqs must be >= 1 and max_num_batched_tokens must fit one decode row "
                             f"with its drafts ({1 + num_spec_tokens} tokens)")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_spec_tokens = num_spec_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0        # since start (the service's dflash_num_preemptions_total)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, request: Request, free_pages: bool = True) -> None:
        """Take a request out of the queues and return its pages (finish, abort or failure)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if free_pages:
            self.kv.free(request.request_id)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_draft_context = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _num_drafts(self, request: Request, budget: int) -> int:
        """Drafts for a decode row: as many as the budget allows, none past the model's context. None for a
        request's first token, even where the prefix cache left one prompt token to compute: the first token is
        drawn as from a whole prompt, so a seeded request draws alike whatever the cache holds."""
        if request.num_tokens - request.num_computed_tokens != 1 or not request.output_token_ids:
            return 0
        room = budget if self.max_model_len is None else min(budget, self.max_model_len - request.num_tokens)
        return max(0, min(self.num_spec_tokens, room))

    @staticmethod
    def _to_compute(request: Request, computed: int) -> int:
        """The tokens a row of ``request`` computes when ``computed`` are in the cache: all the rest, but a
        recompute after preemption stops short of the last token, which then goes as a decode row with its drafts,
        as it would have without the preemption. So a seeded request draws the same numbers either way, and its
        output does not depend on the load (greedy output never does)."""
        left = request.num_tokens - computed
        return left - 1 if left > 1 and request.output_token_ids else left

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        # In the order they came: a request still computing its prompt (or a recompute) came after every row that
        # decodes, as it takes the whole budget until its last chunk, so it never takes what a decode row's drafts
        # need. A request's drafts a step (and a seeded request's draws) depend on the load only where the decode rows
        # alone exceed the budget.
        for request in list(self.running):
            if budget <= 0:
                break
            if request not in self.running:      # preempted earlier in this loop
                continue
            num_new = min(self._to_compute(request, request.num_computed_tokens), budget)
            while not self.kv.allocate_slots(request.request_id, request.num_computed_tokens + num_new):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                spec = self._num_drafts(request, budget - num_new)
                out.scheduled.append(ScheduledRequest(request, num_new, spec))
                budget -= num_new + spec
        if out.preempted:
            return out       # the pool is full: admit nobody this step
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            prefix = self.kv.probe_prefix(request.history) if request.num_computed_tokens == 0 else None
            cached = prefix.num_tokens if prefix else 0
            num_new = min(self._to_compute(request, cached), budget)
            if not self.kv.allocate_slots(request.request_id, cached + num_new, prefix):
                break
            self.waiting.popleft()
            request.num_computed_tokens = cached
            request.num_draft_context = cached
            request.num_cached_tokens = cached if request.num_preemptions == 0 else request.num_cached_tokens
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            spec = self._num_drafts(request, budget - num_new)
            out.scheduled.append(ScheduledRequest(request, num_new, spec))
            budget -= num_new + spec
        return out
