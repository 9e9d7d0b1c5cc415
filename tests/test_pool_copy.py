"""Pages copied from a mapped peer's pools (the same-GPU transport) equal NIXL's READ of the same plan, byte for byte.

On a GPU the mapping comes from CUDA IPC handles; here the reader maps the source endpoint's own host buffers
(the tensors the handles would rebuild), so the plan, the region lookup and the copies are what run on a GPU.
Both transports run with real NIXL agents over UCX in this process.
"""

import asyncio
import ctypes
import types

import numpy as np
import pytest
import torch

from actors.nixl_transfer import MANY_COPIES, NixlEndpoint, PoolMapping, TransferError, copy_regions
from kv.pool import KVPool
from kv.spec import LayerOwner, make_layer_specs

T, D = LayerOwner.TARGET, LayerOwner.DRAFT
PAGE_SIZE, NUM_PAGES = 4, 24


def specs(heads: int):
    # FP8 target and BF16 draft layers of different page sizes: two pool groups.
    return make_layer_specs(T, 3, torch.float8_e4m3fn, heads, 16) + make_layer_specs(D, 2, torch.bfloat16, heads, 16)


def endpoint(name: str, heads: int = 2, tp_size: int = 1, tp_rank: int = 0, num_pages: int = NUM_PAGES
             ) -> NixlEndpoint:
    pool = KVPool(specs(heads), PAGE_SIZE, num_pages)
    return NixlEndpoint(name, [pool], tp_size=tp_size, tp_rank=tp_rank,
                        total_kv_heads={s.name: 2 for s in pool.specs})


def source_buffers(ep: NixlEndpoint) -> list[torch.Tensor]:
    return [g.buffer.view(-1) for g in ep.pools[0].groups]


@pytest.fixture
def pair():
    src = endpoint("copy-src")
    gen = torch.Generator().manual_seed(0)
    for buffer in source_buffers(src):
        buffer.copy_(torch.randint(1, 255, buffer.shape, dtype=torch.uint8, generator=gen))
    dst = endpoint("copy-dst")
    name = dst.add_peer(src.rank_info.to_json())
    yield src, dst, name
    dst.close()
    src.close()


def mapped_copy(dst: NixlEndpoint, name: str, src: NixlEndpoint) -> PoolMapping:
    """A mapping of the source pools at other addresses than the ones it registered (as a CUDA IPC mapping is),
    with the registered memory scrambled meanwhile: a copy must read the mapping, never the peer's addresses."""
    mapping = PoolMapping(dst.peers[name], [b.clone() for b in source_buffers(src)])
    for buffer in source_buffers(src):
        buffer.fill_(0xEE)
    return mapping


def restore(src: NixlEndpoint, mapping: PoolMapping) -> None:
    for buffer, kept in zip(source_buffers(src), mapping.segments):
        buffer.copy_(kept)


def move(dst: NixlEndpoint, name: str, mapping: PoolMapping | None, remote, local, owners=(T, D)):
    """Zero the destination, move the pages one way; returns (stats, destination bytes)."""
    for buffer in source_buffers(dst):
        buffer.zero_()
    dst.mapped.pop(name, None)
    if mapping is not None:
        dst.mapped[name] = mapping
    stats = asyncio.run(dst.read(name, [remote], [local], owners, timeout_s=10.0))
    return stats, [b.clone() for b in source_buffers(dst)]


def both_ways(dst: NixlEndpoint, name: str, src: NixlEndpoint, remote, local, owners=(T, D)):
    """NIXL's READ, then the copy from a mapping; the destination bytes must be equal. Returns both stats."""
    read_stats, read = move(dst, name, None, remote, local, owners)
    mapping = mapped_copy(dst, name, src)
    copy_stats, copied = move(dst, name, mapping, remote, local, owners)
    restore(src, mapping)
    assert dst.transport(name) == "ipc"
    assert copy_stats[0] == read_stats[0] > 0          # bytes
    for got, want in zip(copied, read):
        assert torch.equal(got, want)
    return read_stats, copy_stats


