"""Data parallel over W ranks: partition the host state, then stream.

Every unit's flat layout is cut into W equal chunks (the last padded): rank r owns elements
``r*chunk .. (r+1)*chunk`` of every unit, its fp32 master, Adam moments and accumulator, so the ranks of a
node hold one copy of the training state between them, whatever their number. Per unit and step:

    upload     this rank's shard of the compute copy -> its chunk of the device slot   (H2D: 1/W of the unit)
    all-gather the W chunks into the whole slot, on the device (NVLink where there is one)
    compute    forward, recompute, backward as with one rank
    reduce-scatter the unit's gradient (the mean over ranks, as DDP takes it) on the device: the ranks
               swap chunks, each sums its W parts in rank order                          (D2H: 1/W)
    host       this rank lands and steps its shard with its own threads

Clipping needs the global norm: the squares of each parameter's pieces' norms are summed over ranks (one
all-reduce of two numbers per parameter), and the norm taken from them as one rank would. A parameter has a gradient in the step when any rank's backward produced one (DDP's rule): the
per-parameter flags are or-ed over ranks with the gradient.

Every rank must make the same engine calls in the same order: each collective is issued from the
compute-issuing thread at a point that does not depend on timing (which block a prefetch loads, how many
slots, which graphs are kept: decided the same way on every rank, engine.py).

Collectives on device tensors go through `group` (NCCL on CUDA, gloo on the CPU), the weights' all-gathers
through a communicator of their own (they run on the H2D stream, beside the compute stream's gradient
exchange); those on host tensors (the flags, the norm, a checkpoint's gathers) through a gloo group over
the same ranks.
"""

from __future__ import annotations

import socket
import zlib
from typing import Any

import torch
import torch.distributed as dist


class Partition:
    """This rank's part of every unit, and the collectives over the ranks."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        # (new_group is itself collective: every rank builds its engine, so every rank gets here)
        ranks = dist.get_process_group_ranks(group)  # (the group's own ranks, not every process's)
        self.cpu_group = group if dist.get_backend(group) == "gloo" else dist.new_group(ranks, backend="gloo")
        # The weights' all-gathers run on the H2D stream, the gradients' exchange on the compute stream: each
        # on its own communicator, so that neither waits behind the other.
        self.gather_group = dist.new_group(ranks, backend=dist.get_backend(group))
        # The ranks on this machine (they split its CPUs: optim/threads.py), found by a hash of the host name.
        host = torch.tensor([zlib.crc32(socket.gethostname().encode())], dtype=torch.int64)
        hosts = [torch.empty_like(host) for _ in range(self.world)]
        dist.all_gather(hosts, host, group=self.cpu_group)
        local = [r for r, h in enumerate(hosts) if int(h) == int(host)]
        self.local_rank, self.local_world = local.index(self.rank), len(local)

    # -- layout ---------------------------------------------------------------------------------
    def chunk(self, numel: int) -> int:
        """Elements per rank of a unit of `numel` elements (W chunks cover it, the last one padded)."""
        return max(1, -(-numel // self.world))

    def padded(self, numel: int) -> int:
        """The length of the unit's flat on the device: W whole chunks."""
        return self.chunk(numel) * self.world

    def bounds(self, numel: int, rank: int | None = None) -> tuple[int, int]:
        """The elements (lo, hi) of a unit of `numel` elements that `rank` (this one by default) owns; empty
        (lo == hi) for the last ranks of a unit smaller than W."""
        chunk, r = self.chunk(numel), self.rank if rank is None else rank
        lo = min(r * chunk, numel)
        return lo, min(lo + chunk, numel)

    # -- device collectives ---------------------------------------------------------------------
    def gather(self, flat: torch.Tensor) -> None:
        """All-gather a unit's device flat (`padded` long) in place: this rank's chunk holds its shard."""
        chunk = flat.numel() // self.world
        mine = flat[self.rank * chunk : (self.rank + 1) * chunk]
        dist.all_gather_into_tensor(flat, mine, group=self.gather_group, async_op=True).wait()

    def reduce_scatter(self, flat: torch.Tensor, numel: int) -> torch.Tensor:
        """The mean over ranks of a unit's gradient (`flat`, whole, `numel` elements), this rank's shard of it,
        on the device. The ranks exchange chunks (all-to-all: the traffic of a reduce-scatter, each rank
        sends the others their chunks) and each sums the W parts of its own in rank order, each divided by W
        first as DDP divides, in fp32: the sum is the same bits whatever algorithm the collective library
        picks, and a bf16 gradient is rounded once, after the sum."""
        padded = self.padded(numel)
        if flat.numel() < padded:
            flat = torch.cat([flat, flat.new_zeros(padded - flat.numel())])
        parts = torch.empty_like(flat[:padded])
        dist.all_to_all_single(parts, flat[:padded], group=self.group, async_op=True).wait()
        parts = parts.view(self.world, -1)
        mean = parts[0].float() / self.world
        for part in parts[1:]:
            mean += part.float() / self.world
        lo, hi = self.bounds(numel)
        return mean[: hi - lo].to(flat.dtype)

    # -- host collectives -------------------------------------------------------------------------
    def any_rank(self, flags: list[bool]) -> list[bool]:
        """`flags` or-ed over the ranks."""
        t = torch.tensor(flags, dtype=torch.uint8)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.cpu_group)
        return [bool(x) for x in t.tolist()]

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor summed over the ranks (in place; returned)."""
        dist.all_reduce(t, group=self.cpu_group)
        return t

    def least(self, value: int) -> int:
        """The smallest `value` of any rank."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t)

    def gather_host(self, shard: torch.Tensor, numel: int) -> torch.Tensor:
        """The whole of a unit's host buffer (`numel` elements) from every rank's `shard` of it, on every rank."""
        chunk = self.chunk(numel)
        mine = torch.zeros(chunk, dtype=shard.dtype)
        mine[: shard.numel()].copy_(shard)
        whole = torch.empty(chunk * self.world, dtype=shard.dtype)
        dist.all_gather_into_tensor(whole, mine, group=self.cpu_group)
        return whole[:numel]


def partition_of(group: Any) -> Partition | None:
    """A Partition over `group`'s ranks; None without a group or with one rank (the engine unpartitioned)."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return None
    return Partition(group) if dist.get_world_size(group) > 1 else None
