"""Per rank: the model shard and its engine, over the pool segments the rank's KV manager created.

A replica drives its ranks, each a Ray actor on the replica's node (its placement group): rank 0 is an
``actors.engine_host.EngineHost``, which owns the scheduler, steps the engine in a thread of its own and streams
each step's outputs to the replica's process in one message; ranks > 0 of a tensor-parallel group run, in a thread
of their own, each forward rank 0 broadcasts over the group's process group (``engine.parallel``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc

import hashlib
import socket
import threading
import uuid
from collections.abc import Sequence

import torch

from actors.cpus import claim_engine_cpu
from actors.engine_loop import EngineLoop
from actors.logs import configure_actor_logging
from actors.memory import map_segment
from engine.checkpoint import Qwen3Config, read_config
from engine.llm import EngineConfig
from engine.parallel import TensorParallel, check_tp_size
from kv.spec import LayerOwner

HEALTH_PING_TIMEOUT_S = 5.0
KV_MANAGER_NAMESPACE = "dflash"     # KV manager actors are named by their NIXL agent, here
# On a GPU a rank's KV manager takes this share of the rank's GPU (it only holds the pool, allocated once): Ray then
# shows it the same device as its worker, which maps the pool through CUDA IPC. The worker takes the rest.
KV_MANAGER_GPU_SHARE = 0.1


_rank_actors: dict[str, object] = {}


def rank_actor(name: str):
    """The rank's actor named ``name`` in this project's namespace: a KVManagerActor (named by its NIXL agent) or a
    replica's ``EngineHost`` (``RankGroup.host_name``), looked up once per process (tickets and streams carry
    names, not handles, because a handle in a reply costs a registration with its owner)."""
    import ray

    if name not in _rank_actors:
        _rank_actors[name] = ray.get_actor(name, namespace=KV_MANAGER_NAMESPACE)
    return _rank_actors[name]


kv_manager = rank_actor       # by its NIXL agent's name


def build_engine(config: EngineConfig, allocate=None, tp: TensorParallel | None = None):
    from spec_decode import build_engine as build      # the engine with its DFlash drafter, when configured

    return build(config, allocate, tp)


def check_tensor_parallel(config: EngineConfig, tp_size: int) -> None:
    """Refuse, before any rank starts, a TP size that does not split the target's (or drafter's) heads."""
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp_size}")
    if tp_size == 1:
        return
    c = Qwen3Config.from_dict(read_config(config.model), f"{config.model}/config.json")
    check_tp_size(tp_size, heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
                  intermediate=c.intermediate_size, who=f"the target model {config.model}")
    if config.draft is not None:
        d = read_config(config.draft)
        heads = d.get("num_attention_heads", 0)
        check_tp_size(tp_size, heads=heads, kv_heads=d.get("num_key_value_heads", heads),
                      intermediate=d.get("intermediate_size", 0), who=f"the DFlash drafter {config.draft}")


def freeze_heap() -> None:
    """Move everything alive now (the model, its graphs, the imported libraries) out of the garbage collector's
    reach: a full collection in a serving process walks a quarter of a million such objects (70 ms measured on this
    project's CPU box, with the engine thread stopped for it), and they live until the process ends."""
    gc.collect()
    gc.freeze()


class Lifeline:
    """Mixed into an async actor that shares its owner's fate (Ray ends the actors a process owns when it dies): a
    call to ``lifeline`` never returns, so its caller's pending call fails the moment this actor ends. The metrics
    hub holds one per replica, on the replica's rank-0 engine process (``serve_app.metrics.MetricsHub.watch``)."""

    async def lifeline(self) -> None:
        await asyncio.Event().wait()


class RankWorker:
    """One rank's engine: rank 0 steps it in an engine loop thread; a rank > 0 follows rank 0's forwards."""

    def __init__(self, config: EngineConfig, kv_manager=None, *, num_threads: int = 1, tp_size: int = 1,
                 tp_rank: int = 0, tp_address: tuple[str, int] | None = None):
        configure_actor_logging()      # also rank 0's engine process (``EngineHost``)
        claim_engine_cpu()             # a core of its own, if the service names engine cores (``actors.cpus``)
        torch.set_num_threads(num_threads)
        self.config = config
        self.tp_rank = tp_rank
        allocate = None
        if kv_manager is not None:
            # Every pool buffer is a segment the KV manager created; the engine sees plain tensors over it. (Waited
            # for through a future: rank 0 is built in an async actor, where ray.get warns of blocking its loop.)
            allocate = lambda n: map_segment(kv_manager.create_segment.remote(n).future().result())  # noqa: E731
        tp = TensorParallel.connect(tp_rank, tp_size, *tp_address, device=config.device) if tp_size > 1 else None
        self.engine = build_engine(config, allocate, tp)
        freeze_heap()
        self.loop: EngineLoop | None = None
        self._follower: threading.Thread | None = None
        self.follow_error: BaseException | None = None
        if tp_rank == 0:
            self.loop = EngineLoop(self.engine)
        else:
            self._follower = threading.Thread(target=self._follow, name=f"rank{tp_rank}-follow", daemon=True)
            self._follower.start()

    def _follow(self) -> None:
        try:
            self.engine.follow()
        except BaseException as e:      # reported by the health check: rank 0 cannot step without this rank
            self.follow_error = e

    def ready(self) -> None:
        """Returns once the rank is built (a remote rank's constructor has run)."""

    def problem(self) -> str | None:
        """Why this rank > 0 cannot serve any more (None while it follows rank 0)."""
        if self._follower is not None and not self._follower.is_alive():
            return f"stopped following rank 0 ({self.follow_error!r})"
        return None

    def pool_specs(self) -> tuple[list, int, list[int], dict[str, int]]:
        """What the KV manager needs to mirror the pools: layer specs per space, page size, pages per space, and
        each layer's kv heads over all ranks (its RankInfo says which of them this rank holds)."""
        pools = self.engine.kv.pools
        totals = {LayerOwner.TARGET: self.engine.model.config.num_key_value_heads}
        if self.engine.speculator is not None:
            totals[LayerOwner.DRAFT] = self.engine.speculator.drafter.config.num_key_value_heads
        heads = {spec.name: totals[spec.owner] for pool in pools for spec in pool.specs}
        return [pool.specs for pool in pools], self.engine.kv.page_size, [pool.num_pages for pool in pools], heads

    def page_digest(self, tables: list[list[int]], owners: Sequence[str] = ("target", "draft")) -> str:
        """A hash of the bytes of ``tables``' pages, restricted to ``owners``' layers (tests, benchmarks)."""
        digest = hashlib.sha256()
        owner_set = tuple(LayerOwner(o) for o in owners)
        for pool, table in zip(self.engine.kv.pools, tables):
            for group, offset, length in pool.page_regions(table, owner_set):
                flat = pool.groups[group].buffer.view(-1)
                digest.update(flat[offset:offset + length].cpu().numpy().tobytes())
        return digest.hexdigest()

    def pages_in_use(self) -> int:
        return self.engine.kv.pages_in_use()

    def shutdown(self) -> None:
        """Stop stepping (rank 0). Ranks > 0 are not released with a message: a step may still be running, and
        they end with their actors (``RankGroup.shutdown`` kills them). The frozen heap is handed back to the
        collector: a process that goes on (a test run, a notebook) must be able to collect this engine's cycles."""
        if self.loop is not None:
            self.loop.shutdown()
        gc.unfreeze()


@dataclasses.dataclass(frozen=True)
class RankProblem:
    """Why rank ``rank`` cannot serve now; ``fatal``: it never will again (its process died, its loop stopped),
    not merely slow to answer."""

    rank: int
    what: str
    fatal: bool

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.what}"


