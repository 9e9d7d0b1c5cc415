"""CUDA graphs for the forwards whose shapes repeat: batches of rows of one query length (decode: 1 token a row;
verification and drafter blocks: K + 1), captured at a ladder of padded batch sizes, as vLLM and SGLang do.

A captured forward reads static device buffers. Each step copies its ids, positions, KV slots, block tables and
sequence lengths into their first rows and resets the rows past its batch (the padding up to the captured size)
to a harmless row: no KV slot (-1, so a padded row stores nothing and never writes a live request's page), and a
context of one token on page 0, which it only reads (every page holds finite values: pools start zeroed and
stores saturate). Each output's first dim is per token or per row; the caller gets the rows of its batch.

Batches above the largest captured size and mixed query lengths (prefill chunks) run eagerly. Capture needs the
Triton attention backend (the torch reference path syncs the host: boolean masks, per-sequence loops) and a
single rank (a collective inside a graph needs NCCL's graph support on every rank; not built yet).
``cuda_graphs``: ``auto`` captures on CUDA when both hold, ``on`` requires them, ``off`` never captures.

``capture=False`` runs the same static, padded buffers eagerly: how the tests pin the padding without a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from engine.attention import AttentionMetadata

log = logging.getLogger(__name__)

CUDA_GRAPH_MODES = ("auto", "on", "off")
# KV tiles per split of the Triton decode kernel inside a graph (max_seq_len is then the table's capacity).
GRAPH_DECODE_SPLIT_TILES = 4

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], Sequence[torch.Tensor]]


def capture_sizes(max_batch: int) -> list[int]:
    """The padded batch sizes captured: 1, 2, 4, 8, then every multiple of 8 below ``max_batch``, and it."""
    if max_batch < 1:
        raise ValueError(f"the largest captured batch must be >= 1, got {max_batch}")
    return sorted({s for s in (1, 2, 4) if s < max_batch} | set(range(8, max_batch, 8)) | {max_batch})


def use_cuda_graphs(mode: str, device: torch.device | str, backend: str, tensor_parallel: bool) -> bool:
    """Whether an engine captures graphs: ``auto`` when it can, ``on`` raises when it cannot, ``off`` never."""
    if mode not in CUDA_GRAPH_MODES:
        raise ValueError(f"cuda_graphs must be one of {CUDA_GRAPH_MODES}, got {mode!r}")
    if mode == "off":
        return False
    problems = []
    if torch.device(device).type != "cuda":
        problems.append(f"the device is {torch.device(device).type}, not CUDA")
    if backend != "triton":
        problems.append(f"the attention backend is {backend!r} (the torch path syncs the host; use 'triton')")
    if tensor_parallel:
        problems.append("the engine is tensor-parallel (collectives are not captured yet)")
    if problems and mode == "on":
        raise ValueError("cuda_graphs=on but " + "; ".join(problems))
    return not problems


class StepGraphs:
    """Graphs (or, without ``capture``, their static padded inputs run eagerly) of one forward
    ``fn(ids, positions, meta) -> outputs`` over batches of rows of ``q`` tokens, q in ``query_lens``."""

    def __init__(self, fn: Forward, *, device: torch.device, query_lens: Sequence[int], max_batch: int,
                 max_pages: int, page_size: int, causal: bool, backend: str, capture: bool):
        self.fn = fn
        self.device = torch.device(device)
        self.query_lens = tuple(sorted(set(query_lens)))
        self.sizes = capture_sizes(max_batch)
        self.max_batch = max_batch
        self.max_seq_len = max_pages * page_size        # any row's context fits its block table
        self.causal = causal
        self.backend = backend
        self.capture = capture
        tokens = max_batch * max(self.query_lens)
        self.ids = torch.zeros(tokens, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=self.device)
        self.slots = torch.full((tokens,), -1, dtype=torch.int64, device=self.device)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=self.device)
        self.tables = torch.zeros((max_batch, max_pages), dtype=torch.int32, device=self.device)
        self.query_starts = {q: torch.arange(max_batch + 1, dtype=torch.int32, device=self.device) * q
                             for q in self.query_lens}
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self._pool = None
        self.steps_run = 0                 # forwards run through the static inputs (replayed, or eagerly)

    def accepts(self, batch: int, q: int) -> bool:
        return 0 < batch <= self.max_batch and q in self.query_lens

    def padded(self, batch: int) -> int:
        return next(size for size in self.sizes if size >= batch)

    def _meta(self, size: int, q: int) -> AttentionMetadata:
        return AttentionMetadata(query_start_loc=self.query_starts[q][:size + 1], seq_lens=self.seq_lens[:size],
                                 block_tables=self.tables[:size], slot_mapping=self.slots[:size * q],
                                 max_query_len=q, max_seq_len=self.max_seq_len, causal=self.causal,
                                 backend=self.backend, decode_split_tiles=GRAPH_DECODE_SPLIT_TILES)

    def _forward(self, size: int, q: int) -> tuple[torch.Tensor, ...]:
        return tuple(self.fn(self.ids[:size * q], self.positions[:size * q], self._meta(size, q)))

    def capture_all(self) -> None:
        """Capture every (size, q), the largest first so that the smaller ones reuse its memory pool."""
        for q in self.query_lens:
            for size in reversed(self.sizes):
                self._capture(size, q)
        log.info("captured %d CUDA graphs (batch sizes %s, query lengths %s)", len(self._graphs), self.sizes,
                 self.query_lens)

    @torch.inference_mode()
    def _capture(self, size: int, q: int) -> None:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(2):       # compiles the Triton kernels and sets up cuBLAS outside the capture
                self._forward(size, q)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = self._forward(size, q)
        self._pool = graph.pool()
        # The padded inputs store nothing (every slot is -1), so a replay and an eager run of the same inputs
        # must agree; a capture that baked in a stale pointer or a host value would not.
        graph.replay()
        eager = self._forward(size, q)
        for got, want in zip(outputs, eager):
            if got.shape != want.shape or not torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2):
                raise RuntimeError(f"the CUDA graph of batch {size} x {q} tokens disagrees with the eager forward "
                                   "on the same inputs; run with cuda_graphs: off and report this")
        self._graphs[size, q] = (graph, outputs)

    @torch.inference_mode()
    def run(self, batch: int, q: int, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
            ) -> tuple[torch.Tensor, ...]:
        """The forward over ``batch`` rows of ``q`` tokens (``ids``, ``positions`` and ``meta`` as the eager
        forward takes them), padded to the next captured size; the outputs' rows of this batch."""
        if meta.block_tables.shape[1] > self.tables.shape[1]:
            # Wider than any table of a request within the context length: never expected; eager is correct.
            log.warning("a block table of %d pages exceeds the graphs' %d; running eagerly",
                        meta.block_tables.shape[1], self.tables.shape[1])
            return tuple(self.fn(ids, positions, meta))
        size, n = self.padded(batch), batch * q
        self.ids[:n].copy_(ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.slots[n:size * q].fill_(-1)
        self.seq_lens[:batch].copy_(meta.seq_lens)
        self.seq_lens[batch:size].fill_(1)
        self.tables[:batch, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.tables[batch:size].zero_()
        self.steps_run += 1
        entry = self._graphs.get((size, q))
        if entry is not None:
            graph, outputs = entry
            graph.replay()
        elif self.capture:
            raise RuntimeError(f"no CUDA graph was captured for batch {size} x {q} tokens")
        else:
            outputs = self._forward(size, q)
        # Per-token outputs have size * q rows, per-row ones size.
        return tuple(out[:batch * (out.shape[0] // size)] for out in outputs)
