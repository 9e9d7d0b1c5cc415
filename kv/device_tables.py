"""Block tables kept on the device: one preallocated ``[rows, pages]`` int32 tensor per page space, updated
incrementally, so a step's attention metadata is gathered on the device instead of rebuilt from Python lists.

A request takes a row the first time a step needs its table and keeps it until the KV manager frees its pages.
A table only grows while its request lives (pages are appended, never replaced), so each step writes only the
pages added since the request's last step: every row's new entries of a step go in one small host-to-device copy
and one scatter. The tensor's address never changes unless it must grow (more rows or longer tables than it was
made for): a captured graph can keep pointing at it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on ``device`` without a host sync: a copy from pageable memory waits for the stream
    to drain first, one from pinned memory is queued behind the work already queued."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _persistent_zeros(rows: int, pages: int, device: torch.device) -> torch.Tensor:
    """A table that later steps update in place, whether or not they run under torch.inference_mode: one made
    inside it would be an inference tensor, which no update outside it may touch."""
    with torch.inference_mode(False):
        return torch.zeros(rows, pages, dtype=torch.int32, device=device)


class DeviceBlockTables:
    def __init__(self, device: torch.device, rows: int = 64, pages: int = 64):
        self.device = torch.device(device)
        self.table = _persistent_zeros(max(rows, 1), max(pages, 1), device=self.device)
        self._row_of: dict[str, int] = {}
        self._synced: dict[str, int] = {}         # entries of the request's table already on the device
        self._free_rows = list(range(self.table.shape[0] - 1, -1, -1))
        self._stale: dict[int, int] = {}          # freed row -> entries its last owner left there

    def __len__(self) -> int:
        return len(self._row_of)

    def rows(self, request_ids: Sequence[str], tables: Sequence[Sequence[int]]) -> list[int]:
        """The rows holding these requests' ``tables`` (each request's current block table in this space), with
        the pages each gained since its last call written first."""
        widest = max((len(t) for t in tables), default=0)
        if widest > self.table.shape[1]:
            self._grow(self.table.shape[0], max(widest, 2 * self.table.shape[1]))
        rows, where, values = [], [], []
        for request_id, table in zip(request_ids, tables):
            row = self._row_of.get(request_id)
            if row is None:
                if not self._free_rows:
                    self._grow(2 * self.table.shape[0], self.table.shape[1])
                row = self._row_of[request_id] = self._free_rows.pop()
                self._synced[request_id] = 0
                # What the row's previous owner left past this table's end goes back to 0 (unused entries).
                leftover = self._stale.pop(row, 0)
                where += [row * self.table.shape[1] + c for c in range(len(table), leftover)]
                values += [0] * max(0, leftover - len(table))
            done = self._synced[request_id]
            if len(table) < done:
                raise RuntimeError(f"request {request_id}: its block table shrank from {done} to {len(table)} pages "
                                   "without its pages being freed")
            if len(table) > done:
                base = row * self.table.shape[1]
                where += range(base + done, base + len(table))
                values += table[done:]
                self._synced[request_id] = len(table)
            rows.append(row)
        if where:
            update = upload([where, values], torch.int64, self.device)
            self.table.view(-1).index_copy_(0, update[0], update[1].to(torch.int32))
        return rows

    def release(self, request_id: str) -> None:
        """The request's pages were freed: its row is free for another request."""
        row = self._row_of.pop(request_id, None)
        if row is not None:
            self._stale[row] = self._synced.pop(request_id)
            self._free_rows.append(row)

    def _grow(self, rows: int, pages: int) -> None:
        old = self.table
        self.table = _persistent_zeros(rows, pages, device=self.device)
        self.table[:old.shape[0], :old.shape[1]] = old
        self._free_rows = list(range(rows - 1, old.shape[0] - 1, -1)) + self._free_rows
