"""The step's last gradient sums sent down in the order the next forward needs them.

With gradient sums kept on the device, speculative steps and a slot for every block (so that each block's next
weights go up as soon as its speculative step is done: engine/device/ahead.py), a step of micro-batches ends
with every unit's fp32 sum going down (4 B/param) as its last backward ends: the head's first, the blocks' from
the last one down, the embedding's last. A CUDA stream runs its copies in the order they were issued, so issued
at once the embedding's sum, which the next forward needs first, waits behind every block's (at 8B on an H100,
0.6 s of downloads for a 0.37 s backward). Here a sum waits on the host instead while the link has
:data:`IN_FLIGHT` of them still to finish, and each time the link has room the waiting sum whose unit the next
forward reads first goes (the worker's rank of its speculative step, engine/host/worker.py): a sum that waits
is passed by the later ones, which the forward needs sooner, and the embedding's goes almost at once. At the end
of the backward (autograd's final callback) every waiting sum is sent in that order; anything that reads or
waits for a unit sends its sum first (:meth:`NeededFirst.send_now`), so no landing of a unit is ever reordered.

Only the order of the copies changes: each sum is the same bytes into the same accumulator, landed and
stepped as before (tests/test_needed_first.py, bit for bit under copy streams that really run late).
docs/benchmarks.md, "The tail of a step of micro-batches", has the floor this order approaches.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megatrain_lightning.engine.host.units import HostUnit

IN_FLIGHT = 3
"""Sums on the link (issued, not finished) beyond which the next one waits. The thread issuing the backward runs
about two block calls ahead of the GPU, so of three such sums one is copying and two may still wait for their
gradient; with two the link idled between checks (one per block's backward). Modelled for Llama 3.1 8B, 4 x
4096 on h100-sxm (docs/benchmarks.md): 1 in flight 2.383 s, 2: 2.267, 3: 2.199, 4: 2.196, 6: 2.203."""


@dataclass(order=True)
class _Waiting:
    rank: int  # engine/host/host_steps.HostSide.step_rank: the next forward's order
    seq: int
    unit: HostUnit = field(compare=False)
    send: Callable[[], object] = field(compare=False)  # issues the copy (and what follows it); its event
    held: bool = field(default=False, compare=False)  # it did wait (not sent as it was deferred)


class NeededFirst:
    """The sums of one backward waiting for the link, and the events of those on it (module docstring)."""

    def __init__(self, streams, stats: dict) -> None:
        self.streams, self.stats = streams, stats
        self._waiting: list[_Waiting] = []
        self._sent: deque = deque()  # events of sums issued in this backward, oldest first
        self._seq = itertools.count()
        self._armed: int | None = None  # the backward (autograd's graph task) whose final callback is queued
        # Whether sums may wait now: only where every block's next weights go up ahead (speculative steps, a slot
        # for every block: engine/device/ahead.UploadsAhead.possible), so that the next forward waits on each
        # unit's sum, step and upload alone. With fewer slots the forward's own uploads pace it, and sums held
        # back made the step slower (8B, 4 x 4096, 14 slots: 2.672 s in landing order, 2.727 needed first).
        self.when: Callable[[], bool] = lambda: False

    def defer(self, rank: int, unit: HostUnit, send: Callable[[], object]) -> bool:
        """Let `unit`'s sum wait for the link; False outside a backward (nothing would send it at the end):
        the caller sends it now."""
        task = torch._C._current_graph_task_id()
        if self._armed != task:  # (a backward that failed left its callback unrun: this one gets its own)
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self.flush)
            except RuntimeError:  # "Final callbacks can only be installed during backward pass"
                return False
            self._armed = task
        w = _Waiting(rank, next(self._seq), unit, send)
        self._waiting.append(w)
        self.pump()
        w.held = w in self._waiting
        return True

    def pump(self, flush: bool = False) -> None:
        """Send waiting sums, needed first, while the link has room (`flush`: all of them)."""
        while self._waiting:
            while self._sent and self.streams.ended(self._sent[0]):
                self._sent.popleft()
            if not flush and len(self._sent) >= IN_FLIGHT:
                return
            first = min(self._waiting)
            self._waiting.remove(first)
            self._send(first)

    def send_now(self, unit: HostUnit) -> None:
        """`unit`'s sum, if it waits, goes now: something is about to read or wait for the unit."""
        for w in self._waiting:
            if w.unit is unit:
                self._waiting.remove(w)
                self._send(w)
                return

    def flush(self) -> None:
        """Every waiting sum, needed first (the end of the backward)."""
        self.pump(flush=True)
        self._sent.clear()
        self._armed = None

    def waiting(self) -> bool:
        return bool(self._waiting)

    def _send(self, w: _Waiting) -> None:
        self._sent.append(w.send())
        if w.held:
            self.stats["sums_held_for_the_link"] += 1
