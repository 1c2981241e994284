"""One training step of strategy="megatrain", drawn: a torch profiler trace and a plot of its lanes.

    python bench/timeline.py TRACE.json.gz [PLOT.png]     # redraw a trace that bench/throughput.py wrote

bench/throughput.py profiles one optimizer step after its timed window (:class:`OneStepTrace`) and
writes the trace with this module. The lanes a person wants to see side by side, taken from the
trace's events:

    compute          GPU kernels, any stream; on the CPU (dry mode): the ops of every thread but the worker
    H2D              "Memcpy HtoD" copies: block weights and outer copies going up
    D2H              "Memcpy DtoH" copies: gradients coming down
    megatrain-host   the ops and ranges of the engine's host worker thread: landing gradients, Adam steps
    issue            CPU ops of the other threads (Python issuing kernels); GPU runs only

A step whose pipeline overlaps shows the H2D, D2H and megatrain-host bars under the compute bar, not
between its pieces. Two things make the worker visible at all: the profiler records other threads
only with ``profile_all_threads`` (an experimental Kineto option), and the native Adam kernel is no
torch op, so while profiling ``kernels.adam_step_`` and ``kernels.accumulate_`` run inside
``record_function`` ranges named ``megatrain-host/...``.
"""

from __future__ import annotations

import gzip
import json
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from megatrain_lightning.optim import kernels

WORKER = "megatrain-host"  # the engine's ThreadPoolExecutor thread_name_prefix
LANES = ("compute", "H2D", "D2H", WORKER, "issue")
Interval = tuple[float, float]  # (start, end) in microseconds


# -- recording ---------------------------------------------------------------------------------------
def start_profiler(device: torch.device) -> profile:
    """A started profiler over the CPU (all threads, where this torch can) and, on a GPU, CUDA."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    try:
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:  # older torch: only the thread that starts the profiler is recorded
        warnings.warn("this torch cannot profile all threads: the megatrain-host lane will be empty", stacklevel=2)
        config = None
    prof = profile(activities=activities, experimental_config=config)
    prof.start()
    return prof


@contextmanager
def host_ranges() -> Iterator[None]:
    """Name the worker's jobs in the trace: wrap the kernels the engine looks up at call time."""
    step, accumulate = kernels.adam_step_, kernels.accumulate_

    def named(fn: Callable, name: str) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with record_function(f"{WORKER}/{name}"):
                return fn(*args, **kwargs)

        return wrapper

    kernels.adam_step_, kernels.accumulate_ = named(step, "adam_step"), named(accumulate, "land")
    try:
        yield
    finally:
        kernels.adam_step_, kernels.accumulate_ = step, accumulate


def worker_tids() -> list[int]:
    """Native ids of the engine's host worker threads (the profiler's ``tid``)."""
    return [t.native_id for t in threading.enumerate() if t.name.startswith(WORKER) and t.native_id]


