"""Aggregated, prefill and decode replicas: each drives one tensor-parallel group of ranks placed on one node.

A rank is a ``KVManagerActor`` (pool memory, NIXL) and a ``RankWorker`` (model, engine) sharing one
placement-group bundle. Groups are built for any TP size, but the engine runs TP=1, so only 1 is accepted.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.kv_manager import KVManagerActor
from actors.nixl_transfer import TransferError
from actors.worker import PrefillResult, RankWorker
from engine.llm import EngineConfig
from engine.llm_engine import RequestOutput
from engine.sequence import SamplingParams

_names = itertools.count()


@dataclasses.dataclass(frozen=True)
class Ticket:
    """What a decode replica needs to take over a prefilled request (plain data: it crosses replicas)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    first_token: int
    peer_agents: list[str]         # per rank: the prefill rank's NIXL agent
    tables: list[list[int]]        # per space: the prefill pages of the prompt
    prefill_s: float = 0.0


@dataclasses.dataclass
class Rank:
    kv_manager: ray.actor.ActorHandle
    worker: ray.actor.ActorHandle
    rank_info: str                  # RankInfo JSON


class RankGroup:
    """Start one replica's ranks: a placement group (STRICT_PACK: one node), then per rank its two actors."""

    def __init__(self, role: str, config: EngineConfig, *, tp_size: int = 1, cpus_per_actor: float = 0.25,
                 hold_timeout_s: float = 30.0, num_threads: int = 1):
        if tp_size != 1:
            raise NotImplementedError(f"tensor parallelism {tp_size} is not implemented: the engine runs TP=1")
        self.name = f"{role}-{next(_names)}"
        gpu = torch.device(config.device).type == "cuda"
        bundle = {"CPU": 2 * cpus_per_actor, **({"GPU": 1} if gpu else {})}
        self.pg = placement_group([dict(bundle) for _ in range(tp_size)], strategy="STRICT_PACK")
        ray.get(self.pg.ready())
        self.ranks: list[Rank] = []
        for tp_rank in range(tp_size):
            strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=tp_rank)
            # The KV manager allocates on the rank's GPU and shares it by CUDA IPC; both actors see that GPU.
            kvm = ray.remote(KVManagerActor).options(
                num_cpus=cpus_per_actor, num_gpus=0.1 if gpu else 0, scheduling_strategy=strategy).remote(
                f"{self.name}-rank{tp_rank}", device=config.device, tp_size=tp_size, tp_rank=tp_rank,
                hold_timeout_s=hold_timeout_s, num_threads=num_threads)
            worker = ray.remote(RankWorker).options(
                num_cpus=cpus_per_actor, num_gpus=0.9 if gpu else 0, scheduling_strategy=strategy).remote(
                config, kvm, num_threads=num_threads, tp_size=tp_size, tp_rank=tp_rank)
            specs, page_size, num_pages = ray.get(worker.pool_specs.remote())
            info = ray.get(kvm.attach.remote(worker, specs, page_size, num_pages))
            self.ranks.append(Rank(kvm, worker, info))

    @property
    def worker(self):
        return self.ranks[0].worker

    @property
    def kv_manager(self):
        return self.ranks[0].kv_manager

    def pages_in_use(self) -> int:
        return sum(ray.get([r.worker.pages_in_use.remote() for r in self.ranks]))

    def shutdown(self) -> None:
        for rank in self.ranks:
            try:
                ray.get(rank.kv_manager.close.remote(), timeout=10)
            except Exception:
                pass
            ray.kill(rank.worker)
            ray.kill(rank.kv_manager)
        remove_placement_group(self.pg)


class AggregatedReplica:
    """Prefill and decode in one engine: no transfer."""

    def __init__(self, config: EngineConfig, **group_kwargs):
        self.group = RankGroup("agg", config, **group_kwargs)

    def generate(self, requests: Sequence[tuple[str, list[int], SamplingParams]]) -> list[RequestOutput]:
        outputs = {o.request_id: o for o in ray.get(self.group.worker.generate.remote(list(requests)))}
        return [outputs[request_id] for request_id, _, _ in requests]

    def shutdown(self) -> None:
        self.group.shutdown()


