"""Offline driver for ``dflash-serve generate --mode agg|disagg``: the same prompts through Ray replicas."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

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
    transfer_s: list[float] = field(default_factory=list)      # per request: reserve + READ + activate
    read_s: list[float] = field(default_factory=list)          # per request: the NIXL READ alone
    bytes_moved: int = 0
    decode_s: float = 0.0
    total_s: float = 0.0


def run_disaggregated(prefill, decode, requests, hold_timeout_s: float | None = None
                      ) -> tuple[list[RequestOutput], Timings]:
    """Prefill every request, move each one's KV to the decode replica, then decode them all."""
    timings = Timings()
    start = time.perf_counter()
    tickets, outputs = prefill.prefill(requests, hold_timeout_s)
    timings.prefill_s = time.perf_counter() - start
    done = {o.request_id: o for o in outputs}
    for ticket in tickets:
        t0 = time.perf_counter()
        stats = decode.receive(ticket)
        timings.transfer_s.append(time.perf_counter() - t0)
        timings.read_s.append(stats["seconds"])
        timings.bytes_moved += stats["bytes"]
        if stats["output"] is not None:
            done[ticket.request_id] = stats["output"]
    t0 = time.perf_counter()
    done.update({o.request_id: o for o in decode.run()})
    timings.decode_s = time.perf_counter() - t0
    timings.total_s = time.perf_counter() - start
    return [done[request_id] for request_id, _, _ in requests], timings


def generate_offline(mode: str, engine_kwargs: dict, prompts: Sequence[str | Sequence[int]],
                     params: SamplingParams, *, transfer_draft_kv: bool = True) -> list[RequestOutput]:
    """Outputs of ``prompts`` from one aggregated replica, or one prefill and one decode replica."""
    from actors.replica import AggregatedReplica, DecodeReplica, PrefillReplica

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    config = EngineConfig(**engine_kwargs)
    requests = [(f"req-{i}", ids, params) for i, ids in enumerate(encode_prompts(config.model, prompts))]
    started = ensure_ray()
    replicas = []
    try:
        if mode == "agg":
            replicas.append(AggregatedReplica(config))
            return replicas[0].generate(requests)
        replicas.append(PrefillReplica(config))
        replicas.append(DecodeReplica(config, transfer_draft_kv=transfer_draft_kv))
        replicas[1].connect(replicas[0].rank_infos)
        outputs, _ = run_disaggregated(replicas[0], replicas[1], requests)
        return outputs
    finally:
        for replica in replicas:
            replica.shutdown()
        if started:
            import ray
            ray.shutdown()
