"""The ranks an engine trains over: one (the ordinary case), or W partitioning the host state (data parallel).

Every engine holds a :class:`Ranks` (``engine.ranks``, from :func:`ranks_of`): :class:`OneRank` in one process,
:class:`Partition` over W > 1 ranks. Both answer the same layout and collectives, and with one rank the
layout is the whole unit and every collective is the identity, costing nothing: no copy, no allocation, no
``torch.distributed`` call (no process group is needed). Where W ranks must act otherwise than one, not only
exchange more, the difference is a named attribute here with its reason (``whole_here``, ``late_steps``,
``stages_uploads``, ``ships_absent``, ``adds_stray_grads``, :meth:`Ranks.prefetch_depth`), so that the engine
reads why it acts as it does and never counts the ranks.

Data parallel over W ranks: partition the host state, then stream. Every unit's flat layout is cut into W
equal chunks (the last padded): rank r owns elements ``r*chunk .. (r+1)*chunk`` of every unit, its fp32
master, Adam moments and accumulator, so the ranks of a node hold one copy of the training state between
them, whatever their number. Per unit and step:

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

import os
import socket
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatrain_lightning.optim.threads import numa_nodes, rank_cpus, usable_cpus


class Ranks:
    """The ranks an engine trains over: this rank's part of every unit, the collectives, and the few decisions
    that W ranks take otherwise than one (each named for its reason)."""

    rank: int  # this rank, 0 .. world - 1
    world: int  # W
    local_rank: int  # this rank among those on its machine
    local_world: int  # the ranks on this machine
    split_cpus: bool  # the ranks on this machine share its CPUs, so they split them (optim/threads.py)
    # Every parameter is whole in this process (master, gradient, moments): what needs a whole parameter (a
    # block's state_dict(), the host view, an optimizer that steps itself, optimizer.state_dict() with its
    # moments) works; with W ranks each holds 1/W of every unit, so these are refused, and close() gathers
    # the masters so that every rank gets the whole trained model back.
    whole_here: bool
    # A block's host step may finish late: a prefetch skips a block whose step is still pending and the block
    # is uploaded when it runs. With W ranks an upload ends in an all-gather, a collective, which every rank
    # must issue alike whatever its own timing: a prefetch waits for the step instead.
    late_steps: bool
    # The lean layout's uploads may be cast and issued on a thread of their own (engine/device/uploads.py). With W
    # ranks an upload ends in an all-gather that every rank issues from its compute-issuing thread in the
    # same order, so it casts inline.
    stages_uploads: bool
    # A trained unit's gradient is shipped even when this rank's backward produced none: with W ranks the
    # exchange is a collective every rank joins, and a parameter has a gradient if any rank's has one.
    ships_absent: bool
    # A gradient that reaches a block parameter outside its block's call (left in .grad) can be added to the
    # step: with one rank it is the whole of it; with W it would be this rank's alone, outside the exchange
    # that takes the mean over ranks.
    adds_stray_grads: bool

    def chunk(self, numel: int) -> int:
        """Elements per rank of a unit of `numel` elements (W chunks cover it, the last one padded)."""
        raise NotImplementedError

    def padded(self, numel: int) -> int:
        """The length of the unit's flat on the device: W whole chunks."""
        raise NotImplementedError

    def bounds(self, numel: int, rank: int | None = None) -> tuple[int, int]:
        """The elements (lo, hi) of a unit of `numel` elements that `rank` (this one by default) owns."""
        raise NotImplementedError

    def unit_shard(self, numel: int) -> tuple[tuple[int, int] | None, int | None]:
        """A unit of `numel` elements as engine/host/units.py's ``HostUnit`` takes it: (this rank's bounds, the
        length of its flat on the device); (None, None) for the whole unit, laid out on the device as one
        process lays it out (each parameter aligned)."""
        raise NotImplementedError

    def host_cpus(self) -> list[int] | None:
        """This rank's CPUs for its host threads; None: the process's own, all of them."""
        raise NotImplementedError

    def least_of(self, measure: Callable[[], int | None]) -> Callable[[], int | None]:
        """`measure` as every rank reads it when a collective depends on it: the least of the ranks' readings."""
        raise NotImplementedError

    def share_note(self) -> str:
        """How much of the model this rank's host buffers hold, for a message (empty: all of it)."""
        raise NotImplementedError

    def prefetch_depth(self, others: int, forward: bool) -> int:
        """How many blocks ahead of the one computing are uploaded, with `others` slots beside its own."""
        raise NotImplementedError

    def norms(self, by_param: dict[int, torch.Tensor], order: list[int]) -> list[torch.Tensor]:
        """Each parameter's gradient norm, in `order` (parameter ids: the optimizer's), from `by_param`: this
        rank's norm of its part of each parameter that has a gradient."""
        raise NotImplementedError

    def gather(self, flat: torch.Tensor) -> None:
        """All-gather a unit's device flat (`padded` long) in place: this rank's chunk holds its shard."""
        raise NotImplementedError

    def reduce_scatter(self, flat: torch.Tensor, numel: int) -> torch.Tensor:
        """The mean over ranks of a unit's device gradient (`flat`, whole, `numel` elements): this rank's shard."""
        raise NotImplementedError

    def any_rank(self, flags: list[bool]) -> list[bool]:
        """`flags` or-ed over the ranks."""
        raise NotImplementedError

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor summed over the ranks (in place; returned)."""
        raise NotImplementedError

    def least(self, value: int) -> int:
        """The smallest `value` of any rank."""
        raise NotImplementedError

    def gather_host(self, shard: torch.Tensor, numel: int) -> torch.Tensor:
        """The whole of a unit's host buffer (`numel` elements) from every rank's `shard` of it, on every rank."""
        raise NotImplementedError


class OneRank(Ranks):
    """One process training alone: the whole of every unit, and every collective the identity (the input
    itself, never a copy)."""

    rank, world, local_rank, local_world, split_cpus = 0, 1, 0, 1, False
    whole_here = late_steps = stages_uploads = adds_stray_grads = True
    ships_absent = False

    def chunk(self, numel: int) -> int:
        return numel

    def padded(self, numel: int) -> int:
        return numel

    def bounds(self, numel: int, rank: int | None = None) -> tuple[int, int]:
        return 0, numel

    def unit_shard(self, numel: int) -> tuple[tuple[int, int] | None, int | None]:
        return None, None

    def host_cpus(self) -> list[int] | None:
        return None

    def least_of(self, measure: Callable[[], int | None]) -> Callable[[], int | None]:
        return measure

    def share_note(self) -> str:
        return ""

    def prefetch_depth(self, others: int, forward: bool) -> int:
        return others  # as many as the other slots hold

    def norms(self, by_param: dict[int, torch.Tensor], order: list[int]) -> list[torch.Tensor]:
        return [by_param[i] for i in order if i in by_param]

    def gather(self, flat: torch.Tensor) -> None:
        return None

    def reduce_scatter(self, flat: torch.Tensor, numel: int) -> torch.Tensor:
        return flat

    def any_rank(self, flags: list[bool]) -> list[bool]:
        return flags

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def least(self, value: int) -> int:
        return value

    def gather_host(self, shard: torch.Tensor, numel: int) -> torch.Tensor:
        return shard


class Partition(Ranks):
    """This rank's part of every unit, and the collectives over the ranks."""

    whole_here = late_steps = stages_uploads = adds_stray_grads = False
    ships_absent = True

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        # (new_group is itself collective: every rank builds its engine, so every rank gets here)
        whole = dist.get_world_size(group) == dist.get_world_size()  # (groups of our own need every process)
        if not whole and dist.get_backend(group) != "gloo":
            raise ValueError(
                f"a data-parallel group of {self.world} of the {dist.get_world_size()} processes on "
                f"{dist.get_backend(group)} needs a gloo group beside it, which only every process together can "
                "make; pass the whole world (torch.distributed.group.WORLD) or a gloo group"
            )
        self.cpu_group = group if dist.get_backend(group) == "gloo" else dist.new_group(backend="gloo")
        # The weights' all-gathers run on the H2D stream, the gradients' exchange on the compute stream: each
        # on its own communicator (with the whole world), so that neither waits behind the other.
        self.gather_group = dist.new_group(backend=dist.get_backend(group)) if whole else group
        # The ranks on this machine (found by a hash of the host name) split its CPUs for their host threads
        # (optim/threads.py), unless they were given different CPUs already (a launcher's CPU binding).
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        mine = torch.tensor([zlib.crc32(socket.gethostname().encode()), zlib.crc32(str(cpus).encode())])
        every = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine, group=self.cpu_group)
        local = [r for r, t in enumerate(every) if int(t[0]) == int(mine[0])]
        self.local_rank, self.local_world = local.index(self.rank), len(local)
        self.split_cpus = all(int(every[r][1]) == int(mine[1]) for r in local)

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

    def unit_shard(self, numel: int) -> tuple[tuple[int, int] | None, int | None]:
        return self.bounds(numel), self.padded(numel)

    # -- decisions every rank takes alike ---------------------------------------------------------
    def host_cpus(self) -> list[int] | None:
        """The ranks on this machine split its CPUs for their host threads (optim/threads.py), unless they
        were bound apart already (a launcher's CPU binding): then each keeps its own."""
        if self.split_cpus:
            return rank_cpus(self.local_rank, self.local_world, usable_cpus(), numa_nodes())
        return sorted(usable_cpus())

    def least_of(self, measure: Callable[[], int | None]) -> Callable[[], int | None]:
        def least() -> int | None:  # (None on a device with no measure: every rank alike)
            have = measure()
            return None if have is None else self.least(have)

        return least

    def share_note(self) -> str:
        return f" (this rank's 1/{self.world} share of them)"

    def prefetch_depth(self, others: int, forward: bool) -> int:
        """An upload is a collective, so a prefetch cannot be skipped when its block's optimizer step is still
        running (whether it is would differ between ranks): it waits for that step. In the forward, which
        follows the host steps, one block ahead then keeps the steps overlapping the compute; a deeper
        prefetch (up to one slot per block with ``num_slots="auto"``) would make the first block wait for
        nearly every step. The backward finds every step done and prefetches as deep as one rank."""
        return min(others, 1) if forward else others

    def norms(self, by_param: dict[int, torch.Tensor], order: list[int]) -> list[torch.Tensor]:
        """No rank holds a whole gradient: the squares of the pieces' norms summed over ranks in fp64, then
        the norms in fp32, as one rank would have them."""
        squares = torch.zeros(2, len(order), dtype=torch.float64)  # (sum of squares, whether any rank has it)
        for j, i in enumerate(order):
            if i in by_param:
                squares[0, j], squares[1, j] = float(by_param[i].double() ** 2), 1.0
        total = self.sum(squares)
        return [total[0, j].sqrt().float() for j in range(len(order)) if total[1, j]]

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


def ranks_of(group: Any) -> Ranks:
    """The ranks of `group`: one (no group, no initialised process group, or a group of one) or a Partition."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return OneRank()
    return Partition(group) if dist.get_world_size(group) > 1 else OneRank()
