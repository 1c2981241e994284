"""The engine's host worker: one thread running host jobs one at a time, the most urgent ready one first.

A job is submitted with an ``order`` and the things it must come after (``after``: copy events it reads
the result of, the future of its unit's previous job). It is *ready* once all of those are complete.
The worker runs the ready job with the lowest order (the earliest submitted among equal orders); when
none is ready it waits for the first to become so. The engine gives a gradient's landing job order 0,
and an Adam step 1 + the place of its unit in the next forward (embedding, blocks 0..L-1, final norm and
head). When the optimizer overlaps backward, gradients land in backward order, L-1 first: the worker
steps, among the gradients that have landed, the one the next forward needs first, so when the backward
ends block 0 is stepped next (not after every other block still queued) and the next forward starts
while the rest are stepped in its order.

``fifo=True`` (the NVMe tier, whose read-ahead plan names the steps in the order they were queued) runs
jobs strictly in submission order, as a one-thread pool would.

A unit's jobs run in the order submitted whatever their orders (each comes after its unit's previous
job), so a unit's ``future`` remains its last job.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any


class HostWorker:
    """A single thread running submitted callables, the ready one of lowest (order, submission) first."""

    def __init__(
        self, thread_name: str, initializer: Callable[..., None], initargs: tuple = (), fifo: bool = False
    ) -> None:
        self._initializer, self._initargs, self.fifo = initializer, initargs, fifo
        self._queue: list[tuple[int, int, Future, Callable, tuple, dict, tuple]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._closing = False
        self._broken: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=thread_name, daemon=True)
        self._thread.start()

    def submit(
        self, fn: Callable[..., Any], /, *args: Any, order: int = 0, after: Iterable[Any] = (), **kwargs: Any
    ) -> Future:
        future: Future = Future()
        with self._cv:
            if self._closing:
                raise RuntimeError("the engine's host worker was shut down (engine.close())")
            self._queue.append(
                (order, next(self._seq), future, fn, args, kwargs, tuple(a for a in after if a is not None))
            )
            self._cv.notify()
        return future

    def shutdown(self, wait: bool = True) -> None:
        """Run what is queued, then stop."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        if wait:
            self._thread.join()

    def _next(self) -> tuple | None:
        """The job to run now, removed from the queue (lock held): the ready one of lowest order; when only
        copy events hold every job back, the earliest one whose unit's previous job is done (it waits for
        its copy inside, as every landing does: the worker never idles while a job could make progress,
        and a copy that completes only when waited on cannot stall it). None when the queue is empty."""
        if self.fifo:
            job = self._queue[0] if self._queue else None
        else:
            free = [j for j in self._queue if all(a.done() for a in j[6] if isinstance(a, Future))]
            ready = [j for j in free if all(a.query() for a in j[6] if not isinstance(a, Future))]
            job = min(ready, key=lambda j: (j[0], j[1])) if ready else min(free, key=lambda j: j[1], default=None)
        if job is not None:
            self._queue.remove(job)
        return job

    def _loop(self) -> None:
        try:
            self._initializer(*self._initargs)
        except BaseException as err:  # every job fails with it, as a broken pool's would
            self._broken = err
        while True:
            with self._cv:
                job = self._next()
                while job is None:  # (a non-empty queue always has a job whose unit is free)
                    if self._closing:
                        return
                    self._cv.wait()
                    job = self._next()
            self._run(job)

    def _run(self, job: tuple) -> None:
        _, _, future, fn, args, kwargs, _ = job
        if not future.set_running_or_notify_cancel():
            return
        if self._broken is not None:
            future.set_exception(RuntimeError(f"the host worker failed to start: {self._broken!r}"))
            return
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as err:
            future.set_exception(err)
