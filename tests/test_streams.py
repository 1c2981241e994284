"""The engine's stream waits are necessary and sufficient, proven on the CPU with an asynchronous double.

tests/async_streams.py replaces the synchronous CPU stand-ins with copy streams that run late, in
order, on their own threads (see its docstring). Under it:

1. the double itself behaves like CUDA streams: a copy is invisible until its event is waited on, reads
   its source when it runs, and each stream runs in issue order, behind the events it waits on;
2. trainings that are bitwise equal to ordinary training stay bitwise equal (so every wait the engine
   needs is there), with every copy held until waited on and with seeded random delays;
3. removing one essential wait makes the training differ from ordinary training (so the double would
   have caught its absence).
"""

from __future__ import annotations

import functools
import threading
import time

import pytest
import torch

from megatrain_lightning import Engine, EngineConfig, MegatrainStrategy
from megatrain_lightning.engine import build as build_module
from megatrain_lightning.engine.device.streams import SlotPool
from megatrain_lightning.engine.host.host_steps import HostSide
from tests.async_streams import AsyncStreams, install
from tests.helpers import CausalLM, fit, hf_llama, hf_loss, params_of, token_batches

# -- 1. the double ------------------------------------------------------------------------------


def test_a_copy_is_invisible_until_its_event_is_waited_on():
    streams = AsyncStreams(torch.device("cpu"), hold=1.0)
    src, dst = torch.ones(8), torch.zeros(8)
    streams.copy(streams.h2d, dst, src)
    ready = streams.event(streams.h2d)
    time.sleep(0.05)
    assert not ready.query() and torch.equal(dst, torch.zeros(8))  # read early: the data from before
    src.fill_(2.0)  # like a DMA, the copy reads its source when it runs, not when it was issued
    streams.wait(None, ready)  # the compute stream (the host) waits: the copy runs first
    assert ready.query() and torch.equal(dst, torch.full((8,), 2.0))

    slab = torch.zeros(8)
    streams.copy(streams.d2h, slab, dst)
    done = streams.event(streams.d2h)
    time.sleep(0.02)
    assert torch.equal(slab, torch.zeros(8))
    done.synchronize()  # the host waits for the download
    assert torch.equal(slab, dst)
    assert [kind for _, _, kind in streams.log] == ["copy", "record", "copy", "record"]


@pytest.mark.parametrize("seed", [0, 1])
def test_each_stream_runs_in_issue_order_off_the_host_thread(seed):
    streams = AsyncStreams(torch.device("cpu"), seed=seed, hold=0.3, max_delay=2e-3)
    threads = set()

    class Spy(torch.Tensor):  # notes the thread each copy runs on
        def copy_(self, src, non_blocking=False):
            threads.add(threading.get_ident())
            return super().copy_(src)

    dst = {s.name: torch.zeros(1).as_subclass(Spy) for s in (streams.h2d, streams.d2h)}
    for i in range(40):
        for s in (streams.h2d, streams.d2h):
            streams.copy(s, dst[s.name], torch.full((1,), float(i)))
            if i % 7 == 0:
                streams.event(s)
    streams.synchronize()
    assert all(float(d) == 39.0 for d in dst.values())  # the last copy issued ran last
    for name in ("h2d", "d2h"):
        seqs = [seq for s, seq, _ in streams.log if s == name]
        assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) == 40 + 6
    assert threading.get_ident() not in threads and len(threads) >= 2  # one thread per stream


def test_a_stream_runs_nothing_behind_a_wait_until_its_event_completes():
    streams = AsyncStreams(torch.device("cpu"), hold=0.0, max_delay=0.0)
    streams.d2h.hold = 1.0  # the download is held until somebody needs it
    a, b = torch.zeros(4), torch.zeros(4)
    streams.copy(streams.d2h, a, torch.ones(4))
    downloaded = streams.event(streams.d2h)
    streams.wait(streams.h2d, downloaded)
    streams.copy(streams.h2d, b, torch.ones(4))  # would run at once, but it is behind the wait
    uploaded = streams.event(streams.h2d)
    time.sleep(0.05)
    assert not uploaded.query() and torch.equal(b, torch.zeros(4))
    streams.wait(None, uploaded)  # forcing the upload forces the download it waits for
    assert downloaded.query() and torch.equal(a, torch.ones(4)) and torch.equal(b, torch.ones(4))
    copies = [(s, seq) for s, seq, kind in streams.log if kind == "copy"]
    assert copies == [("d2h", 1), ("h2d", 2)]


