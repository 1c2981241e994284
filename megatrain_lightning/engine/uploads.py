"""Host -> device copies of a unit's weights: whole from its compute copy, or piece by piece through a
staging ring where there is none (the lean layout casts the fp32 master into a staging buffer just
before it goes up; engine/ring.py).

    host     | cast piece 0 | cast piece 1 |  (waits until the copy that read a buffer has finished)
    H2D      |              | piece 0 ->   | piece 1 -> |
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from megatrain_lightning.engine.host import HostUnit
from megatrain_lightning.engine.ring import HostRing, pieces


class Uploader:
    """Issues the H2D copies of units' weights on the engine's H2D stream and counts their bytes."""

    def __init__(self, streams, stats: dict, piece: int, staging: HostRing | None, partition=None) -> None:
        """`partition` (engine/partition.py): each rank uploads its shard, then the ranks all-gather the rest."""
        self.streams, self.stats, self.piece, self.staging = streams, stats, piece, staging
        self.partition = partition
        self._uploaded = None  # event: the end of the upload issued last (holds its staging buffer)

    def upload(self, unit: HostUnit, dst: torch.Tensor) -> object:
        """Issue the H2D copies of `unit`'s weights into `dst` (the caller made the H2D stream wait until
        `dst` may be overwritten). Returns the event of the last copy, which ends them all (one stream,
        in order). Partitioned, this rank's shard goes to its place in `dst` and an all-gather on the same
        stream brings the other ranks' shards; the event ends that too."""
        base = unit.lo  # (0 for a whole unit)
        for lo, hi in pieces(unit.numel, unit.numel if unit.copy is not None else self.piece):
            with self._source(unit, lo, hi) as source:
                self.streams.copy(self.streams.h2d, dst[base + lo : base + hi], source)
                self._uploaded = self.streams.event(self.streams.h2d)
        self.stats["h2d_bytes"] += unit.numel * dst.element_size()
        if unit.partitioned:
            whole = dst[: unit.device_numel]
            self.streams.run(self.streams.h2d, lambda: self.partition.gather(whole))
            self._uploaded = self.streams.event(self.streams.h2d)
            self.stats["allgather_bytes"] += whole.numel() * whole.element_size()
        return self._uploaded

    @contextmanager
    def _source(self, unit: HostUnit, lo: int, hi: int) -> Iterator[torch.Tensor]:
        """The host buffer an upload of `unit`'s elements lo..hi reads: its compute copy, or the next staging
        buffer with the master just cast into it, held until the upload issued meanwhile has read it."""
        if unit.copy is not None:
            yield unit.copy[lo:hi]
            return
        i, staged = self.staging.take(hi - lo)
        staged.copy_(unit.master[lo:hi])  # the rounding the step's fused cast would do: the same bits go up
        yield staged
        self.staging.hold(i, self._uploaded)

    def rings(self) -> list[HostRing]:
        return [self.staging] if self.staging is not None else []
