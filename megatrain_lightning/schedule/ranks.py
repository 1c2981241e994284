"""One rank of the data-parallel mode ("partition, then stream", engine/ranks.py), modelled on the recording of the
single-GPU engine: what each of N GPUs of one node would issue, and what it would share.

The design modelled: each unit's flat host buffers are cut into N contiguous shards, one per rank. For each
unit the rank uploads only its shard into its own part of the slot and the device link all-gathers the
rest (in place); in backward the unit's gradient is reduce-scattered on the device link (in place in the
gradient slot) and the rank downloads only its shard and steps it on its own host threads. Clipping adds
one all-reduce of the ranks' partial squared norms. The engine does not run this yet; the recorder makes it
out of what the engine issues today:

    H2D      | shard of unit i (1/N) |
    link     |                       | all-gather i (N-1)/N |     ...     | reduce-scatter i (N-1)/N |
    compute  |                                              | fwd/bwd i |
    D2H                                                                                           | shard |
    host                                                                                           | Adam 1/N |

- Each copy of a unit's weights (``engine/device/uploads.py``) becomes the shard's copy, ceil(elements / N), and
  an all-gather that brings in the other N - 1 shards; each copy of a unit's gradient (``engine/host/host_steps.py``)
  becomes a reduce-scatter sending out N - 1 shards, then the shard's copy. Saved inputs move whole.
- ``link="nvlink"``: the collectives run on a sixth lane, ``peer``, at the profile's NVLink rate each way
  (a ring moves (N - 1)/N of the unit through every GPU's link, both directions at once). An event of the
  upload stream completes once the all-gathers queued before it have; what the copy streams wait for, the
  link waits for too (a slot is free for both, a gradient is computed for both).
- ``link="pcie"``: GPUs reach each other through the PCIe switch on the same x16 link as the host copies,
  so the all-gather is queued on the upload lane and the reduce-scatter on the download lane (their traffic
  in the other direction, as much again, is not charged: an optimistic figure).
- Host work (Adam, accumulation, norms, casts) is on 1/N of each unit, at 1/N of the host's DRAM bandwidth:
  the N ranks' workers step their shards at the same time on one node's memory, and the native Adam kernel
  is bandwidth-bound (one thread already reaches the DRAM ceiling, docs/benchmarks.md), so cores/N threads
  per rank suffice and N ranks do not get N times the bandwidth.
- Ranks are alike: one rank is recorded and replayed; the others are assumed to keep its pace (no skew,
  no waiting for the slowest in a collective). A collective's latency is not modelled, only its bytes.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Any

import torch

from megatrain_lightning.schedule.profiles import Profile
from megatrain_lightning.schedule.record import RecordedEvent, Recorder, RecordingStreams
from megatrain_lightning.schedule.replay import LAUNCH_S
from megatrain_lightning.schedule.trace import Copy, Record, Wait

LINKS = ("nvlink", "pcie")
UNIT_COPIERS = ("megatrain_lightning.engine.device.uploads", "megatrain_lightning.engine.host.host_steps")
"""The engine modules whose copies move units' weights and gradients (sharded); others move whole."""
NORM_READ = "_param_norms"
"""Where the engine reads the clipping norms from the device: the all-reduce of the ranks' parts goes first."""


