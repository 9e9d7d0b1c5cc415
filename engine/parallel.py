"""Tensor parallelism inside a replica: which shard of each weight a rank holds, the rank's collectives, and
the per-forward message with which rank 0 makes every rank run the same forward in lockstep.

Rank 0 owns the scheduler, the step loop, sampling and verification. Before each forward (a target step, a
drafter block, a drafter context store) it broadcasts that forward's inputs: a small fixed-size header on a
CPU (gloo) group, then every index tensor packed into one int64 payload on the device group (gloo on CPU,
NCCL on GPU). Ranks > 0 wait on the header (a blocking socket read: an idle rank uses no CPU) and run the
same forward over their shard; the collectives inside it (all-reduce, logits all-gather) keep them in step.
At TP=1 none of this exists: the model holds no ``TensorParallel`` and makes no collective call.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kv.rank_info import kv_head_slice

OP_STOP, OP_TARGET, OP_DRAFT, OP_STORE, OP_CLEAR, OP_SYNC = range(6)
HEADER_LEN = 64
# A rank > 0 waits for the next step's header as long as the replica stays idle: no finite timeout fits.
IDLE_TIMEOUT = datetime.timedelta(days=365)
RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=120)


def check_tp_size(tp_size: int, *, heads: int, kv_heads: int, intermediate: int, who: str) -> None:
    """Refuse a TP size that does not split ``who``'s heads and MLP evenly; the message names the TP size."""
    problems = []
    if heads % tp_size:
        problems.append(f"does not divide num_attention_heads {heads}")
    if kv_heads % tp_size and tp_size % kv_heads:
        problems.append(f"neither divides nor is a multiple of num_key_value_heads {kv_heads}")
    if intermediate % tp_size:
        problems.append(f"does not divide intermediate_size {intermediate}")
    if problems:
        raise ValueError(f"tensor_parallel_size {tp_size} {' and '.join(problems)} of {who}")


@dataclass(frozen=True)
class Shard:
    """The slice ``[start, end)`` of dimension ``dim`` that a rank loads, zero-padded to ``size``."""

    dim: int
    start: int
    end: int
    size: int


