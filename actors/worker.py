"""Per rank: the actor that holds the model shard and runs the engine's forwards on the pool its KV manager shares.

TP=1 today: one worker is the whole model. The decode loop runs inside ``run`` (no Ray call per step).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import torch

from actors.memory import map_segment
from engine.llm import EngineConfig, build_engine
from engine.llm_engine import RequestOutput
from engine.sequence import SamplingParams
from kv.spec import LayerOwner


@dataclasses.dataclass(frozen=True)
class PrefillResult:
    request_id: str
    first_token: int
    tables: list[list[int]]        # per space: the pages that hold the prompt's K/V
    finished: bool                 # the first token already ends the request (EOS or max_tokens 1)
    output: RequestOutput


class RankWorker:
    def __init__(self, config: EngineConfig, kv_manager, *, num_threads: int = 1, tp_size: int = 1, tp_rank: int = 0):
        import ray

        if tp_size != 1:
            raise NotImplementedError(f"tensor parallelism {tp_size} is not implemented: the engine runs TP=1")
        torch.set_num_threads(num_threads)
        self.config = config
        # Every pool buffer is a segment the KV manager created; the engine sees plain tensors over it.
        self.engine = build_engine(config, allocate=lambda n: map_segment(ray.get(kv_manager.create_segment.remote(n))))

    def ping(self) -> float:
        import time
        return time.monotonic()

    def pool_specs(self) -> tuple[list, int, list[int]]:
        """What the KV manager needs to mirror the pools: layer specs per space, page size, pages per space."""
        pools = self.engine.kv.pools
        return [pool.specs for pool in pools], self.engine.kv.page_size, [pool.num_pages for pool in pools]

    def pages_in_use(self) -> int:
        return self.engine.kv.pages_in_use()

    def has_speculator(self) -> bool:
        return self.engine.speculator is not None

    # --- aggregated -----------------------------------------------------------------------------
    def generate(self, requests: Sequence[tuple[str, list[int], SamplingParams]]) -> list[RequestOutput]:
        for request_id, prompt, params in requests:
            self.engine.add_request(prompt, params, request_id=request_id)
        return self.run()

    def run(self) -> list[RequestOutput]:
        """Step until every request has finished; returns the finished outputs."""
        done = []
        while self.engine.has_unfinished():
            done.extend(out for out in self.engine.step() if out.finished)
        return done

    # --- prefill side ---------------------------------------------------------------------------
    def prefill(self, requests: Sequence[tuple[str, list[int], SamplingParams]]) -> list[PrefillResult]:
        """Run the prompts to their first token, target and draft layers written; the pages stay held."""
        ids = []
        for request_id, prompt, params in requests:
            self.engine.add_request(prompt, dataclasses.replace(params, max_tokens=1), request_id=request_id,
                                    hold_pages=True)
            ids.append(request_id)
        outputs = {out.request_id: out for out in self.run()}
        results = []
        kv = self.engine.kv
        for (request_id, prompt, params) in requests:
            out = outputs[request_id]
            n_pages = -(-len(prompt) // kv.page_size)
            tables = [kv.block_table(request_id, s)[:n_pages] for s in range(len(kv.pools))]
            ends = out.finish_reason == "stop" or params.max_tokens == 1
            results.append(PrefillResult(request_id, out.token_ids[0], tables, ends, out))
        return results

    def release(self, request_id: str) -> None:
        self.engine.release(request_id)

    # --- decode side ----------------------------------------------------------------------------
    def reserve(self, request_id: str, prompt: list[int], first_token: int, params: SamplingParams
                ) -> list[list[int]] | None:
        """Pages for a transferred prompt (per space, prompt pages only), or None when the pool is full now."""
        if self.engine.reserve_transfer(prompt, first_token, params, request_id=request_id) is None:
            return None
        kv = self.engine.kv
        n_pages = -(-len(prompt) // kv.page_size)
        return [kv.block_table(request_id, s)[:n_pages] for s in range(len(kv.pools))]

    def activate(self, request_id: str, draft_context: bool = True) -> RequestOutput | None:
        """The pages have landed: start decoding. Returns the output if the first token already ends it."""
        out = self.engine.activate_transfer(request_id, draft_context=draft_context)
        return out if out is not None and out.finished else None

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    # --- inspection (tests, benchmarks) ---------------------------------------------------------
    def page_digest(self, tables: list[list[int]], owners: Sequence[str] = ("target", "draft")) -> str:
        """A hash of the bytes of ``tables``' pages, restricted to ``owners``' layers."""
        digest = hashlib.sha256()
        owner_set = tuple(LayerOwner(o) for o in owners)
        for pool, table in zip(self.engine.kv.pools, tables):
            for group, offset, length in pool.page_regions(table, owner_set):
                flat = pool.groups[group].buffer.view(-1)
                digest.update(flat[offset:offset + length].cpu().numpy().tobytes())
        return digest.hexdigest()