@dataclass(frozen=True)
class DataParallel:
    """N GPUs of one node, each a rank, joined by `link` ("nvlink" or "pcie")."""

    gpus: int = 1
    link: str = "nvlink"

    def __post_init__(self) -> None:
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 1:
            raise ValueError(f"gpus={self.gpus!r} must be an integer >= 1 (the GPUs of one node)")
        if self.link not in LINKS:
            raise ValueError(f"link={self.link!r}: choose one of {', '.join(LINKS)}")

    def shard(self, n: int) -> int:
        """A rank's part of `n` elements or bytes: its shard, rounded up (the unit padded to N shards)."""
        return -(-n // self.gpus)

    @property
    def gather_lane(self) -> str:
        return "peer" if self.link == "nvlink" else "h2d"

    @property
    def scatter_lane(self) -> str:
        return "peer" if self.link == "nvlink" else "d2h"

    def rank_profile(self, profile: Profile) -> Profile:
        """`profile` as one of the N ranks sees it: 1/N of the host's DRAM bandwidth (and of a given Adam
        rate), and the link to its peers. One GPU: `profile` itself."""
        if self.gpus == 1:
            return profile
        if self.link == "nvlink" and profile.nvlink_gbps is None:
            raise ValueError(f"device {profile.name!r} has no NVLink; model its peers over PCIe (link='pcie')")
        adam = profile.host_adam_gparams
        return dataclasses.replace(
            profile,
            host_gbps=profile.host_gbps / self.gpus,
            host_adam_gparams=None if adam is None else adam / self.gpus,
            peer_gbps=profile.nvlink_gbps if self.link == "nvlink" else profile.link_gbps,
        )


class RankRecorder(Recorder):
    """A :class:`Recorder` that logs what one rank would issue (module docstring); of one GPU, what the plain
    recorder logs."""

    def __init__(
        self, dp: DataParallel, profile: Profile | None = None, launch_s: float = LAUNCH_S, fusion: Any = None
    ) -> None:
        super().__init__(None if profile is None else dp.rank_profile(profile), launch_s, fusion)
        self.dp = dp

    def streams(self, device: torch.device) -> RecordingStreams:
        return RankStreams(self, device) if self.dp.gpus > 1 else super().streams(device)

    def host_work(self, kind: str, numel: int, nbytes: int) -> None:
        """The rank's host work is on its shards only."""
        super().host_work(kind, self.dp.shard(numel), self.dp.shard(nbytes))

    def host_read(self, where: str) -> None:
        """Before the clipping norms are read: one all-reduce of the ranks' partial squared norms, after every
        reduce-scatter (the norms are of the summed gradient) and before the read."""
        if NORM_READ in where and self.dp.gpus > 1:
            lane, done = self.dp.scatter_lane, self.new_event()
            computed = self.new_event()
            self.log(Record(computed, "compute"))
            self.log(Wait(lane, computed))
            self.log(Copy(lane, 4, self.step, self.phase, "all-reduce"))
            self.log(Record(done, lane))
            self.log(Wait("compute", done))
        super().host_read(where)


class RankStreams(RecordingStreams):
    """The recording streams of a rank: units' copies become shard copies and collectives."""

    recorder: RankRecorder

    def event(self, stream: torch.Stream | None = None) -> RecordedEvent:
        lane, gather = self._name(stream), self.recorder.dp.gather_lane
        if lane != "h2d" or gather == "h2d":
            return super().event(stream)
        event = RecordedEvent(self.recorder, self.recorder.new_event())
        self.recorder.log(Record(event.id, lane, also=(gather,)))  # the slot is whole once its all-gather is
        return event

    def wait(self, stream: torch.Stream | None, event: object) -> None:
        super().wait(stream, event)
        lane, dp = self._name(stream), self.recorder.dp
        mirror = {"h2d": dp.gather_lane, "d2h": dp.scatter_lane}.get(lane, lane)
        if event is not None and mirror != lane:
            self.recorder.log(Wait(mirror, event.id))

    def copy(self, stream: torch.Stream | None, dst: torch.Tensor, src: torch.Tensor) -> None:
        if sys._getframe(1).f_globals.get("__name__") not in UNIT_COPIERS:
            return super().copy(stream, dst, src)
        rec, dp = self.recorder, self.recorder.dp
        elt, lane = dst.element_size(), self._name(stream)
        shard = dp.shard(dst.numel()) * elt
        others = (dp.gpus - 1) * shard
        if lane == "h2d":
            rec.log(Copy("h2d", shard, rec.step, rec.phase))
            self._then("h2d", dp.gather_lane)
            rec.log(Copy(dp.gather_lane, others, rec.step, rec.phase, "all-gather"))
        else:
            rec.log(Copy(dp.scatter_lane, others, rec.step, rec.phase, "reduce-scatter"))
            self._then(dp.scatter_lane, "d2h")
            rec.log(Copy("d2h", shard, rec.step, rec.phase))
        with rec.quiet():
            dst.copy_(src)

    def _then(self, first: str, then: str) -> None:
        """What is queued on lane `then` from now on starts after what is queued on `first` so far."""
        if first != then:
            event = self.recorder.new_event()
            self.recorder.log(Record(event, first))
            self.recorder.log(Wait(then, event))