PLANS = {
    "one run": (list(range(0, 6)), list(range(10, 16))),
    "scattered": (list(range(0, 2 * MANY_COPIES, 2)), list(range(1, 2 * MANY_COPIES + 1, 2))),
    "a few pages apart": ([3, 9, 0], [20, 1, 7]),
}


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("owners", [(T, D), (T,)], ids=["target+draft", "target only"])
def test_copy_from_a_mapping_equals_the_nixl_read(pair, plan, owners):
    src, dst, name = pair
    remote, local = PLANS[plan]
    (_, descriptors), (_, copies) = both_ways(dst, name, src, remote, local, owners)
    # And what they both did is right: every chosen layer of each page landed, nothing else was touched.
    pool, spool = dst.pools[0], src.pools[0]
    for spec in pool.specs:
        for a, b in zip(pool.kv_views(spec.owner, spec.layer_index), spool.kv_views(spec.owner, spec.layer_index)):
            for r, l in zip(remote, local):
                want = b[r].view(torch.uint8) if spec.owner in owners else torch.zeros_like(b[r].view(torch.uint8))
                assert torch.equal(a[l].view(torch.uint8), want)
            untouched = [p for p in range(NUM_PAGES) if p not in local]
            assert not a[untouched].view(torch.uint8).any()
    if plan == "one run":      # one region per pool group either way (the FP8 target's, the BF16 draft's)
        assert copies == descriptors == len(owners)
    if plan == "scattered" and owners == (T, D):
        assert copies == 4      # whole pages of one size per group: one gather and one scatter each
        assert descriptors == 2 * MANY_COPIES


def test_head_slices_between_tp_sizes_copy_like_nixl_reads():
    """A decode rank of TP 2 takes its one kv head of each page from a TP 1 peer: the same fragments either way."""
    src = endpoint("slice-src")
    for buffer in source_buffers(src):
        buffer.copy_(torch.randint(1, 255, buffer.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(1)))
    dst = endpoint("slice-dst", heads=1, tp_size=2, tp_rank=1)
    try:
        name = dst.add_peer(src.rank_info.to_json())
        remote, local = [2, 5, 6, 11, 0, 3, 8, 9, 14], [1, 4, 7, 2, 3, 15, 16, 17, 20]
        (nbytes, _), _ = both_ways(dst, name, src, remote, local)
        # One head of 16 dims per layer, K and V: 3 FP8 target layers and 2 BF16 draft layers.
        assert nbytes == len(remote) * 2 * PAGE_SIZE * 16 * (3 * 1 + 2 * 2)
        pool, spool = dst.pools[0], src.pools[0]
        for spec in pool.specs:
            for a, b in zip(pool.kv_views(spec.owner, spec.layer_index), spool.kv_views(spec.owner, spec.layer_index)):
                for r, l in zip(remote, local):
                    # Views are [page, token, head, dim]: this rank holds head 1 of 2.
                    assert torch.equal(a[l].view(torch.uint8), b[r][:, 1:2].view(torch.uint8))
    finally:
        dst.close()
        src.close()


def test_a_mapping_that_does_not_fit_the_peer_is_refused(pair):
    src, dst, name = pair
    buffers = source_buffers(src)
    with pytest.raises(TransferError, match="1 mapped segments for 2 pool groups"):
        PoolMapping(dst.peers[name], buffers[:1])
    with pytest.raises(TransferError, match="its pages take"):
        PoolMapping(dst.peers[name], [buffers[0], buffers[1][:-1]])


@pytest.mark.parametrize("rows", [1, MANY_COPIES], ids=["few rows", "many rows"])
def test_regions_outside_the_segments_are_refused_before_any_copy(rows):
    dst, src = torch.zeros(64 * rows, dtype=torch.uint8), torch.ones(64 * rows, dtype=torch.uint8)
    at = np.arange(rows, dtype=np.int64) * 64

    def table(tensor, offsets):
        return np.stack([tensor.data_ptr() + offsets, np.full(rows, 16), np.zeros(rows, dtype=np.int64)], 1)

    assert copy_regions(table(dst, at), table(src, at + 16), [dst], [src]) == (1 if rows == 1 else 2)
    assert all(dst[o:o + 16].all() and not dst[o + 16:o + 64].any() for o in at.tolist())
    dst.zero_()
    with pytest.raises(TransferError, match="a local region lies outside"):
        copy_regions(table(dst, at + 56), table(src, at), [dst], [src])      # the last row runs past the end
    with pytest.raises(TransferError, match="a remote region lies outside"):
        copy_regions(table(dst, at), table(src, at - 16), [dst], [src])      # the first row starts before it
    assert not dst.any()


class HostRuntime:
    """Stands in for the CUDA runtime, which needs a GPU (a fault we cannot cause here otherwise): its copies are
    memmoves of the same addresses in host memory, recorded."""

    def __init__(self):
        self.copies = []

    def copy(self, dst, src, nbytes, stream):
        self.copies.append((dst, src, nbytes, stream))
        ctypes.memmove(dst, src, nbytes)

    def copy_all(self, copies, stream):
        for dst, src, nbytes in copies:
            self.copy(dst, src, nbytes, stream)
        return len(copies)