class PrefillReplica:
    """Runs prompts to their first token and holds their pages until a decode peer READs them (or the hold expires)."""

    def __init__(self, config: EngineConfig, **group_kwargs):
        self.group = RankGroup("prefill", config, **group_kwargs)

    @property
    def rank_infos(self) -> list[str]:
        return [r.rank_info for r in self.group.ranks]

    def prefill(self, requests: Sequence[tuple[str, list[int], SamplingParams]], hold_timeout_s: float | None = None
                ) -> tuple[list[Ticket], list[RequestOutput]]:
        """Tickets for requests that continue on a decode replica, and outputs of those the first token ended."""
        start = time.perf_counter()
        results: list[PrefillResult] = ray.get(self.group.worker.prefill.remote(list(requests)))
        elapsed = time.perf_counter() - start
        by_id = {request_id: (prompt, params) for request_id, prompt, params in requests}
        ongoing = [r for r in results if not r.finished]
        for r in results:
            if r.finished:
                self.group.worker.release.remote(r.request_id)
        # The hold is in place before any peer hears of the request, so its READ notification finds it.
        ray.get(self.group.kv_manager.hold.remote([r.request_id for r in ongoing], hold_timeout_s))
        agents = [f"{self.group.name}-rank{i}" for i in range(len(self.group.ranks))]
        tickets = [Ticket(r.request_id, by_id[r.request_id][0], by_id[r.request_id][1], r.first_token, agents,
                          r.tables, elapsed) for r in ongoing]
        return tickets, [r.output for r in results if r.finished]

    def shutdown(self) -> None:
        self.group.shutdown()


class DecodeReplica:
    """Takes over prefilled requests: checks the peer, allocates pages, READs them with NIXL, runs DFlash."""

    def __init__(self, config: EngineConfig, *, transfer_draft_kv: bool = True, read_timeout_s: float = 10.0,
                 **group_kwargs):
        self.group = RankGroup("decode", config, **group_kwargs)
        self.transfer_draft_kv = transfer_draft_kv
        self.read_timeout_s = read_timeout_s

    def connect(self, rank_infos: Sequence[str]) -> list[str]:
        """Register a prefill replica's ranks (rank i with rank i); a mismatching peer raises PeerMismatchError."""
        if len(rank_infos) != len(self.group.ranks):
            raise ValueError(f"the prefill replica has {len(rank_infos)} ranks, this decode replica "
                             f"{len(self.group.ranks)}")
        return ray.get([r.kv_manager.register_peer.remote(info) for r, info in zip(self.group.ranks, rank_infos)])

    def receive(self, ticket: Ticket) -> dict:
        """Move one request's KV here and start decoding it; returns transfer stats (raises TransferError)."""
        worker, kvm = self.group.worker, self.group.kv_manager
        tables = ray.get(worker.reserve.remote(ticket.request_id, ticket.prompt_token_ids, ticket.first_token,
                                               ticket.params))
        if tables is None:
            # The prefill hold expires and frees the peer's pages; a serving router would retry later instead.
            raise MemoryError(f"request {ticket.request_id}: no decode pages free now")
        try:
            stats = ray.get(kvm.read.remote(ticket.request_id, ticket.peer_agents[0], ticket.tables, tables,
                                            self.transfer_draft_kv, self.read_timeout_s))
        except Exception as e:
            # The KV manager already told the prefill rank to free its pages; free ours, fail the request.
            ray.get(worker.abort.remote(ticket.request_id))
            if isinstance(e, TransferError):    # Ray re-raises the actor's TransferError as a subclass of it
                raise TransferError(f"request {ticket.request_id} failed: KV transfer from "
                                    f"{ticket.peer_agents[0]}: {e.args[0] if e.args else e}") from None
            raise
        stats["output"] = ray.get(worker.activate.remote(ticket.request_id, self.transfer_draft_kv))
        stats["tables"] = tables
        return stats

    def run(self) -> list[RequestOutput]:
        return ray.get(self.group.worker.run.remote())

    def shutdown(self) -> None:
        self.group.shutdown()