class RankGroup:
    """One replica's ranks: per rank a KV manager actor (when pages move between replicas) and a worker.

    The KV managers are placed where the replica runs (its placement-group bundle, else its node): they
    share pool memory with the workers (POSIX shared memory on CPU, CUDA IPC on GPU).
    """

    def __init__(self, role: str, config: EngineConfig, *, transfers: bool, tp_size: int = 1,
                 hold_timeout_s: float = 30.0, num_threads: int = 1, read_delay_s: float = 0.0,
                 kv_transport: str = "auto"):
        import ray

        from actors.kv_manager import KVManagerActor

        check_tensor_parallel(config, tp_size)
        self.name = f"{role}-{uuid.uuid4().hex[:8]}"
        self.kv_managers = []
        self.rank_infos: list[str] = []
        self.remote_ranks: list = []        # RankWorker actors of ranks 1..tp_size-1
        gpu = torch.device(config.device).type == "cuda"
        if transfers:
            for tp_rank in range(tp_size):
                self.kv_managers.append(ray.remote(KVManagerActor).options(
                    name=self.agent_name(tp_rank), namespace=KV_MANAGER_NAMESPACE, num_cpus=0,
                    num_gpus=KV_MANAGER_GPU_SHARE if gpu else 0, scheduling_strategy=_beside_me(tp_rank),
                    max_restarts=0,
                ).remote(self.agent_name(tp_rank), device=config.device, tp_size=tp_size, tp_rank=tp_rank,
                         hold_timeout_s=hold_timeout_s, num_threads=num_threads, read_delay_s=read_delay_s,
                         transport=kv_transport))
        from actors.engine_host import EngineClient, EngineHost

        address = _free_address() if tp_size > 1 else None
        for tp_rank in range(1, tp_size):
            self.remote_ranks.append(ray.remote(RankWorker).options(
                name=f"{self.agent_name(tp_rank)}-worker", namespace=KV_MANAGER_NAMESPACE, num_cpus=0,
                num_gpus=1 - KV_MANAGER_GPU_SHARE if gpu else 0, scheduling_strategy=_beside_me(tp_rank),
                max_restarts=0,
            ).remote(config, self.kv_managers[tp_rank] if transfers else None, num_threads=num_threads,
                     tp_size=tp_size, tp_rank=tp_rank, tp_address=address))
        # Rank 0 in a process of its own, on the replica's GPU share (less its KV manager's): the replica's process
        # keeps the per-request streaming, the engine's keeps the interpreter to itself.
        self.host_name = f"{self.agent_name(0)}-worker"
        self.host = ray.remote(EngineHost).options(
            name=self.host_name, namespace=KV_MANAGER_NAMESPACE, num_cpus=0,
            num_gpus=_rank0_gpu_share(transfers) if gpu else 0, scheduling_strategy=_beside_me(0), max_restarts=0,
        ).remote(config, self.kv_managers[0] if transfers else None, kv_managers=self.kv_managers,
                 kv_manager_names=[self.agent_name(r) for r in range(len(self.kv_managers))], num_threads=num_threads,
                 tp_size=tp_size, tp_address=address)
        try:
            # Under TP rank 0 joins the process group (every rank must be starting) and loads its shard.
            ray.get([rank.ready.remote() for rank in [self.host, *self.remote_ranks]])
        except BaseException:
            for rank in [self.host, *self.remote_ranks]:
                ray.kill(rank)
            raise
        self.engine = EngineClient(self.host)
        self.engine.connect()
        if transfers:
            # Every rank's pools hold as many heads per layer (its share), so rank 0's specs describe them all.
            specs, page_size, num_pages, total_kv_heads = ray.get(self.host.pool_specs.remote())
            self.rank_infos = ray.get([kvm.attach.remote(specs, page_size, num_pages, total_kv_heads)
                                       for kvm in self.kv_managers])

    def agent_name(self, tp_rank: int) -> str:
        return f"{self.name}-rank{tp_rank}"

    def health_problems(self, timeout_s: float = HEALTH_PING_TIMEOUT_S) -> list[RankProblem]:
        """Why a rank cannot serve (empty when every rank can): its engine thread stopped, or its KV manager or
        worker is dead or does not answer within ``timeout_s`` (a busy one may answer later: not ``fatal``)."""
        import ray

        problems = [] if self.engine.alive else [RankProblem(0, "its engine output stream ended", True)]
        pings = [kvm.ping.remote() for kvm in self.kv_managers]
        workers = [rank.problem.remote() for rank in [self.host, *self.remote_ranks]]
        for rank, ping in enumerate(pings):
            try:
                ray.get(ping, timeout=timeout_s)
            except Exception as e:
                problems.append(RankProblem(rank, f"its KV manager does not answer ({type(e).__name__})",
                                            isinstance(e, ray.exceptions.ActorDiedError)))
        for rank, ref in enumerate(workers):
            try:
                problem = ray.get(ref, timeout=timeout_s)
                if problem:
                    problems.append(RankProblem(rank, problem, True))
            except Exception as e:
                problems.append(RankProblem(rank, f"its worker does not answer ({type(e).__name__})",
                                            isinstance(e, ray.exceptions.ActorDiedError)))
        return problems

    def pages_in_use_per_rank(self) -> list[int]:
        """Pages in use on every rank's pool (ranks > 0 allocate none: rank 0's block tables drive them)."""
        import ray

        return ray.get([rank.pages_in_use.remote() for rank in [self.host, *self.remote_ranks]], timeout=30)

    def shutdown(self) -> None:
        import ray

        try:
            ray.get(self.host.shutdown.remote(), timeout=10)
        except Exception:       # already dead
            pass
        for rank in [self.host, *self.remote_ranks]:
            # Killed, not told to stop: a rank > 0 waits for rank 0's next message, which never comes.
            ray.kill(rank)
        for kvm in self.kv_managers:
            try:
                ray.get(kvm.close.remote(), timeout=10)
            except Exception:       # already dead: nothing to close
                pass
            ray.kill(kvm)


def _beside_me(tp_rank: int = 0):
    """A scheduling strategy for a rank's actor: on this process's node, in the placement group's bundle of
    ``tp_rank`` (one GPU per rank), or its last bundle when the group has fewer bundles."""
    import ray
    from ray.util import get_current_placement_group
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

    pg = get_current_placement_group()
    if pg is not None:
        return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=min(tp_rank, pg.bundle_count - 1))
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def _rank0_gpu_share(transfers: bool) -> float:
    """Rank 0's share of its GPU: its placement-group bundle's (one GPU without a group), less its KV manager's."""
    from ray.util import get_current_placement_group

    pg = get_current_placement_group()
    share = pg.bundle_specs[0].get("GPU", 0) if pg is not None else 1
    return share - KV_MANAGER_GPU_SHARE if transfers else share


def _free_address() -> tuple[str, int]:
    """This node's address and a free TCP port on it: where rank 0 hosts the group's rendezvous store."""
    import ray

    host = ray.util.get_node_ip_address()
    with socket.socket() as s:
        s.bind((host, 0))
        return host, s.getsockname()[1]