class ShardPlan:
    """One rank's share of a Qwen3-style stack: its head counts and sizes, and the slice of each checkpoint
    tensor it loads (QKV and gate/up by rows, o_proj and down by columns, embedding and LM head by vocab)."""

    def __init__(self, tp_size: int, tp_rank: int, *, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                 vocab: int | None = None, who: str = "the model"):
        check_tp_size(tp_size, heads=heads, kv_heads=kv_heads, intermediate=intermediate, who=who)
        self.tp_size, self.tp_rank, self.head_dim = tp_size, tp_rank, head_dim
        self.num_heads = heads // tp_size
        self.intermediate_size = intermediate // tp_size
        # Fewer kv heads than ranks: each kv head is replicated on the consecutive ranks whose query heads read
        # it. One rule with the disaggregated transfer's (kv.rank_info), which READs these slices between TP sizes.
        self.kv_head_start, self.num_kv_heads = kv_head_slice(kv_heads, tp_size, tp_rank)
        self.vocab_size = vocab
        # Vocab shards are equal (the last one zero-padded) so the logits all-gather moves equal blocks.
        self.vocab_per_rank = -(-vocab // tp_size) if vocab is not None else 0
        self.vocab_start = tp_rank * self.vocab_per_rank

    def shard(self, name: str) -> Shard | None:
        """The slice of checkpoint tensor ``name`` this rank loads (None: the whole tensor, replicated)."""
        hd = self.head_dim
        q0, kv0, i0 = self.tp_rank * self.num_heads * hd, self.kv_head_start * hd, self.tp_rank * self.intermediate_size
        q_len, kv_len, i_len = self.num_heads * hd, self.num_kv_heads * hd, self.intermediate_size
        rules = {
            "self_attn.q_proj.weight": (0, q0, q_len), "self_attn.k_proj.weight": (0, kv0, kv_len),
            "self_attn.v_proj.weight": (0, kv0, kv_len), "self_attn.o_proj.weight": (1, q0, q_len),
            "mlp.gate_proj.weight": (0, i0, i_len), "mlp.up_proj.weight": (0, i0, i_len),
            "mlp.down_proj.weight": (1, i0, i_len),
        }
        for suffix, (dim, start, length) in rules.items():
            if name.endswith(suffix):
                return Shard(dim, start, start + length, length)
        if self.vocab_size is not None and name.endswith(("embed_tokens.weight", "lm_head.weight")):
            end = min(self.vocab_size, self.vocab_start + self.vocab_per_rank)
            return Shard(0, self.vocab_start, end, self.vocab_per_rank)
        return None


@dataclass
class Message:
    """One forward's inputs as rank 0 broadcast them: an op, small integers, and index tensors (int64)."""

    op: int
    ints: list[int]
    tensors: list[torch.Tensor]


class PeerLost(RuntimeError):
    """A collective of the rank group failed: a rank is gone (its process died or its connection broke; gloo says
    so at once, NCCL when its watchdog does). The group cannot be used again: the replica must stop serving."""


def _collective(what: str, run) -> None:
    try:
        run()
    except RuntimeError as e:
        raise PeerLost(f"the tensor-parallel {what} failed, a rank is gone: {str(e)[:200]}") from e


class TensorParallel:
    """One rank's view of its replica's process group: collectives for the sharded layers, and rank 0's
    per-forward broadcast. Standalone process groups (no torch.distributed global state): one per replica."""

    def __init__(self, rank: int, size: int, device: torch.device | str, cpu_group, device_group):
        self.rank, self.size, self.device = rank, size, torch.device(device)
        self._cpu = cpu_group
        self._device = device_group

    @classmethod
    def connect(cls, rank: int, size: int, host: str, port: int, device: torch.device | str = "cpu"
                ) -> "TensorParallel":
        """Join the group whose rank 0 listens on ``host:port`` (blocks until every rank has joined)."""
        store = dist.TCPStore(host, port, size, rank == 0, timeout=RENDEZVOUS_TIMEOUT)
        cpu = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, IDLE_TIMEOUT)
        group = cpu
        if torch.device(device).type == "cuda":
            group = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size)
        tp = cls(rank, size, device, cpu, group)
        tp._store = store          # rank 0 hosts the store: it must outlive the groups
        return tp

    # --- collectives inside a forward ------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (the row-parallel layers' partial outputs)."""
        _collective("all-reduce", lambda: self._device.allreduce([x]).wait())
        return x

    def all_gather_vocab(self, x: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Every rank's vocab shard of ``x`` ``[..., V/tp]`` side by side, padding dropped: ``[..., V]``."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        _collective("all-gather", lambda: self._device.allgather([parts], [x]).wait())
        return torch.cat(parts, dim=-1)[..., :vocab_size]

    def barrier(self) -> None:
        """Return once every rank has called it (on the CPU group: it orders work, it moves no data)."""
        _collective("barrier", lambda: self._cpu.allreduce([torch.zeros(1)]).wait())

    # --- rank 0's per-forward message -------------------------------------------------------------
    def publish(self, op: int, ints: Sequence[int] = (), tensors: Sequence[torch.Tensor] = ()) -> None:
        """Rank 0: send the next forward's inputs to the other ranks (two broadcasts, none per token)."""
        header = [op, len(ints), len(tensors), *ints]
        for t in tensors:
            header += [t.dim(), *t.shape]
        if len(header) > HEADER_LEN:
            raise ValueError(f"a step message header of {len(header)} integers exceeds {HEADER_LEN}")
        self._broadcast(self._cpu, torch.tensor(header + [0] * (HEADER_LEN - len(header)), dtype=torch.int64))
        if tensors:
            payload = torch.cat([t.reshape(-1).to(device=self.device, dtype=torch.int64) for t in tensors])
            self._broadcast(self._device, payload)

    def receive(self) -> Message:
        """Ranks > 0: block until rank 0 publishes, then return what it sent."""
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        self._broadcast(self._cpu, header)
        h = header.tolist()
        op, n_ints, n_tensors = h[:3]
        ints, pos, shapes = h[3:3 + n_ints], 3 + n_ints, []
        for _ in range(n_tensors):
            ndim = h[pos]
            shapes.append(h[pos + 1:pos + 1 + ndim])
            pos += 1 + ndim
        tensors = []
        if shapes:
            payload = torch.empty(sum(math.prod(s) for s in shapes), dtype=torch.int64, device=self.device)
            self._broadcast(self._device, payload)
            tensors = [part.view(s) for part, s in zip(payload.split([math.prod(s) for s in shapes]), shapes)]
        return Message(op, ints, tensors)

    @staticmethod
    def _broadcast(group, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        _collective("broadcast", lambda: group.broadcast([tensor], opts).wait())


def active(tp: TensorParallel | None) -> TensorParallel | None:
    """``tp`` when it spans several ranks, else None: the single-rank path then makes no collective call."""
    return tp if tp is not None and tp.size > 1 else None