def test_the_engine_issues_every_copy_through_the_streams(monkeypatch):
    """The bytes the double copied are exactly the bytes the engine counts as transferred (uploads of blocks
    and outer parameters, gradient downloads): none of those copies bypasses Streams.copy."""
    monkeypatch.setenv("MEGATRAIN_CPU_ADAM", "torch")
    made = install(monkeypatch, hold=1.0)
    moved = {"h2d": 0, "d2h": 0}
    copy = AsyncStreams.copy

    def counted(self, stream, dst, src):
        moved[stream.name] += dst.numel() * dst.element_size()
        copy(self, stream, dst, src)

    monkeypatch.setattr(AsyncStreams, "copy", counted)
    model = hf_llama(layers=4)
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true"))
    opt = engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    for batch in token_batches(2):
        with engine.backward():
            model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
    engine.close()
    assert len(made) == 1 and made[0].copies > 0
    assert moved == {"h2d": engine.stats["h2d_bytes"], "d2h": engine.stats["d2h_bytes"]}
    assert not (made[0].h2d.queue or made[0].d2h.queue)  # release drained both streams


# -- 2. bitwise equality under the double -------------------------------------------------------


def two_views(model, batch: torch.Tensor) -> torch.Tensor:
    """Two forwards in one loss: each block's gradients are held and summed in its slab (host_steps.Held)."""
    return hf_loss(model, batch) + 0.5 * hf_loss(model, batch.flip(1))


# Cut-down versions of tests/test_strategy.py's twenty-steps test (accumulation 4, clipping, warm-up +
# cosine schedule, a no-decay group) and overlapped test (no clipping: blocks step during backward), of
# tests/test_engine.py's 3-slot run (with 5 blocks, so backward uploads again), and of
# tests/test_host_steps.py's two forwards in one loss.
TRAININGS = {
    "accumulate-clip-schedule": dict(
        layers=3,
        batches=20,
        module=dict(split_decay=True, schedule=5),
        trainer=dict(accumulate_grad_batches=4, gradient_clip_val=1.0),
    ),
    "overlapped": dict(layers=3, batches=8, module=dict(split_decay=True, schedule=8), trainer={}),
    "three-slots": dict(layers=5, batches=6, module={}, trainer={}, slots=3),
    "two-views": dict(layers=3, batches=6, module=dict(loss_fn=two_views), trainer=dict(accumulate_grad_batches=2)),
}
# num_slots="auto" growing to a slot per block after the first step (with the device memory patched in).
CONFIGS = {
    **TRAININGS,
    "auto-slots": dict(layers=5, batches=6, module={}, trainer=dict(accumulate_grad_batches=2), slots="auto"),
}

MODES = {
    "lazy": dict(hold=1.0),  # every copy runs only when something waits for it
    "seed0": dict(seed=0, hold=0.25, max_delay=1e-3),
    "seed1": dict(seed=1, hold=0.0, max_delay=2e-3),  # nothing held: copies race the host
}


