"""Turns a scheduled step into model inputs (ids, positions, attention metadata) and runs the target."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata
from engine.cuda_graphs import RaggedGraphs, StepGraphs
from engine.model import LayerKV, Qwen3Model
from engine.parallel import OP_TARGET, Message
from kv.device_tables import DeviceBlockTables, upload
from kv.manager import KVCacheManager
from kv.spec import LayerOwner


@dataclass(frozen=True)
class Row:
    """One sequence's slice of a batch: ``num_tokens`` positions from ``start`` of request ``request_id``."""

    request_id: str
    start: int
    num_tokens: int


# A step of at most this many tokens (decode, verification and drafter blocks) computes its positions, slots, query
# starts and lengths on the host, one pass over its tokens, and sends them in two copies; a longer one (prefill
# chunks) computes them on the device from each row's start and length, with no host work per token.
HOST_METADATA_MAX_TOKENS = 256


def row_tables(kv: KVCacheManager, space: int, rows: Sequence[Row], device: torch.device
               ) -> tuple[list[list[int]], DeviceBlockTables, list[int]]:
    """The rows' block tables in page space ``space``, its device mirror, and their rows in it (brought up to
    date); raises when a row's positions run past its pages."""
    tables = [kv.block_table(r.request_id, space) for r in rows]
    for row, table in zip(rows, tables):
        if -(-(row.start + row.num_tokens) // kv.page_size) > len(table):
            raise RuntimeError(f"request {row.request_id}: positions up to {row.start + row.num_tokens} exceed its "
                               f"{len(table)} pages")
    mirror = kv.device_block_tables(space, device)
    return tables, mirror, mirror.rows([r.request_id for r in rows], tables)


def build_metadata(kv: KVCacheManager, space: int, rows: Sequence[Row], *, causal: bool, backend: str,
                   device: torch.device, ragged: bool = False) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions [T] and attention metadata of ``rows`` over page space ``space``; K/V of every row's
    positions are stored into that space's pages at their slots. ``ragged``: the rows take the ragged tiles even
    when they are of one length (``AttentionMetadata.uniform`` False: a step with a prompt, see ``ModelRunner.run``).

    Block tables stay on the device (``kv.device_block_tables``): the host sends each row's table row (and the
    pages the step's requests gained), and the batch's block tables are gathered there. Positions and slots are
    computed on the host for short steps (every kernel launched before a step's forward is host time the device
    may wait for) and on the device for long ones."""
    page_size = kv.page_size
    tables, mirror, table_rows = row_tables(kv, space, rows, device)
    num_tokens = sum(r.num_tokens for r in rows)
    max_query_len = max(r.num_tokens for r in rows)
    width = max(len(t) for t in tables)
    if num_tokens <= HOST_METADATA_MAX_TOKENS:
        positions_list, slots, query_start_list = [], [], [0]
        for row, table in zip(rows, tables):
            for p in range(row.start, row.start + row.num_tokens):
                positions_list.append(p)
                slots.append(table[p // page_size] * page_size + p % page_size)
            query_start_list.append(query_start_list[-1] + row.num_tokens)
        longs = upload(positions_list + slots + table_rows, torch.int64, device)
        ints = upload(query_start_list + [r.start + r.num_tokens for r in rows], torch.int32, device)
        positions, slot_mapping = longs[:num_tokens], longs[num_tokens:2 * num_tokens]
        block_tables = mirror.table[longs[2 * num_tokens:], :width]
        query_start_loc, seq_lens = ints[:len(rows) + 1], ints[len(rows) + 1:]
    else:
        starts, lengths, table_rows = upload([[r.start for r in rows], [r.num_tokens for r in rows], table_rows],
                                             torch.int64, device)
        query_start = torch.zeros(len(rows) + 1, dtype=torch.int64, device=device)
        torch.cumsum(lengths, 0, out=query_start[1:])
        token_row = torch.repeat_interleave(torch.arange(len(rows), device=device), lengths, output_size=num_tokens)
        positions = starts[token_row] + torch.arange(num_tokens, device=device) - query_start[token_row]
        block_tables = mirror.table[table_rows, :width]
        slot_mapping = block_tables[token_row, positions // page_size].long() * page_size + positions % page_size
        query_start_loc, seq_lens = query_start.int(), (starts + lengths).int()
    meta = AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables,
        slot_mapping=slot_mapping,
        max_query_len=max_query_len,
        max_seq_len=max(r.start + r.num_tokens for r in rows),
        causal=causal,
        backend=backend,
        uniform=not ragged and all(r.num_tokens == max_query_len for r in rows),
    )
    return positions, meta


def device_metadata(kv: KVCacheManager, space: int, request_ids: Sequence[str], starts: torch.Tensor, width: int, *,
                    causal: bool, backend: str) -> tuple[torch.Tensor, AttentionMetadata]:
    """``build_metadata`` for rows of ``width`` tokens whose starts ``[B]`` are on the device (a step launched from
    the previous step's results before the host has read them): the host sends the rows of the block tables
    (whose pages it allocated for the longest block each row may reach), the device computes the rest."""
    device = starts.device
    tables = [kv.block_table(r, space) for r in request_ids]
    mirror = kv.device_block_tables(space, device)
    table_rows = upload(mirror.rows(request_ids, tables), torch.int64, device)
    width_pages = max(len(t) for t in tables)
    block_tables = mirror.table[table_rows, :width_pages]
    positions = starts[:, None] + torch.arange(width, device=device)
    page_size = kv.page_size
    slots = block_tables.gather(1, positions // page_size).long() * page_size + positions % page_size
    num_rows = len(request_ids)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(num_rows + 1, dtype=torch.int32, device=device) * width,
        seq_lens=(starts + width).int(), block_tables=block_tables, slot_mapping=slots.flatten(),
        max_query_len=width, max_seq_len=width_pages * page_size, causal=causal, backend=backend)
    return positions.flatten(), meta


def pack_inputs(ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
                ) -> tuple[list[int], list[torch.Tensor]]:
    """A forward's ids, positions and attention metadata as a step message's integers and tensors."""
    return ([meta.max_query_len, meta.max_seq_len, int(meta.causal), int(meta.uniform)],
            [ids, positions, meta.slot_mapping, meta.block_tables, meta.query_start_loc, meta.seq_lens])


def unpack_inputs(message: Message, backend: str
                  ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[torch.Tensor]]:
    """``pack_inputs`` undone on another rank; returns the message's remaining integers and tensors too."""
    (max_q, max_s, causal, uniform), rest_ints = message.ints[:4], message.ints[4:]
    ids, positions, slots, tables, starts, seq_lens = message.tensors[:6]
    meta = AttentionMetadata(query_start_loc=starts.int(), seq_lens=seq_lens.int(), block_tables=tables.int(),
                             slot_mapping=slots, max_query_len=max_q, max_seq_len=max_s, causal=bool(causal),
                             backend=backend, uniform=bool(uniform))
    return ids, positions, meta, rest_ints, message.tensors[6:]


def layer_kv_of(kv: KVCacheManager, owner: LayerOwner, num_layers: int) -> list[LayerKV]:
    """The cache views and scales of an owner's layers, wherever the manager placed them."""
    pool = kv.pools[kv.space_of(owner)]
    layers = []
    for i in range(num_layers):
        k, v = pool.kv_views(owner, i)
        scale = pool.spec(owner, i).scale
        layers.append(LayerKV(k, v, scale, scale))
    return layers


class ModelRunner:
    """Owns the target model and its layers' cache views; one call runs one step's target forward."""

    def __init__(self, model: Qwen3Model, kv: KVCacheManager, backend: str):
        self.model = model
        self.kv = kv
        self.backend = backend
        self.device = model.device
        self.tp = model.tp
        self.target_space = kv.space_of(LayerOwner.TARGET)
        self.layer_kv = layer_kv_of(kv, LayerOwner.TARGET, model.config.num_hidden_layers)
        self.graphs: StepGraphs | None = None
        self.ragged: RaggedGraphs | None = None
        self._graph_capture_layers: tuple[int, ...] = ()

    def enable_graphs(self, query_lens: Sequence[int], max_batch: int, max_pages: int,
                      capture_layers: Sequence[int], capture: bool) -> StepGraphs:
        """Run batches of rows of ``query_lens`` tokens each whose logits are all wanted (decode, verification)
        through ``StepGraphs``; ``capture_layers`` are the hidden states every such step captures."""
        self._graph_capture_layers = tuple(capture_layers)

        def forward(ids, positions, meta):
            hidden, captured = self.model.forward(ids, positions, self.layer_kv, meta, self._graph_capture_layers)
            logits = self.model.compute_logits(hidden, self.backend)
            return (logits,) if captured is None else (logits, captured)

        self.graphs = StepGraphs(forward, device=self.device, query_lens=query_lens, max_batch=max_batch,
                                 max_pages=max_pages, page_size=self.kv.page_size, causal=True,
                                 backend=self.backend, capture=capture)
        return self.graphs

    def enable_ragged_graphs(self, max_tokens: int, max_batch: int, max_pages: int, capture: bool) -> RaggedGraphs:
        """Run the steps of up to ``max_tokens`` tokens whose attention takes ragged tiles (rows of several lengths,
        or longer than a split-KV block: steps with a prompt) through ``RaggedGraphs``; the graphs return the final
        hidden states (and the captured ones of ``enable_graphs``' layers), and the wanted rows' logits are
        computed after, eagerly."""
        from engine.triton_attention import ragged_tiles

        group = self.model.num_heads // self.model.num_kv_heads
        self._ragged_tiles = lambda uniform, max_query_len: ragged_tiles(uniform, max_query_len, group)

        def forward(ids, positions, meta):
            hidden, captured = self.model.forward(ids, positions, self.layer_kv, meta, self._graph_capture_layers)
            return (hidden,) if captured is None else (hidden, captured)

        self.ragged = RaggedGraphs(forward, device=self.device, max_tokens=max_tokens, max_batch=max_batch,
                                   max_pages=max_pages, page_size=self.kv.page_size, causal=True,
                                   backend=self.backend, capture=capture)
        return self.ragged

    def _graphable(self, rows: Sequence[Row], logit_rows: Sequence[int], capture_layers: Sequence[int]) -> bool:
        q = rows[0].num_tokens
        n = len(rows) * q
        return (self.graphs is not None and self.graphs.accepts(len(rows), q)
                and all(r.num_tokens == q for r in rows) and tuple(capture_layers) == self._graph_capture_layers
                and len(logit_rows) == n and logit_rows[0] == 0 and logit_rows[-1] == n - 1)

    @torch.inference_mode()
    def run(self, rows: Sequence[Row], ids: torch.Tensor, logit_rows: Sequence[int],
            capture_layers: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Target forward over ``rows`` (their flattened token ``ids`` on the device); returns float32 logits at the
        flat indices ``logit_rows`` and the captured hidden states of every token (or None). A batch of rows of
        one length whose every logit is wanted runs through the CUDA graphs when they are on, a ragged one (a step
        with a prompt) through the ragged graphs.

        A step that wants some of its tokens' logits only has a prompt chunk in it, and takes the ragged tiles even
        when its rows are of one short length (a prompt's few tokens after a prefix-cache hit, which no decode graph
        fits): through the ragged graphs, or eagerly with the same tiles (the same numbers either way). Only decode
        and verification steps, every logit wanted, take the split-KV kernel and the decode graphs."""
        ragged = len(logit_rows) != ids.shape[0]
        if (self.ragged is not None and tuple(capture_layers) == self._graph_capture_layers
                and self._ragged_tiles(not ragged and all(r.num_tokens == rows[0].num_tokens for r in rows),
                                       max(r.num_tokens for r in rows))):
            tables, mirror, table_rows = row_tables(self.kv, self.target_space, rows, self.device)
            if self.ragged.accepts(ids.shape[0], len(rows), max(map(len, tables))):
                outputs = self.ragged.run([r.start for r in rows], [r.num_tokens for r in rows], table_rows,
                                          mirror.table, [ids])
                index = upload(logit_rows, torch.int64, self.device)
                return self._logits(outputs[0], index), (outputs[1] if capture_layers else None)
        positions, meta = build_metadata(self.kv, self.target_space, rows, causal=True, backend=self.backend,
                                         device=self.device, ragged=ragged)
        if self._graphable(rows, logit_rows, capture_layers):
            outputs = self.graphs.run(len(rows), rows[0].num_tokens, ids, positions, meta)
            return outputs[0], (outputs[1] if capture_layers else None)
        index = upload(logit_rows, torch.int64, self.device)
        if self.tp is not None:
            ints, tensors = pack_inputs(ids, positions, meta)
            self.tp.publish(OP_TARGET, ints + list(capture_layers), tensors + [index])
        return self._forward(ids, positions, meta, index, capture_layers)

    @torch.inference_mode()
    def metadata_ahead(self, request_ids: Sequence[str], starts: torch.Tensor, width: int
                       ) -> tuple[torch.Tensor, AttentionMetadata]:
        """Positions and metadata of rows of ``width`` tokens whose starts are on the device (``device_metadata``)."""
        return device_metadata(self.kv, self.target_space, request_ids, starts, width, causal=True,
                               backend=self.backend)

    @torch.inference_mode()
    def run_ahead(self, width: int, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                  capture_layers: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``run`` through the graphs for rows of ``width`` tokens, every logit, with ``metadata_ahead``'s inputs."""
        outputs = self.graphs.run(len(meta.seq_lens), width, ids, positions, meta)
        return outputs[0], (outputs[1] if capture_layers else None)

    def _forward(self, ids, positions, meta, index, capture_layers) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden, captured = self.model.forward(ids, positions, self.layer_kv, meta, capture_layers)
        return self._logits(hidden, index), captured

    def _logits(self, hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden[index], self.backend) if len(index) else hidden.new_zeros(0)

    @torch.inference_mode()
    def follow(self, message: Message) -> torch.Tensor | None:
        """A rank > 0: the target forward rank 0 published; returns the captured hidden states (the same on
        every rank) for the drafter context store that follows."""
        ids, positions, meta, capture_layers, (index,) = unpack_inputs(message, self.backend)
        return self._forward(ids, positions, meta, index, tuple(capture_layers))[1]
