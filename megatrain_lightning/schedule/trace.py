"""What a recording holds: the items each thread issued, in order (record.py writes them, replay.py reads them).

Times are not recorded (they are the replay's to decide): only what was issued, on which lane, with how
much work, and what each item depends on.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Kernel:
    """A device kernel on the compute lane."""

    name: str
    flops: int  # what the kernel computes (attention: the CUDA kernels' count for these shapes)
    counted: int  # what FlopCounterMode counts for the op on this device (flop_counter's registry)
    nbytes: int  # read + written
    attention: bool
    causal: bool
    step: int
    phase: str
    origin: str = "model"  # "model", or "engine:<function>" for the engine's own work (record.origin)


@dataclass(frozen=True)
class Copy:
    lane: str  # "h2d" | "d2h" | "peer" (the device link between GPUs, data parallel)
    nbytes: int
    step: int
    phase: str
    what: str = "copy"  # or the collective it models: "all-gather", "reduce-scatter", "all-reduce"


@dataclass(frozen=True)
class Record:
    """An event recorded on `lane`: complete once everything enqueued there (and on the lanes `also`) before it is."""

    event: int
    lane: str
    also: tuple[str, ...] = ()


@dataclass(frozen=True)
class Wait:
    """Nothing enqueued on `lane` after this starts before `event` is complete (the host does not block)."""

    lane: str
    event: int


@dataclass(frozen=True)
class Sync:
    """The thread blocks until `event` is complete (``event.synchronize()`` or ``query()``)."""

    event: int
    where: str


@dataclass(frozen=True)
class DeviceSync:
    """The thread blocks until every lane of the device is idle."""

    where: str


@dataclass(frozen=True)
class Submit:
    job: int


@dataclass(frozen=True)
class Join:
    """The thread blocks until host job `job` has finished (``future.result()``)."""

    job: int
    where: str


@dataclass(frozen=True)
class HostWork:
    """Host arithmetic on the thread that runs it: an optimizer step, an accumulation, norms, a cast."""

    kind: str
    numel: int
    nbytes: int
    step: int
    phase: str


@dataclass(frozen=True)
class Mark:
    """The issuing thread begins optimizer step `step`."""

    step: int


@dataclass
class Trace:
    """Items of the issuing thread in order, and per host job (in submission order) the items it ran."""

    issue: list = field(default_factory=list)
    jobs: list[list] = field(default_factory=list)
    job_step: list[int] = field(default_factory=list)  # the optimizer step during which each job was submitted
    job_order: list[int] = field(default_factory=list)  # its order on the worker (engine/host/worker.py)
    job_after: list[tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)  # (events, jobs) first
    slots: int = 0  # the engine's weight slots when the recording ended (num_slots="auto" grows them)
    grad_sums: int = 0  # blocks summing their gradients on the device when the recording ended (device_grad_sums)
    speculative: tuple[int, int] = (0, 0)  # speculative steps kept and discarded over the recording (units)
    kept_calls: list[int] = field(default_factory=list)  # per recorded step, block calls that kept their graph
    # compile_blocks modelled (fusion.py): the eager bytes of the block kernels scaled, per compiled graph
    eager_block_bytes: dict[str, int] = field(default_factory=lambda: {"forward": 0, "backward": 0})
