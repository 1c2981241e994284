"""The schedule model (megatrain_lightning/schedule, `megatrain schedule`, bench/schedule.py): what it records
is what the engine does, its replay is the timeline worked out by hand, and the command lines print the lanes'
table and end with the summary line.

The recording tests train a tiny Llama for real on the CPU (real tensors, not fake) with the recorder
installed, and compare what it logged with the engine's own counters and with torch's FlopCounterMode
around the same steps.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import io
import re
from contextlib import nullcontext, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from megatrain_lightning import Engine, EngineConfig
from megatrain_lightning.cli.main import run
from megatrain_lightning.engine.host.pending_reads import PendingReads
from megatrain_lightning.models import LlamaConfig, LlamaForCausalLM
from megatrain_lightning.planning.flops import matmul_params, model_flops
from megatrain_lightning.schedule import PROFILES, Profile, Recorder, replay, summarize, table, train_steps
from megatrain_lightning.schedule.modelled import modelled_step
from megatrain_lightning.schedule.profiles import ADAM_BYTES_PER_PARAM, HOST_EFFICIENCY, LINK_EFFICIENCY, profile
from megatrain_lightning.schedule.ranks import DataParallel
from megatrain_lightning.schedule.record import kernel_bytes
from megatrain_lightning.schedule.replay import Interval, Replay, Timeline
from megatrain_lightning.schedule.report import CHAIN
from megatrain_lightning.schedule.steps import record_steps
from megatrain_lightning.schedule.trace import (
    Copy,
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

SEQ, BATCH, STEPS = 32, 2, 2


def tiny() -> LlamaConfig:
    return LlamaConfig.from_preset("tiny", token_chunk_size=None)


def batch() -> torch.Tensor:
    return torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tensors are tiny: intra-op threads would only contend with whatever else runs on the machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class GlobalFlopCounter(FlopCounterMode):
    """FlopCounterMode without its per-module tracker, whose backward hooks refuse the engine's recompute
    (``autograd.grad`` inside a backward: "A leaf node was passed to _will_engine_execute_node"). The
    counting is FlopCounterMode's own: its dispatch mode and registry, summed under "Global"."""

    def __init__(self) -> None:
        super().__init__(display=False)
        self.mod_tracker = _GlobalOnly()


class _GlobalOnly:
    parents = {"Global"}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@dataclass(frozen=True)
class Run:
    trace: Trace
    stats: dict
    params: int
    weights: dict
    counted_flops: int  # FlopCounterMode's total around the whole run