def train(name: str, strategy: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    cfg = CONFIGS[name]
    module = CausalLM(hf_llama(layers=cfg["layers"]), **cfg["module"])
    if strategy == "megatrain" and "slots" in cfg:
        strategy = MegatrainStrategy(num_slots=cfg["slots"])
    fit(module, token_batches(cfg["batches"]), strategy=strategy, **cfg["trainer"])
    return module.losses, params_of(module.model)


@functools.cache
def ordinary(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    return train(name, "auto")


def same(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(TRAININGS))
def test_trainings_stay_bitwise_equal_with_asynchronous_copies(name, mode, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_CPU_ADAM", "torch")
    ref = ordinary(name)
    made = install(monkeypatch, **MODES[mode])
    got = train(name, "megatrain")
    assert len(made) == 1 and made[0].copies > 0 and made[0].error is None
    assert got[0] == ref[0]
    assert same(got, ref)


@pytest.mark.parametrize("mode", list(MODES))
def test_slots_added_mid_run_keep_training_bitwise_equal_with_asynchronous_copies(mode, monkeypatch):
    """num_slots="auto" adds its slots after the first step (here 3, one per block: every block then stays
    resident across the micro-batches of an accumulation); with copies running late the training is still
    ordinary training's, bit for bit."""
    monkeypatch.setenv("MEGATRAIN_CPU_ADAM", "torch")
    monkeypatch.setattr(build_module, "free_device_bytes", lambda device: 1 << 40)
    monkeypatch.setattr(build_module, "step_transient_bytes", lambda device: 0)
    grown, grow = [], SlotPool.grow
    monkeypatch.setattr(SlotPool, "grow", lambda pool, n: grown.append(n) or grow(pool, n))
    ref = ordinary("auto-slots")
    made = install(monkeypatch, **MODES[mode])
    got = train("auto-slots", "megatrain")
    assert grown == [2, 3] and made[0].copies > 0 and made[0].error is None
    assert same(got, ref)


@pytest.mark.parametrize("mode", ["lazy", "seed0"])
def test_bf16_is_unchanged_by_asynchronous_copies(mode, monkeypatch):
    """bf16 has a pinned compute copy apart from the master, rewritten by every step while uploads read it:
    megatrain's bf16 training is the same with and without the double (it is deterministic on the CPU)."""
    monkeypatch.setenv("MEGATRAIN_CPU_ADAM", "torch")

    def run() -> tuple:
        module = CausalLM(hf_llama(layers=4), split_decay=True, schedule=4)
        fit(
            module,
            token_batches(8),
            strategy="megatrain",
            precision="bf16-mixed",
            accumulate_grad_batches=2,
            gradient_clip_val=1.0,
        )
        return module.losses, params_of(module.model)

    plain = run()
    made = install(monkeypatch, **MODES[mode])
    assert same(run(), plain) and made[0].copies > 0


# -- 3. a removed wait is caught ------------------------------------------------------------------


def hold_first_landing(monkeypatch) -> None:
    """Keep the host worker busy with its first landing until the host has packed three block gradients:
    a slow host worker, as with a large model, so the host runs ahead of the downloads."""
    packed, gate = [0], threading.Event()
    pack, land = HostSide.pack_grads, HostSide._land

    def counting_pack(self, *args):
        out = pack(self, *args)
        packed[0] += 1
        if packed[0] == 3:
            gate.set()
        return out

    def held_land(self, *args):
        gate.wait(timeout=10)
        return land(self, *args)

    monkeypatch.setattr(HostSide, "pack_grads", counting_pack)
    monkeypatch.setattr(HostSide, "_land", held_land)


# Not caught, because the host thread is the compute stream: the copy streams' waits for compute (H2D
# on a slot's `free` event in SlotPool.load, D2H on the gradient's `produced` event in ship, the outer
# upload's wait for earlier compute); every copy is issued after the compute before it has run. Nor the
# host worker's wait for a unit's upload before stepping it (_step_unit): every upload is waited for by
# the compute that reads it, which comes before the block's gradient and so before its step.
REMOVED = {
    # The host worker reads the pinned slab before the gradient's download has finished.
    "land-reads-slab-before-download": dict(skip=("_land", "host")),
    # The compute stream reads a weight slot before the block's upload into it has finished. Where the
    # forward and the recompute read different stale contents, the engine's recompute self-check stops the
    # step (which depends on how late the copies run); otherwise it trains on wrong data.
    "compute-reads-slot-before-upload": dict(skip=("acquire", "compute"), may_stop=True),
    # The compute stream reads the embedding/norm/head before their upload after a step has finished.
    "compute-reads-outer-before-upload": dict(skip=("_upload", "compute")),
    # The compute stream overwrites a device grad slot before its previous download has read it (visible
    # when the host worker lags behind, which would otherwise force each download promptly).
    "grad-slot-reused-before-download": dict(skip=("pack_grads", "compute"), setup=hold_first_landing),
}


@pytest.mark.parametrize("removed", list(REMOVED))
def test_a_removed_wait_changes_the_result(removed, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_CPU_ADAM", "torch")
    case = REMOVED[removed]
    ref = ordinary("overlapped")
    if "setup" in case:
        case["setup"](monkeypatch)
    made = install(monkeypatch, hold=1.0, skip=(case["skip"],))
    # No other exception is expected: each stale read trains to the end on wrong data (measured, every case),
    # or is stopped by the recompute self-check where the case says it may be; any other error (a failed copy
    # included) would be a different fault than the removed wait, so it fails here.
    try:
        got = train("overlapped", "megatrain")
    except RuntimeError as error:
        if not case.get("may_stop") or "its recompute in backward did not reproduce its forward" not in str(error):
            raise
        got = None
    assert made and made[0].skipped[case["skip"]] > 0, "the wait to remove was never issued"
    if got is None:
        return
    assert made[0].error is None
    assert not same(got, ref)


def test_a_lagging_host_worker_alone_changes_nothing(monkeypatch):
    """The control for the grad-slot case: holding the first landing back, with every wait in place."""
    monkeypatch.setenv("MEGATRAIN_CPU_ADAM", "torch")
    ref = ordinary("overlapped")
    hold_first_landing(monkeypatch)
    install(monkeypatch, hold=1.0)
    assert same(train("overlapped", "megatrain"), ref)


# -- 4. the CUDA-only parts of the streams, with a recording stand-in ---------------------------------------


class _RecordingStreams(AsyncStreams):
    """AsyncStreams that notes the compute-stream events it records and every wait of a copy stream."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device, hold=1.0)
        self.compute_events: list[object] = []
        self.copy_waits: list[tuple[str, object]] = []

    def event(self, stream=None):
        ev = super().event(stream)
        if stream is None:
            self.compute_events.append(ev)
        return ev

    def wait(self, stream, event) -> None:
        if stream is not None:
            self.copy_waits.append((stream.name, event))
        super().wait(stream, event)


def test_a_grown_slot_is_not_uploaded_into_before_the_compute_issued_ahead_of_it():
    """A slot added mid-forward (``recompute=False`` or auto growth) gets memory the caching allocator may
    have just taken back from kernels still queued on the compute stream: its `free` event is recorded on
    the compute stream at allocation, and the first upload into it waits for that event on the H2D stream.
    (On the CPU compute has run when the event is recorded; what is checked is that the wait is issued.)"""
    streams = _RecordingStreams(torch.device("cpu"))
    pool = SlotPool(streams, 2, 16, torch.float32)
    pool.grow(1)
    grown = pool.free[2]
    assert grown is not None and grown is streams.compute_events[-1]
    pool.load(0, set(), lambda dst: streams.event(streams.h2d))
    pool.load(1, set(), lambda dst: streams.event(streams.h2d))
    pool.load(2, {0, 1}, lambda dst: streams.event(streams.h2d))  # slots 0 and 1 hold protected blocks
    assert pool.slot_of(2) == 2 and ("h2d", grown) in streams.copy_waits


def test_device_collectives_run_one_at_a_time_in_issue_order():
    """The weights' all-gather (H2D stream) and the gradients' exchange (compute stream) use two
    communicators; two in flight at once can hang NCCL. Each collective waits for the one issued before it,
    whatever its stream: the exchange, issued second, runs after the all-gather even though the H2D stream
    runs late."""
    streams = AsyncStreams(torch.device("cpu"), hold=1.0)
    ran: list[str] = []

    def gather() -> None:
        time.sleep(0.05)  # a slow all-gather: an exchange not chained to it would run first
        ran.append("gather")

    streams.copy(streams.h2d, torch.zeros(4), torch.ones(4))  # held work ahead of it on the H2D stream
    streams.collective(streams.h2d, gather)
    streams.collective(None, lambda: ran.append("exchange"))
    streams.collective(streams.h2d, lambda: ran.append("gather 2"))
    streams.synchronize()
    assert ran == ["gather", "exchange", "gather 2"]


def test_events_the_host_waits_on_sleep_instead_of_spinning(monkeypatch):
    """CUDA events default to spin-waiting: a host thread synchronizing on one burns a core the host
    optimizer's threads need. The engine's events are blocking ones (a fake CUDA layer records how they are
    made)."""
    from megatrain_lightning.engine.device.streams import Streams

    made: list[dict] = []

    class FakeEvent:
        def __init__(self, **kwargs) -> None:
            made.append(kwargs)

        def record(self, stream=None) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: object())
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: object())
    streams = Streams(torch.device("cuda", 0))
    streams.event()
    streams.event(streams.d2h)
    assert made == [{"blocking": True}, {"blocking": True}]
