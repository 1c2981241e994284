"""Streams, events and the GPU weight slots that blocks are streamed through.

On CUDA there are three streams: the compute stream (whatever stream is current when a block runs),
one for host-to-device weight uploads and one for device-to-host gradient downloads. Every copy the
engine issues goes through `Streams.copy` on one of the two copy streams, and an event recorded after
it marks its end: nothing reads a copy's target, or overwrites its source, before waiting for it.

Forward with S = 2 slots (slot a, slot b), block i computing while block i+1 uploads::

    H2D     | up 0 -> a |        | up 1 -> b |        | up 2 -> a |      ...
    compute |           | fwd 0 (a)          | fwd 1 (b)          | fwd 2 (a)
                          ^ waits ready[a]     ^ waits ready[b]
                                               ^ up 2 -> a waits free[a] (recorded after fwd 0)

Backward starts with the last S blocks still resident, so they are not uploaded again. A block's weight
gradients are packed into one of two device grad slots (g0, g1 in turn), downloaded into the unit's
pinned slab, and landed by the host worker::

    H2D     |                   | up L-3 -> b       |
    compute | bwd L-1 (b) -> g0 | bwd L-2 (a) -> g1 | bwd L-3 (b) -> g0
                                  ^ up L-3 -> b waits free[b] (recorded after bwd L-1)
                                                      ^ waits ready[b]; waits done[L-1] before writing g0
    D2H     |                   | g0 -> slab L-1    | g1 -> slab L-2
                                  ^ waits the compute event recorded after bwd L-1; records done[L-1]
    worker  |                      | land L-1, step L-1 | land L-2, step L-2 ...
                                     ^ done[L-1].synchronize() before reading the slab

On the CPU (no GPU) the same code runs with synchronous stand-ins: a copy happens when it is issued and
every event is complete, so the CPU suite exercises every scheduling decision above but no wait.
tests/async_streams.py is a test double that makes the two copy streams asynchronous on the CPU (each
copy queued on its stream, run late and in order on the stream's own thread, forced by a wait on an
event recorded after it). Under it the trainings stay bitwise equal to ordinary training, and removing
a wait for a copy (ready, done before the slab is read or g0 rewritten, the outer parameters' upload)
changes the result (tests/test_streams.py). A copy stream's waits for compute (free, the event before a
download) cannot be shown on the CPU: the host is the compute stream, so its compute has finished
before it issues the copy.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from megatrain_lightning.engine.config import check_num_slots


def issued(event: object) -> object:
    """`event`, or, for an upload the stager still has in hand (engine/device/uploads.py), the event of its last
    copy, once the stager has issued it."""
    resolve = getattr(event, "resolve", None)
    return resolve() if resolve is not None else event


class _DoneEvent:
    """CPU stand-in for a CUDA event: work on the CPU is finished when it has been issued."""

    def record(self, stream: object = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class Streams:
    """The H2D and D2H copy streams beside the compute stream, or synchronous stand-ins on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.h2d = torch.cuda.Stream(device) if self.is_cuda else None
        self.d2h = torch.cuda.Stream(device) if self.is_cuda else None
        self._collective_end: object | None = None  # the end of the device collective issued last

    def compute(self) -> torch.cuda.Stream | None:
        # The compute stream is looked up each time: autograd runs a node's backward on the stream its
        # forward used, which need not be the stream that was current when the engine was built.
        return torch.cuda.current_stream(self.device) if self.is_cuda else None

    def event(self, stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | _DoneEvent:
        """An event recorded now on `stream` (the compute stream when None)."""
        if not self.is_cuda:
            return _DoneEvent()
        # blocking=True: a host thread that waits for it (the worker before reading a slab, a staging buffer's
        # reuse) sleeps instead of spinning a core that the host optimizer's threads need. A stream's wait for
        # it is the same either way.
        ev = torch.cuda.Event(blocking=True)
        ev.record(stream if stream is not None else self.compute())
        return ev

    def wait(self, stream: torch.cuda.Stream | None, event: torch.cuda.Event | _DoneEvent | None) -> None:
        """Make `stream` (the compute stream when None) wait for `event` without blocking the host."""
        event = issued(event)  # (on the CPU too: a staged upload's copies are done once issued)
        if self.is_cuda and event is not None:
            (stream if stream is not None else self.compute()).wait_event(event)

    def ended(self, event: object) -> bool:
        """Whether the work before `event` has finished, without waiting (a poll)."""
        return issued(event).query()

    def synchronize(self) -> None:
        """Block the host until every stream of the device, copies included, has finished its work."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def run(self, stream: torch.cuda.Stream | None, work: Callable[[], None]) -> None:
        """Issue `work` (a collective) on `stream`, after what was issued there so far: it waits for that work
        and ends on the stream. Done at once on the CPU. A test double can run it late, in stream order."""
        with torch.cuda.stream(stream) if self.is_cuda else nullcontext():
            work()

    def collective(self, stream: torch.cuda.Stream | None, work: Callable[[], None]) -> None:
        """Issue a device collective (`work`) on `stream` (the compute stream when None), after the device
        collective issued before it has finished, whichever stream that one ran on.

        The weights' all-gathers run on the H2D stream and the gradients' exchange on the compute stream, each
        on its own communicator. Two NCCL collectives in flight at once on two communicators can hang: each
        kernel waits for its peers, and the ranks' GPUs may start them in different orders. Chained like this,
        a rank has one in flight at a time, in the order issued, which every rank shares (engine/ranks.py:
        every collective is issued at a point that does not depend on timing)."""
        self.wait(stream, self._collective_end)
        self.run(stream, work)
        self._collective_end = self.event(stream)

    def copy(self, stream: torch.cuda.Stream | None, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy `src` into `dst` on a copy stream: enqueued on CUDA (it runs after the waits issued on `stream`
        so far), done at once on the CPU. Every copy the engine puts on a copy stream goes through here, so
        a test double can intercept them (tests/async_streams.py)."""
        with torch.cuda.stream(stream) if self.is_cuda else nullcontext():
            dst.copy_(src, non_blocking=True)


class SlotPool:
    """S flat device buffers, each sized to the largest block, that block weights are uploaded into.

    Each slot remembers which block it holds, when that block's upload finished (`ready`) and when the
    compute stream last finished reading it (`free`). A slot is only overwritten after its `free` event,
    and compute only reads it after its `ready` event. Eviction is least-recently-used among slots not
    protected by the caller, which is what keeps the last blocks of forward resident for backward.
    """

    def __init__(self, streams: Streams, num_slots: int, numel: int, dtype: torch.dtype) -> None:
        if check_num_slots(num_slots) == "auto":
            raise ValueError("num_slots='auto' is the engine's to resolve: a pool is built with a count")
        self.streams, self.numel, self.dtype = streams, numel, dtype
        self.buffers: list[torch.Tensor] = []
        self.holder: list[int | None] = []
        self.ready: list[object | None] = []
        self.free: list[object | None] = []
        self.last_use: list[int] = []
        self.pins: list[int] = []  # calls that kept a graph over the slot's weights (engine/device/recompute.py)
        self.grow_when_pinned = False  # recompute=False: a slot is added when every one is pinned
        # Next weights uploaded ahead into a slot (speculative steps, engine/device/ahead.py): block -> (slot,
        # the upload's event, what says whether they became the block's weights). The slot holds no block.
        self.staged: dict[int, tuple[int, object, Any]] = {}
        self._clock = 0
        self.uploads = 0  # blocks uploaded since construction (tests read this)
        self.grow(num_slots)

    @property
    def num_slots(self) -> int:
        return len(self.buffers)

    @property
    def slot_bytes(self) -> int:
        return self.numel * torch.empty(0, dtype=self.dtype).element_size()

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def grow(self, n: int) -> None:
        """Add `n` empty slots (allocated now; a failed allocation leaves the slots added before it).

        A new slot's `free` event is recorded on the compute stream as it is allocated: the caching allocator
        may hand back memory that kernels already queued on the compute stream still read (activations freed
        mid-forward, when a slot grows with ``recompute=False``), and the first upload into the slot, on the
        H2D stream, must not overwrite it before they have run."""
        for _ in range(n):
            self.buffers.append(torch.empty(self.numel, dtype=self.dtype, device=self.streams.device))
            self.holder.append(None)
            self.ready.append(None)
            self.free.append(self.streams.event())
            self.last_use.append(0)
            self.pins.append(0)

    def truncate(self, n: int) -> None:
        """Keep the first `n` slots (the others must be empty and unpinned: slots just grown)."""
        if any(h is not None or p for h, p in zip(self.holder[n:], self.pins[n:])):
            raise RuntimeError(f"cannot drop weight slots {n}..{self.num_slots - 1}: a block is in one of them")
        for field in (self.buffers, self.holder, self.ready, self.free, self.last_use, self.pins):
            del field[n:]

    def slot_of(self, idx: int) -> int | None:
        return self.holder.index(idx) if idx in self.holder else None

    def invalidate(self, idx: int | None = None) -> None:
        """Forget that a slot holds block `idx` (all blocks when None), or next weights of it: its host weights
        were written from outside."""
        self.stepped(idx)
        for j in [j for j in self.staged if idx is None or j == idx]:
            del self.staged[j]

    def stepped(self, idx: int | None = None) -> None:
        """Forget that a slot holds block `idx` (all blocks when None): an optimizer step changed its weights
        (next weights uploaded ahead stay staged: whether they are the step's is :meth:`take_staged`'s caller's
        to say)."""
        for s, held in enumerate(self.holder):
            if idx is None or held == idx:
                self.holder[s] = None

    def stage(self, idx: int, s: int, upload: Callable[[torch.Tensor], object], tag: Any) -> object:
        """Upload next weights of block `idx` into slot `s`, which holds its present ones, behind the compute
        that reads them; the slot then holds no block until :meth:`commit`. Returns the upload's event."""
        self.streams.wait(self.streams.h2d, self.free[s])
        event = upload(self.buffers[s])
        self.holder[s] = None
        self.staged[idx] = (s, event, tag)
        self.last_use[s] = self._tick()
        self.uploads += 1
        return event

    def take_staged(self, idx: int) -> tuple[int, object, Any] | None:
        """(slot, event, tag) of next weights of block `idx` uploaded ahead and still there, forgotten here."""
        return self.staged.pop(idx, None)

    def commit(self, idx: int, s: int, event: object) -> int:
        """Next weights staged in slot `s` (:meth:`take_staged`) are block `idx`'s weights now."""
        self.holder[s], self.ready[s] = idx, event
        self.last_use[s] = self._tick()
        return s

    def load(
        self, idx: int, protect: set[int], upload: Callable[[torch.Tensor], object], optional: bool = False
    ) -> int | None:
        """Make sure block `idx` is resident or on its way; returns its slot. `upload(dst)` issues the H2D
        copies of its weights into the slot's buffer and returns the event that ends them. `optional` (a
        prefetch): None, and nothing issued, when every slot is protected or pinned."""
        s = self.slot_of(idx)
        if s is not None:
            return s
        s = self._victim(protect | {idx}, optional)
        if s is None:
            return None
        self.streams.wait(self.streams.h2d, self.free[s])  # never overwrite weights still being read
        self.ready[s] = upload(self.buffers[s])
        self.holder[s] = idx
        self.last_use[s] = self._tick()
        self.uploads += 1
        return s

    def acquire(self, s: int, numel: int) -> torch.Tensor:
        """The flat weights of slot `s`, safe to read on the compute stream from now on."""
        self.streams.wait(None, self.ready[s])
        self.last_use[s] = self._tick()
        return self.buffers[s][:numel]

    def release(self, s: int) -> None:
        """Compute has issued its last read of slot `s` for now."""
        self.free[s] = self.streams.event()

    def pin(self, s: int) -> None:
        """A call keeps a graph over slot `s`'s weights: nothing may overwrite them until :meth:`unpin`."""
        self.pins[s] += 1

    def unpin(self, s: int) -> None:
        self.pins[s] -= 1

    def pinned(self) -> int:
        """How many slots are pinned."""
        return sum(1 for n in self.pins if n)

    def _victim(self, protect: set[int], optional: bool = False) -> int | None:
        staged = {s: j for j, (s, _, _) in self.staged.items()}
        candidates = [
            s for s, held in enumerate(self.holder) if not self.pins[s] and (held is None or held not in protect)
        ]
        if any(s not in staged for s in candidates):  # a slot staged for a block is the last one taken
            candidates = [s for s in candidates if s not in staged]
        if not candidates and optional:
            return None
        if not candidates and self.grow_when_pinned:
            self.grow(1)
            return self.num_slots - 1
        if not candidates:
            raise RuntimeError(
                f"all {self.num_slots} weight slots hold protected blocks {sorted(protect)}; "
                "increase num_slots or prefetch fewer blocks"
            )
        victim = min(candidates, key=lambda s: (self.holder[s] is not None, self.last_use[s]))
        if victim in staged:
            del self.staged[staged[victim]]
        return victim

    def _tick(self) -> int:
        self._clock += 1
        return self._clock
