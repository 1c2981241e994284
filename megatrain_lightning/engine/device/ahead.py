"""Speculative weights sent up during the backward, ahead of the step they belong to (``speculative_step``).

In the step's last backward each unit's speculative step (engine/host/host_steps.py) writes the unit's next
weights into its spare copy as soon as its gradient has landed. With a slot for every block the backward uploads
nothing, so the link is free then, and each block's slot holds its present weights until the next forward.
:class:`UploadsAhead` sends a block's spare copy up into that slot once its speculative step is done (the copy
waits for the backward's reads of the slot: ``SlotPool.stage``). The slot then holds no block, so nothing before
the step can read next weights as present ones (a forward between backward and step uploads the block again);
the next load of the block takes them as its weights if the step kept the speculation (:meth:`UploadsAhead.take`),
and otherwise finds the slot merely free.

Whether a speculative step is done is asked by the thread issuing the backward, which may run far ahead of the
GPU, and the host's steps keep the GPU's pace: so while uploads ahead are possible that thread stays
:data:`AHEAD_CALLS` block calls ahead of the GPU, and asks as the GPU gets there.
"""

from __future__ import annotations

import functools
from typing import Any

from megatrain_lightning.engine.device.streams import SlotPool
from megatrain_lightning.engine.device.uploads import Uploader
from megatrain_lightning.engine.host.host_steps import HostSide
from megatrain_lightning.engine.host.units import HostUnit
from megatrain_lightning.engine.ranks import Ranks

# Block calls of the backward the issuing thread keeps issued beyond what the GPU has finished, while weights
# may go up ahead: enough to keep the GPU fed wherever uploads ahead pay (a call takes the GPU longer to run
# than the thread to issue).
AHEAD_CALLS = 2


class UploadsAhead:
    """The blocks of the backward under way whose speculative weights may still go up ahead."""

    def __init__(self, pool: SlotPool, units: list[HostUnit], host: HostSide, uploads: Uploader, ranks: Ranks) -> None:
        self.pool, self.units, self.host, self.uploads, self.ranks = pool, units, host, uploads, ranks
        self.waiting: list[int] = []  # blocks whose speculative step is not done yet (or whose slot is pinned)
        self._issued: list[Any] = []  # the compute event after each of this backward's calls

    def possible(self) -> bool:
        """Whether a backward now sends weights up ahead: speculative steps, a slot for every block, one rank."""
        return self.host.speculates() and self.ranks.late_steps and self.pool.num_slots >= len(self.units)

    def backward_call(self, idx: int) -> None:
        """Block `idx`'s backward of the step's last micro-batch has been issued: send up the next weights of
        every block of this backward whose speculative step is done by now. Only with a slot for every block,
        and where a block's upload is its own copy: one rank (``late_steps``; several upload shards and gather
        them in one order). Every unit has a whole compute copy there, which speculative steps need."""
        if self.possible():
            self.waiting.append(idx)  # (its gradient, and so its speculative step, comes after this call)
            self._issued.append(self.pool.streams.event())
            if len(self._issued) > AHEAD_CALLS:
                self._issued.pop(0).synchronize()
        still = []
        for j in self.waiting:
            unit, slot = self.units[j], self.pool.slot_of(j)
            if slot is None:
                continue  # (not resident)
            spec = self.host.speculation(unit)
            if spec is None or spec.future is None or not spec.future.done() or self.pool.pins[slot]:
                still.append(j)  # not yet (until the next forward)
            elif spec.future.exception() is None:
                upload = functools.partial(self.uploads.upload, unit, source=unit.spare)
                unit.spare_read = self.pool.stage(j, slot, upload, spec)  # (the next speculation waits for it)
        self.waiting = still

    def forward_call(self) -> None:
        """A forward: the backward whose weights could go up ahead is over."""
        self.waiting.clear()
        self._issued.clear()

    def take(self, idx: int) -> int | None:
        """The slot block `idx`'s next weights went up into, now its weights if the step kept the speculation
        (the caller waited for the step's keeping); None otherwise (the slot, if any, is free)."""
        staged = self.pool.take_staged(idx)
        if staged is None or not staged[2].kept:
            return None
        self.host.stats["uploads_ahead"] += 1
        return self.pool.commit(idx, staged[0], staged[1])
