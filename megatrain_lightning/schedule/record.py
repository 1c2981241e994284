"""Recording what the engine issues: device kernels, copies, events and waits, host jobs and host blocks.

A :class:`Recorder` is installed around an engine from outside, without a change to the engine:

- a double of ``engine.streams`` (:class:`RecordingStreams`, put in place of ``engine.build.Streams``
  while the engine is built, so the slot pool and the saved inputs get it too) that answers like a CUDA
  device (``is_cuda`` is True) but only logs: each copy (lane and bytes), each event (a marker at its
  place in its lane), each wait (the lane's next op depends on the event) and each host block on an event;
- a dispatch mode on the issuing thread that logs every op as a device kernel (FLOPs from
  ``torch.utils.flop_counter``'s registry, bytes read and written), or as host work when it touches a host
  buffer (every host buffer comes from ``host_empty``, whose observers name them, as in measure.py);
- a proxy of the engine's worker pool: each job and what it does (the kernels ``adam_step_``,
  ``accumulate_``, ``param_norms``, wrapped in ``optim.kernels``, with their element counts and bytes, and
  its waits on copy events), and each place a thread blocks on a job (``future.result()``). Jobs run when
  submitted, on the submitting thread (see :class:`_Worker`); whether one would be done yet
  (``future.done()``) is the live replay's answer;
- a torch-function mode that logs the host reading a device tensor (``.cpu()``, ``.item()``, ...), which on
  the CPU stand-in runs no op at all;
- wrappers of ``engine.streamer.forward_block``/``backward_block`` that name the block every op belongs to;
- measure.py's device-byte counter (host jobs and buffers excluded): the free memory the engine reads
  (:meth:`Recorder.probes`) shrinks as the slot pool grows and as block calls keep their graphs.

On fake tensors the kernels only log (the native kernel cannot read a fake buffer); on real tensors they
also run, and the copies are done at once, as on the CPU stand-in streams.

Why one file of about 570 lines: the doubles above are one recording, installed and removed together around
one engine, each logging into the same trace in the order the threads issue; split, every part would need
the recorder's state (the step and phase under way, the host buffers it has seen) handed across files.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from megatrain_lightning.engine.host import host_steps
from megatrain_lightning.engine.probes import Probes
from megatrain_lightning.optim import kernels
from megatrain_lightning.planning.measure import DeviceBytes, observe_host_allocations, storage_key, tensors_in
from megatrain_lightning.schedule.origin import compiled_graph, origin
from megatrain_lightning.schedule.profiles import Profile
from megatrain_lightning.schedule.replay import LAUNCH_S, Replay
from megatrain_lightning.schedule.report import gpu_kind
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

aten = torch.ops.aten


# -- the recorder ----------------------------------------------------------------------------------------
class Recorder:
    """Collects a :class:`Trace`; `step`, `stage` and the running block name what each item belongs to.

    With a device `profile` the trace is replayed live as it is recorded, so a decision the engine takes
    from timing (``future.done()``: is a block's optimizer step finished, may it be prefetched now?) gets
    the answer it would get on that device; without one every job counts as finished."""

    def __init__(self, profile: Profile | None = None, launch_s: float = LAUNCH_S, fusion: Any = None) -> None:
        self.trace = Trace()
        self.fusion = fusion  # compile_blocks modelled: the block's memory-bound bytes scaled (fusion.py)
        self.live = None if profile is None else Replay(self.trace, profile, launch_s)
        self.step, self.stage = 0, "setup"
        self.block: tuple[str, int] | None = None
        self.events = 0
        self._local = threading.local()  # .job: the host job running; .quiet: ops not to log
        self._host: set[int] = set()  # storage keys of host buffers
        self._undo: list[Callable[[], None]] = []
        self.memory = DeviceBytes(skip=self.in_job)  # device bytes live; a host job's are host memory

    @property
    def phase(self) -> str:
        return f"{self.block[0]} block {self.block[1]}" if self.block else self.stage

    def begin_step(self, step: int) -> None:
        self.step, self.stage = step, "forward"
        self.trace.issue.append(Mark(step))

    def log(self, item: Any) -> None:
        """Append to the running host job's items while one runs, else to the issuing thread's."""
        job = self.running_job()
        (self.trace.issue if job is None else self.trace.jobs[job]).append(item)

    @contextmanager
    def quiet(self) -> Iterator[None]:
        """Ops run meanwhile are not logged: they are part of something logged as a whole (a copy, a host kernel)."""
        self._local.quiet = getattr(self._local, "quiet", 0) + 1
        try:
            yield
        finally:
            self._local.quiet -= 1

    def in_job(self) -> bool:
        return self.running_job() is not None

    def is_quiet(self) -> bool:
        return getattr(self._local, "quiet", 0) > 0

    # -- installation ---------------------------------------------------------------------------------
    @contextmanager
    def recording(self) -> Iterator[Recorder]:
        """Log from now on (build the engine inside, with :meth:`probes`). Enter inside a FakeTensorMode
        (if any), so that this dispatch mode sees each op before the fake mode runs it."""
        with (
            _patched_kernels(self),
            observe_host_allocations(self._host_buffer),
            observe_host_allocations(self.memory.host_buffer),
            _Ops(self),
            _HostReads(self),
            self.memory,
        ):
            try:
                yield self
            finally:
                self.detach()

    def probes(self, device_memory: tuple[int, int] | None = None) -> Probes:
        """What an engine recorded by this recorder runs on: the recording streams, its host jobs through the
        recorder, no host-memory limit (fake tensors take none), and `device_memory` = (capacity, transient
        bytes): free device memory is `capacity` (the GPU's less the CUDA context) less the bytes live when
        read; `transient` what the first step needed beyond the persistent buffers (the planner's figure)."""
        capacity, transient = device_memory if device_memory is not None else (None, None)
        return Probes(
            host_available_bytes=lambda: 1 << 62,
            device_free_bytes=None if capacity is None else lambda: capacity - self.memory.live,
            step_transient_bytes=None if transient is None else lambda: transient,
            streams=self.streams,
            worker=lambda worker: _Worker(self, worker),
        )

    def streams(self, device: torch.device) -> RecordingStreams:
        """The streams the engine is built with (a data-parallel rank's record its collectives, ranks.py)."""
        return RecordingStreams(self, device)

    def attach(self, engine: Any) -> None:
        """Name the block each op of the engine's block calls belongs to (undone by :meth:`detach`)."""
        if not isinstance(engine.streams, RecordingStreams):
            raise RuntimeError("build the engine with Recorder.probes(): its streams are not the recording ones")
        streamer = engine.streamer  # (engine/device/streamer.py: what each block's runner calls)
        for name, label in (("forward_block", "forward"), ("backward_block", "backward")):
            streamer.__dict__[name] = self._named_block(getattr(streamer, name), label)
            self._undo.append(lambda name=name: streamer.__dict__.pop(name, None))

    def detach(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _named_block(self, run: Callable[..., Any], label: str) -> Callable[..., Any]:
        def wrapped(idx: int, *args: Any, **kwargs: Any) -> Any:
            outer, self.block = self.block, (label, idx)
            try:
                return run(idx, *args, **kwargs)
            finally:
                self.block = outer

        return wrapped

    def _host_buffer(self, t: torch.Tensor) -> None:
        self.mark_host([t])

    def is_host(self, t: torch.Tensor) -> bool:
        """Whether `t` lives in host memory: a buffer from ``host_empty`` or the result of host work."""
        return storage_key(t) in self._host

    def mark_host(self, tensors: list[torch.Tensor]) -> None:
        """Remember these tensors' storages as host memory while they live (an address freed may come back as
        device memory), as measure.py's DeviceBytes follows storages."""
        for t in tensors:
            key = storage_key(t)
            if key not in self._host:
                self._host.add(key)
                weakref.finalize(t.untyped_storage(), self._host.discard, key).atexit = False

    # -- what the hooks log -------------------------------------------------------------------------
    def new_event(self) -> int:
        self.events += 1
        return self.events

    def submit(self, order: int = 0, after: tuple = ()) -> int:
        """A new host job, submitted at `order` to run after `after` (recorded events and jobs' futures)."""
        job = len(self.trace.jobs)
        self.trace.jobs.append([])
        self.trace.job_step.append(self.step)
        self.trace.job_order.append(order)
        events = tuple(a.id for a in after if isinstance(a, RecordedEvent))
        self.trace.job_after.append((events, tuple(a.job for a in after if isinstance(a, _Future))))
        self.log(Submit(job))
        return job

    def job_done(self, job: int) -> bool:
        """What ``future.done()`` of host job `job` answers now (see the class docstring)."""
        return True if self.live is None else self.live.ended_by_now(job)

    def ended(self, event: int) -> bool:
        """Whether recorded `event` is complete by the issuing thread's clock in the live replay (True without
        one)."""
        return True if self.live is None else self.live.event_ended_by_now(event)

    def running_job(self) -> int | None:
        """The host job running on this thread now (None: the issuing thread's own code)."""
        return getattr(self._local, "job", None)

    def run_job(self, job: int, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        outer, self._local.job = self.running_job(), job
        try:
            return fn(*args, **kwargs)
        finally:
            self._local.job = outer

    def host_work(self, kind: str, numel: int, nbytes: int) -> None:
        self.log(HostWork(kind, numel, nbytes, self.step, self.phase))

    def host_read(self, where: str) -> None:
        """The thread reads a device tensor (``.cpu()``, ``.item()``): a copy on the compute stream that the
        host waits for, so it waits for all compute issued before it."""
        event = self.new_event()
        self.log(Record(event, "compute"))
        self.log(Sync(event, where + " (reads a device tensor)"))

    def op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Log one op of the issuing thread: a device kernel, or host work when it touches a host buffer."""
        outs = tensors_in(out)
        if _no_kernel(func, outs):
            return  # metadata, allocation or a view: no kernel runs
        ins = tensors_in((args, kwargs))
        nbytes = _kernel_bytes(func, args, kwargs, ins, outs)
        if self.in_job() or any(self.is_host(t) for t in ins + outs):  # the worker's arithmetic is host work
            self.host_work(func._overloadpacket.__name__, outs[0].numel(), nbytes)
            self.mark_host(outs)
            return
        flops, counted, attention, causal = _flops(func, args, kwargs, out)
        name, whose = func._overloadpacket.__name__, origin()
        if self.fusion is not None and self.block is not None and gpu_kind(name) == "memory-bound":
            graph = compiled_graph(whose)  # (the model's work in a compiled block: inductor's fused bytes)
            if graph is not None:
                self.trace.eager_block_bytes[graph] += nbytes
                nbytes = round(nbytes * self.fusion.ratio(graph))
        self.log(Kernel(name, flops, counted, nbytes, attention, causal, self.step, self.phase, whose))


# -- the doubles -----------------------------------------------------------------------------------------
class _Lane(torch.Stream):
    """A named stand-in for a CUDA stream: a torch.Stream, so ``tensor.record_stream(lane)`` parses (the
    recorder's dispatch mode drops that call). All CPU streams compare equal: lanes are told apart by identity."""

    name: str


class RecordingStreams:
    """Stands in for ``engine.device.streams.Streams``: answers as a CUDA device would and logs each call; a copy is
    done at once (the replay decides when it would have run)."""

    is_cuda = True  # the engine's CUDA branches (record_stream) are the ones a GPU run takes

    def __init__(self, recorder: Recorder, device: torch.device) -> None:
        self.recorder, self.device = recorder, torch.device(device)
        self.h2d, self.d2h, self._compute = _named_lane("h2d"), _named_lane("d2h"), _named_lane("compute")

    def compute(self) -> torch.Stream:
        return self._compute

    def event(self, stream: torch.Stream | None = None) -> RecordedEvent:
        event = RecordedEvent(self.recorder, self.recorder.new_event())
        self.recorder.log(Record(event.id, self._name(stream)))
        return event

    def wait(self, stream: torch.Stream | None, event: Any) -> None:
        if event is None:
            return  # a slot or buffer never used before
        if not isinstance(event, RecordedEvent):
            raise TypeError(f"wait on {event!r}: the recorder only knows events of its own streams")
        self.recorder.log(Wait(self._name(stream), event.id))

    def synchronize(self) -> None:
        self.recorder.log(DeviceSync(_where()))

    def ended(self, event: RecordedEvent) -> bool:
        """A poll of `event`, answered by the live replay as the device would answer it now (logs nothing: the
        decision taken on it is in what the engine issues next); complete without a profile."""
        return self.recorder.ended(event.id)

    def copy(self, stream: torch.Stream | None, dst: torch.Tensor, src: torch.Tensor) -> None:
        rec = self.recorder
        rec.log(Copy(self._name(stream), dst.numel() * dst.element_size(), rec.step, rec.phase))
        with rec.quiet():
            dst.copy_(src)

    def _name(self, stream: torch.Stream | None) -> str:
        if stream is None or stream is self._compute:
            return "compute"
        if stream is self.h2d or stream is self.d2h:
            return stream.name
        raise ValueError(f"stream {stream!r} is not one of the recording streams")


def _named_lane(name: str) -> _Lane:
    lane = _Lane(device="cpu")
    lane.name = name
    return lane


class RecordedEvent:
    """An event of :class:`RecordingStreams`: a host block on it is logged, and it answers as complete."""

    def __init__(self, recorder: Recorder, event_id: int) -> None:
        self.recorder, self.id = recorder, event_id

    def synchronize(self) -> None:
        self.recorder.log(Sync(self.id, _where()))

    def query(self) -> bool:
        # A poll's answer depends on timing the recording does not have; it is replayed as a block.
        self.recorder.log(Sync(self.id, _where() + " (query)"))
        return True


class _Worker:
    """The engine's worker pool, with each job and each block on one logged. A job runs the moment it is
    submitted, on the submitting thread: the engine lets its worker run at any pace, so this is one of the
    orders a real run may take; what the trace records depends on the pace only where the engine asks
    whether a job is done, which the live replay answers (times come from the replay). It also keeps fake
    tensors on one thread: FakeTensorMode is not thread-safe."""

    def __init__(self, recorder: Recorder, inner: Any) -> None:
        self.recorder, self.inner = recorder, inner

    def submit(
        self, fn: Callable[..., Any], /, *args: Any, order: int = 0, after: tuple = (), **kwargs: Any
    ) -> _Future:
        job, done = self.recorder.submit(order, tuple(after)), Future()
        try:
            done.set_result(self.recorder.run_job(job, fn, args, kwargs))
        except Exception as e:  # raised where the engine reads the future, as the pool would
            done.set_exception(e)
        return _Future(self.recorder, job, done)

    def __getattr__(self, name: str) -> Any:  # shutdown()
        return getattr(self.inner, name)


class _Future:
    def __init__(self, recorder: Recorder, job: int, inner: Future) -> None:
        self.recorder, self.job, self.inner = recorder, job, inner

    def result(self, timeout: float | None = None) -> Any:
        self.recorder.log(Join(self.job, _where()))
        return self.inner.result(timeout)

    def done(self) -> bool:
        # The job ran when it was submitted; whether it would have finished by now is the live replay's
        # answer (a prefetch depends on it).
        return self.inner.done() and self.recorder.job_done(self.job)

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        # (it ran, and what the callback settles is settled as of this job's end: see _Promise)
        self.recorder.run_job(self.job, fn, (self,), {})

    def __getattr__(self, name: str) -> Any:  # exception(), ...: no event, so no synchronize()
        return getattr(self.inner, name)


class _Promise(Future):
    """A future the engine makes itself for a host job to settle (after a kept speculative step, that the unit's
    compute copy holds the step's weights: host_steps.HostSide.step): done, and waited for, as the job that
    settled it is, by the live replay. A second settle, which the engine tries when the replay's clock says the
    first one has not happened yet, is the same event and changes nothing."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder, self.job = recorder, None

    def set_result(self, result: Any) -> None:
        if not super().done():
            self.job = self.recorder.running_job()
            super().set_result(result)

    def set_exception(self, exception: BaseException | None) -> None:
        if not super().done():
            self.job = self.recorder.running_job()
            super().set_exception(exception)

    def done(self) -> bool:
        return super().done() and (self.job is None or self.recorder.job_done(self.job))

    def result(self, timeout: float | None = None) -> Any:
        if self.job is not None:
            self.recorder.log(Join(self.job, _where()))
        return super().result(timeout)


class _Ops(TorchDispatchMode):
    """Logs the ops of the thread that entered it: the issuing thread's, and the host jobs' (they run on it)."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._overloadpacket is aten.record_stream:
            return None  # an allocator hint for a CUDA stream; the lanes are stand-ins
        out = func(*args, **kwargs)
        if not self.recorder.is_quiet():
            self.recorder.op(func, args, kwargs, out)
        return out


class _HostReads(TorchFunctionMode):
    """Logs the host reading a device tensor. On the CPU stand-in ``.cpu()`` of a "device" tensor is no op at
    all (it is already on the CPU), so these are seen as calls, before any dispatch."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        rec = self.recorder
        reads = getattr(func, "__name__", "") in _READS and args and isinstance(args[0], torch.Tensor)
        if reads and not rec.is_quiet() and not rec.is_host(args[0]):
            rec.host_read(_where())
        return func(*args, **(kwargs or {}))


_READS = {"cpu", "item", "tolist", "numpy", "__float__", "__int__", "__bool__"}


# -- the host kernels ------------------------------------------------------------------------------------
@contextmanager
def _patched_kernels(rec: Recorder) -> Iterator[None]:
    """Log the host kernels the engine calls (looked up in ``optim.kernels`` at call time)."""
    step, acc, norms, clip = kernels.adam_step_, kernels.accumulate_, kernels.param_norms, kernels.clip_coefficient
    peek = kernels.adam_peek_

    def adam_step_(master, m, v, grad, copy, *args, **kwargs):
        written = 0 if copy is None else _nbytes(copy)
        rec.host_work("adam", master.numel(), 2 * (_nbytes(master) + _nbytes(m) + _nbytes(v)) + _nbytes(grad) + written)
        if not isinstance(master, FakeTensor):  # the native kernel reads real memory only
            with rec.quiet():
                step(master, m, v, grad, copy, *args, **kwargs)

    def adam_peek_(master, m, v, grad, copy, *args, **kwargs):
        # reads master, m, v and the gradient once; writes the copy (its scratch stays in the CPU's caches)
        nbytes = _nbytes(master) + _nbytes(m) + _nbytes(v) + _nbytes(grad) + _nbytes(copy)
        rec.host_work("speculate", master.numel(), nbytes)
        if not isinstance(master, FakeTensor):
            with rec.quiet():
                peek(master, m, v, grad, copy, *args, **kwargs)

    def accumulate_(into, grad, first):
        rec.host_work("accumulate", into.numel(), _nbytes(into) * (1 if first else 2) + _nbytes(grad))
        if not isinstance(into, FakeTensor):
            with rec.quiet():
                acc(into, grad, first)

    def param_norms(flat, spans, accurate=False):
        if not (rec.in_job() or rec.is_host(flat)):
            return norms(flat, spans)  # of a gradient on the device: its reductions are logged as kernels
        numel = sum(n for _, n in spans)
        rec.host_work("norms", numel, numel * flat.element_size())
        with rec.quiet():  # (the fp64 kernel reads real memory only; both read the same bytes)
            out = norms(flat, spans, accurate and not isinstance(flat, FakeTensor))
        rec.mark_host(out)
        return out

    def clip_coefficient(values, max_norm):
        if any(isinstance(v, FakeTensor) for v in values):
            return 1.0  # a fake norm has no value; the scale changes no decision the engine takes
        with rec.quiet():
            return clip(values, max_norm)

    with (
        _patched(host_steps, "Future", lambda: _Promise(rec)),
        _patched(kernels, "adam_step_", adam_step_),
        _patched(kernels, "adam_peek_", adam_peek_),
        _patched(kernels, "accumulate_", accumulate_),
        _patched(kernels, "param_norms", param_norms),
        _patched(kernels, "clip_coefficient", clip_coefficient),
    ):
        yield


@contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


# -- classifying ops -------------------------------------------------------------------------------------
_NO_KERNEL = {
    aten.empty,
    aten.empty_strided,
    aten.empty_like,
    aten.new_empty,
    aten.new_empty_strided,
    aten._unsafe_view,
    aten.lift_fresh,
    aten.resize_,
    aten.set_,
}
_GATHERS = {aten.embedding, aten.index_select, aten.index, aten.gather}  # read what they write, not the table
# In place into `self` at indices: they touch as many of its elements as the indices or values have, not all.
_SCATTERS = {
    aten.index_put_,
    aten._index_put_impl_,
    aten.scatter_,
    aten.scatter_add_,
    aten.index_add_,
    aten.index_copy_,
}


def _is_view(func: Any) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def kernel_bytes(func: Any, args: tuple, kwargs: dict, out: Any) -> int | None:
    """The bytes op `func` reads and writes as a device kernel; None when it runs none (metadata, an allocation,
    a view)."""
    outs = tensors_in(out)
    return None if _no_kernel(func, outs) else _kernel_bytes(func, args, kwargs, tensors_in((args, kwargs)), outs)


def _no_kernel(func: Any, outs: list[torch.Tensor]) -> bool:
    """Whether op `func` with tensor outputs `outs` runs no device kernel (metadata, an allocation, a view)."""
    return not outs or func._overloadpacket in _NO_KERNEL or _is_view(func)


def _kernel_bytes(func: Any, args: tuple, kwargs: dict, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> int:
    """:func:`kernel_bytes` of an op that runs a kernel, given its tensors, `ins` and `outs`."""
    if func._overloadpacket in _SCATTERS:  # read what they index and write back as many elements of `self`
        rest = tensors_in((args[1:], kwargs))
        return sum(_nbytes(t) for t in rest) + 2 * max(t.numel() for t in rest) * args[0].element_size()
    return _moved(func, ins, outs)


def _moved(func: Any, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> int:
    written = sum(_nbytes(t) for t in outs)
    if func._overloadpacket in _GATHERS:
        return 2 * written + sum(_nbytes(t) for t in ins if not t.is_floating_point())
    return sum(_nbytes(t) for t in ins) + written


def _flops(func: Any, args: tuple, kwargs: dict, out: Any) -> tuple[int, int, bool, bool]:
    """(FLOPs, FLOPs flop_counter counts, attention, causal). The CPU flash-attention ops are not in the
    registry; they get the count of the CUDA kernels that run in their place."""
    packet = func._overloadpacket
    counted = int(flop_registry[packet](*args, **kwargs, out_val=out)) if packet in flop_registry else 0
    if "attention" not in packet.__name__:
        return counted, counted, False, False
    named = dict(zip((a.name for a in func._schema.arguments), args), **kwargs)
    flops = counted or _attention_flops(packet.__name__, named)
    return flops, counted, True, bool(named.get("is_causal", False))


def _attention_flops(name: str, named: dict) -> int:
    q, k, v = named["query"].shape, named["key"].shape, named["value"].shape
    if name.endswith("_backward"):
        return int(sdpa_backward_flop_count(named["grad_out"].shape, q, k, v))
    return int(sdpa_flop_count(q, k, v))


def _where(depth: int = 4) -> str:
    """The engine functions that led here, innermost first ("wait<_wait<_load<_run")."""
    frame, names = sys._getframe(1), []
    while frame is not None and len(names) < depth:
        if frame.f_code.co_filename != __file__:
            names.append(frame.f_code.co_name)
        frame = frame.f_back
    return "<".join(names)