@functools.cache
def recorded_run(clip: float | None = None, offload: bool = False, count: bool = False, micro_batches: int = 1) -> Run:
    """Train the tiny model STEPS steps with the recorder installed (and FlopCounterMode around it all when
    `count`: it runs some ops as their decompositions, which may round differently)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny())
    recorder, counter = Recorder(), GlobalFlopCounter()
    with counter if count else nullcontext(), recorder.recording():
        engine = Engine(
            model,
            EngineConfig(
                device="cpu", precision="bf16-true", pin_memory=False, offload_inputs=offload, clipping=clip is not None
            ),
            recorder.probes(),
        )
        recorder.attach(engine)
        train_steps(engine, model, batch(), recorder, STEPS, clip, micro_batches=micro_batches)
    weights = {k: v.clone() for k, v in engine.master_state_dict().items()}
    engine.close()
    return Run(recorder.trace, dict(engine.stats), engine.num_parameters(), weights, counter.get_total_flops())


def copied(trace: Trace, lane: str) -> int:
    return sum(i.nbytes for i in trace.issue if isinstance(i, Copy) and i.lane == lane)


@pytest.mark.parametrize(("clip", "micro_batches"), [(None, 1), (1.0, 1), (1.0, 2)])
def test_recorded_transfers_are_the_engines_own(clip, micro_batches):
    """Every byte the engine counts as uploaded or downloaded went through a recorded copy, and nothing else
    (with accumulation too: each micro-batch's gradients go down)."""
    run = recorded_run(clip, count=clip is None, micro_batches=micro_batches)  # (the FLOPs' run serves too)
    assert copied(run.trace, "h2d") == run.stats["h2d_bytes"] > 0
    assert copied(run.trace, "d2h") == run.stats["d2h_bytes"] > 0
    assert run.stats["d2h_bytes"] == recorded_run(clip, count=clip is None).stats["d2h_bytes"] * micro_batches


def test_offloaded_inputs_travel_on_the_copy_lanes_too():
    run = recorded_run(offload=True)
    assert run.stats["offloaded_passes"] == STEPS
    moved = run.stats["h2d_bytes"] + run.stats["d2h_bytes"] + run.stats["input_offload_bytes"]
    assert copied(run.trace, "h2d") + copied(run.trace, "d2h") == moved


def test_recording_changes_nothing_the_engine_computes():
    """The same steps without the recorder installed (the engine's own streams and worker thread)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny())
    engine = Engine(model, EngineConfig(device="cpu", precision="bf16-true", pin_memory=False, clipping=True))
    train_steps(engine, model, batch(), Recorder(), STEPS, 1.0)  # the recorder only counts steps here
    plain = engine.master_state_dict()
    recorded = recorded_run(1.0).weights
    assert plain.keys() == recorded.keys() and all(torch.equal(plain[k], recorded[k]) for k in plain)
    engine.close()


def test_an_indexed_write_is_charged_for_the_elements_it_touches_not_its_whole_destination():
    """The loss's backward subtracts 1 at each row's target in a [tokens, vocab] chunk (models/loss.py): a kernel
    that reads the indices and values and writes as many elements, not one that moves the whole chunk."""
    seen = {}

    class Bytes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen[func._overloadpacket.__name__] = kernel_bytes(func, args, kwargs or {}, out)
            return out

    probs, rows, targets, ones = (
        torch.zeros(64, 50_000),
        torch.arange(64),
        torch.zeros(64, dtype=torch.long),
        torch.ones(64),
    )
    with Bytes():
        probs[rows, targets] -= ones
    read = rows.nbytes + targets.nbytes + ones.nbytes
    assert read < seen["index_put_"] <= read + 2 * ones.nbytes < probs.nbytes // 1000


def test_recorded_flops_equal_the_flop_counter():
    """Matmul FLOPs logged per kernel add up to FlopCounterMode's total around the same steps; the CPU
    flash-attention ops (which FlopCounterMode does not know) carry the CUDA kernels' count, checked here
    against the hand formula: 4·B·heads·T²·head_dim forward, 2.5 times that backward (the scores recomputed)."""
    run = recorded_run(count=True)
    kernels = [i for i in run.trace.issue if isinstance(i, Kernel)]
    assert sum(k.counted for k in kernels) == run.counted_flops > 0
    cfg = tiny()
    forward = 4 * BATCH * cfg.num_attention_heads * SEQ**2 * cfg.head_dim
    calls = STEPS * cfg.num_hidden_layers  # each block: forward, recompute (a forward) and backward per step
    assert sum(k.flops for k in kernels if k.attention) == calls * (2 * forward + forward * 5 // 2)
    assert all(k.causal for k in kernels if k.attention)


def test_host_jobs_and_blocks_are_recorded():
    """With clipping: every unit is stepped once per step on the host; the per-parameter norms are taken
    once per step, on the host as gradients land or on the device before they go down; the issuing thread
    waits for them before the clip coefficient (the global norm needs all); and no job starts before the
    copy it depends on (the download it lands, or the upload still reading the copy it rewrites)."""
    run = recorded_run(1.0)
    work = [i for job in run.trace.jobs for i in job if isinstance(i, HostWork)]
    assert sum(i.numel for i in work if i.kind == "adam") == STEPS * run.params
    on_host = sum(i.numel for i in work if i.kind == "norms")
    norms = sum(1 for i in run.trace.issue if isinstance(i, Kernel) and i.name == "linalg_vector_norm")
    # (less each block call's output fingerprint, in its forward and its recompute: engine/self_checks.py)
    on_device = norms - 2 * STEPS * tiny().num_hidden_layers
    params = len(list(LlamaForCausalLM(tiny()).parameters()))
    assert (on_host, on_device) in [(STEPS * run.params, 0), (0, STEPS * params)]
    assert any(isinstance(i, (Join, Sync)) and "_clip_scale" in i.where for i in run.trace.issue)
    assert run.trace.jobs and all(job and isinstance(job[0], Sync) for job in run.trace.jobs)


# -- replay of a hand-built graph -----------------------------------------------------------------------
def unit_profile() -> Profile:
    """1 TFLOP/s, 1 GB/s each way, 1 Gparam/s of Adam; HBM so fast that bytes never decide."""
    return Profile("unit", 1, 1, 1, 1e12, 1 / LINK_EFFICIENCY, 1, 1, host_adam_gparams=1)


def test_replay_overlaps_lanes_waits_for_events_and_blocks_the_host():
    """By hand, with a launch cost of 0.25 s: the upload (2 s) runs from 0.25 to 2.25 while kernel A runs
    from 0.5 to 1.5; B waits for the upload's event, 2.25 to 3.25; the job submitted at 0.75 waits for B's
    event, then steps for 1 s until 4.25; the issuing thread blocks on it until 4.25, so C (causal
    attention, 2 TFLOP of which half is computed) runs from 4.5 to 5.5."""
    kernel = dict(counted=0, nbytes=0, step=1, phase="p")
    trace = Trace(
        issue=[
            Mark(1),
            Copy("h2d", 2 * 10**9, 1, "p"),
            Record(1, "h2d"),
            Kernel("A", 10**12, attention=False, causal=False, **kernel),
            Wait("compute", 1),
            Kernel("B", 10**12, attention=False, causal=False, **kernel),
            Record(2, "compute"),
            Submit(0),
            Join(0, "test"),
            Kernel("C", 2 * 10**12, attention=True, causal=True, **kernel),
        ],
        jobs=[[Sync(2, "land"), HostWork("adam", 10**9, 28 * 10**9, 1, "p")]],
        job_step=[1],
    )
    timeline = replay(trace, unit_profile(), launch_s=0.25)
    spans = {(iv.lane, iv.what): (iv.start, iv.end) for iv in timeline.intervals if iv.what != "launch"}
    expected = {
        ("h2d", "copy"): (0.25, 2.25),
        ("compute", "A"): (0.5, 1.5),
        ("compute", "B"): (2.25, 3.25),
        ("host blocked", "land"): (0.75, 3.25),
        ("host", "adam"): (3.25, 4.25),
        ("issue blocked", "test"): (0.75, 4.25),
        ("compute", "C"): (4.5, 5.5),
    }
    assert spans.keys() == expected.keys()  # (pytest >= 9.2 refuses approx over a dict of tuples)
    assert all(spans[k] == pytest.approx(v) for k, v in expected.items()), spans


def test_replay_runs_the_ready_job_of_lowest_order_first():
    """As engine/host/worker.py does: jobs 0 (order 5) and 1 (order 1) are submitted at once and run 1 then 0;
    job 2 (order 0) comes after a copy that ends at 1.25, so it waits while job 0 runs (1 to 2), then goes
    ahead of job 3 (order 9, ready at 0) that was submitted before it."""

    def adam(job: int) -> HostWork:  # 1 s each on the unit profile; the phase names the job
        return HostWork("adam", 10**9, 1, 1, f"job {job}")

    trace = Trace(
        issue=[Mark(1), Submit(0), Submit(1), Submit(3), Copy("d2h", 10**9, 1, "p"), Record(1, "d2h"), Submit(2)],
        jobs=[[adam(0)], [adam(1)], [Sync(1, "land"), adam(2)], [adam(3)]],
        job_step=[1] * 4,
        job_order=[5, 1, 0, 9],
        job_after=[((), ()), ((), ()), ((1,), ()), ((), ())],
    )
    timeline = replay(trace, unit_profile(), launch_s=0.25)
    ran = [(iv.phase, iv.start) for iv in timeline.intervals if iv.lane == "host"]
    assert ran == [("job 1", 0.0), ("job 0", 1.0), ("job 2", 2.0), ("job 3", 3.0)]  # the copy ended at 1.25


def test_replay_refuses_a_schedule_that_cannot_proceed():
    """The issuing thread waits for a job whose copy event is recorded only after that wait."""
    trace = Trace(issue=[Submit(0), Join(0, "x"), Record(1, "d2h")], jobs=[[Sync(1, "y")]], job_step=[0])
    with pytest.raises(RuntimeError, match="cannot proceed"):
        replay(trace, unit_profile())


# -- live replay: timing decisions during the recording --------------------------------------------------
def adam_job(seconds: float, name: str) -> list:
    return [HostWork("adam", int(seconds * 10**9), 1, 1, name)]  # on the unit profile: 1 Gparam/s


def launches(n: int) -> list[Kernel]:
    """`n` kernels that take no GPU time: each moves the issuing thread's clock by one launch."""
    return [Kernel("k", 0, 0, 0, False, False, 1, "p") for _ in range(n)]


def spans(timeline: Timeline) -> list[Interval]:
    """The intervals in time order per lane (a live replay appends them in another order)."""
    return sorted(timeline.intervals, key=lambda iv: (iv.lane, iv.start, iv.end, iv.what, iv.phase))


def test_live_replay_says_whether_a_job_is_done_by_the_issuing_threads_clock():
    """While a trace is being recorded, a job is done once the replay has it ended by the issuing thread's
    clock: a 1 s job submitted at 0 is not after one 0.25 s launch, and is after four; the finished live
    replay is the replay of the whole trace."""
    trace = Trace()
    live = Replay(trace, unit_profile(), launch_s=0.25)
    trace.issue += [Mark(1), Submit(0)]
    trace.jobs.append(adam_job(1.0, "job 0"))
    trace.job_step.append(1)
    trace.issue += launches(1)
    assert not live.ended_by_now(0)
    trace.issue += launches(3)
    assert live.ended_by_now(0)
    assert spans(live.run()) == spans(replay(trace, unit_profile(), launch_s=0.25))


def test_live_replay_starts_no_job_that_a_later_submission_could_precede():
    """Job 0 (order 5) is submitted, then the recording stops at the issuing thread's clock 0; job 1 (order 1)
    submitted at the same moment must still go first, as in the replay of the whole trace."""
    trace = Trace(job_order=[5, 1])
    live = Replay(trace, unit_profile(), launch_s=0.25)
    trace.issue += [Mark(1), Submit(0)]
    trace.jobs.append(adam_job(1.0, "job 0"))
    trace.job_step.append(1)
    assert not live.ended_by_now(0)
    trace.issue += [Submit(1), *launches(1)]
    trace.jobs.append(adam_job(1.0, "job 1"))
    trace.job_step.append(1)
    assert not live.ended_by_now(0) and live.ended_by_now(1) is False  # (job 1 runs 0 to 1, the clock is 0.25)
    timeline = live.run()
    assert [iv.phase for iv in timeline.intervals if iv.lane == "host"] == ["job 1", "job 0"]
    assert spans(timeline) == spans(replay(trace, unit_profile(), launch_s=0.25))


def slow_host() -> Profile:
    """A fast GPU whose host steps 1000 parameters a second: no step is done before the GPU needs it."""
    return dataclasses.replace(unit_profile(), host_adam_gparams=1e-6)


def recorded_uploads(profile: Profile | None, num_slots: int) -> list[Copy]:
    """The uploads of 2 clipped steps of the tiny model recorded with `num_slots` slots (on `profile`)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny())
    recorder = Recorder(profile)
    with recorder.recording():
        engine = Engine(
            model,
            EngineConfig(device="cpu", precision="bf16-true", pin_memory=False, clipping=True, num_slots=num_slots),
            recorder.probes(),
        )
        recorder.attach(engine)
        train_steps(engine, model, batch(), recorder, STEPS, clip=1.0)
    engine.close()
    return [i for i in recorder.trace.issue if isinstance(i, Copy) and i.lane == "h2d"]


def test_prefetch_decisions_follow_the_replayed_timing():
    """With 4 slots the optimizer step issues block 0 for the next forward and blocks 1 and 2 if their steps
    are done. Recorded without a device every job counts as done, so all three go up there; on a host too
    slow to finish any step in time only block 0 does, and blocks 1 and 2 go up in the forward instead
    (each block once a step)."""
    runs = recorded_uploads(None, 4), recorded_uploads(slow_host(), 4)
    block = max(c.nbytes for c in runs[0])

    def blocks(uploads: list[Copy], step: int, phase: str) -> int:
        return sum(c.nbytes == block and c.step == step and c.phase.startswith(phase) for c in uploads)

    assert [blocks(uploads, 1, "optimizer") for uploads in runs] == [3, 1]  # step 1 issuing step 2's forward
    layers = tiny().num_hidden_layers
    assert [blocks(uploads, 1, "optimizer") + blocks(uploads, 2, "forward") for uploads in runs] == [layers] * 2


# -- the bound ---------------------------------------------------------------------------------------------
def test_clipping_is_bound_by_the_backward_then_the_host_steps():
    """By hand: step 2 runs from 1 (the end of step 1's backward) to 3. The host steps for 1 s, then the GPU
    runs the forward (0.2 s) and the backward (0.8 s): no resource is busy more than 1 s, but with
    clipping no step may start before the backward's last gradient, nor the next backward before the last
    step, so the bound is the chain 0.8 + 1 = 1.8 s. Without clipping the steps may overlap the backward:
    the chain is the Adam time, 1 s, and the bound the busiest resource's (a tie names the resource)."""
    timeline = Timeline(
        intervals=[
            Interval("compute", 0.0, 1.0, 1, "mm", "backward block 0"),
            Interval("host", 1.0, 2.0, 2, "adam", "optimizer"),
            Interval("compute", 2.0, 2.2, 2, "mm", "forward block 0"),
            Interval("compute", 2.2, 3.0, 2, "mm", "backward block 0"),
        ]
    )
    clipped, plain = (summarize(timeline, unit_profile(), 1e12, 2, clipped=c) for c in (True, False))
    assert (clipped.bound, clipped.bound_s, clipped.step_s) == pytest.approx((CHAIN, 1.8, 2.0))
    assert clipped.resource in ("gpu", "host") and clipped.resource_ratio == pytest.approx(2.0)
    assert (plain.bound, plain.bound_s, plain.chain_s) == ("gpu", 1.0, 1.0)


def test_kept_speculative_steps_take_the_chain_off_the_norm():
    """By hand, as above with clipping, but each unit's speculative step (0.6 s in all) ran during the backward
    and was kept: the next forward waited for those, not for Adam (1 s, now the steps proper beside it), so
    the chain is the unclipped one with 0.6 s in Adam's place: 0.6 + 1.0 - 0.2 - 0.8 = 0.6 s, and the bound
    the busiest resource, the host's 1.6 s."""
    timeline = Timeline(
        intervals=[
            Interval("compute", 0.0, 1.0, 1, "mm", "backward block 0"),
            Interval("host", 1.0, 2.0, 2, "adam", "optimizer"),
            Interval("compute", 1.0, 1.2, 2, "mm", "forward block 0"),
            Interval("compute", 1.2, 2.0, 2, "mm", "backward block 0"),
            Interval("host", 1.4, 2.0, 2, "speculate", "backward block 0"),
        ]
    )
    kept = summarize(timeline, unit_profile(), 1e12, 2, clipped=True, speculative=True)
    assert kept.chain_s == pytest.approx(0.6)
    assert (kept.bound, kept.bound_s) == pytest.approx(("host", 1.6))
    assert summarize(timeline, unit_profile(), 1e12, 2, clipped=True).chain_s == pytest.approx(1.8)


def test_speculative_steps_are_recorded_beside_the_steps_proper(capsys):
    """`megatrain schedule --clip 1.0 --speculative-step` on the tiny preset: every unit's speculative step is
    host work of its own kind, reading master, m, v (fp32) and the gradient (bf16: one micro-batch's waits in
    its slab) and writing the bf16 copy once, 16 bytes per parameter, kept every step (a fake norm counts as
    not clipped); Adam proper still runs."""
    args = ["schedule", "--model", "tiny", "--device", "a100", "--seq-len", "32", "--steps", "2", "--clip", "1.0"]
    step = run([*args, "--speculative-step"])
    out = capsys.readouterr().out
    config = step.config
    units = config.num_hidden_layers + 2 + (not config.tie_word_embeddings)  # blocks, embedding, norm, head
    assert step.trace.speculative == (STEPS * units, 0)
    assert f"speculative steps: {STEPS * units} kept, 0 discarded" in out
    work = [w for job in step.trace.jobs for w in job if isinstance(w, HostWork) and w.kind == "speculate"]
    assert sum(w.numel for w in work) == STEPS * config.num_parameters()
    assert sum(w.nbytes for w in work) == (3 * 4 + 2 + 2) * STEPS * config.num_parameters()
    assert step.summary.host_kinds["adam"] > 0 and step.summary.host_kinds["speculate"] > 0


def test_the_recording_waits_for_no_pending_step_that_nothing_reads(monkeypatch):
    """The recorded loop reads no weights between steps, so the pending-read watch (engine/host/pending_reads.py)
    must never make it wait: the engine's own per-call self-check of parameter storage once did, which put each
    block's step proper, not its speculative step, before its next forward in the model (8B at 4 x 4096 with
    device sums: 3.68 s recorded against 2.66 s)."""
    made = []
    monkeypatch.setattr(PendingReads, "watch", _spy(PendingReads.watch, made))
    record_steps(tiny(), SEQ, clip=1.0, micro_batches=2, speculative_step=True, profile=PROFILES["a100"])
    assert made and all(reads.waits == 0 for reads in made)  # (made: the watch was set, so it could have waited)


def _spy(method, seen: list):
    def spied(self, *args, **kwargs):
        seen.append(self)
        return method(self, *args, **kwargs)

    return spied


def _speculations_end(intervals: list[Interval]) -> dict[tuple[int, str], float]:
    """(step, phase) -> when its last speculative step ended (phase "backward": the outer units', the
    embedding's last)."""
    ends: dict[tuple[int, str], float] = {}
    for iv in intervals:
        if iv.lane == "host" and iv.what == "speculate":
            ends[iv.step, iv.phase] = max(iv.end, ends.get((iv.step, iv.phase), 0.0))
    return ends


def test_the_next_forward_waits_for_each_kept_speculative_step(capsys):
    """Recorded with speculative steps on a slow host (tiny preset, clip 1.0, every speculation kept, host jobs
    far longer than the GPU's work): block k's forward of the next step starts after block k's speculative step
    has ended (it uploads the weights that step wrote), and the embedding's lookup after the embedding's."""
    args = ["schedule", "--model", "tiny", "--device", "a100", "--seq-len", "32", "--steps", "3", "--clip", "1.0"]
    step = run([*args, "--speculative-step", "--host-gbps", "0.01"])
    intervals = step.timeline.intervals
    spec_end = _speculations_end(intervals)

    def first(step: int, phase: str, what: str | None = None) -> float:
        return min(
            iv.start
            for iv in intervals
            if iv.lane == "compute" and iv.step == step and iv.phase == phase and what in (None, iv.what)
        )

    for s in (1, 2):
        for k in range(step.config.num_hidden_layers):
            assert first(s + 1, f"forward block {k}") >= spec_end[s, f"backward block {k}"], (s, k)
        assert first(s + 1, "forward", "embedding") >= spec_end[s, "backward"]


def test_steps_proper_start_after_the_last_speculative_step():
    """Recorded with speculative steps over a slow link (tiny preset, clip 1.0, every speculation kept): the head's
    speculative step is done long before the embedding's gradient has come down, yet no step proper starts before
    the step's last speculative step has ended (begun earlier, it would hold the one worker from what the next
    forward waits for first)."""
    slow_link = dataclasses.replace(PROFILES["a100"], link_gbps=0.1)
    intervals = modelled_step(tiny(), slow_link, SEQ, clip=1.0, steps=3, speculative_step=True).timeline.intervals
    spec_end = _speculations_end(intervals)
    for s in (1, 2):
        last = max(end for (t, _), end in spec_end.items() if t == s)
        assert min(iv.start for iv in intervals if iv.lane == "host" and iv.what == "adam" and iv.step == s) >= last


def test_with_accumulation_the_chain_holds_all_but_the_first_forward():
    """Two micro-batches after the host's 1 s of Adam and 0.4 s of accumulating (0.2 s each): forward 0.2 s
    and backward 0.8 s each. Only the first forward may overlap the previous step's Adam (block by block),
    so with clipping the chain is 1 + 2.0 - 0.2 = 2.8 s (the accumulating overlaps the GPU); without, the
    steps may start during the last backward, each after its unit's last accumulation: 2.8 - 0.8 + 0.2 =
    2.2 s, above every resource (GPU 2.0 s, host 1.4 s)."""
    timeline = Timeline(
        intervals=[
            Interval("compute", 0.0, 1.0, 1, "mm", "backward block 0"),
            Interval("host", 1.0, 2.0, 2, "adam", "optimizer"),
            *(Interval("host", t, t + 0.2, 2, "accumulate", "backward block 0") for t in (3.0, 4.0)),
            *(Interval("compute", t, t + 0.2, 2, "mm", "forward block 0") for t in (2.0, 3.0)),
            *(Interval("compute", t, t + 0.8, 2, "mm", "backward block 0") for t in (2.2, 3.2)),
        ]
    )
    clipped, plain = (summarize(timeline, unit_profile(), 1e12, 2, clipped=c, micro_batches=2) for c in (True, False))
    assert (clipped.bound, clipped.bound_s, clipped.step_s) == pytest.approx((CHAIN, 2.8, 3.0))
    assert (plain.bound, plain.bound_s) == pytest.approx((CHAIN, 2.2))


# -- the command line ----------------------------------------------------------------------------------
LAST = re.compile(
    r"^schedule: model=(\S+) tokens_per_step=(\d+) clip=(\S+) step_s=(\S+) bound_s=(\S+) ratio=(\S+) "
    r"bound=(gpu|h2d|d2h|host|step-chain) mfu=(\S+)$"
)


def test_command_line_ends_with_the_summary_line(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_schedule", Path(__file__).parents[1] / "bench" / "schedule.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    out = io.StringIO()
    png = tmp_path / "lanes.png"
    with redirect_stdout(out):
        args = [
            "--model",
            "tiny",
            "--tokens",
            "64",
            "--clip",
            "1.0",
            "--device",
            "a100",
            "--steps",
            "2",
            "--png",
            str(png),
        ]
        assert cli.main(args) == 0
    lines = out.getvalue().strip().splitlines()
    match = LAST.match(lines[-1])
    assert match, lines[-1]
    model, tokens, clip, step_s, bound_s, ratio, _, mfu = match.groups()
    assert (model, tokens, clip) == ("tiny", "64", "1")
    assert float(step_s) >= float(bound_s) > 0 and 0 < float(mfu) < 1
    assert float(ratio) == pytest.approx(float(step_s) / float(bound_s), rel=1e-3)
    if importlib.util.find_spec("matplotlib") is None:
        assert any("matplotlib is not installed" in line for line in lines)
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_megatrain_schedule_prints_the_lanes_table_and_the_summary_line(capsys):
    """`megatrain schedule` on the tiny preset: the description, every lane's row, the step, what the GPU and
    host did, and the summary line last (tokens per step: micro-batches x seq-len)."""
    args = ["--model", "tiny", "--device", "a100", "--seq-len", "64", "--steps", "2", "--micro-batches", "2"]
    step = run(["schedule", *args, "--clip", "1.0"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("schedule model: tiny (") and "2 micro-batches of 1 x 64 tokens/step" in lines[0]
    assert "modelled a100" in lines[0]
    header = lines.index(table(step.summary).splitlines()[0])
    assert lines[header].split() == ["lane", "busy", "s", "share"]
    rows = [line.split()[0] for line in lines[header + 1 :]]
    assert rows[:7] == ["gpu", "h2d", "d2h", "host", "issue", CHAIN, "step"]
    assert rows[7:9] == ["gpu:", "host:"] and lines[header + 10].startswith("issuing thread blocked: ")
    for line in lines[header + 1 : header + 6]:  # busy seconds and share of the step, e.g. "gpu 0.0014 24.5%"
        assert re.match(r"^\S+ +\d+\.\d{4} +\d+\.\d%", line), line
    match = LAST.match(lines[-1])
    assert match and match.group(1, 2, 3) == ("tiny", "128", "1"), lines[-1]
    assert lines[-1] == step.summary_line() and len(lines) == header + 12


def test_host_rates_measured_on_a_machine_replace_the_profiles_spec_figures():
    """A host measured at 60 GB/s and 4 Gparams/s of Adam: the worker's rates are those, not the socket's spec
    times the efficiency; the GPU's and the link's stay; a rank of 2 has half of each."""
    spec = profile("h100-sxm")
    assert spec.host_bytes() == pytest.approx(307e9 * HOST_EFFICIENCY) and not spec.host_given
    measured = spec.with_host(60, 4.0)
    assert measured.host_given and measured.host_bytes() == pytest.approx(60e9)
    assert measured.adam_params() == pytest.approx(4e9)
    assert (measured.link_bytes(), measured.hbm_bytes(), measured.matmul_flops()) == (
        spec.link_bytes(),
        spec.hbm_bytes(),
        spec.matmul_flops(),
    )
    assert spec.with_host(60).adam_params() == pytest.approx(60e9 / ADAM_BYTES_PER_PARAM)  # Adam from it
    assert spec.with_host() == spec
    rank = DataParallel(2, "nvlink").rank_profile(measured)
    assert rank.host_bytes() == pytest.approx(30e9) and rank.adam_params() == pytest.approx(2e9)
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="give the rate measured on the machine"):
            spec.with_host(bad)


def test_megatrain_schedule_says_which_host_rates_were_given(capsys):
    args = ["--model", "tiny", "--device", "a100", "--seq-len", "64", "--steps", "2"]
    run(["schedule", *args, "--host-gbps", "60", "--host-adam-gparams", "4"])
    rates = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("rates: "))
    assert "host 60 GB/s (given), Adam 4 Gparams/s (given)" in rates


def test_megatrain_schedule_names_the_profiles_for_an_unknown_device(capsys):
    with pytest.raises(SystemExit) as exit_:
        run(["schedule", "--model", "tiny", "--device", "h1000", "--seq-len", "64"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1
    assert err[0].startswith("megatrain schedule: error: device 'h1000': choose one of ")
    assert all(name in err[0] for name in PROFILES)


def test_model_flops_count_the_weight_matrices_and_causal_pairs():
    """N is every parameter but the input embedding and the norm gains (2 per block and the final one);
    causal attention is half the full square plus the diagonal: 12·heads·head_dim per pair, forward and backward."""
    cfg = LlamaConfig.from_preset("llama-3.1-8b")
    gains = (2 * cfg.num_hidden_layers + 1) * cfg.hidden_size
    assert matmul_params(cfg) == cfg.num_parameters() - cfg.vocab_size * cfg.hidden_size - gains
    seq = 4096
    full = 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * seq * seq
    assert model_flops(cfg, seq, seq) == 6 * matmul_params(cfg) * seq + (full + full // seq) // 2


def test_kept_blocks_forward_is_recorded_once(capsys):
    """`megatrain schedule --recompute false` against `true` on the tiny preset: with every graph kept, the
    blocks' backward records fewer FLOPs, by exactly the FLOPs of their forward in the same step (a kept
    block's forward is not recomputed), and the description says how many blocks kept their graph."""
    args = ["schedule", "--model", "tiny", "--device", "a100", "--seq-len", "32", "--steps", "2"]
    steps = {rc: run([*args, "--recompute", rc]) for rc in ("true", "false")}
    out = capsys.readouterr().out
    layers = steps["true"].config.num_hidden_layers
    assert f"recompute true: 0 of {layers} blocks" in out and f"recompute false: {layers} of {layers} blocks" in out

    def flops(rc: str, label: str) -> int:
        issue = steps[rc].trace.issue
        return sum(k.flops for k in issue if isinstance(k, Kernel) and k.step == 2 and k.phase.startswith(label))

    assert steps["false"].trace.kept_calls == [layers, layers] and steps["true"].trace.kept_calls == [0, 0]
    assert flops("true", "forward block") == flops("false", "forward block") > 0
    assert flops("true", "backward block") - flops("false", "backward block") == flops("true", "forward block")


def test_rows_per_micro_batch_are_recorded_as_rows(capsys):
    """`megatrain schedule --batch-size 2`: the engine runs micro-batches of 2 rows, so every matmul and
    attention kernel of the recording does exactly twice the FLOPs of the one-row run's, and the step's
    tokens and model FLOPs are twice as many."""
    args = ["schedule", "--model", "tiny", "--device", "a100", "--seq-len", "32", "--steps", "2"]
    one, two = run(args), run([*args, "--batch-size", "2"])
    out = capsys.readouterr().out
    assert "2 x 32 tokens/step" in out and "1 x 32 tokens/step" in out
    recorded = [sum(k.flops for k in step.trace.issue if isinstance(k, Kernel)) for step in (one, two)]
    assert recorded[1] == 2 * recorded[0] > 0
    assert (two.step_tokens, two.summary.model_flops) == (2 * one.step_tokens, 2 * one.summary.model_flops)
    with pytest.raises(SystemExit):
        run([*args, "--batch-size", "0"])
    assert "batch_size=0 must be an integer >= 1" in capsys.readouterr().err


def test_the_engines_own_kernels_are_told_from_the_models(capsys):
    """Each recorded kernel says whose work it is: the engine's packing of gradients and its recompute
    fingerprints (and, with device sums, their adds) are the engine's, named by the function that issued
    them; every matmul and attention kernel is the model's. The table's GPU line gives the engine's share."""
    args = ["schedule", "--model", "tiny", "--device", "a100", "--seq-len", "32", "--steps", "2"]
    plain, sums = run([*args, "--micro-batches", "2"]), run([*args, "--micro-batches", "2", "--device-grad-sums", "4"])
    out = capsys.readouterr().out

    def origins(step) -> set[str]:
        return {k.origin for k in step.trace.issue if isinstance(k, Kernel)}

    assert {"engine:pack_grads", "engine:fingerprint", "model"} <= origins(plain)
    assert "engine:_add" in origins(sums) and "engine:_add" not in origins(plain)
    kernels = [k for k in plain.trace.issue if isinstance(k, Kernel)]
    assert all(k.origin == "model" for k in kernels if k.attention or k.name in ("mm", "addmm", "bmm"))
    own = plain.summary.engine_kernels
    assert own and set(own) <= {o.removeprefix("engine:") for o in origins(plain)}
    assert f"the engine's own {sum(own.values()):.4f} s" in out


def test_layer_major_rows_are_recorded_as_chunks_with_the_weights_up_once(capsys):
    """`megatrain schedule --batch-size 8 --row-chunk 2`: the same matmul FLOPs as whole calls of 8 rows, in more
    than three times as many matmuls (each block call runs as 4 chunks; the head's are per micro-batch), and the
    same bytes up and down the link: each block's weights go up, and its gradient comes down, once per
    micro-batch. (The attention kernels' FLOPs follow the tiles, planned for a chunk's rows.)"""
    args = ["schedule", "--model", "tiny", "--device", "a100", "--seq-len", "32", "--steps", "2", "--batch-size", "8"]
    args += ["--recompute", "true"]  # (whole calls may keep their last blocks' graphs; chunked calls never do)
    whole, chunked = run(args), run([*args, "--row-chunk", "2"])
    assert "layer-major: block calls of 2 rows" in capsys.readouterr().out

    def kernels(step) -> list[Kernel]:
        model = (k for k in step.trace.issue if isinstance(k, Kernel) and k.origin == "model")
        return [k for k in model if k.name in ("mm", "addmm", "bmm")]

    def link(step, lane: str) -> int:
        return sum(c.nbytes for c in step.trace.issue if isinstance(c, Copy) and c.lane == lane)

    assert sum(k.flops for k in kernels(chunked)) == sum(k.flops for k in kernels(whole)) > 0
    assert len(kernels(chunked)) > 3 * len(kernels(whole))
    assert (link(chunked, "h2d"), link(chunked, "d2h")) == (link(whole, "h2d"), link(whole, "d2h"))
    auto = run([*args, "--row-chunk", "auto"])  # 8 rows of the tiny model fit an A100 whole: calls stay whole
    assert len(kernels(auto)) == len(kernels(whole)) and "layer-major" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        run([*args, "--row-chunk", "0"])
    assert "row_chunk=0: give the rows each chunk" in capsys.readouterr().err
