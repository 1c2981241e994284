"""A CPU test double for the copy streams that really is asynchronous: :class:`AsyncStreams`.

The CPU stand-ins in ``engine/device/streams.py`` copy at once, so on the CPU every wait the engine issues is
trivially satisfied and a missing one goes unnoticed. This double takes their place (installed with
:func:`install`, over the ``Streams`` class the engine instantiates) and makes the H2D and D2H streams
behave like CUDA streams:

- ``copy(stream, dst, src)`` only enqueues: the copy runs later, on the stream's own thread, and reads
  ``src`` when it runs, not when it was issued;
- each stream runs its work in issue order. Before an item runs it is *held* (with probability `hold`,
  until something needs it) or delayed by a random time up to `max_delay`; the draws come from a seeded
  ``random.Random`` per stream, in issue order;
- an event recorded on a copy stream completes when the stream reaches it. Waiting for it forces the
  stream: every hold up to the event is released and the delays are skipped. The host forces with
  ``event.synchronize()``, the compute stream with ``wait(None, event)``, and a wait queued on the other
  copy stream forces once it is forced itself;
- ``wait(stream, event)`` on a copy stream enqueues the wait: nothing issued on `stream` after it runs
  before `event` has completed;
- ``run(stream, work)`` (a collective, data parallel) enqueues `work` and forces the stream up to it: the
  other ranks wait for it, as they would for a GPU stream, which never holds work back.

The compute "stream" is the host thread itself (CPU compute is synchronous), so ``wait(None, event)``
blocks the host until the event's copies have run, and an event recorded on the compute stream is
complete when it is recorded.

``hold=1.0`` is the lazy extreme: nothing runs before it is waited for, so reading a buffer without its
wait deterministically sees the data from before the copy.

`skip` removes waits, to prove they are needed: pairs ``(function, waiter)`` where `function` is the name of
the engine function that issues the wait and `waiter` is ``"compute"`` / ``"h2d"`` / ``"d2h"`` for
``wait(stream, event)`` or ``"host"`` for ``event.synchronize()``. Each removed wait is counted in
``skipped``.

What this cannot catch: a missing wait of a copy stream for the *compute* stream (H2D on a slot's
``free`` event, D2H on the gradient's ``produced`` event, the outer upload's wait for earlier compute) and
a missing ``record_stream``. The host issues each copy after the compute it has already run, so those
events are complete when recorded; and a queued copy holds a Python reference to its tensors, so the
caching allocator's reuse that ``record_stream`` prevents cannot happen here.
"""

from __future__ import annotations

import random
import sys
import threading
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

import torch

from megatrain_lightning.engine import build as build_module
from megatrain_lightning.engine.device.streams import Streams, _DoneEvent, issued

IDLE_EXIT_S = 0.5  # a stream thread with nothing queued exits after this long (restarted on demand)
MAX_HOLD_S = 60.0  # a held item nobody waits for runs after this long, so abandoned engines leak no thread


class AsyncEvent:
    """An event recorded on an :class:`AsyncStreams` copy stream: done when the stream has reached it."""

    def __init__(self, stream: _CopyStream) -> None:
        self.stream = stream
        self.seq = 0  # position in the stream's issue order (set when recorded)
        self.done = False

    def synchronize(self) -> None:
        owner = self.stream.owner
        key = (sys._getframe(1).f_code.co_name, "host")
        if key in owner.skip:
            owner.skipped[key] += 1
            return
        owner._host_wait(self)

    def query(self) -> bool:
        return self.done


@dataclass
class _Item:
    kind: str  # "copy" | "wait" | "record" | "run"
    seq: int
    payload: Any
    held: bool
    delay: float


