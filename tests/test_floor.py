"""The floor of an accumulation step's tail (megatrain_lightning/schedule/floor.py): the least GPU idle each
resource allows, by hand, against an independent preemptive earliest-due-first schedule (which reaches the
least lateness on one server with releases and due times), and against a recorded step, which can only be
slower."""

from __future__ import annotations

import dataclasses
import random

import pytest

from megatrain_lightning.models import LlamaConfig
from megatrain_lightning.schedule import PROFILES
from megatrain_lightning.schedule.floor import RESOURCES, TailUnit, floor_idle, least_idle, tail_units
from megatrain_lightning.schedule.modelled import modelled_step


def unit(name: str, release: float, due: float, host: float, d2h: float = 0.0, h2d: float = 0.0) -> TailUnit:
    return TailUnit(name, release, due, {"d2h": d2h, "host": host, "h2d": h2d})


def test_least_idle_by_hand():
    """A (released at -0.3, due at 0, 0.2 s of host work) and B (released -0.1, due 0.05, 0.3 s): both take
    0.5 s from -0.3, so the later due time, 0.05 + x, is at least 0.2: x = 0.15. Alone, A fits (x = 0)."""
    a, b = unit("a", -0.3, 0.0, 0.2), unit("b", -0.1, 0.05, 0.3)
    assert least_idle([a, b], "host") == pytest.approx(0.15)
    assert least_idle([a], "host") == 0.0
    assert floor_idle([a, b]) == (pytest.approx(0.15), "host")
    # the link's own work sets the floor where it is the larger
    c = unit("c", -0.1, 0.0, 0.0, d2h=0.4)
    assert floor_idle([a, c]) == (pytest.approx(0.3), "d2h")


def edf_lateness(units: list[TailUnit], resource: str) -> float:
    """Preemptive earliest-due-first on one server: the largest lateness (at least 0), event by event."""
    left = {u.name: u.work[resource] for u in units}
    t, late = min(u.release for u in units), 0.0
    while any(w > 1e-15 for w in left.values()):
        ready = [u for u in units if u.release <= t + 1e-15 and left[u.name] > 1e-15]
        if not ready:
            t = min(u.release for u in units if left[u.name] > 1e-15)
            continue
        job = min(ready, key=lambda u: u.due)
        arrivals = [u.release for u in units if u.release > t + 1e-15]
        run = min([left[job.name], *(r - t for r in arrivals)])
        t += run
        left[job.name] -= run
        if left[job.name] <= 1e-15:
            late = max(late, t - job.due)
    return late


@pytest.mark.parametrize("seed", range(20))
def test_least_idle_is_what_earliest_due_first_reaches(seed):
    """Random tails of 2-12 units: the interval condition's least idle is the least lateness of preemptive
    EDF, which is optimal for one server (Horn, 1974), so neither may be smaller than the other."""
    rng = random.Random(seed)
    units = [
        unit(f"u{i}", -rng.uniform(0, 1), rng.uniform(0, 0.3), rng.uniform(0, 0.2)) for i in range(rng.randint(2, 12))
    ]
    assert least_idle(units, "host") == pytest.approx(edf_lateness(units, "host"), abs=1e-9)


def test_a_recorded_step_is_never_below_its_floor():
    """The tiny Llama, 2 micro-batches, every unit summed on the device and speculated, on a host 10^4 times
    slower than the a100 profile's: the tail's floor is above zero, the host sets it, and the recorded step's
    GPU idle between the last backward and the end of the next first forward is at least that floor. Units
    taken as stepped on the GPU lower it."""
    config = LlamaConfig.from_preset("tiny", token_chunk_size=None)
    blocks = config.num_hidden_layers
    slow_host = dataclasses.replace(PROFILES["a100"], host_gbps=PROFILES["a100"].host_gbps * 1e-4)
    step = modelled_step(
        config, slow_host, 32, micro_batches=2, clip=1.0, num_slots=blocks, steps=2, grad_sums=blocks,
        speculative_step=True,
    )  # fmt: skip
    units = tail_units(step.timeline, 2, config, slow_host.link_bytes(), slow_host.host_bytes())
    assert sorted(u.name for u in units) == sorted(["embedding", "head", *(f"block {k}" for k in range(blocks))])
    by_name = {u.name: u for u in units}
    releases = [by_name[f"block {k}"].release for k in range(blocks)]
    dues = [by_name[f"block {k}"].due for k in range(blocks)]
    assert releases == sorted(releases, reverse=True) and all(r < 0 for r in releases)  # the backward runs down
    assert dues == sorted(dues) and by_name["head"].due >= dues[-1] > dues[0] > by_name["embedding"].due >= 0.0
    assert by_name["embedding"].release > releases[0] > by_name["head"].release
    x, resource = floor_idle(units)
    assert x > 0 and resource == "host"

    compute = sorted((iv for iv in step.timeline.intervals if iv.lane == "compute"), key=lambda iv: iv.start)
    lo = step.summary.window[0]  # where step 1's backward ends
    nxt = [iv for iv in compute if iv.step == 2]
    first_backward = next(i for i, iv in enumerate(nxt) if iv.phase.startswith("backward"))
    forward = [iv for iv in nxt[:first_backward] if iv.phase.startswith("forward")]
    idle = (forward[-1].end - lo) - sum(iv.seconds for iv in forward)
    assert idle >= x * (1 - 1e-9)

    lighter = tail_units(
        step.timeline, 2, config, slow_host.link_bytes(), slow_host.host_bytes(), on_device=("embedding", "head")
    )
    assert all(least_idle(lighter, r) <= least_idle(units, r) for r in RESOURCES)
    assert floor_idle(lighter)[0] < x
