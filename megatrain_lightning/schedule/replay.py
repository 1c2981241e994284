"""Replaying a recorded trace against a device profile: when each op runs on each lane.

Five lanes: ``compute`` (the GPU's compute stream), ``h2d`` and ``d2h`` (its copy engines), ``host`` (the
engine's worker thread) and ``issue`` (the Python thread that launches kernels and blocks on syncs); a rank
of the data-parallel model (``ranks.py``) adds a sixth, ``peer``, for collectives on the NVLink between GPUs.

- The issuing thread walks its items in order. Each kernel or copy costs it `launch_s`; on its lane the op
  starts at the latest of its issue time, the end of the lane's previous op and the events the lane was
  told to wait for, and lasts its modelled time. An event completes when everything enqueued on its lane
  before it has (or when it is recorded, on an idle lane). A sync moves the thread's clock to the end of
  what it waits for (an event, a host job, the whole device): that stretch is recorded as blocked.
- The worker runs one job at a time, as engine/host/worker.py does: a job is ready once submitted and once
  what it was submitted after (copy events, earlier jobs) is complete; when the worker is free it takes
  the ready job of lowest order (submission order among equal ones), else waits for the first to become
  ready. Its waits on copy events block it like the issuing thread's; its kernels take their host time.

Kernel time = max(FLOPs / rate, bytes / HBM bandwidth, KERNEL_FLOOR_S): attention at the profile's
attention rate on causal FLOPs (the flash kernels skip the masked half), everything else at the matmul
rate. Copy time = bytes / link bandwidth (on ``peer``: / the GPU-to-GPU link's bandwidth). Host time: Adam steps at the profile's Adam rate (params/s),
other host work (accumulation, norms, casts) = bytes / host bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatrain_lightning.schedule.profiles import Profile
from megatrain_lightning.schedule.trace import (
    Copy,
    DeviceSync,
    HostWork,
    Join,
    Kernel,
    Mark,
    Record,
    Submit,
    Sync,
    Trace,
    Wait,
)

LAUNCH_S = 8e-6
"""Issuing one kernel or copy from Python: PyTorch's eager dispatch plus cudaLaunchKernel, typically 5-10 us."""
KERNEL_FLOOR_S = 2e-6
"""The shortest a kernel takes on the GPU, however little it does (launch latency and tail)."""
DEVICE_LANES = ("compute", "h2d", "d2h", "peer")


@dataclass(frozen=True)
class Interval:
    lane: str  # compute, h2d, d2h, host, issue; blocked stretches: "issue blocked", "host blocked"
    start: float
    end: float
    step: int
    what: str  # kernel name / copy / host kind / where a thread blocked
    phase: str = ""
    origin: str = ""  # a kernel's: "model" or "engine:<function>" (trace.Kernel)

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    intervals: list[Interval] = field(default_factory=list)
    marks: dict[int, float] = field(default_factory=dict)  # step -> when the issuing thread began it


@dataclass(frozen=True)
class _JobStart:
    job: int


@dataclass(frozen=True)
class _JobEnd:
    job: int


class _Thread:
    """A host thread's items and clock."""

    def __init__(self, name: str, items: list) -> None:
        self.name, self.items, self.i, self.clock = name, items, 0, 0.0
        self.step = 0  # the step of the job running (worker) or of the last mark (issuer)

    @property
    def done(self) -> bool:
        return self.i >= len(self.items)