class _CopyStream:
    """One copy stream: a queue run in order by its own thread."""

    def __init__(self, owner: AsyncStreams, name: str, seed: int, hold: float, max_delay: float) -> None:
        self.owner, self.name = owner, name
        self.rng = random.Random(f"{seed}-{name}")
        self.hold, self.max_delay = hold, max_delay
        self.queue: deque[_Item] = deque()
        self.issued = 0  # seq of the last item enqueued
        self.demand = 0  # items up to this seq must run now: somebody waits for them
        self.thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"<AsyncStreams {self.name}>"

    # Called with the owner's condition held.
    def put(self, kind: str, payload: Any) -> int:
        self.issued += 1
        held = self.rng.random() < self.hold
        delay = self.rng.uniform(0.0, self.max_delay)
        self.queue.append(_Item(kind, self.issued, payload, held, delay))
        if kind == "record":
            payload.seq = self.issued
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name=f"async-{self.name}", daemon=True)
            self.thread.start()
        self.owner._cv.notify_all()
        return self.issued

    def force(self, seq: int) -> None:
        if seq > self.demand:
            self.demand = seq
            self.owner._cv.notify_all()

    def _run(self) -> None:
        cv = self.owner._cv
        with cv:
            while True:
                if not self.queue and not cv.wait_for(lambda: self.queue, timeout=IDLE_EXIT_S):
                    self.thread = None
                    return
                item = self.queue[0]

                def forced(item: _Item = item) -> bool:
                    return self.demand >= item.seq

                if item.held:
                    cv.wait_for(forced, timeout=MAX_HOLD_S)
                elif item.delay > 0:
                    cv.wait_for(forced, timeout=item.delay)
                if item.kind == "wait":
                    event: AsyncEvent = item.payload
                    while not event.done:  # nothing behind this wait runs before the event completes
                        if forced():
                            event.stream.force(event.seq)
                        cv.wait()
                elif item.kind in ("copy", "run"):
                    cv.release()
                    try:
                        with torch.no_grad():  # a device copy is never recorded by autograd
                            if item.kind == "run":
                                item.payload()
                            else:
                                item.payload[0].copy_(item.payload[1])
                    except BaseException as e:  # surfaced to the next waiter
                        self.owner.error = self.owner.error or e
                    finally:
                        cv.acquire()
                else:
                    item.payload.done = True
                self.queue.popleft()
                self.owner.log.append((self.name, item.seq, item.kind))
                cv.notify_all()


class AsyncStreams(Streams):
    """Drop-in for :class:`Streams` on the CPU whose copy streams run late, in order, on their own threads."""

    def __init__(
        self,
        device: torch.device,
        *,
        seed: int = 0,
        hold: float = 0.25,
        max_delay: float = 1e-3,
        skip: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(device)
        if self.is_cuda:
            raise ValueError("AsyncStreams stands in for the CPU streams only")
        self._cv = threading.Condition()
        self.h2d = _CopyStream(self, "h2d", seed, hold, max_delay)
        self.d2h = _CopyStream(self, "d2h", seed, hold, max_delay)
        self.skip = set(skip)
        self.skipped: Counter = Counter()
        self.log: list[tuple[str, int, str]] = []  # (stream, seq, kind) in the order the items ran
        self.copies = 0  # copies issued
        self.error: BaseException | None = None

    def event(self, stream: _CopyStream | None = None) -> AsyncEvent | _DoneEvent:
        if stream is None:
            return _DoneEvent()  # compute is the host thread: everything issued so far has run
        ev = AsyncEvent(stream)
        with self._cv:
            stream.put("record", ev)
        return ev

    def wait(self, stream: _CopyStream | None, event: Any) -> None:
        key = (sys._getframe(1).f_code.co_name, "compute" if stream is None else stream.name)
        if key in self.skip:
            self.skipped[key] += 1
            return
        event = issued(event)  # an upload the stager still has in hand: once it has issued it
        if event is None or isinstance(event, _DoneEvent):
            return
        if stream is None:
            self._host_wait(event)
        else:
            with self._cv:
                stream.put("wait", event)

    def copy(self, stream: _CopyStream | None, dst: torch.Tensor, src: torch.Tensor) -> None:
        if stream is None:
            raise ValueError("copies go on a copy stream")
        with self._cv:
            self.copies += 1
            stream.put("copy", (dst, src))

    def run(self, stream: _CopyStream | None, work: Any) -> None:
        """A collective issued on a copy stream runs there in order, never held: the other ranks wait for it
        (so the items before it are forced). Skipped (``(function, "run")``), it runs at once on the calling
        thread, before what was issued on the stream ahead of it."""
        key = (sys._getframe(1).f_code.co_name, "run")
        if stream is None or key in self.skip:
            self.skipped[key] += int(stream is not None)
            work()
            return
        with self._cv:
            stream.force(stream.put("run", work))
        self._raise()

    def synchronize(self) -> None:
        with self._cv:
            for s in (self.h2d, self.d2h):
                s.force(s.issued)
            self._cv.wait_for(lambda: self.error is not None or not (self.h2d.queue or self.d2h.queue))
            self._raise()

    def _host_wait(self, event: AsyncEvent) -> None:
        with self._cv:
            event.stream.force(event.seq)
            self._cv.wait_for(lambda: event.done or self.error is not None)
            self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError("a copy on an AsyncStreams stream failed") from self.error


def install(monkeypatch: Any, **kwargs: Any) -> list[AsyncStreams]:
    """Make every engine built from now on (until `monkeypatch` undoes it) use :class:`AsyncStreams`
    with `kwargs`; returns the list the instances are appended to."""
    made: list[AsyncStreams] = []

    def factory(device: torch.device) -> AsyncStreams:
        made.append(AsyncStreams(device, **kwargs))
        return made[-1]

    monkeypatch.setattr(build_module, "Streams", factory)
    return made
