"""The least GPU idle the tail of an accumulation step can have, in any order of its work.

A step of several micro-batches whose optimizer state lives in host memory ends with work that only the links
and the host can do: each unit's gradient sum goes down once its last backward has ended (not before: the sum
is not final), the host computes the unit's next weights from it (a speculative step: master, moments and
sum read, new weights written), and those go up before the next step's first forward uses the unit. The GPU
has nothing else to do meanwhile; it waits where a unit is not up in time.

Each resource (the link down, the host, the link up) is one server. Take its work on the units alone, as if
the stages before and after it took no time and every unit's work could be cut into pieces and run in any
order: a unit's work can start at its release and must end by its due time. Both are taken on the generous
side, so that splitting a unit finer could not beat them: the release where the unit's last backward begins
(none of its gradients is final before), the due time where its forward in the next step ends, counting that
forward's busy time only from a start `x` after the last backward ended (each of its parameters has been read
by then). On one server with releases, due times and preemption, the work fits exactly when, for every window
from a release r to a due time d, the work of the units released at or after r and due by d is at most
d + x - r (the classical interval condition; preemptive earliest-due-first reaches it). So `x` can be no
smaller than the largest excess of work over any such window, for each resource: :func:`least_idle`. The
engine's step can only be longer (its stages follow each other, its copies and host jobs are whole units, its
downloads go in landing order).

:func:`tail_units` reads the releases and due times off a recorded step (modelled.py) and prices each unit's
work at the profile's rates, as record.py prices the same copies and host kernels; ``bench/tail_floor.py``
prints the floor beside the recorded step (docs/benchmarks.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from megatrain_lightning.planning import planner
from megatrain_lightning.schedule.replay import Interval, Timeline

RESOURCES = ("d2h", "host", "h2d")

SUM_BYTES = 4  # a gradient sum in fp32, down once per step
PEEK_BYTES = 4 + 4 + 4 + 4  # read by a speculative step: master, two moments, the sum (record.py's adam_peek_)


@dataclass(frozen=True)
class TailUnit:
    """One unit of the step's tail: from when its gradient sum may be final, by when the next forward has
    read its new weights (seconds after that forward starts, counting its busy time only), and its work on each
    resource in seconds."""

    name: str
    release: float  # seconds, 0 where the step's last backward ends (releases are < 0)
    due: float  # seconds after the next forward begins
    work: dict[str, float]


def least_idle(units: list[TailUnit], resource: str) -> float:
    """The least wait `x` of the GPU between the last backward and the next forward that lets `resource` do
    every unit's work between its release and its due time (module docstring; 0 where none is needed)."""
    releases = sorted({u.release for u in units})
    dues = sorted({u.due for u in units})
    x = 0.0
    for r in releases:
        later = [u for u in units if u.release >= r]
        for d in dues:
            work = sum(u.work[resource] for u in later if u.due <= d)
            x = max(x, work - (d - r))
    return x


def floor_idle(units: list[TailUnit]) -> tuple[float, str]:
    """(the least idle over all resources, the resource that sets it)."""
    return max((least_idle(units, r), r) for r in RESOURCES)


def tail_units(
    timeline: Timeline,
    step: int,
    config,
    link_bytes: float,
    host_bytes: float,
    compute_bytes: int = 2,
    on_device: tuple[str, ...] = (),
) -> list[TailUnit]:
    """The units of the tail between optimizer steps `step` - 1 and `step` of `timeline`, a recorded step of
    `config` (a Llama-shaped model: blocks, then "embedding" and "head"), every unit's gradient summed on the
    device and speculated by the host. `link_bytes` and `host_bytes`: bytes/s. `on_device`: units taken as
    stepped on the GPU instead (no work of theirs on these resources), to see what that would buy."""
    compute = [iv for iv in timeline.intervals if iv.lane == "compute"]
    last = _last_backward(compute, step - 1)
    end = max(iv.end for iv in last)
    released = {name: t - end for name, t in _released(last).items()}
    released["head"] = min(iv.start for iv in last) - end  # its backward comes first
    due = _due(_first_forward(compute, step))
    numel = {"embedding": config.vocab_size * config.hidden_size, "head": planner.outer_numel(config)}
    numel["head"] -= numel["embedding"]  # (head and final norm: with tied embeddings, the norm alone)
    blocks = planner.block_numel(config)
    units = []
    for name, release in released.items():
        n = numel.get(name, blocks)
        work = {
            "d2h": n * SUM_BYTES / link_bytes,
            "host": n * (PEEK_BYTES + compute_bytes) / host_bytes,
            "h2d": n * compute_bytes / link_bytes,
        }
        if name in on_device:
            work = dict.fromkeys(RESOURCES, 0.0)
        units.append(TailUnit(name, release, due[name], work))
    return units


_BLOCK = re.compile(r"(forward|backward) block (\d+)$")


def _last_backward(compute: list[Interval], step: int) -> list[Interval]:
    """The compute intervals of `step`'s last micro-batch's backward (after its last forward kernel)."""
    mine = sorted((iv for iv in compute if iv.step == step), key=lambda iv: iv.start)
    forwards = [i for i, iv in enumerate(mine) if iv.phase.startswith("forward")]
    if not forwards:
        raise ValueError(f"step {step} has no forward in the timeline: record at least 2 steps")
    return [iv for iv in mine[forwards[-1] + 1 :] if iv.phase.startswith("backward")]


def _first_forward(compute: list[Interval], step: int) -> list[Interval]:
    """The compute intervals of `step`'s first micro-batch's forward (before its first backward kernel)."""
    mine = sorted((iv for iv in compute if iv.step == step), key=lambda iv: iv.start)
    out = []
    for iv in mine:
        if iv.phase.startswith("backward"):
            break
        if iv.phase.startswith("forward"):
            out.append(iv)
    return out


def _released(backward: list[Interval]) -> dict[str, float]:
    """When each unit's backward begins, by name ("block 7"; the embedding's: after the first block's): no
    gradient of the unit is final before (a part of it may be soon after: a unit's release is the earliest)."""
    out: dict[str, float] = {}
    for iv in sorted(backward, key=lambda iv: iv.start):
        m = _BLOCK.match(iv.phase)
        name = f"block {m.group(2)}" if m else ("embedding" if "block 0" in out else None)
        if name is not None:
            out.setdefault(name, iv.start)
    return out


def _due(forward: list[Interval]) -> dict[str, float]:
    """Busy seconds of the forward until each unit's last kernel of it (the embedding's: before the first
    block's): by then each of its parameters has been read (a part of it may be read sooner: a unit's due
    time is the latest), the head's at the forward's end."""
    due: dict[str, float] = {}
    busy = 0.0
    for iv in forward:
        m = _BLOCK.match(iv.phase)
        if m and "embedding" not in due:
            due["embedding"] = busy
        busy += iv.seconds
        if m:
            due[f"block {m.group(2)}"] = busy
    due["head"] = busy
    return due