class Replay:
    """One replay of `trace` on `profile` (call :meth:`run` once)."""

    def __init__(self, trace: Trace, profile: Profile, launch_s: float = LAUNCH_S) -> None:
        self.trace, self.profile, self.launch_s = trace, profile, launch_s
        self.frontier = dict.fromkeys(DEVICE_LANES, 0.0)  # when everything enqueued on a lane so far is done
        self.events: dict[int, float] = {}
        self.submitted: dict[int, float] = {}
        self.ended: dict[int, float] = {}
        self.timeline = Timeline()
        self.started: set[int] = set()
        self.threads = (_Thread("issue", trace.issue), _Thread("host", []))  # the issuing thread reads the list live

    def run(self) -> Timeline:
        """Replay the whole trace; RuntimeError when it cannot proceed."""
        self._go(live=False)
        issue, worker = self.threads
        if not (issue.done and worker.done) or len(self.started) < len(self.trace.jobs):
            stuck = {t.name: t.items[t.i] for t in self.threads if not t.done}
            raise RuntimeError(f"the recorded schedule cannot proceed: each thread waits for the other ({stuck})")
        return self.timeline

    def catch_up(self) -> None:
        """Live replay, while the trace is still being recorded: replay what has been issued so far. The
        worker starts no job after the issuing thread's clock, since an item issued later may submit a job
        that would go first."""
        self._go(live=True)

    def ended_by_now(self, job: int) -> bool:
        """Live replay: whether host job `job` has finished by the issuing thread's clock (what a real
        ``future.done()`` would answer at that point of the recording)."""
        self.catch_up()
        return job in self.ended and self.ended[job] <= self.threads[0].clock

    def event_ended_by_now(self, event: int) -> bool:
        """Live replay: whether `event` is complete by the issuing thread's clock (a real ``event.query()``)."""
        self.catch_up()
        return event in self.events and self.events[event] <= self.threads[0].clock

    def _go(self, live: bool) -> None:
        """Advance both threads as far as the items allow (`live`: no job started past the clock of an
        issuing thread that has run out of items)."""
        issue, worker = self.threads
        while True:
            moved = self._advance(issue)
            if worker.done:
                limit = issue.clock if live and issue.done else None
                moved = self._next_job(worker, limit) or moved
            if not (self._advance(worker) or moved):
                return

    def _ready_at(self, job: int) -> float | None:
        """When `job` can start (submitted, what it comes after complete), None while that is not known."""
        if job not in self.submitted:
            return None
        events, jobs = self.trace.job_after[job] if self.trace.job_after else ((), ())
        if any(e not in self.events for e in events) or any(j not in self.ended for j in jobs):
            return None
        return max([self.submitted[job], *(self.events[e] for e in events), *(self.ended[j] for j in jobs)])

    def _next_job(self, worker: _Thread, limit: float | None = None) -> bool:
        """Give the idle worker its next job: the issuing thread has gone as far as it can, so every job
        that can be ready before the worker's clock is known (live: before `limit`, the issuing thread's
        clock, which later submissions cannot precede). Whether there was one."""
        ready = {j: t for j in self.submitted if j not in self.started and (t := self._ready_at(j)) is not None}
        if not ready:
            return False
        at = max(worker.clock, min(ready.values()))
        if limit is not None and at >= limit:
            return False
        order = self.trace.job_order or [0] * len(self.trace.jobs)  # (a trace built by hand may give none)
        job = min((j for j, t in ready.items() if t <= at), key=lambda j: (order[j], j))
        self.started.add(job)
        worker.items += [_JobStart(job), *self.trace.jobs[job], _JobEnd(job)]
        return True

    def _advance(self, thread: _Thread) -> bool:
        """Run `thread` until it waits for something not replayed yet; whether it moved."""
        moved = False
        while not thread.done and self._apply(thread, thread.items[thread.i]):
            thread.i += 1
            moved = True
        return moved

    def _apply(self, t: _Thread, item: Any) -> bool:
        """Replay one item on thread `t`; False when it depends on what the other thread has not reached."""
        if isinstance(item, (Kernel, Copy)):
            lane = "compute" if isinstance(item, Kernel) else item.lane
            self._enqueue(t, lane, self._device_seconds(item), item)
        elif isinstance(item, Record):
            self.events[item.event] = max(self.frontier[item.lane], *(self.frontier[a] for a in item.also), t.clock)
        elif isinstance(item, Wait):
            if item.event not in self.events:
                return False
            self.frontier[item.lane] = max(self.frontier[item.lane], self.events[item.event])
        elif isinstance(item, Sync):
            if item.event not in self.events:
                return False
            self._block(t, self.events[item.event], item.where)
        elif isinstance(item, DeviceSync):
            self._block(t, max(self.frontier.values()), item.where)
        elif isinstance(item, Join):
            if item.job not in self.ended:
                return False
            self._block(t, self.ended[item.job], item.where)
        else:
            return self._apply_host(t, item)
        return True

    def _apply_host(self, t: _Thread, item: Any) -> bool:
        if isinstance(item, HostWork):
            end = t.clock + self._host_seconds(item)
            step = t.step if t.name == "host" else item.step  # a job's work belongs to the step that asked for it
            self.timeline.intervals.append(Interval(t.name, t.clock, end, step, item.kind, item.phase))
            t.clock = end
        elif isinstance(item, Submit):
            self.submitted[item.job] = t.clock
        elif isinstance(item, _JobStart):
            if item.job not in self.submitted:
                return False
            t.step, t.clock = self.trace.job_step[item.job], max(t.clock, self.submitted[item.job])
        elif isinstance(item, _JobEnd):
            self.ended[item.job] = t.clock
        elif isinstance(item, Mark):
            t.step, self.timeline.marks[item.step] = item.step, t.clock
        else:
            raise TypeError(f"cannot replay {item!r}")
        return True

    def _enqueue(self, t: _Thread, lane: str, seconds: float, item: Kernel | Copy) -> None:
        issued = t.clock + self.launch_s
        self.timeline.intervals.append(Interval(t.name, t.clock, issued, item.step, "launch", item.phase))
        t.clock = issued
        start = max(issued, self.frontier[lane])
        self.frontier[lane] = start + seconds
        what, origin = (item.name, item.origin) if isinstance(item, Kernel) else (item.what, "")
        self.timeline.intervals.append(Interval(lane, start, start + seconds, item.step, what, item.phase, origin))

    def _block(self, t: _Thread, until: float, where: str) -> None:
        if until > t.clock:
            self.timeline.intervals.append(Interval(f"{t.name} blocked", t.clock, until, t.step, where))
            t.clock = until

    def _device_seconds(self, item: Kernel | Copy) -> float:
        p = self.profile
        if isinstance(item, Copy):
            return item.nbytes / (p.peer_bytes() if item.lane == "peer" else p.link_bytes())
        rate = p.attention_flops() if item.attention else p.matmul_flops()
        flops = item.flops / 2 if item.causal else item.flops
        return max(flops / rate, item.nbytes / p.hbm_bytes(), KERNEL_FLOOR_S)

    def _host_seconds(self, item: HostWork) -> float:
        if item.kind == "adam":
            return item.numel / self.profile.adam_params()
        return item.nbytes / self.profile.host_bytes()


def replay(trace: Trace, profile: Profile, launch_s: float = LAUNCH_S) -> Timeline:
    """The timeline of `trace` on `profile` (module docstring)."""
    return Replay(trace, profile, launch_s).run()
