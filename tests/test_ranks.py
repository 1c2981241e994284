"""The data-parallel schedule model (megatrain_lightning/schedule/ranks.py, scaling.py) of the data-parallel
mode (engine/ranks.py): one rank's host copies are 1/N of one GPU's and the collectives move the rest, one GPU is
today's model exactly, the ranks' host Adam shares one node's DRAM, strong scaling stays below N, and
`megatrain schedule --gpus` prints it.

Recordings are of a 2-block tiny Llama on fake tensors (a second each); the scaling test widens it so that
the GPU's work, not the launch cost, decides the step.
"""

from __future__ import annotations

import functools

import pytest

from megatrain_lightning.cli.main import run
from megatrain_lightning.models import LlamaConfig
from megatrain_lightning.schedule import PROFILES, DataParallel, modelled_step, replay, scaling, summarize
from megatrain_lightning.schedule.steps import record_steps
from megatrain_lightning.schedule.trace import Copy, HostWork, Trace

SEQ, STEPS = 64, 2
H100 = PROFILES["h100-sxm"]


def tiny() -> LlamaConfig:
    return LlamaConfig.from_preset("tiny", token_chunk_size=None, num_hidden_layers=2)


@functools.cache
def trace(gpus: int, link: str = "nvlink") -> Trace:
    """STEPS clipped steps of one micro-batch of one rank of `gpus` (of 1: as the plain recorder, see below)."""
    return record_steps(tiny(), SEQ, 1.0, STEPS, num_slots=2, profile=H100, data_parallel=DataParallel(gpus, link))


def items(t: Trace) -> list:
    return [*t.issue, *(item for job in t.jobs for item in job)]


def moved(t: Trace, lane: str, what: str = "copy") -> int:
    return sum(c.nbytes for c in items(t) if isinstance(c, Copy) and c.lane == lane and c.what == what)


@pytest.mark.parametrize(("gpus", "link"), [(4, "nvlink"), (2, "pcie")])
def test_a_ranks_host_copies_are_its_shard_and_the_collectives_move_the_rest(gpus, link):
    """Every unit of the tiny model divides by 4, so the shards are exact: H2D and D2H bytes 1/N of one GPU's;
    the all-gather brings in, and the reduce-scatter sends out, the other N - 1 shards."""
    one, rank = trace(1), trace(gpus, link)
    dp = DataParallel(gpus, link)
    for lane in ("h2d", "d2h"):
        assert moved(one, lane) > 0 and moved(rank, lane) * gpus == moved(one, lane)
    assert moved(rank, dp.gather_lane, "all-gather") == (gpus - 1) * moved(rank, "h2d")
    assert moved(rank, dp.scatter_lane, "reduce-scatter") == (gpus - 1) * moved(rank, "d2h")
    reduces = [c for c in items(rank) if isinstance(c, Copy) and c.what == "all-reduce"]
    assert [c.step for c in reduces] == list(range(1, STEPS + 1))  # one per clipped step, none on one GPU
    assert not any(isinstance(c, Copy) and c.what != "copy" for c in items(one))


def test_one_gpu_is_todays_model_exactly():
    """modelled_step(gpus=1) records with the plain recorder, as before data parallelism was modelled; the
    rank recorder of one GPU logs the same items, and its replay gives the same step time to the last bit."""
    today = modelled_step(tiny(), H100, SEQ, 1, 1.0, num_slots=2, steps=STEPS)
    mine, plain = trace(1), today.trace  # (the last item names its caller: record_steps<modelled_step)
    assert mine.issue[:-1] == plain.issue[:-1] and mine.jobs == plain.jobs and today.profile is H100
    rank = summarize(replay(mine, DataParallel(1).rank_profile(H100)), H100, 1.0, STEPS, clipped=True)
    assert rank.step_s == today.summary.step_s and today.global_tokens == SEQ and today.gpus == 1


def test_host_adam_shares_one_nodes_dram():
    """N ranks each step 1/N of the parameters at 1/N of the node's DRAM bandwidth: a rank's Adam takes as
    long as one GPU's, while its host copies take 1/N of the time."""
    one = replay(trace(1), H100)
    rank = replay(trace(4), DataParallel(4).rank_profile(H100))

    def seconds(timeline, lane, what):
        return sum(iv.seconds for iv in timeline.intervals if iv.lane == lane and iv.what == what)

    assert seconds(rank, "host", "adam") == pytest.approx(seconds(one, "host", "adam"), rel=1e-9)
    assert seconds(rank, "h2d", "copy") == pytest.approx(seconds(one, "h2d", "copy") / 4, rel=1e-9)
    adam = [w for w in items(trace(4)) if isinstance(w, HostWork) and w.kind == "adam"]
    assert sum(w.numel for w in adam) * 4 == STEPS * tiny().num_parameters()


def test_strong_scaling_speeds_up_below_n():
    """Global tokens fixed, split over 1, 2, 4 GPUs of a model whose blocks all stay in the slots (its one-GPU
    step is not bound by the host link): each rank computes less, but the host's Adam over every parameter
    takes as long on any count, so the speedup grows and stays below N. (Where one GPU's step is bound by its
    link, the shards cut that N-fold and the speedup can pass N: docs/benchmarks.md, 70B on 2 GPUs.)"""
    wide = dict(num_hidden_layers=2, hidden_size=1024, intermediate_size=2816, loss_chunk_size=4096)
    config = LlamaConfig.from_preset("tiny", token_chunk_size=None, **wide)
    rows = scaling(config, H100, 4096, global_micro_batches=4, gpus=(1, 2, 4), steps=STEPS, modes=("strong",))
    assert [r.step.global_tokens for r in rows] == [4 * 4096] * 3
    assert [r.step.step_tokens for r in rows] == [4 * 4096, 2 * 4096, 4096]
    speedups = [r.speedup for r in rows]
    assert speedups[0] == 1.0 < speedups[1] < speedups[2]
    assert all(r.speedup < r.gpus for r in rows[1:]) and all(0 < r.efficiency <= 1 for r in rows)


def test_megatrain_schedule_gpus(capsys):
    step = run(["schedule", "--model", "tiny", "--device", "a100", "--seq-len", "64", "--steps", "2", "--gpus", "2"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("data parallel (modelled; the strategy trains on one GPU today)") for line in lines)
    assert any(line.startswith("peer ") for line in lines)  # the NVLink lane's row
    assert lines[-1] == step.summary_line() and " gpus=2 link=nvlink tokens_per_s=" in lines[-1]
    assert "tokens_per_step=64 " in lines[-1] and step.global_tokens == 128
