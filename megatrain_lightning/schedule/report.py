"""The steady-state step of a replayed timeline: its length, its busiest resource, MFU, where time goes.

The step measured is the last one recorded, from the end of the previous step's backward on the GPU to the
end of its own: it holds the previous step's optimizer work (host Adam, outer uploads), which overlaps this
step's forward, and this step's backward. A resource's busy time is the work of that step on its lane (a
host job belongs to the step that submitted it), so the busiest resource's is what the step could take if
every resource overlapped perfectly and the busiest never waited.

The optimizer step also chains each step to the next (``step-chain``), which no overlap can hide: a unit's
Adam step reads its gradient complete, that is after the step's last micro-batch has come back (with
global-norm clipping after the whole of that backward: the clip coefficient needs every gradient), and
the next step gets no further than its first forward (each block once its own weights are stepped)
before the last Adam step has ended: everything after that forward's last block waits for it. The GPU
runs one kernel at a time and the worker one job at a time, so a step takes at least the host's Adam time
plus the GPU work of the step but its first forward; without clipping the steps may start during the last
backward, unit by unit as each gradient completes, so that backward leaves the chain and the last
micro-batch's accumulation, which each unit's step waits for, joins it. With micro-batches alike, the
first forward, the last backward and the last accumulation are 1/K of the step's. ``bound_s`` is the
larger of the busiest resource's time and that chain (a tie names the resource: with one micro-batch and
no clipping the chain is the Adam time and the optimizer step's own few kernels, the host's time or a
hair above it). Speculative steps kept (``speculative_step``) take the chain off the norm: what the next
forward waits for is each unit's speculative step, which starts as its gradient lands during the last
backward (as an unclipped step does), and the step proper (masters and moments) waits for nothing the next
forward does; so the chain is the unclipped one with the speculative steps' time in place of Adam's.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from megatrain_lightning.schedule.profiles import Profile
from megatrain_lightning.schedule.replay import Interval, Timeline

RESOURCES = {"gpu": "compute", "h2d": "h2d", "d2h": "d2h", "host": "host"}
CHAIN = "step-chain"  # the host's work on complete gradients, then the GPU's past the next first forward
MATMULS = {"mm", "addmm", "bmm", "baddbmm"}


@dataclass(frozen=True)
class Summary:
    step_s: float
    bound_s: float
    bound: str
    mfu: float
    model_flops: float
    window: tuple[float, float]
    busy: dict[str, float]  # per resource (and "issue"): seconds of work of the step
    gpu_kinds: dict[str, float]  # the GPU's busy seconds by kind: matmul, attention, memory-bound
    host_kinds: dict[str, float]
    blocked: dict[str, float]  # seconds the issuing thread sat blocked in the window, by where
    gpu_idle_s: float  # seconds of the window with no kernel on the GPU
    resource: str  # the busiest resource (the bound unless the clipping chain is longer)
    chain_s: float = 0.0  # the optimizer step's chain: see the module docstring
    # The GPU's busy seconds of the engine's own kernels (casts, packing, norms, sums, fingerprints), by the
    # engine function that issued them (record.origin); the rest of the GPU's time is the model's.
    engine_kernels: dict[str, float] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.step_s / self.bound_s

    @property
    def resource_ratio(self) -> float:
        """The step against its busiest resource alone (the bound when not clipping)."""
        return self.step_s / self.busy[self.resource]


def steady_window(timeline: Timeline, step: int) -> tuple[float, float]:
    """(end of step-1's backward on the GPU, end of step's)."""
    ends: dict[int, float] = {}
    for iv in timeline.intervals:
        if iv.lane == "compute" and iv.phase.startswith("backward"):
            ends[iv.step] = max(ends.get(iv.step, 0.0), iv.end)
    if step not in ends or step - 1 not in ends:
        raise ValueError(f"the timeline has no backward of steps {step - 1} and {step}: record at least 2 steps")
    return ends[step - 1], ends[step]


def summarize(
    timeline: Timeline,
    profile: Profile,
    flops: float,
    step: int,
    clipped: bool = False,
    micro_batches: int = 1,
    speculative: bool = False,
) -> Summary:
    """The figures of optimizer step `step` (the last recorded) of `timeline`, of `micro_batches` alike
    micro-batches; `clipped`: the steps waited for a global gradient norm; `speculative`: speculative steps
    were kept (see the module docstring)."""
    lo, hi = steady_window(timeline, step)
    mine = [iv for iv in timeline.intervals if iv.step == step]
    lanes = {**RESOURCES, **({"peer": "peer"} if any(iv.lane == "peer" for iv in mine) else {})}
    busy = {name: _total(mine, lane) for name, lane in lanes.items()}
    busy["issue"] = _total(mine, "issue")
    resource = max(lanes, key=lambda name: busy[name])
    chain = chain_seconds(mine, micro_batches, clipped, speculative)
    longer = chain > busy[resource] * (1 + 1e-6)  # (a tie names the resource)
    bound, bound_s = (CHAIN, chain) if longer else (resource, busy[resource])
    blocked: dict[str, float] = defaultdict(float)
    for iv in timeline.intervals:
        if iv.lane == "issue blocked":
            blocked[iv.what] += _overlap(iv, lo, hi)
    compute = [iv for iv in timeline.intervals if iv.lane == "compute"]
    return Summary(
        step_s=hi - lo,
        bound_s=bound_s,
        bound=bound,
        mfu=flops / (hi - lo) / (profile.bf16_peak_tflops * 1e12),
        model_flops=flops,
        window=(lo, hi),
        busy=busy,
        gpu_kinds=_by(mine, "compute", gpu_kind),
        host_kinds=_by(mine, "host", lambda w: w),
        blocked={k: v for k, v in sorted(blocked.items(), key=lambda kv: -kv[1]) if v > 0},
        gpu_idle_s=(hi - lo) - _covered(compute, lo, hi),
        resource=resource,
        chain_s=chain,
        engine_kernels=_engine_kernels(mine),
    )


def chain_seconds(
    intervals: list[Interval], micro_batches: int = 1, clipped: bool = False, speculative: bool = False
) -> float:
    """The optimizer step's chain over one step's intervals of `micro_batches` alike micro-batches (module
    docstring): the host worker's Adam steps plus the GPU's work but 1/K of its forward; without clipping
    1/K of its backward less and 1/K of the host's accumulation more; with speculative steps kept, the
    unclipped chain with their time in place of Adam's."""
    k = micro_batches
    gpu = [iv for iv in intervals if iv.lane == "compute"]
    host = _by(intervals, "host", lambda what: what)
    optimizer = host.get("speculate", 0.0) if speculative else host.get("adam", 0.0)
    chain = optimizer + sum(iv.seconds for iv in gpu) - _phase(gpu, "forward") / k
    if clipped and not speculative:
        return chain
    return chain + (host.get("accumulate", 0.0) - _phase(gpu, "backward")) / k


