"""Per rank: the model shard and its engine, over the pool segments the rank's KV manager created.

A replica drives its ranks: rank 0's worker lives in the replica's own process (its engine thread streams
tokens to the replica's event loop with no hop in between); further ranks of a tensor-parallel group would
be Ray actors placed beside their KV managers. TP=1 today.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence

import torch

from actors.engine_loop import EngineLoop
from actors.memory import map_segment
from engine.llm import EngineConfig
from kv.spec import LayerOwner

HEALTH_PING_TIMEOUT_S = 5.0
KV_MANAGER_NAMESPACE = "dflash"     # KV manager actors are named by their NIXL agent, here


def build_engine(config: EngineConfig, allocate=None):
    from spec_decode import build_engine as build      # the engine with its DFlash drafter, when configured

    return build(config, allocate)


class RankWorker:
    """One rank's engine and the thread that steps it."""

    def __init__(self, config: EngineConfig, kv_manager=None, *, num_threads: int = 1, tp_size: int = 1,
                 tp_rank: int = 0):
        import ray

        if tp_size != 1:
            raise NotImplementedError(f"tensor parallelism {tp_size} is not implemented: the engine runs TP=1")
        torch.set_num_threads(num_threads)
        self.config = config
        allocate = None
        if kv_manager is not None:
            # Every pool buffer is a segment the KV manager created; the engine sees plain tensors over it.
            allocate = lambda n: map_segment(ray.get(kv_manager.create_segment.remote(n)))  # noqa: E731
        self.engine = build_engine(config, allocate)
        self.loop = EngineLoop(self.engine)

    def pool_specs(self) -> tuple[list, int, list[int]]:
        """What the KV manager needs to mirror the pools: layer specs per space, page size, pages per space."""
        pools = self.engine.kv.pools
        return [pool.specs for pool in pools], self.engine.kv.page_size, [pool.num_pages for pool in pools]

    def page_digest(self, tables: list[list[int]], owners: Sequence[str] = ("target", "draft")) -> str:
        """A hash of the bytes of ``tables``' pages, restricted to ``owners``' layers (tests, benchmarks)."""
        digest = hashlib.sha256()
        owner_set = tuple(LayerOwner(o) for o in owners)
        for pool, table in zip(self.engine.kv.pools, tables):
            for group, offset, length in pool.page_regions(table, owner_set):
                flat = pool.groups[group].buffer.view(-1)
                digest.update(flat[offset:offset + length].cpu().numpy().tobytes())
        return digest.hexdigest()

    def shutdown(self) -> None:
        self.loop.shutdown()


class RankGroup:
    """One replica's ranks: per rank a KV manager actor (when pages move between replicas) and a worker.

    The KV managers are placed where the replica runs (its placement-group bundle, else its node): they
    share pool memory with the workers (POSIX shared memory on CPU, CUDA IPC on GPU).
    """

    def __init__(self, role: str, config: EngineConfig, *, transfers: bool, tp_size: int = 1,
                 hold_timeout_s: float = 30.0, num_threads: int = 1, read_delay_s: float = 0.0):
        import ray

        from actors.kv_manager import KVManagerActor

        self.name = f"{role}-{uuid.uuid4().hex[:8]}"
        self.kv_managers = []
        self.rank_infos: list[str] = []
        if transfers:
            gpu = torch.device(config.device).type == "cuda"
            for tp_rank in range(tp_size):
                self.kv_managers.append(ray.remote(KVManagerActor).options(
                    name=self.agent_name(tp_rank), namespace=KV_MANAGER_NAMESPACE, num_cpus=0, num_gpus=0.1 if gpu else 0, scheduling_strategy=_beside_me(), max_restarts=0,
                ).remote(self.agent_name(tp_rank), device=config.device, tp_size=tp_size, tp_rank=tp_rank,
                         hold_timeout_s=hold_timeout_s, num_threads=num_threads, read_delay_s=read_delay_s))
        self.workers = [RankWorker(config, self.kv_managers[0] if transfers else None, num_threads=num_threads,
                                   tp_size=tp_size)]
        if transfers:
            specs, page_size, num_pages = self.workers[0].pool_specs()
            self.rank_infos = ray.get([kvm.attach.remote(specs, page_size, num_pages) for kvm in self.kv_managers])

    def agent_name(self, tp_rank: int) -> str:
        return f"{self.name}-rank{tp_rank}"

    @property
    def worker(self) -> RankWorker:
        return self.workers[0]

    def health_problems(self, timeout_s: float = HEALTH_PING_TIMEOUT_S) -> list[str]:
        """Why a rank cannot serve (empty when every rank can): its engine thread stopped, or its KV manager
        does not answer. Blocks up to ``timeout_s``."""
        import ray

        problems = [f"rank {r}: the engine loop has stopped" for r, w in enumerate(self.workers) if not w.loop.alive]
        pings = [kvm.ping.remote() for kvm in self.kv_managers]
        for rank, ping in enumerate(pings):
            try:
                ray.get(ping, timeout=timeout_s)
            except Exception as e:
                problems.append(f"rank {rank}: its KV manager does not answer ({type(e).__name__})")
        return problems

    def shutdown(self) -> None:
        import ray

        for worker in self.workers:
            worker.shutdown()
        for kvm in self.kv_managers:
            try:
                ray.get(kvm.close.remote(), timeout=10)
            except Exception:       # already dead: nothing to close
                pass
            ray.kill(kvm)


def _beside_me():
    """A scheduling strategy for an actor that must share memory with this process."""
    import ray
    from ray.util import get_current_placement_group
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

    pg = get_current_placement_group()
    if pg is not None:
        return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
