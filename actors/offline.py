"""Offline driver for ``dflash-serve generate --mode agg|disagg``: the same prompts through Ray replicas."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.llm import EngineConfig
from engine.llm_engine import RequestOutput
from engine.sequence import SamplingParams

MODES = ("agg", "disagg")


def ensure_ray(num_cpus: int = 4) -> bool:
    """Start a local Ray cluster unless one is up; True when this call started it."""
    import ray

    if ray.is_initialized():
        return False
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    return True


def encode_prompts(model: str, prompts: Sequence[str | Sequence[int]]) -> list[list[int]]:
    tokenizer = None
    encoded = []
    for prompt in prompts:
        if isinstance(prompt, str):
            if tokenizer is None:
                from engine.tokenizer import Tokenizer
                if not (Path(model) / "tokenizer.json").is_file():
                    raise ValueError("this model has no tokenizer.json; pass token ids")
                tokenizer = Tokenizer(model)
            encoded.append(tokenizer.encode(prompt))
        else:
            encoded.append(list(prompt))
    return encoded


@dataclass
class Timings:
    """Where the time of one offline run went (seconds)."""

    prefill_s: float = 0.0
    decode_s: float = 0.0      # from the tickets to the last token: READs, then DFlash decode
    total_s: float = 0.0


class ReplicaActor:
    """A replica started as a Ray actor in a placement group of its own: one node, and on a GPU cluster one
    bundle with a GPU per tensor-parallel rank (``tp_size`` is passed on to the replica)."""

    def __init__(self, cls, config: EngineConfig, *, num_cpus: float = 0.25, **kwargs):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpu = torch.device(config.device).type == "cuda"
        bundles = [{"CPU": num_cpus, **({"GPU": 1} if gpu else {})}]
        if gpu:
            bundles += [{"GPU": 1}] * (kwargs.get("tp_size", 1) - 1)
        self.pg = placement_group(bundles, strategy="STRICT_PACK")
        ray.get(self.pg.ready())
        self.handle = ray.remote(cls).options(
            num_cpus=num_cpus, max_concurrency=1000,      # its rank 0 engine and KV manager take the bundle's GPU
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=0),
        ).remote(config, **kwargs)
        ray.get(self.handle.ready.remote())

    def pages_in_use(self) -> int:
        import ray
        return ray.get(self.handle.pages_in_use.remote())

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            ray.get(self.handle.shutdown.remote(), timeout=30)
        except Exception:        # already dead: its KV managers died with their owner
            pass
        ray.kill(self.handle)
        remove_placement_group(self.pg)


def run_disaggregated(prefill: ReplicaActor, decode: ReplicaActor, requests) -> tuple[list[RequestOutput], Timings]:
    """Prefill every request (one batch), then decode them all on the other replica (one batch)."""
    import ray

    from actors.replica import collect

    timings = Timings()
    start = time.perf_counter()
    results = ray.get([prefill.handle.prefill.remote(rid, ids, p) for rid, ids, p in requests])
    timings.prefill_s = time.perf_counter() - start
    done, tickets = {}, []
    for (request_id, ids, _), result in zip(requests, results):
        if "ticket" in result:
            tickets.append(result["ticket"])
        else:
            done[request_id] = asyncio.run(collect(request_id, ids, _single(result["chunk"])))
    t0 = time.perf_counter()
    done.update({o.request_id: o for o in ray.get(decode.handle.decode_all.remote(tickets))})
    timings.decode_s = time.perf_counter() - t0
    timings.total_s = time.perf_counter() - start
    return [done[request_id] for request_id, _, _ in requests], timings


async def _single(chunk: dict):
    yield chunk


def generate_offline(mode: str, engine_kwargs: dict, prompts: Sequence[str | Sequence[int]],
                     params: SamplingParams, *, transfer_draft_kv: bool = True, tp_size: int = 1,
                     prefill_tp: int | None = None, decode_tp: int | None = None) -> list[RequestOutput]:
    """Outputs of ``prompts`` from one aggregated replica of ``tp_size`` tensor-parallel ranks, or one prefill
    and one decode replica (``prefill_tp`` and ``decode_tp`` ranks, default ``tp_size``)."""
    import ray

    from actors.replica import AggregatedReplica, DecodeReplica, PrefillReplica
    from actors.worker import check_tensor_parallel

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    config = EngineConfig(**engine_kwargs)
    prefill_tp, decode_tp = prefill_tp or tp_size, decode_tp or tp_size
    for size in {tp_size} if mode == "agg" else {prefill_tp, decode_tp}:
        check_tensor_parallel(config, size)          # before Ray starts: a bad TP size fails at once
    requests = [(f"req-{i}", ids, params) for i, ids in enumerate(encode_prompts(config.model, prompts))]
    started = ensure_ray()
    replicas = []
    try:
        if mode == "agg":
            replicas.append(ReplicaActor(AggregatedReplica, config, tp_size=tp_size))
            return ray.get(replicas[0].handle.generate_all.remote(requests))
        replicas.append(ReplicaActor(PrefillReplica, config, tp_size=prefill_tp))
        replicas.append(ReplicaActor(DecodeReplica, config, tp_size=decode_tp, transfer_draft_kv=transfer_draft_kv))
        outputs, _ = run_disaggregated(replicas[0], replicas[1], requests)
        return outputs
    finally:
        for replica in replicas:
            replica.shutdown()
        if started:
            ray.shutdown()
