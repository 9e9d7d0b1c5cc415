"""CUDA graphs for the forwards whose shapes repeat: batches of rows of one query length (decode: 1 token a row;
verification and drafter blocks: K + 1), captured at a ladder of padded batch sizes, as vLLM and SGLang do.

A captured forward reads static device buffers. Each step copies its ids, positions, KV slots, block tables and
sequence lengths into their first rows and resets the rows past its batch (the padding up to the captured size)
to a harmless row: no KV slot (-1, so a padded row stores nothing and never writes a live request's page), and a
context of one token on page 0, which it only reads (every page holds finite values: pools start zeroed and
stores saturate). Each output's first dim is per token or per row; the caller gets the rows of its batch.

Steps with a prefill chunk (rows of mixed query lengths) take ``RaggedGraphs`` instead: captured per padded token
count, rows padded to the largest batch, positions and slots computed inside the graph from each row's start and
length. Larger steps, and batches above the largest captured size, run eagerly. Capture needs the
Triton attention backend (the torch reference path syncs the host: boolean masks, per-sequence loops) and a
single rank (a collective inside a graph needs NCCL's graph support on every rank; not built yet).
``cuda_graphs``: ``auto`` captures on CUDA when both hold, ``on`` requires them, ``off`` never captures;
``decode`` is ``auto`` without the ragged graphs.

``capture=False`` runs the same static, padded buffers eagerly: how the tests pin the padding without a GPU.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Sequence

import torch

from engine.attention import AttentionMetadata

log = logging.getLogger(__name__)

# "decode": as auto, but only the uniform steps (decode, verification, drafter blocks); prompt steps run eagerly.
CUDA_GRAPH_MODES = ("auto", "on", "decode", "off")

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], Sequence[torch.Tensor]]


def capture_sizes(max_batch: int) -> list[int]:
    """The padded batch sizes captured: 1, 2, 4, 8, then every multiple of 8 below ``max_batch``, and it."""
    if max_batch < 1:
        raise ValueError(f"the largest captured batch must be >= 1, got {max_batch}")
    return sorted({s for s in (1, 2, 4) if s < max_batch} | set(range(8, max_batch, 8)) | {max_batch})


def use_cuda_graphs(mode: str, device: torch.device | str, backend: str, tensor_parallel: bool) -> bool:
    """Whether an engine captures graphs: ``auto`` (and ``decode``) when it can, ``on`` raises when it cannot,
    ``off`` never."""
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
                                 backend=self.backend)

    def _forward(self, size: int, q: int) -> tuple[torch.Tensor, ...]:
        return tuple(self.fn(self.ids[:size * q], self.positions[:size * q], self._meta(size, q)))

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every (size, q), the largest first so that the smaller ones reuse its memory pool."""
        for q in self.query_lens:
            for size in reversed(self.sizes):
                self._capture(size, q)
        log.info("captured %d CUDA graphs (batch sizes %s, query lengths %s)", len(self._graphs), self.sizes,
                 self.query_lens)

    def _capture(self, size: int, q: int) -> None:
        graph, outputs = capture_graph(self.device, self._pool, lambda: self._forward(size, q))
        self._pool = graph.pool()
        # The padded inputs store nothing (every slot is -1), so a replay and an eager run of the same inputs
        # must agree; a capture that baked in a stale pointer or a host value would not.
        check_replay(graph, outputs, lambda: self._forward(size, q), f"batch {size} x {q} tokens")
        self._graphs[size, q] = (graph, outputs)

    @torch.inference_mode()
    def replays_equal_eager(self) -> tuple[int, int]:
        """(graphs whose replay is bit-identical to the eager forward of the same static inputs, graphs)."""
        return count_equal((graph, outputs, lambda key=key: self._forward(*key))
                           for key, (graph, outputs) in self._graphs.items())

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


# Ragged steps: token counts captured, in steps of 32 up to 256, of 64 up to 512, then of 128 (a step of T tokens
# pads to the next, so padding costs at most a quarter of a large step's compute, and a small step is host-bound).
RAGGED_MAX_TOKENS = 1024


