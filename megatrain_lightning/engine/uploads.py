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

    def __init__(self, streams, stats: dict, piece: int, staging: HostRing | None) -> None:
        self.streams, self.stats, self.piece, self.staging = streams, stats, piece, staging
        self._uploaded = None  # event: the end of the upload issued last (holds its staging buffer)

    def upload(self, unit: HostUnit, dst: torch.Tensor) -> object:
        """Issue the H2D copies of `unit`'s weights into `dst` (the caller made the H2D stream wait until
        `dst` may be overwritten). Returns the event of the last copy, which ends them all (one stream,
        in order)."""
        for lo, hi in pieces(unit.numel, unit.numel if unit.copy is not None else self.piece):
            with self._source(unit, lo, hi) as source:
                self.streams.copy(self.streams.h2d, dst[lo:hi], source)
                self._uploaded = self.streams.event(self.streams.h2d)
        self.stats["h2d_bytes"] += unit.numel * dst.element_size()
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
