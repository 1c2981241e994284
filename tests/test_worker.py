"""The engine's host worker: the ready job of lowest order first, submission order among equals."""

from __future__ import annotations

import threading

from megatrain_lightning.engine.host.worker import HostWorker


class Gate:
    """An event stand-in that completes when opened: query() as the worker asks, synchronize() as a
    landing job waits for its copy."""

    def __init__(self) -> None:
        self.opened = threading.Event()

    def query(self) -> bool:
        return self.opened.is_set()

    def synchronize(self) -> None:
        self.opened.wait()


def blocked_worker(fifo: bool = False) -> tuple[HostWorker, threading.Event]:
    """A worker busy with a first job until the returned event is set, so later submissions queue up."""
    release = threading.Event()
    worker = HostWorker("test-host", lambda: None, fifo=fifo)
    worker.submit(release.wait)
    return worker, release


def test_ready_jobs_run_lowest_order_first_and_in_submission_order_among_equals():
    worker, release = blocked_worker()
    ran: list[str] = []
    for name, order in [("step 5", 5), ("step 2", 2), ("land a", 0), ("step 2 again", 2), ("land b", 0)]:
        worker.submit(ran.append, name, order=order)
    release.set()
    worker.shutdown()
    assert ran == ["land a", "land b", "step 2", "step 2 again", "step 5"]


def test_a_job_waits_for_its_event_and_its_units_previous_job():
    """An urgent job whose copy has not finished does not hold up a ready one; with nothing else to do the
    worker runs it anyway and it waits for its copy inside; the job after it in its unit's chain runs only
    after it, whatever its order."""
    worker, release = blocked_worker()
    ran: list[str] = []
    copy = Gate()
    landing = worker.submit(lambda: copy.synchronize() or ran.append("landing"), order=0, after=(copy,))
    worker.submit(ran.append, "its step", order=1, after=(landing,))
    other = worker.submit(ran.append, "other step", order=9)
    release.set()
    other.result(timeout=5)
    assert ran == ["other step"]  # the landing's copy is still running
    copy.opened.set()
    worker.shutdown()
    assert ran == ["other step", "landing", "its step"]


def test_fifo_runs_in_submission_order():
    worker, release = blocked_worker(fifo=True)
    ran: list[int] = []
    for order in [3, 1, 2]:
        worker.submit(ran.append, order, order=order)
    release.set()
    worker.shutdown()
    assert ran == [3, 1, 2]


def test_errors_reach_the_future_and_a_failed_start_fails_every_job():
    worker = HostWorker("test-host", lambda: None)
    future = worker.submit(lambda: 1 / 0)
    worker.shutdown()
    assert isinstance(future.exception(timeout=5), ZeroDivisionError)

    def boom() -> None:
        raise RuntimeError("no device")

    broken = HostWorker("test-host", boom)
    job = broken.submit(lambda: "never")
    broken.shutdown()
    assert "failed to start" in str(job.exception(timeout=5))