def ragged_sizes(max_tokens: int, min_tokens: int = 1) -> list[int]:
    """The padded token counts of ragged graphs: the ladder from the first size >= ``min_tokens`` up to
    ``max_tokens`` (which ends it when it is off the ladder)."""
    if max_tokens < 1 or min_tokens > max_tokens:
        raise ValueError(f"ragged graphs need 1 <= min_tokens <= max_tokens, got {min_tokens} and {max_tokens}")
    ladder = [*range(32, 257, 32), *range(320, 513, 64), *range(640, max_tokens + 128, 128)]
    sizes = sorted({s for s in ladder if s < max_tokens} | {max_tokens})
    first = next(i for i, s in enumerate(sizes) if s >= min_tokens)
    return sizes[first:]


Ragged = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], Sequence[torch.Tensor]]


class RaggedGraphs:
    """Graphs of a forward ``fn(inputs, positions, meta) -> per-token outputs`` over ragged batches: rows of any
    token counts (prefill chunks beside decode and verification rows), captured per padded token count
    (``ragged_sizes``) with the rows padded to ``max_batch`` rows of no tokens.

    A step sends its rows' starts, lengths and block-table rows (one small copy) and its per-token ``inputs`` (ids,
    or hidden states); the graph computes the tokens' positions, KV slots and query starts on the device. Tokens
    past the step's own store nothing (slot -1) and belong to no row: attention leaves them alone, and what the
    per-token layers make of them is dropped. Attention takes the varlen kernel's largest tiles, as an eager step
    of such rows does (``AttentionMetadata.uniform``), in its flat grid (``max_query_len`` is the padded count): the
    same numbers per row, graphed or not."""

    def __init__(self, fn: Ragged, *, device: torch.device, max_tokens: int, max_batch: int, max_pages: int,
                 page_size: int, causal: bool, backend: str, capture: bool, min_tokens: int = 1,
                 input_shape: tuple[int, ...] = (), input_dtype: torch.dtype = torch.int64):
        self.fn = fn
        self.device = torch.device(device)
        self.sizes = ragged_sizes(max_tokens, min_tokens)
        self.max_batch = max_batch
        self.page_size = page_size
        self.max_seq_len = max_pages * page_size
        self.causal = causal
        self.backend = backend
        self.capture = capture
        tokens = self.sizes[-1]
        # starts [B] | lengths [B] | block-table rows [B] | tokens stored (the step's count; 0: none)
        self.ints = torch.zeros(3 * max_batch + 1, dtype=torch.int64, device=self.device)
        self.inputs = torch.zeros((tokens, *input_shape), dtype=input_dtype, device=self.device)
        self.tables = torch.zeros((max_batch, max_pages), dtype=torch.int32, device=self.device)
        self.query_start = torch.zeros(max_batch + 1, dtype=torch.int64, device=self.device)
        self.token_index = torch.arange(tokens, device=self.device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self._pool = None
        self.steps_run = 0

    def accepts(self, num_tokens: int, num_rows: int, widest_table: int) -> bool:
        """Whether a step of ``num_tokens`` in ``num_rows`` rows, none with more pages than ``widest_table``, fits."""
        return (0 < num_tokens <= self.sizes[-1] and 0 < num_rows <= self.max_batch
                and widest_table <= self.tables.shape[1])

    def padded(self, num_tokens: int) -> int:
        return next(size for size in self.sizes if size >= num_tokens)

    def _forward(self, size: int) -> tuple[torch.Tensor, ...]:
        b, page = self.max_batch, self.page_size
        starts, lengths, stored = self.ints[:b], self.ints[b:2 * b], self.ints[3 * b:]
        query_start = self.query_start
        torch.cumsum(lengths, 0, out=query_start[1:])
        token = self.token_index[:size]
        row = torch.searchsorted(query_start[1:], token, right=True).clamp_(max=b - 1)
        positions = torch.where(token < query_start[b], starts[row] + token - query_start[row], 0)
        pages = self.tables[row, positions // page].long()
        slots = torch.where(token < stored, pages * page + positions % page, -1)
        meta = AttentionMetadata(query_start_loc=query_start.int(), seq_lens=(starts + lengths).int(),
                                 block_tables=self.tables, slot_mapping=slots, max_query_len=size,
                                 max_seq_len=self.max_seq_len, causal=self.causal, backend=self.backend,
                                 uniform=False)
        return tuple(self.fn(self.inputs[:size], positions, meta))

    def _check_inputs(self, size: int) -> None:
        """One row of ``size`` tokens (at most the tables' reach) from position 0 on page 0, which it only reads (no
        token is stored): inputs whose every output is defined, so that a replay can be compared with eager."""
        self.ints.zero_()
        self.ints[self.max_batch] = min(size, self.max_seq_len)
        self.tables[0].zero_()

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every size, the largest first so that the smaller ones reuse its memory pool."""
        for size in reversed(self.sizes):
            self._check_inputs(size)
            graph, outputs = capture_graph(self.device, self._pool, lambda: self._forward(size))
            self._pool = graph.pool()
            check_replay(graph, outputs, lambda: self._forward(size), f"a ragged step of {size} tokens")
            self._graphs[size] = (graph, outputs)
        self.ints.zero_()
        log.info("captured %d CUDA graphs of ragged steps (token counts %s)", len(self._graphs), self.sizes)

    @torch.inference_mode()
    def replays_equal_eager(self) -> tuple[int, int]:
        """(graphs whose replay is bit-identical to the eager forward of the same static inputs, graphs)."""
        def entries():
            for size, (graph, outputs) in self._graphs.items():
                self._check_inputs(size)
                yield graph, outputs, lambda size=size: self._forward(size)
        try:
            return count_equal(entries())
        finally:
            self.ints.zero_()

    @torch.inference_mode()
    def run(self, starts: Sequence[int], lengths: Sequence[int], table_rows: Sequence[int], table: torch.Tensor,
            inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The forward over rows ``starts`` / ``lengths`` whose block tables are rows ``table_rows`` of ``table``
        (``DeviceBlockTables.table``), their per-token ``inputs`` concatenated; the outputs' rows of its tokens."""
        n, total = len(starts), sum(lengths)
        size, b = self.padded(total), self.max_batch
        pad = [0] * (b - n)
        host = [*starts, *pad, *lengths, *pad, *table_rows, *pad, total]
        self.ints.copy_(torch.tensor(host, dtype=torch.int64, pin_memory=self.device.type == "cuda"),
                        non_blocking=True)
        if len(inputs) == 1:
            self.inputs[:total].copy_(inputs[0])
        else:
            torch.cat(list(inputs), out=self.inputs[:total])
        index = self.ints[2 * b:2 * b + n]
        width = min(table.shape[1], self.tables.shape[1])     # entries past a row's own pages are never read
        if width == table.shape[1] == self.tables.shape[1]:
            torch.index_select(table, 0, index, out=self.tables[:n])
        else:
            self.tables[:n, :width] = table[index, :width]
        self.steps_run += 1
        entry = self._graphs.get(size)
        if entry is not None:
            entry[0].replay()
            outputs = entry[1]
        elif self.capture:
            raise RuntimeError(f"no CUDA graph was captured for a ragged step of {size} tokens")
        else:
            outputs = self._forward(size)
        return tuple(out[:total] for out in outputs)


def capture_graph(device: torch.device, pool, forward: Callable[[], tuple[torch.Tensor, ...]]
                  ) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]:
    """A CUDA graph of ``forward()`` over static inputs, in memory ``pool`` (None: a new one), and its outputs."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for _ in range(2):       # compiles the Triton kernels and sets up cuBLAS outside the capture
            forward()
    current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # No garbage collection inside the capture: a dropped engine's graphs (reference cycles) freed there would
    # fail it, for no graph may be destroyed while a stream captures (seen on an H100: a check building an engine
    # right after dropping another hung after "operation not permitted when stream is capturing").
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            outputs = forward()
    finally:
        if collecting:
            gc.enable()
    return graph, outputs


def check_replay(graph: torch.cuda.CUDAGraph, outputs: Sequence[torch.Tensor],
                 forward: Callable[[], tuple[torch.Tensor, ...]], what: str) -> None:
    """Replay ``graph`` and run ``forward`` eagerly on the same static inputs; raise unless they agree."""
    graph.replay()
    eager = forward()
    for got, want in zip(outputs, eager):
        if got.shape != want.shape or not torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2):
            raise RuntimeError(f"the CUDA graph of {what} disagrees with the eager forward on the same inputs; "
                               "run with cuda_graphs: off and report this")


def count_equal(entries) -> tuple[int, int]:
    """Of ``(graph, outputs, forward)`` entries: (how many replay bit-identically to ``forward()``, how many)."""
    same = total = 0
    for graph, outputs, forward in entries:
        graph.replay()
        replayed = [o.clone() for o in outputs]
        same += all(torch.equal(a, b) for a, b in zip(replayed, forward()))
        total += 1
    return same, total
