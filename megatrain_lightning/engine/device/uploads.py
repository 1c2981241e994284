"""Host -> device copies of a unit's weights: whole from its compute copy, or piece by piece through a
staging ring where there is none (the lean layout casts the fp32 master into a staging buffer just
before it goes up; engine/host/ring.py).

The cast is host work as long as a memory pass over the unit, so it runs on a thread of its own, the
stager, not on the thread that issues the kernels: that thread hands the upload over and goes on issuing
compute, so the GPU's queue does not run dry while a block's master is cast::

    issuing  | fwd i | hand over i+1 | fwd i+1 (waits for i+1's last copy to be issued) |
    stager   |       | cast piece 0 | cast piece 1 | ...   (each waits for the copy that last read its buffer)
    H2D      |                      | piece 0 ->   | piece 1 -> |

The stager issues the copies of an upload in order, after the waits the issuing thread put on the H2D
stream before handing it over; an upload's end is a :class:`Staged` event, which resolves to the CUDA event of
its last copy once the stager has issued it. A partitioned upload ends in an all-gather, a collective
that every rank must issue from its compute-issuing thread in the same order: it casts inline (the ranks'
``stages_uploads``, engine/ranks.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from megatrain_lightning.engine.host.ring import HostRing, pieces
from megatrain_lightning.engine.host.units import HostUnit
from megatrain_lightning.engine.ranks import Ranks


class Staged:
    """The end of an upload the stager has yet to issue: an event once it has (:meth:`resolve`)."""

    def __init__(self, future: Future) -> None:
        self.future = future

    def resolve(self) -> object:
        """The event of the upload's last copy, waiting for the stager to issue it (re-raising its error)."""
        return self.future.result()

    def synchronize(self) -> None:
        self.resolve().synchronize()

    def query(self) -> bool:
        return self.future.done() and self.resolve().query()


class Uploader:
    """Issues the H2D copies of units' weights on the engine's H2D stream and counts their bytes."""

    def __init__(self, streams, stats: dict, piece: int, staging: HostRing | None, ranks: Ranks) -> None:
        """`ranks` (engine/ranks.py): each rank uploads its shard, then the ranks all-gather the rest."""
        self.streams, self.stats, self.piece, self.staging = streams, stats, piece, staging
        self.ranks = ranks
        self._stager: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def upload(self, unit: HostUnit, dst: torch.Tensor, source: torch.Tensor | None = None) -> object:
        """Issue the H2D copies of `unit`'s weights into `dst` (the caller made the H2D stream wait until
        `dst` may be overwritten). Returns the event of the last copy, which ends them all (one stream,
        in order), or a :class:`Staged` one when the stager casts and issues them. Partitioned, this rank's
        shard goes to its place in `dst` and an all-gather on the same stream brings the other ranks' shards;
        the event ends that too. `source`: another whole compute copy of the unit's weights than its own (the
        spare copy a speculative step wrote)."""
        self.stats["h2d_bytes"] += unit.numel * dst.element_size()
        if unit.copy is None and self.ranks.stages_uploads:
            return Staged(self._stage(lambda: self._copies(unit, dst, None)))
        done = self._copies(unit, dst, unit.copy if source is None else source)
        if unit.partitioned:
            whole = dst[: unit.device_numel]
            self.streams.collective(self.streams.h2d, lambda: self.ranks.gather(whole))
            done = self.streams.event(self.streams.h2d)
            self.stats["allgather_bytes"] += whole.numel() * whole.element_size()
        return done

    def _copies(self, unit: HostUnit, dst: torch.Tensor, copy: torch.Tensor | None) -> object:
        """The H2D copies of `unit` into `dst` from its compute `copy` (None: cast from the master), piece by piece;
        the event of the last."""
        h2d, base, done = self.streams.h2d, unit.lo, None  # (base: 0 for a whole unit)
        for lo, hi in pieces(unit.numel, unit.numel if copy is not None else self.piece):
            buffer, source = (None, copy[lo:hi]) if copy is not None else self._cast(unit, lo, hi)
            # (one copy, unless the slot's alignment padding separates parameters: engine/host/units.py)
            for a, b, at in unit.slot_runs(base + lo, base + hi):
                self.streams.copy(h2d, dst[at : at + b - a], source[a - base - lo : b - base - lo])
            done = self.streams.event(h2d)
            if buffer is not None:
                self.staging.hold(buffer, done)  # free again once this copy has read it
        return done

    def _cast(self, unit: HostUnit, lo: int, hi: int) -> tuple[int, torch.Tensor]:
        """The next staging buffer (once the copy that last read it is done), holding the master's elements
        lo..hi cast to the compute dtype: the rounding the step's fused cast would do, so the same bits go up."""
        i, staged = self.staging.take(hi - lo)
        staged.copy_(unit.master[lo:hi])
        return i, staged

    def _stage(self, job: Callable[[], object]) -> Future:
        with self._lock:
            if self._stager is None:  # (one thread: uploads are issued in the order handed over)
                self._stager = ThreadPoolExecutor(1, "megatrain-stager", self._on_engine_device)
            return self._stager.submit(job)

    def _on_engine_device(self) -> None:
        """The stager's CUDA calls (events, copies) go to the engine's GPU, not to GPU 0, a new thread's default."""
        if self.streams.is_cuda and torch.cuda.is_available():  # (a recording double answers is_cuda on a CPU)
            torch.cuda.set_device(self.streams.device)

    def rings(self) -> list[HostRing]:
        return [self.staging] if self.staging is not None else []

    def close(self) -> None:
        """Let the stager's last uploads be issued, then end its thread."""
        with self._lock:
            stager, self._stager = self._stager, None
        if stager is not None:
            stager.shutdown(wait=True)