def _phase(intervals: list[Interval], prefix: str) -> float:
    return sum(iv.seconds for iv in intervals if iv.phase.startswith(prefix))


def table(s: Summary) -> str:
    """Lanes: busy seconds of the step and their share of it; then what the GPU and host did and where
    the issuing thread waited."""
    rows = [f"{'lane':<6} {'busy s':>9} {'share':>7}"]
    for name, seconds in s.busy.items():
        mark = "  <- bound" if name == s.bound else "  <- busiest" if name == s.resource else ""
        rows.append(f"{name:<6} {seconds:>9.4f} {seconds / s.step_s:>7.1%}{mark}")
    mark = "  <- bound" if s.bound == CHAIN else ""
    rows.append(
        f"{CHAIN} {s.chain_s:>5.4f} {s.chain_s / s.step_s:>7.1%}{mark}  (Adam, then the GPU work that waits for it)"
    )
    rows.append(f"step   {s.step_s:>9.4f}  (bound {s.bound_s:.4f} s on {s.bound}; GPU idle {s.gpu_idle_s:.4f} s of it)")
    own = sum(s.engine_kernels.values())
    engine = f"; the engine's own {own:.4f} s ({_listing(dict(list(s.engine_kernels.items())[:4]))})" if own else ""
    rows.append("gpu:   " + _listing(s.gpu_kinds) + engine)
    rows.append("host:  " + _listing(s.host_kinds))
    top = dict(list(s.blocked.items())[:4])
    rows.append("issuing thread blocked: " + (_listing(top) if top else "never"))
    return "\n".join(rows)


def _listing(seconds: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.4f} s" for k, v in seconds.items()) or "-"


def gpu_kind(name: str) -> str:
    return "attention" if "attention" in name else "matmul" if name in MATMULS else "memory-bound"


def _engine_kernels(intervals: list[Interval]) -> dict[str, float]:
    """Seconds of the engine's own kernels by the engine function that issued them, longest first."""
    out: dict[str, float] = defaultdict(float)
    for iv in intervals:
        if iv.lane == "compute" and iv.origin.startswith("engine:"):
            out[iv.origin.removeprefix("engine:")] += iv.seconds
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _by(intervals: list[Interval], lane: str, kind) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for iv in intervals:
        if iv.lane == lane:
            out[kind(iv.what)] += iv.seconds
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _total(intervals: list[Interval], lane: str) -> float:
    return sum(iv.seconds for iv in intervals if iv.lane == lane)


def _overlap(iv: Interval, lo: float, hi: float) -> float:
    return max(0.0, min(iv.end, hi) - max(iv.start, lo))


def _covered(intervals: list[Interval], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] covered by `intervals` (one lane's ops never overlap each other)."""
    return sum(_overlap(iv, lo, hi) for iv in intervals)