def test_few_regions_go_to_the_cuda_runtime_as_addresses_after_the_bounds_check():
    dst, src = torch.zeros(256, dtype=torch.uint8), torch.ones(256, dtype=torch.uint8)
    local = np.array([[dst.data_ptr() + 32, 64, 0], [dst.data_ptr() + 128, 16, 0]], dtype=np.int64)
    remote = np.array([[src.data_ptr(), 64, 0], [src.data_ptr() + 200, 16, 0]], dtype=np.int64)
    runtime = HostRuntime()
    assert copy_regions(local, remote, [dst], [src], (runtime, 7)) == 2
    assert runtime.copies == [(dst.data_ptr() + 32, src.data_ptr(), 64, 7),
                              (dst.data_ptr() + 128, src.data_ptr() + 200, 16, 7)]
    assert dst[32:96].all() and dst[128:144].all() and int(dst.sum()) == 80
    past = remote.copy()
    past[1, 0] = src.data_ptr() + 250          # 16 bytes from 250 run past the end
    runtime.copies.clear()
    with pytest.raises(TransferError, match="a remote region lies outside"):
        copy_regions(local, past, [dst], [src], (runtime, 7))
    assert runtime.copies == []                # refused before the first copy


def test_a_mapped_read_plans_its_runtime_copies_and_lands_what_nixl_does(pair):
    """With the CUDA runtime (here its stand-in), a mapped peer's few regions are located while planning, so the
    READ only launches them; the pages land as NIXL's READ lands them, and a table past the pool fails at plan
    time, before anything is copied."""
    src, dst, name = pair
    dst._cuda, dst._stream = HostRuntime(), types.SimpleNamespace(cuda_stream=0)
    remote, local = PLANS["a few pages apart"]
    mapping = mapped_copy(dst, name, src)
    dst.mapped[name] = mapping
    plan = dst.plan(name, [remote], [local], (T, D))
    assert plan.copies == [(la, ra, n) for (la, n, _), (ra, _, _) in zip(plan.local.tolist(), plan.remote.tolist())]
    del dst.mapped[name]
    restore(src, mapping)
    both_ways(dst, name, src, remote, local)
    assert len(dst._cuda.copies) == len(plan.copies)
    dst.mapped[name] = mapping
    with pytest.raises(TransferError, match="page 24 is outside space 0"):
        dst.plan(name, [[NUM_PAGES]], [[0]], (T, D))


def test_cuda_runtime_errors_become_transfer_errors():
    """A library object stands in for libcudart (no GPU here): its status codes are what the runtime returns."""
    from actors.nixl_transfer import CudaRuntime

    class Lib:
        class Fn:
            def __init__(self, status):
                self.status = status

            def __call__(self, *args):
                return self.status

        def __init__(self, copy=0, query=0):
            self.cudaMemcpyAsync, self.cudaEventRecord = self.Fn(copy), self.Fn(0)
            self.cudaEventQuery = self.Fn(query)
            self.cudaGetErrorString = lambda status: b"an illegal memory access was encountered"

    CudaRuntime(Lib()).copy(1, 2, 3, 0)
    with pytest.raises(TransferError, match="cudaMemcpyAsync failed: an illegal memory access"):
        CudaRuntime(Lib(copy=700)).copy(1, 2, 3, 0)
    assert CudaRuntime(Lib(query=0)).query(5) and not CudaRuntime(Lib(query=CudaRuntime.NOT_READY)).query(5)
    with pytest.raises(TransferError, match="cudaEventQuery failed"):
        CudaRuntime(Lib(query=700)).query(5)
    if not torch.cuda.is_available():
        assert CudaRuntime.load() is None


def test_a_peer_with_more_pages_is_read_past_this_side_s_page_count():
    """A prefill replica's pool is often larger than its decode peer's: its pages past the reader's own count READ
    and copy like any other (each table is bounded by its own side's pool), and a page past either pool is
    refused before anything moves."""
    src = endpoint("big-src", num_pages=2 * NUM_PAGES)
    gen = torch.Generator().manual_seed(1)
    for buffer in source_buffers(src):
        buffer.copy_(torch.randint(1, 255, buffer.shape, dtype=torch.uint8, generator=gen))
    dst = endpoint("small-dst")
    name = dst.add_peer(src.rank_info.to_json())
    try:
        remote, local = [NUM_PAGES + 3, 2 * NUM_PAGES - 1, 1], [0, 5, NUM_PAGES - 1]
        both_ways(dst, name, src, remote, local)
        landed = [b.view(NUM_PAGES, -1) for b in source_buffers(dst)]
        sent = [b.view(2 * NUM_PAGES, -1) for b in source_buffers(src)]
        for got, want in zip(landed, sent):
            assert torch.equal(got[local], want[remote])
        with pytest.raises(TransferError, match=f"page {2 * NUM_PAGES} is outside space 0 of big-src"):
            dst.plan(name, [[2 * NUM_PAGES]], [[0]], (T, D))
        with pytest.raises(TransferError, match=f"page {NUM_PAGES} is outside space 0 of small-dst"):
            dst.plan(name, [[0]], [[NUM_PAGES]], (T, D))
    finally:
        dst.close()
        src.close()
