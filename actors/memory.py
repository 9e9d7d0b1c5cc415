"""Pool memory a KV manager allocates and its rank worker maps: POSIX shared memory on CPU, CUDA IPC on GPU.

The KV manager creates each segment and keeps its own mapping (the one NIXL registers); the worker maps
the same memory from a picklable handle. CUDA handles also go to a peer's KV manager on the same device,
which copies pages from its own mapping (``actors.nixl_transfer.PoolMapping``).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Any

import torch

SHM_DIR = "/dev/shm"
# ``torch.multiprocessing.reductions.rebuild_cuda_tensor``'s argument that names the device (by the exporting
# process's index).
STORAGE_DEVICE_ARG = 6


@dataclass(frozen=True)
class ShmHandle:
    """A file in /dev/shm; both processes map it MAP_SHARED."""

    path: str
    nbytes: int


@dataclass(frozen=True)
class CudaIpcHandle:
    """A CUDA allocation shared through torch's CUDA IPC (``reduce_tensor``'s rebuild function and arguments)."""

    rebuild: Any
    args: tuple
    nbytes: int


class SharedSegments:
    """The segments of one rank's pools, owned by its KV manager (created here, unlinked on ``close``)."""

    def __init__(self, device: str = "cpu", prefix: str = "dflash-kv"):
        self.device = torch.device(device)
        self.prefix = f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.tensors: list[torch.Tensor] = []
        self.handles: list[ShmHandle | CudaIpcHandle] = []
        self._paths: list[str] = []

    def create(self, nbytes: int) -> ShmHandle | CudaIpcHandle:
        """Allocate one zeroed segment of ``nbytes``; returns the handle its worker maps."""
        if self.device.type == "cuda":
            return self._create_cuda(nbytes)
        path = os.path.join(SHM_DIR, f"{self.prefix}-{len(self.tensors)}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)      # a sparse file of zeros: pages materialise on first touch
        finally:
            os.close(fd)
        self._paths.append(path)
        self.tensors.append(map_segment(ShmHandle(path, nbytes)))
        self.handles.append(ShmHandle(path, nbytes))
        return self.handles[-1]

    def _create_cuda(self, nbytes: int) -> CudaIpcHandle:
        from torch.multiprocessing.reductions import reduce_tensor

        tensor = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        self.tensors.append(tensor)
        rebuild, args = reduce_tensor(tensor)
        self.handles.append(CudaIpcHandle(rebuild, args, nbytes))
        return self.handles[-1]

    def export(self) -> PoolExport | None:
        """The segments' handles for a reader on this node; None for shared memory (unlinked once mapped)."""
        if self.device.type != "cuda":
            return None
        return PoolExport(device_uuid(self.device), tuple(self.handles))

    def unlink(self) -> None:
        """Remove the shm names once every process has mapped them; the memory lives until the last unmap."""
        for path in self._paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._paths.clear()

    def close(self) -> None:
        self.unlink()
        self.tensors.clear()
        self.handles.clear()


def map_segment(handle: ShmHandle | CudaIpcHandle, device_index: int | None = None) -> torch.Tensor:
    """The uint8 tensor over a segment, in this process. ``device_index``: this process's index of the CUDA device
    the segment lives on, where it differs from the exporting process's (another CUDA_VISIBLE_DEVICES)."""
    if isinstance(handle, CudaIpcHandle):
        args = handle.args
        if device_index is not None:
            if handle.rebuild.__name__ != "rebuild_cuda_tensor" or len(args) <= STORAGE_DEVICE_ARG:
                raise RuntimeError(f"cannot map a CUDA IPC handle rebuilt by {handle.rebuild.__name__} elsewhere")
            args = args[:STORAGE_DEVICE_ARG] + (device_index,) + args[STORAGE_DEVICE_ARG + 1:]
        return handle.rebuild(*args)
    return torch.from_file(handle.path, shared=True, size=handle.nbytes, dtype=torch.uint8)


def device_uuid(device: torch.device) -> str | None:
    """A CUDA device's UUID (the same in every process, whatever its index there); None for a CPU."""
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device.index or 0).uuid)


@dataclass(frozen=True)
class PoolExport:
    """What a KV manager gives a reader on its node: its pool segments' CUDA IPC handles, in ``RankInfo.groups``
    order, and the device they live on."""

    device_uuid: str
    handles: tuple[CudaIpcHandle, ...]


class SegmentAllocator:
    """A ``KVPool`` ``allocate=`` function that hands out already-mapped segments in order, checking sizes."""

    def __init__(self, tensors: list[torch.Tensor]):
        self._tensors = list(tensors)
        self._next = 0

    def __call__(self, nbytes: int) -> torch.Tensor:
        if self._next >= len(self._tensors):
            raise RuntimeError(f"the pool asked for segment {self._next}; only {len(self._tensors)} were mapped")
        tensor = self._tensors[self._next]
        if tensor.numel() != nbytes:
            raise RuntimeError(f"segment {self._next} has {tensor.numel()} bytes; the pool asked for {nbytes}")
        self._next += 1
        return tensor