def write_trace(prof: profile, path: Path, names: dict[int, str]) -> Path:
    """Export the chrome trace gzipped, with `names` given to those thread ids (Perfetto shows them)."""
    raw = path.with_name(path.name.removesuffix(".gz"))
    prof.export_chrome_trace(str(raw))
    trace = json.loads(raw.read_text())
    raw.unlink()
    events = trace["traceEvents"]
    pid = next((e["pid"] for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"), 0)
    for tid, name in names.items():
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
    with gzip.open(path, "wt") as f:
        json.dump(trace, f)
    return path


def load_trace(path: str | Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


# -- reading -----------------------------------------------------------------------------------------
def named_tids(events: list[dict], name: str) -> set[Any]:
    return {
        e["tid"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name" and e.get("args", {}).get("name") == name
    }


def lanes(events: list[dict]) -> dict[str, list[Interval]]:
    """Each lane's (start, end) intervals in microseconds (see the module docstring for the lanes)."""
    worker = named_tids(events, WORKER)
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    out: dict[str, list[Interval]] = {lane: [] for lane in LANES}
    kernels_seen = any(e.get("cat") == "kernel" for e in spans)
    for e in spans:
        iv = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        cat, name = e.get("cat", ""), e.get("name", "")
        if cat == "kernel":
            out["compute"].append(iv)
        elif cat == "gpu_memcpy":
            out["H2D" if "HtoD" in name else "D2H" if "DtoH" in name else "compute"].append(iv)
        elif e.get("tid") in worker:
            if cat in ("cpu_op", "user_annotation"):  # its work; not cuda_runtime, where it waits on copy events
                out[WORKER].append(iv)
        elif cat == "cpu_op":
            out["issue" if kernels_seen else "compute"].append(iv)
    return out


def union(intervals: list[Interval]) -> list[Interval]:
    """The same time covered by disjoint, sorted intervals."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def busy(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in union(intervals))


def shared(a: list[Interval], b: list[Interval]) -> float:
    """Time covered by both `a` and `b`."""
    ua, ub, i, j, total = union(a), union(b), 0, 0, 0.0
    while i < len(ua) and j < len(ub):
        total += max(0.0, min(ua[i][1], ub[j][1]) - max(ua[i][0], ub[j][0]))
        if ua[i][1] < ub[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize(by_lane: dict[str, list[Interval]]) -> dict[str, Any]:
    """Span of the step, each lane's busy time and the share of it that ran while compute was busy."""
    every = [iv for ivs in by_lane.values() for iv in ivs]
    span = (max(e for _, e in every) - min(s for s, _ in every)) if every else 0.0
    out: dict[str, Any] = {"span_ms": span / 1e3, "lanes": {}}
    for lane, ivs in by_lane.items():
        if not ivs:
            continue
        t = busy(ivs)
        hidden = shared(ivs, by_lane["compute"]) / t if lane != "compute" and t > 0 else None
        out["lanes"][lane] = {"busy_ms": t / 1e3, "events": len(ivs), "under_compute": hidden}
    return out


def plot(by_lane: dict[str, list[Interval]], path: Path, title: str) -> str:
    """Draw the lanes as horizontal bars; returns what was written (or why nothing was)."""
    shown = [lane for lane in LANES if by_lane.get(lane)]
    t0 = min(s for lane in shown for s, _ in by_lane[lane]) if shown else 0.0
    rows = [
        (lane, [((s - t0) / 1e3, (e - s) / 1e3) for s, e in union(by_lane[lane])], f"C{LANES.index(lane)}")
        for lane in shown
    ]
    return draw_lanes(rows, path, title, "ms from the step's first event", size=(12, 0.6 * len(shown) + 1.2))


def draw_lanes(
    rows: list[tuple[str, list[tuple[float, float]], str]],
    path: Path,
    title: str,
    xlabel: str,
    size: tuple[float, float],
    marks: tuple[float, ...] = (),
) -> str:
    """One row of bars per (name, [(start, length)], color), top to bottom, dashed lines at `marks`;
    returns what was written, or why nothing was (bench/schedule.py draws its lanes with it too)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 'no PNG: matplotlib is not installed (pip install matplotlib, or pip install -e ".[bench]")'
    fig, ax = plt.subplots(figsize=size)
    for row, (_, bars, color) in enumerate(reversed(rows)):
        ax.broken_barh(bars, (row - 0.4, 0.8), color=color)
    for x in marks:
        ax.axvline(x, color="k", lw=0.8, ls="--")
    ax.set_yticks(range(len(rows)), [name for name, _, _ in reversed(rows)])
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


# -- the profiled step -------------------------------------------------------------------------------
class OneStepTrace:
    """Profile optimizer step `step` (0-based) of a Lightning run; a callback's hooks call `begin`/`end`.

    `sync` must leave no device work or host job in flight, so the trace holds exactly one step.
    """

    def __init__(self, step: int, accumulate: int, path: Path, device: torch.device, sync: Callable[[], None]) -> None:
        self.first, self.last = step * accumulate, (step + 1) * accumulate - 1
        self.path, self.device, self.sync = path, device, sync
        self.summary: dict[str, Any] = {}
        self._prof: profile | None = None
        self._ranges = host_ranges()

    def begin(self, batch_idx: int) -> None:
        if batch_idx == self.first:
            self.sync()
            self._ranges.__enter__()
            self._prof = start_profiler(self.device)

    def end(self, batch_idx: int) -> None:
        if batch_idx != self.last or self._prof is None:
            return
        self.sync()
        self._prof.stop()
        self._ranges.__exit__(None, None, None)
        t0 = time.perf_counter()
        write_trace(self._prof, self.path, {tid: WORKER for tid in worker_tids()})
        by_lane = lanes(load_trace(self.path))
        png = self.path.parent / "timeline.png"
        note = plot(by_lane, png, f"one optimizer step ({self.last - self.first + 1} micro-batches), {self.device}")
        self.summary = {
            "trace": str(self.path),
            "plot": note,
            **summarize(by_lane),
            "export_s": time.perf_counter() - t0,
        }


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.split("\n\n")[1])
        return 2
    by_lane = lanes(load_trace(argv[0]))
    print(json.dumps(summarize(by_lane), indent=1))
    png = Path(argv[1]) if len(argv) > 1 else Path(argv[0]).with_name("timeline.png")
    print(plot(by_lane, png, Path(argv[0]).name))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
