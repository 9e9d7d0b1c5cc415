"""Pool memory a KV manager allocates and its rank worker maps: POSIX shared memory on CPU, CUDA IPC on GPU.

The KV manager creates each segment and keeps its own mapping (the one NIXL registers); the worker maps
the same memory from a picklable handle. Handles only travel between the two actors of one rank.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Any

import torch

SHM_DIR = "/dev/shm"


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
        return ShmHandle(path, nbytes)

    def _create_cuda(self, nbytes: int) -> CudaIpcHandle:
        from torch.multiprocessing.reductions import reduce_tensor

        tensor = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        self.tensors.append(tensor)
        rebuild, args = reduce_tensor(tensor)
        return CudaIpcHandle(rebuild, args, nbytes)

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


def map_segment(handle: ShmHandle | CudaIpcHandle) -> torch.Tensor:
    """The uint8 tensor over a segment, in this process."""
    if isinstance(handle, CudaIpcHandle):
        return handle.rebuild(*handle.args)
    return torch.from_file(handle.path, shared=True, size=handle.nbytes, dtype=torch.uint8)


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
