"""The host half of the engine: gradients from device to host, and the optimizer steps on them.

An object the engine holds (:class:`HostSide`); it owns the state of the gradients' way to the host
(grad slots, rings, what is pending) and is given the units, streams, worker and counters. Every host-side computation runs on the engine's single worker thread
(engine/host/worker.py: a unit's jobs in the order submitted, steps in the next forward's order); a unit's
``future`` is its last job, and nothing overwrites a unit's slab or uploads its copy before that future
has finished.

Per unit the gradient goes: grad slot on the device -> D2H into the unit's pinned slab -> the worker
waits for the copy event, then keeps it (slab), adds it into the fp32 accumulator, computes its norms,
or, when it completes the step and nothing needs the global norm first, steps the unit right away.

In the lean layout a gradient the worker consumes at once (into the accumulator, or by the step) skips the
slab: it comes down piece by piece (engine/host/ring.py) into a ring, and each piece is landed (and stepped)
as soon as its copy is done, so the host holds a few pieces of gradient, not a unit's.

A block called more than once before one backward (two forwards in one loss) has its calls' gradients
summed first (:class:`Held`): the first waits in the slab while another call is still to come back, the
others come down through a ring and are added to it, and the last call lands the sum as one gradient.

Hooks that read or edit gradients (``engine.gradients_visible``) get them after :meth:`HostSide.expose` has
landed every one into the fp32 accumulator; :meth:`HostSide.take_back` folds what they left into it.

A unit given a device sum (engine/device/grad_sums.py) adds its accumulating micro-batches' gradients on the device
instead, and the sum comes down once, at the step's last backward, into the accumulator.

With ``speculative_step``, a unit whose gradient of the step's last backward has landed gets its Adam step
taken at once into its spare copy (:class:`Speculation`); the optimizer step keeps it, and the next forward
uploads it without waiting, when the step turns out to be the one it assumed.

Why one file of about 980 lines: every path a gradient takes to the host (whole, in pieces, held for a
second call, summed on the device, accumulated, shown to hooks, stepped at once, speculatively or at the
step) moves the unit's gradient state (units.UnitGrad, whose transitions are named), and this object decides
which path each gradient takes; split, those decisions would be spread over several files.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from megatrain_lightning.engine.device.grad_sums import DeviceGradSums
from megatrain_lightning.engine.host.needed_first import NeededFirst
from megatrain_lightning.engine.host.ring import HostRing, pieces
from megatrain_lightning.engine.host.units import GradState, HostUnit, spans
from megatrain_lightning.engine.ranks import Ranks
from megatrain_lightning.engine.self_checks import gated
from megatrain_lightning.optim import kernels
from megatrain_lightning.optim.kernels import AdamHyper


def graph_task() -> int:
    """The backward pass running on this thread (autograd's graph task id; -1 outside a backward)."""
    return torch._C._current_graph_task_id()


@dataclass
class Held:
    """Gradients of one block from one backward pass, summed in the unit's slab until the pass's last call of
    the block has come back. Autograd adds the contributions a weight gets within one backward before they
    reach ``.grad`` (in the weight's compute dtype: under autocast, at the one cached cast of the weight),
    so the sum lands once, as one gradient: into the accumulator, or stepped."""

    task: int  # the backward pass (graph_task) the gradients come from
    accumulate: bool  # that pass was not the last micro-batch of the step
    present: list[bool]  # per parameter, whether any of the calls produced a gradient


@dataclass
class Speculation:
    """A unit's Adam step taken as its gradient of the step's last backward landed, before the step was asked
    for: the new compute-dtype weights only, into the unit's spare copy (:meth:`HostSide._step_aside`). The
    step keeps them when it finds what they assumed (:meth:`HostSide._kept`, then :meth:`HostSide._keep`)."""

    hyper: list[AdamHyper]  # the param groups' hyper-parameters it stepped with, unscaled (clip coefficient 1)
    landed: Any  # the unit's job before it (the gradient's landing): what the clipping norms wait for
    future: Any = None  # the speculative job itself
    version: int | None = None  # the gradient's version it read (UnitGrad.version), set by the job
    steps: list[int] | None = None  # the unit's Adam step counts it stepped from, set by the job
    kept: bool = False  # the step kept it (HostSide._keep)


class HostSide:
    """Gradient shipping, accumulation, clipping and AdamW steps on the host worker.

    What the backward under way should do is set by the engine's ``backward`` context: `mode` "accumulate"
    (more micro-batches follow), "step" (this backward completes the step's gradient) or None (nothing is
    known, e.g. manual optimization: gradients land and wait for the step); `want_norms`: a global-norm
    clip comes before the step (norms are taken on the device, nothing steps during backward)."""

    def __init__(
        self,
        blocks: list[HostUnit],
        outer: list[HostUnit],
        streams,
        worker,
        stats: dict,
        *,
        piece: int,
        grad_ring: HostRing | None,
        ring_shape: tuple[int, bool],
        tier=None,
        overlap_optimizer: bool = True,
        speculative: bool = False,
        invalidate: Callable[[int], None] = lambda idx: None,
        ranks: Ranks,
        sums: DeviceGradSums | None = None,
    ) -> None:
        """`invalidate(i)`: block i's weights on the host changed (stepped), so a device slot holding it is stale.
        `ranks` (engine/ranks.py): each unit holds this rank's shard, its gradients reduce-scattered over
        the ranks (the whole unit and its own gradients with one rank)."""
        self.ranks = ranks
        self.sums = sums  # engine/device/grad_sums.py: blocks whose micro-batch gradients are summed on the device
        self.blocks, self.outer, self.streams, self.worker, self.stats = blocks, outer, streams, worker, stats
        self.piece, self.tier, self.overlap_optimizer, self.invalidate = piece, tier, overlap_optimizer, invalidate
        self.speculative = speculative  # EngineConfig.speculative_step: see :class:`Speculation`
        self._specs: dict[HostUnit, Speculation] = {}
        self._scratch: torch.Tensor | None = None  # kernels.adam_peek_'s, made at the first speculative step
        self.block_index = {id(u): i for i, u in enumerate(blocks)}
        self.compute_dtype, self.device = blocks[0].compute_dtype, streams.device
        # The clipping norms taken here, on the host: as ordinary training takes them on this device, bit for bit
        # on the CPU, and in fp64 where ordinary training reduces on a GPU (kernels.param_norms says why).
        self.accurate_norms = self.device.type != "cpu"
        max_numel = max(u.device_numel for u in blocks)
        self.grad_slots = [torch.empty(max_numel, dtype=self.compute_dtype, device=self.device) for _ in range(2)]
        self.grad_slot_free: list[object | None] = [None, None]
        self.next_grad_slot = 0
        self.grad_ring = grad_ring  # lean layout: gradients landed at once go through these
        # A block called more than once before a backward: its later calls' gradients come down through this
        # ring (the lean layout's gradient ring, else one made at the first such call) to add to the first.
        self.sum_ring: HostRing | None = None
        self.ring_shape = ring_shape
        self.mode: str | None = None  # None | "accumulate" | "step": the engine's backward context
        self.want_norms = False
        # Every gradient of the step lands and waits for it (no step during backward): hooks read or edit the
        # gradients before the step (`engine.gradients_visible`), or the step clamps them (clip by value).
        self.hold = False
        self.hyper: Callable[[], list[AdamHyper]] | None = None  # the attached optimizer's groups, now
        self.param_order: list[int] = []  # ids of the optimizer's parameters in group order
        self.stepper: Any = None  # a torch optimizer stepping itself (engine/generic_optim.py), not the Adam kernel
        self._pending: set[HostUnit] = set()  # units with gradients not yet stepped
        self._eager: set[HostUnit] = set()  # units stepped during this backward already
        self._clip: float | None = None  # global-norm clipping requested for the next step
        self._clip_value: float | None = None  # per-element clamp requested for the next step
        # Run first by every host job of a unit (engine/self_checks.py: on a GPU, whether the unit's recompute
        # agreed with its forward); None: nothing to check.
        self.gate: Callable[[HostUnit], None] | None = None
        # With speculative steps and their weights going up ahead, the step's last sums wait for room on the link
        # and go needed first (engine/host/needed_first.py; `when` set by the streamer).
        self.needed_first = NeededFirst(streams, stats)

    def all_units(self) -> list[HostUnit]:
        # Outer units first: the embedding is the first thing the next forward needs.
        return self.outer + self.blocks

    def attach(self, hyper: Callable[[], list[AdamHyper]], param_order: list[int], stepper: Any = None) -> None:
        if stepper is not None and self.speculative:
            raise ValueError(
                f"speculative_step=True with {', '.join(type(o.optimizer).__name__ for o in stepper.optimizers)}: "
                "a speculative step is the engine's Adam kernel's (torch.optim.AdamW or Adam); pass speculative_step=False for another optimizer"
            )
        self.hyper, self.param_order, self.stepper = hyper, param_order, stepper

    # -- gradients to the host ------------------------------------------------------------------
    def pack_grads(self, unit: HostUnit, grads: list[torch.Tensor | None]) -> tuple[torch.Tensor, int]:
        """Write a block's parameter gradients (None: the parameter got none) into a free device grad slot,
        flat in the unit's layout; a missing gradient is written as zeros and marked absent by `ship`."""
        k = self.next_grad_slot
        self.next_grad_slot = 1 - k
        self.streams.wait(None, self.grad_slot_free[k])  # its previous download must have finished
        flat = self.grad_slots[k][: unit.full_numel]
        parts = [
            (g if g is not None else torch.zeros(e.shape, dtype=self.compute_dtype, device=self.device)).reshape(-1)
            for e, g in zip(unit.layout, grads)
        ]
        torch.cat([p.to(self.compute_dtype) for p in parts], out=flat)
        if unit.device_numel > unit.full_numel:  # partitioned: the padding of the last rank's chunk adds nothing
            self.grad_slots[k][unit.full_numel : unit.device_numel].zero_()
            flat = self.grad_slots[k][: unit.device_numel]
        return flat, k

    def ship(
        self,
        unit: HostUnit,
        flat: torch.Tensor,
        present: list[bool],
        block_idx: int | None = None,
        grad_slot: int | None = None,
        more: bool = False,
    ) -> None:
        """Download a unit's gradient into its pinned slab and hand it to the host worker. `present` says,
        per parameter, whether autograd produced a gradient (absent ones are zeros in `flat`); `more`: the
        block has another call still to come back (its gradients are summed first, see :class:`Held`).

        Partitioned, `flat` and `present` are the whole unit's: the mean over ranks is reduce-scattered on the
        device first, and this rank's shard goes down (a parameter has a gradient if any rank's has one)."""
        self.needed_first.send_now(unit)  # (a second gradient of a unit lands after its first)
        if unit.partitioned:
            present = unit.piece_flags(self.ranks.any_rank(present))
            self.stats["reduce_scatter_bytes"] += unit.device_numel * flat.element_size()
            whole, out = flat, []
            self.streams.collective(None, lambda: out.append(self.ranks.reduce_scatter(whole, unit.full_numel)))
            flat = out[0]
            if self.streams.is_cuda:
                flat.record_stream(self.streams.d2h)  # made on the compute stream, read by the download
        if unit in self._eager:
            raise RuntimeError(
                f"{unit.name} got a second gradient after it was already stepped during this backward; "
                "gradients must reach a unit once per optimizer step when the optimizer overlaps backward"
            )
        task = graph_task()
        if unit.grad.held is not None and unit.grad.held.task != task:
            self.land_held(unit, block_idx, this_pass=False)  # an earlier backward's sum is complete
        if self._into_sum(unit, flat, present, block_idx, more):
            if grad_slot is not None:
                self.grad_slot_free[grad_slot] = None  # (read on the compute stream, which reuses the slot after)
            return
        self.wait(unit)  # the worker must be done reading the slab before it is overwritten
        if self.sums is not None and self.sums.is_open(unit):
            self._spill(unit)  # a block called again in this backward: its calls are summed on the host
        if unit.grad.held is not None:
            done = self._add_to_held(unit, flat, present)
            if not more:
                self.land_held(unit, block_idx, this_pass=True)
        elif more:
            done = self._hold(unit, flat, present, task)
        else:
            done = self._ship_whole(unit, flat, present, block_idx)
        if grad_slot is not None:
            self.grad_slot_free[grad_slot] = done
        elif self.streams.is_cuda:
            flat.record_stream(self.streams.d2h)  # autograd's grad buffer lives until the copy has read it

    # -- sums kept on the device (engine/device/grad_sums.py) ----------------------------------------------------
    def sum_grads(
        self, unit: HostUnit, grads: list[torch.Tensor | None], present: list[bool], block_idx: int, more: bool
    ) -> bool:
        """A block's parameter gradients (None: got none) added straight into its device sum, with no packing
        into a grad slot first, where this backward's gradient goes there (see :meth:`_into_sum`); False: it
        does not (pack and :meth:`ship` it). A partitioned unit's gradient is reduce-scattered whole first."""
        if self.sums is None or unit.partitioned or unit in self._eager:
            return False  # (ship refuses a second gradient of a unit already stepped)
        if unit.grad.held is not None and unit.grad.held.task != graph_task():
            return False  # (ship lands the earlier backward's held sum first)
        return self._into_sum(unit, grads, present, block_idx, more)

    def _into_sum(
        self, unit: HostUnit, grad: torch.Tensor | list, present: list[bool], block_idx: int | None, more: bool
    ) -> bool:
        """Add this backward's gradient of `unit` (flat, or per parameter) to its device sum, if it goes there:
        the only call of a unit allowed one, in an accumulating backward when the unit has a sum open or holds
        no gradient on the host (so no host sum is reordered), or in the step's last backward when a sum is
        open, which then goes down as the backward's one gradient of the unit."""
        sums = self.sums
        if sums is None or more or unit.grad.held is not None or not sums.takes(unit):
            return False
        if self.mode == "accumulate":
            # A unit not pending holds no gradient once its queued jobs (last step's, or a drop) are done, so
            # the sum needs no wait for them: the host may still be stepping it while its next ones are summed.
            if not (sums.is_open(unit) or unit not in self._pending):
                return False
            sums.add(unit, grad, present)
            self._pending.add(unit)
            return True
        if not sums.is_open(unit):
            return False
        self.wait(unit)  # the sum goes down into the accumulator, which the last step's jobs may still read
        sums.add(unit, grad, present)
        self._ship_sum(unit, block_idx)
        return True

    def _ship_sum(self, unit: HostUnit, block_idx: int | None) -> None:
        """The unit's complete device sum goes down as the backward's one gradient of it (into the fp32
        accumulator) and lands: stepped at once where the optimizer overlaps backward, else kept for the step."""
        eager = self._eager_ok()
        total, present = self._close_sum(unit, whole=True)
        send = partial(self._send_sum, unit, block_idx, eager, total, present, self.streams.event())
        if eager or not self.needed_first.when() or not self.needed_first.defer(self.step_rank(unit), unit, send):
            send()

    def _send_sum(
        self, unit: HostUnit, block_idx: int | None, eager: bool, total: torch.Tensor, present: list[bool], made: Any
    ) -> object:
        """:meth:`_ship_sum`'s download of the closed sum `total` (complete at the compute event `made`), its
        landing and what follows it; now, or later in the next forward's order (engine/host/needed_first.py)."""
        hyper = self.hyper() if eager else None
        done = self._send_down(unit, total, made)
        want_norm = self.want_norms and unit.grad.device_norms is None
        rank = self.step_rank(unit) if hyper is not None else 0
        clamp = self._clip_value if eager else None
        self.submit(unit, partial(self._land_sum, unit, done, present, want_norm, hyper, clamp), rank, done)
        self._shipped(unit, eager, block_idx)
        return done

    def _spill(self, unit: HostUnit) -> None:
        """Something needs the gradient on the host before the step's last backward: the device sum goes down
        into the fp32 accumulator, where the host path goes on adding (nothing steps)."""
        done, present = self._download_sum(unit)
        self.submit(unit, partial(self._land_sum, unit, done, present, False, None, None), 0, done)
        self._pending.add(unit)

    def reserve_sums(self) -> None:
        """Allocate now, between steps (as ``device_grad_sums="auto"`` grants the sums, after the first step),
        the device sum and the pinned fp32 accumulator (a sum's download lands in it) of every unit allowed a
        sum, rather than at its first sum and first download, inside a backward: pinning takes about a second per few GB of host memory and stalls the thread issuing that
        backward (the first H200 run: a 1.24B model's first step with ``device_grad_sums="auto"`` took about
        2 s longer, and half its timed window). An accumulator holding a sum is kept as it is."""
        if self.sums is None:
            return
        pin = self.streams.is_cuda
        for unit in self.sums.granted():
            if unit.partitioned:
                continue
            self.sums.reserve(unit)
            if pin and unit.pin and (unit.acc is None or not unit.acc.is_pinned()):
                self.wait(unit)  # (its step may still be reading the accumulator this replaces)
                if unit.grad.state is GradState.EMPTY:
                    unit.ensure_acc(pin=True)

    def spill_all(self) -> None:
        self.needed_first.flush()
        if self.sums is not None:
            for unit in self.sums.open_units():
                self.wait(unit)
                self._spill(unit)

    def _download_sum(self, unit: HostUnit) -> tuple[object, list[bool]]:
        """Send the unit's device sum down into its fp32 accumulator now."""
        total, present = self._close_sum(unit)
        return self._send_down(unit, total, self.streams.event()), present

    def _close_sum(self, unit: HostUnit, whole: bool = False) -> tuple[torch.Tensor, list[bool]]:
        """The unit's complete device sum and presence flags; `whole`: it is the step's whole gradient of the unit,
        whose per-parameter norms clipping then takes on the device (as of a single micro-batch's)."""
        total, present = self.sums.close(unit)
        self._device_norms(unit, total[: unit.numel], present, single=whole)
        return total, present

    def _send_down(self, unit: HostUnit, total: torch.Tensor, made: Any) -> object:
        """Copy the closed sum `total` into the unit's accumulator after the compute event `made`; the copy's event."""
        acc = unit.ensure_acc(pin=unit.pin and self.streams.is_cuda)
        self._before_download(total, made)
        self.streams.copy(self.streams.d2h, acc, total[: unit.numel])
        return self.streams.event(self.streams.d2h)

    def _land_sum(
        self,
        unit: HostUnit,
        done: Any,
        present: list[bool],
        want_norm: bool,
        hyper: list[AdamHyper] | None,
        clamp: float | None,
    ) -> None:
        """A device sum has come down into the accumulator: the unit holds it as its gradient (as the host path
        holds a sum of micro-batches), and steps it when `hyper` says so."""
        t0 = time.perf_counter()
        done.synchronize()  # never read pinned memory before its copy has finished
        unit.grad.arriving(present)
        unit.grad.accumulating()
        unit.grad.landed(self._norms(unit) if want_norm else None)
        self.stats["host_land_seconds"] += time.perf_counter() - t0
        if hyper is not None:
            self._clamp_and_step(unit, hyper, 1.0, clamp)

    def _ship_whole(self, unit: HostUnit, flat: torch.Tensor, present: list[bool], block_idx: int | None) -> object:
        """A unit's whole gradient of this backward: land it (into the accumulator, or stepped at once when
        the optimizer overlaps backward, or kept for the step). Returns the event of its last copy."""
        if unit.grad.state is GradState.SLAB:
            self._promote(unit)
        accumulate = self.mode == "accumulate"
        eager = self._eager_ok()
        self._device_norms(unit, flat, present, single=not accumulate and unit.grad.state is GradState.EMPTY)
        # Lean layout: a gradient the landing job consumes at once (into the accumulator, or by the step
        # itself) goes through the gradient ring; one that waits for the optimizer step needs its own slab.
        to_acc = accumulate or unit.grad.state is GradState.ACC
        hyper = self.hyper() if eager else None
        # Clipping by value said before backward, and this unit steps as it lands: the whole step's gradient
        # is clamped on the device before it goes down; a sum of micro-batches by the landing job.
        clamp = self._clip_value if eager else None
        if clamp is not None and not to_acc:
            flat.clamp_(-clamp, clamp)
            clamp = None
        self._before_download(flat)
        want_norm = self.want_norms and not accumulate and unit.grad.device_norms is None
        if self.grad_ring is not None and (to_acc or eager):
            done = self._ship_pieces(unit, flat, present, to_acc, want_norm, hyper, clamp)
        else:
            slab = unit.ensure_slab()
            self.streams.copy(self.streams.d2h, slab, flat)
            done = self.streams.event(self.streams.d2h)
            # A step waits its turn (engine/host/worker.py): the next forward's order, once its copy has landed.
            rank = self.step_rank(unit) if hyper is not None else 0
            job = partial(self._land, unit, done, present, accumulate, want_norm, hyper, clamp)
            self.submit(unit, job, rank, done)
        self._shipped(unit, eager, block_idx)
        return done

    def _before_download(self, flat: torch.Tensor, made: Any = None) -> None:
        """Count the download of `flat` and hold the link for its compute (event `made`, else all issued so far)."""
        self.stats["d2h_bytes"] += flat.numel() * flat.element_size()
        self.streams.wait(self.streams.d2h, made if made is not None else self.streams.event())  # the gradient is made

    def _shipped(self, unit: HostUnit, eager: bool, block_idx: int | None) -> None:
        if eager:
            self._eager.add(unit)
            self._pending.discard(unit)  # earlier micro-batches' sum is consumed by this step
            if block_idx is not None:
                self.invalidate(block_idx)
        else:
            self._pending.add(unit)
            self._speculate(unit)

    # -- speculative steps (EngineConfig.speculative_step) -------------------------------------------------
    def _speculate(self, unit: HostUnit) -> None:
        """The gradient just shipped completes the unit's step (the step's last backward, nothing stepping
        during it): queue its Adam step into the spare copy, unscaled, behind the landing."""
        if not self.speculates() or unit.grad.held is not None:
            self._specs.pop(unit, None)
            return
        spec = Speculation(self.hyper(), unit.future)
        self.submit(unit, partial(self._step_aside, unit, spec), self.step_rank(unit))
        spec.future = unit.future
        self._specs[unit] = spec

    def speculates(self) -> bool:
        """Whether a gradient completing its unit's step now gets a speculative step: in the step's last backward
        with ``speculative_step``, nothing stepping during it, no clipping by value said."""
        return (
            self.speculative
            and self.mode == "step"
            and not self.hold
            and self.hyper is not None
            and self.stepper is None
            and self._clip_value is None
        )

    def _step_aside(self, unit: HostUnit, spec: Speculation) -> None:
        """Worker: the unit's step as the optimizer would take it unclipped, the new weights into its spare copy
        (its master and moments untouched)."""
        t0 = time.perf_counter()
        if unit.spare_read is not None:
            unit.spare_read.synchronize()  # an upload may still read the spare (the copy it was)
        if self._scratch is None:
            self._scratch = torch.empty(3, kernels.PEEK_CHUNK, dtype=torch.float32)
        for master, m, v, grad, a, b, group, step in self._adam_runs(unit, 0, unit.numel, self._grad_of(unit), 0):
            kernels.adam_peek_(master, m, v, grad, unit.spare[a:b], spec.hyper[group], step + 1, self._scratch)
        spec.version, spec.steps = unit.grad.version, list(unit.steps)
        self.stats["host_step_seconds"] += time.perf_counter() - t0

    def _kept(self, unit: HostUnit, hyper: list[AdamHyper], scale: float, clamp: float | None) -> Speculation | None:
        """The unit's speculative step, if the step now taken is the one it assumed: not clipped (coefficient
        1, no clamp), the same hyper-parameters, and no job of the unit since (the job itself checks that the
        gradient and step counts it read are the step's)."""
        spec = self._specs.pop(unit, None)
        if spec is None:
            return None
        if scale != 1.0 or clamp is not None or spec.hyper != hyper or unit.future is not spec.future:
            self.stats["speculative_discarded"] += 1
            return None
        return spec

    def _keep(self, unit: HostUnit, spec: Speculation, weights: Future) -> None:
        """Worker: keep the speculative step if it read this very gradient from these step counts: its weights
        become the compute copy, and `weights` tells the next upload so at once."""
        if (spec.version, spec.steps) != (unit.grad.version, unit.steps):
            self.stats["speculative_discarded"] += 1  # (set as the step proper ends: see submit)
            return
        unit.copy, unit.spare = unit.spare, unit.copy
        # (each buffer's last upload with it: the new copy's is the one that went up ahead, if any: device/ahead.py)
        unit.spare_read, unit.upload_done = unit.upload_done, unit.spare_read
        spec.kept = True
        self.stats["speculative_kept"] += 1
        weights.set_result(None)

    def _step_proper(
        self, unit: HostUnit, hyper: list[AdamHyper], scale: float, clamp: float | None, spec: Speculation
    ) -> None:
        """Worker: after a kept speculative step the master and moments alone; otherwise the ordinary step."""
        if spec.kept:
            self._step_unit(unit, hyper, 1.0, write_copy=False)
        else:
            self._clamp_and_step(unit, hyper, scale, clamp)

    def wait_weights(self, unit: HostUnit) -> None:
        """Block until the unit's compute copy holds its current weights: after a kept speculative step, at
        once (the master and moments may still be stepping); otherwise after its last host job."""
        self.needed_first.send_now(unit)
        if unit.weights is None:
            self.wait(unit)
        elif not unit.weights.done():
            t0 = time.perf_counter()
            unit.weights.result()
            self.stats["host_wait_seconds"] += time.perf_counter() - t0

    def weights_pending(self, unit: HostUnit) -> bool:
        pending = unit.weights if unit.weights is not None else unit.future
        return pending is not None and not pending.done()

    def speculation(self, unit: HostUnit) -> Speculation | None:
        """The speculative step queued for `unit` in this backward, if any (its ``future`` says when it is done)."""
        return self._specs.get(unit)

    def forget_speculation(self) -> None:
        """The masters were written from outside (a checkpoint loaded): no speculative step stands."""
        self._specs.clear()

    # -- a block called more than once before one backward ----------------------------------------------
    def _hold(self, unit: HostUnit, flat: torch.Tensor, present: list[bool], task: int) -> object:
        """The first gradient of a block that has another call still to come back in this backward: kept in
        the slab, where the others are added (:class:`Held`); nothing lands or steps yet."""
        if unit.grad.state is GradState.SLAB:
            self._promote(unit)  # an earlier backward's gradient leaves the slab for the accumulator
        self._before_download(flat)
        self.streams.copy(self.streams.d2h, unit.ensure_slab(), flat)
        done = self.streams.event(self.streams.d2h)
        unit.grad.hold(Held(task, self.mode == "accumulate", list(present)))  # (its norms are the landing's)
        self.submit(unit, done.synchronize, 0, done)  # the unit's future covers the copy
        self._pending.add(unit)
        return done

    def _add_to_held(self, unit: HostUnit, flat: torch.Tensor, present: list[bool]) -> object:
        """Another call's gradient for the sum held in the slab: down piece by piece through a ring, each piece
        added to its place in the compute dtype by its own host job. Returns the event of the last copy."""
        if self.sum_ring is None:
            count, pin = self.ring_shape
            self.sum_ring = self.grad_ring or HostRing("sum", count, self.piece, self.compute_dtype, pin)
        unit.grad.held.present = [a or b for a, b in zip(unit.grad.held.present, present)]
        self._before_download(flat)
        for lo, hi in pieces(unit.numel, self.piece):
            i, buf = self.sum_ring.take(hi - lo)
            self.streams.copy(self.streams.d2h, buf, flat[lo:hi])
            done = self.streams.event(self.streams.d2h)
            self.submit(unit, lambda buf=buf, lo=lo, done=done: self._add_piece(unit, done, buf, lo), 0, done)
            self.sum_ring.hold(i, unit.future)
        return done

    def _add_piece(self, unit: HostUnit, done: Any, buf: torch.Tensor, lo: int) -> None:
        t0 = time.perf_counter()
        done.synchronize()  # never read pinned memory before its copy has finished
        unit.slab[lo : lo + buf.numel()].add_(buf)
        self.stats["host_land_seconds"] += time.perf_counter() - t0

    def land_held(self, unit: HostUnit, block_idx: int | None, this_pass: bool) -> None:
        """The sum held in the slab is complete: land it as the backward's one gradient of the unit, as
        :meth:`_ship_whole` lands one (stepped at once only when it is this backward's and the optimizer
        overlaps it; a sum left from an earlier backward, or landed by the optimizer step, waits for the step)."""
        self.needed_first.send_now(unit)
        held = unit.grad.unhold()
        eager = this_pass and not held.accumulate and self._eager_ok()
        hyper = self.hyper() if eager else None
        want_norm = self.want_norms and not held.accumulate
        rank = self.step_rank(unit) if hyper is not None else 0
        clamp = self._clip_value if eager else None
        self.submit(unit, partial(self._land, unit, None, held.present, held.accumulate, want_norm, hyper, clamp), rank)
        self._shipped(unit, eager, block_idx)

    def _ship_pieces(
        self,
        unit: HostUnit,
        flat: torch.Tensor,
        present: list[bool],
        to_acc: bool,
        want_norm: bool,
        hyper: list[AdamHyper] | None,
        clamp: float | None = None,
    ) -> object:
        """Lean layout: download `flat` piece by piece into the gradient ring, each piece landed (and, when
        `hyper`, clamped to `clamp` and stepped) by its own host job; returns the event of the last copy. A
        ring buffer is taken again only after the job that consumed it, so the host holds the ring's pieces,
        no slab."""
        first = unit.grad.state is GradState.EMPTY  # (stable: the unit's earlier jobs are done)
        for lo, hi in pieces(unit.numel, self.piece):
            i, buf = self.grad_ring.take(hi - lo)
            self.streams.copy(self.streams.d2h, buf, flat[lo:hi])
            done = self.streams.event(self.streams.d2h)
            job = (unit, done, present, buf, lo, hi, to_acc, first, want_norm, hyper, clamp)
            self.submit(unit, lambda job=job: self._land_piece(*job), 0, done)
            self.grad_ring.hold(i, unit.future)  # free once the landing job has consumed it
        return done

    def _land_piece(
        self,
        unit: HostUnit,
        done: Any,
        present: list[bool],
        buf: torch.Tensor,
        lo: int,
        hi: int,
        to_acc: bool,
        first: bool,
        want_norm: bool,
        hyper: list[AdamHyper] | None,
        clamp: float | None = None,
    ) -> None:
        """Land elements lo..hi of a gradient from a ring buffer: add them into the fp32 accumulator, and/or
        step them (`hyper`, after clamping them to `clamp`); the piece that ends the unit finishes its
        bookkeeping."""
        t0 = time.perf_counter()
        done.synchronize()  # never read pinned memory before its copy has finished
        if lo == 0:  # the step's runs depend on which parameters got a gradient
            unit.grad.arriving(present)
        if to_acc:
            unit.ensure_acc()
            kernels.accumulate_(unit.acc[lo:hi], buf, first)
        last = hi == unit.numel
        if last and hyper is None:
            unit.grad.accumulating()
            unit.grad.landed(self._norms(unit) if want_norm else None)
        self.stats["host_land_seconds"] += time.perf_counter() - t0
        if hyper is not None:
            grad = unit.acc[lo:hi] if to_acc else buf
            if clamp is not None:
                grad.clamp_(-clamp, clamp)
            self._step_unit(unit, hyper, 1.0, lo, hi, grad, last)

    def _device_norms(self, unit: HostUnit, flat: torch.Tensor, present: list[bool], single: bool) -> None:
        """With clipping, a gradient that is the whole of its unit's gradient for this step (one micro-batch,
        the unit's first) gets its per-parameter norms computed on the device before it goes down: the
        clipping coefficient then needs no host pass over the gradients, and waits for no landing."""
        norms = None
        if self.want_norms and single:
            norms = list(zip(kernels.param_norms(flat, _norm_spans(unit)), present))
        unit.grad.measured_on_device(norms)

    def _eager_ok(self) -> bool:
        """Step a unit the moment its last gradient lands: the optimizer overlaps the rest of backward."""
        return (
            self.mode == "step"
            and self.overlap_optimizer
            and not self.want_norms
            and not self.hold
            and self.hyper is not None
            and self.stepper is None
        )

    def _land(
        self,
        unit: HostUnit,
        done: Any,
        present: list[bool],
        accumulate: bool,
        want_norm: bool,
        hyper: list[AdamHyper] | None,
        clamp: float | None = None,
    ) -> None:
        t0 = time.perf_counter()
        if done is not None:  # (a held sum: its copies were waited for by the jobs that added them)
            done.synchronize()  # never read pinned memory before its copy has finished
        # As `.grad` in ordinary training: a parameter has a gradient once any micro-batch produced one.
        unit.grad.arriving(present)
        if accumulate or unit.grad.state is GradState.ACC:
            first = unit.grad.state is GradState.EMPTY
            unit.ensure_acc()
            kernels.accumulate_(unit.acc, unit.slab, first)
            unit.grad.accumulating()
        else:
            unit.grad.in_slab()
        # A norm is only meaningful for the complete gradient; a later micro-batch makes it stale.
        unit.grad.landed(self._norms(unit) if want_norm else None)
        self.stats["host_land_seconds"] += time.perf_counter() - t0
        if hyper is not None:
            self._clamp_and_step(unit, hyper, 1.0, clamp)

    def _promote(self, unit: HostUnit) -> None:
        """A second gradient arrives while the first still sits in the slab: move the first to fp32."""
        unit.ensure_acc()
        kernels.accumulate_(unit.acc, unit.slab, True)
        unit.grad.accumulating()

    def _norms(self, unit: HostUnit) -> list[torch.Tensor]:
        return kernels.param_norms(self._grad_of(unit), _norm_spans(unit), self.accurate_norms)

    def _wait_landed(self, unit: HostUnit) -> None:
        """Block until the unit's gradient has landed (not for a speculative step queued behind it)."""
        spec = self._specs.get(unit)
        if spec is not None and spec.future is unit.future:
            if spec.landed is not None:
                spec.landed.result()
        else:
            unit.wait()

    def _grad_of(self, unit: HostUnit) -> torch.Tensor:
        return unit.acc if unit.grad.state is GradState.ACC else unit.slab

    # -- gradients shown to hooks (engine.gradients_visible) --------------------------------------
    def expose(self) -> None:
        """Before hooks read the gradients: every gradient landed, in the fp32 accumulator `.grad` will view."""
        self.needed_first.flush()
        self._land_all_held()
        self.flush()
        for unit in self.all_units():
            if unit.grad.state is GradState.SLAB:
                self._promote(unit)

    def take_back(self, unit: HostUnit, grads: list[torch.Tensor | None]) -> None:
        """After the hooks: `grads` (per parameter, what its `.grad` holds now) is the unit's gradient. One edited
        in place is already in the accumulator; an assigned one is copied there; None drops the parameter's
        gradient (not stepped, and a later micro-batch starts afresh, as after ``p.grad = None``)."""
        if unit.grad.state is GradState.EMPTY and any(g is not None for g in grads):
            unit.ensure_acc()
            unit.acc.zero_()  # (an earlier step's values must not count for the parameters given none)
            unit.grad.accumulating()
        for e, g in zip(unit.entries, grads):
            view = None if unit.acc is None else unit.acc[e.offset : e.offset + e.numel].view(e.shape)
            if g is None and view is not None:
                view.zero_()
            elif g is not None and not (g.data_ptr() == view.data_ptr() and g.stride() == view.stride()):
                view.copy_(g)
        unit.grad.taken_back([g is not None for g in grads])
        if unit.grad.state is not GradState.EMPTY:
            self._pending.add(unit)

    # -- optimizer step ---------------------------------------------------------------------
    def clip_to(self, max_norm: float) -> None:
        """Clip the global gradient norm to `max_norm` in the next optimizer step (exactly, over all units)."""
        self._check_clip(f"gradient clipping to {max_norm}", self._clip_value)
        self._clip = float(max_norm)

    def clip_value_to(self, clip_value: float) -> None:
        """Clamp every gradient element to [-clip_value, clip_value] in the next optimizer step, as
        ``torch.nn.utils.clip_grad_value_`` on the step's gradient (the sum of its micro-batches). Said before
        the step's last backward, units stepped as they land are clamped first (on the device when the
        gradient is one micro-batch's); the others are clamped on the host in the step."""
        if self._eager and self._clip_value == float(clip_value):
            return  # (said before backward too: the units already stepped were clamped)
        self._check_clip(f"gradient clipping by value to {clip_value}", self._clip)
        self._clip_value = float(clip_value)

    @property
    def clamp_known(self) -> bool:
        """Whether clipping by value was said for the next step (its units may then step as they land)."""
        return self._clip_value is not None

    def _check_clip(self, what: str, other: float | None) -> None:
        if self._eager:
            raise RuntimeError(
                f"{what} was requested after the optimizer already stepped during backward. "
                "Say so before backward: Trainer(gradient_clip_val=...), or engine.backward(clip=True) around a "
                "plain loop's last backward; or pass overlap_optimizer=False."
            )
        if other is not None:
            raise RuntimeError(f"{what} was requested for a step already clipped the other way; clip one way per step")

    def step(self) -> set[HostUnit]:
        """Queue the optimizer step of every unit holding gradients (blocks in the next forward's order);
        returns the units stepped since the last step (during backward too)."""
        self.needed_first.flush()  # (sent at the end of the backward already, unless it failed)
        if self.hyper is None:
            raise RuntimeError("no optimizer is attached to the engine: call engine.optimizer(torch.optim.AdamW(...))")
        clip_val, self._clip = self._clip, None
        clamp, self._clip_value = self._clip_value, None
        self._land_all_held()
        if self.stepper is not None:
            return self._step_with(self.stepper, clip_val, clamp)
        hyper = self.hyper()
        todo = sorted((u for u in self.all_units() if u in self._pending), key=self.step_rank)
        if todo:  # (after a backward that stepped everything, the plan it set reaches into the next one)
            self._read_ahead(todo)  # the moments come in while the clipping norm is being computed
        scale = self._clip_scale(todo, clip_val) if clip_val else 1.0
        # Steps proper start once the last speculative step (the last gradient's: the embedding's) is done: the
        # worker takes one job at a time, and one begun as that gradient lands would hold back what the next
        # forward waits for first. They have until the next backward, which ships into what they read.
        last_spec = next(reversed(self._specs.values())).future if self._specs else None
        for unit in todo:
            spec = self._kept(unit, hyper, scale, clamp)
            if spec is None:
                self.submit(unit, partial(self._clamp_and_step, unit, hyper, scale, clamp), self.step_rank(unit))
            else:  # (order 0: before any step proper, as soon as its speculative step is done)
                weights: Future = Future()
                self.submit(unit, partial(self._keep, unit, spec, weights))
                job = partial(self._step_proper, unit, hyper, scale, clamp, spec)
                self.submit(unit, job, self.land_rank(unit), weights=weights, after=last_spec)
            if id(unit) in self.block_index:
                self.invalidate(self.block_index[id(unit)])
        self._specs.clear()
        stepped = set(todo) | self._eager
        self._pending.clear()
        self._eager.clear()
        return stepped

    def _step_with(self, stepper: Any, clip_val: float | None, clamp: float | None) -> set[HostUnit]:
        """A torch optimizer's own step (engine/generic_optim.py) over the units `stepper` takes: their
        gradients landed and in fp32 (as ``.grad`` is in ordinary training), the clipping coefficient the Adam
        step would use; afterwards each unit's bookkeeping is that of a stepped unit."""
        self.flush()
        todo = stepper.units([u for u in self.all_units() if u in self._pending])
        for unit in todo:
            if unit.grad.state is GradState.SLAB and unit.slab.dtype != torch.float32:
                self._promote(unit)
        scale = self._clip_scale(todo, clip_val) if clip_val else 1.0
        stepper.step(todo, [self._grad_of(u) for u in todo], scale, clamp)
        for unit in todo:
            self._finish_step(unit)
            if id(unit) in self.block_index:
                self.invalidate(self.block_index[id(unit)])
        self._pending.difference_update(todo)
        return set(todo)

    def _read_ahead(self, units: list[HostUnit]) -> None:
        """Tell the NVMe tier the order the next steps take, so it reads their moments ahead of them. The
        plan goes through the worker queue: it takes effect after the jobs submitted before it, so no step
        already queued is in it, and the order it names is the order the worker will step in."""
        if self.tier is not None:
            trained = [(u, [e for e in u.entries if e.group is not None and e.param.requires_grad]) for u in units]
            self.worker.submit(self.tier.plan, [p for u, entries in trained for p in u.tier_pieces(spans(entries))])

    def read_ahead_backward(self) -> None:
        """At the first block of a backward that steps each unit as its gradient lands: blocks L-1..0, then
        the outer parameters not stepped yet (their gradients come last, e.g. the embedding's), then those
        already stepped (the head's and final norm's were shipped before the blocks' backward began): they
        come first in the next step's backward, so their moments are read during the forward before it."""
        if self.tier is not None and self._eager_ok():
            later = [u for u in self.outer if u not in self._eager]
            self._read_ahead(self.blocks[::-1] + later + [u for u in self.outer if u in self._eager])

    def _land_all_held(self) -> None:
        """Land the held sum of every unit a call of whose block has not come back (the sum of those that did),
        and bring down the device sums still open (the gradients are wanted on the host now)."""
        self.spill_all()
        for unit in self.all_units():
            if unit.grad.held is not None:
                self.land_held(unit, self.block_index.get(id(unit)), this_pass=False)

    def _clamp_and_step(self, unit: HostUnit, hyper: list[AdamHyper], scale: float, clamp: float | None) -> None:
        if clamp is not None:
            self._grad_of(unit).clamp_(-clamp, clamp)
        self._step_unit(unit, hyper, scale)

    def grad_norm(self) -> torch.Tensor:
        """The total 2-norm of the gradient the next step uses, as ``clip_grad_norm_`` returns it: every
        gradient lands first (the per-unit norms taken now are kept for the step's clipping)."""
        self.needed_first.flush()
        self._land_all_held()
        return kernels.total_norm(self._param_norms([u for u in self.all_units() if u in self._pending]))

    def _clip_scale(self, todo: list[HostUnit], clip_val: float) -> float:
        return kernels.clip_coefficient(self._param_norms(todo), clip_val)

    def _param_norms(self, todo: list[HostUnit]) -> list[torch.Tensor]:
        by_param: dict[int, torch.Tensor] = {}
        on_device = [
            (id(e.param), n)
            for u in todo
            if u.grad.device_norms
            for e, (n, g) in zip(u.entries, u.grad.device_norms)
            if g
        ]
        if on_device:  # one copy to the host for all of them (it waits for the backward to finish on the device)
            by_param.update(zip([i for i, _ in on_device], torch.stack([n for _, n in on_device]).cpu().unbind()))
        for unit in todo:
            if unit.grad.device_norms is not None:
                continue
            self._wait_landed(unit)
            if unit.grad.norms is None:
                unit.grad.landed(self._norms(unit))
            by_param.update((id(e.param), n) for e, n, g in zip(unit.entries, unit.grad.norms, unit.grad.present) if g)
        # clip_grad_norm_ walks the optimizer's parameters that have a gradient, in group order; so does this
        # (with several ranks each parameter's norm is assembled from its pieces': engine/ranks.py).
        return self.ranks.norms(by_param, self.param_order)

    def _step_unit(
        self,
        unit: HostUnit,
        hyper: list[AdamHyper],
        scale: float,
        lo: int = 0,
        hi: int | None = None,
        grad: torch.Tensor | None = None,
        last: bool = True,
        write_copy: bool = True,
    ) -> None:
        """Adam on elements lo..hi of `unit` (all by default), reading their gradient from `grad` (element lo
        first; the unit's slab or accumulator when None). The moments come a piece at a time (NVMe: read
        ahead, written behind). `last`: this call ends the unit's step, so its counts advance. `write_copy`:
        False when the compute copy holds the new weights already (a kept speculative step)."""
        t0 = time.perf_counter()
        if write_copy and unit.upload_done is not None:
            unit.upload_done.synchronize()  # an in-flight upload may still be reading the copy
        hi = unit.numel if hi is None else hi
        grad, base = (self._grad_of(unit), 0) if grad is None else (grad, lo)
        copy_out = None if unit.copy is unit.master or not write_copy else unit.copy
        for master, m, v, g, a, b, group, step in self._adam_runs(unit, lo, hi, grad, base):
            copy = None if copy_out is None else copy_out[a:b]
            kernels.adam_step_(master, m, v, g, copy, hyper[group], step + 1, scale)
        self.stats["host_step_seconds"] += time.perf_counter() - t0
        if last:
            self._finish_step(unit)

    def _adam_runs(self, unit: HostUnit, lo: int, hi: int, grad: torch.Tensor, base: int) -> Iterator[tuple]:
        """(master, m, v, grad, a, b, group, step): the stretches a..b of elements lo..hi that the unit's step
        updates (one param group, one step count), their moments read a piece at a time (NVMe) and their
        gradient from `grad` (element `base` first)."""
        runs = unit.segments()
        spans = [(start, end) for _, _, start, end in runs]
        for plo, phi, m, v in unit.moment_pieces(lo=lo, hi=hi, only=spans) if runs else ():
            for group, step, start, end in runs:
                a, b = max(start, plo), min(end, phi)
                if a < b:
                    yield (
                        unit.master[a:b],
                        m[a - plo : b - plo],
                        v[a - plo : b - plo],
                        grad[a - base : b - base],
                        a,
                        b,
                        group,
                        step,
                    )

    def _finish_step(self, unit: HostUnit, stepped: bool = True) -> None:
        """After a unit's step (or, `stepped=False`, instead of it): its gradient is gone."""
        if stepped:
            present = unit.grad.stepped()
            unit.steps = [s + int(g and e.group is not None) for s, g, e in zip(unit.steps, present, unit.entries)]
        else:
            unit.grad.empty()

    def zero_grad(self, units: list[HostUnit] | None = None) -> None:
        """Drop the gradients not stepped yet (of `units` only, when given: one of several optimizers'). Nothing
        blocks: each such unit's reset is queued behind its landing jobs on the worker (after an optimizer step
        there are none, and nothing is queued)."""
        self.needed_first.flush()
        units = self.all_units() if units is None else units
        dropped = self._pending.intersection(units)
        for unit in dropped:
            self._specs.pop(unit, None)
            unit.grad.unhold()
            if self.sums is not None:
                self.sums.drop(unit)
            self.submit(unit, lambda unit=unit: self._finish_step(unit, stepped=False))
        for unit in units:
            for e in unit.entries:
                e.param.grad = None
        self._pending.difference_update(dropped)

    # -- the worker -------------------------------------------------------------------------
    def close(self) -> None:
        self.needed_first.flush()
        self.worker.shutdown(wait=True)
        self.grad_slots.clear()
        if self.sums is not None:
            self.sums.release()

    def rings(self) -> list[HostRing]:
        return [r for r in {id(r): r for r in (self.grad_ring, self.sum_ring) if r}.values()]

    def flush(self) -> None:
        """Wait for every host job (landing, steps) and every upload reading a compute copy to finish: after
        this the host buffers may be read or rewritten (checkpoints, loading weights, teardown)."""
        self.needed_first.flush()
        for unit in self.all_units():
            unit.wait()
            for read in (unit.upload_done, unit.spare_read):  # (an upload ahead reads the spare copy)
                if read is not None:
                    read.synchronize()

    def wait(self, unit: HostUnit) -> None:
        """Block on `unit`'s last host job, counting the time the device queue may starve meanwhile."""
        self.needed_first.send_now(unit)  # (its landing is its last job once its sum has gone down)
        if unit.future is not None and not unit.future.done():
            t0 = time.perf_counter()
            unit.wait()
            self.stats["host_wait_seconds"] += time.perf_counter() - t0
        else:
            unit.wait()

    def submit(
        self,
        unit: HostUnit,
        job: Callable[[], None],
        order: int = 0,
        event: Any = None,
        weights: Future | None = None,
        after: Future | None = None,
    ) -> None:
        """Queue `job` as `unit`'s last job: after its previous one, (if given) the copy `event` and another job
        (`after`: its future), at `order` (engine/host/worker.py: 0 for landing and bookkeeping, a step's rank for
        steps). `weights`: the job sets it once the unit's compute copy is current; otherwise an upload waits
        for the whole job."""
        if self.gate is not None:
            job = gated(self.gate, unit, job)
        unit.future = self.worker.submit(job, order=order, after=(unit.future, event, after))
        unit.weights = weights
        if weights is not None:  # set as the job ends at the latest, with its error if it failed
            unit.future.add_done_callback(partial(_settle, weights))

    def land_rank(self, unit: HostUnit) -> int:
        """The order of a step proper after a kept speculative step: after every step and speculative step
        (what the next forward waits for: ranks up to L + 1), since the next forward needs nothing of it (it
        uploads the spare copy), and in the order the next backward ships into its gradient buffers: L + 2
        for outer units, then L + 3 + (L-1-i) for block i."""
        n = len(self.blocks)
        return n + 2 if unit in self.outer else 2 * n + 2 - self.block_index[id(unit)]

    def step_rank(self, unit: HostUnit) -> int:
        """A step's order on the worker: 1 for outer units (``optimizer_step`` waits for them), then
        2 + i for block i, as the next forward reads them."""
        return 1 if unit in self.outer else 2 + self.block_index[id(unit)]


def _norm_spans(unit: HostUnit) -> list[tuple[int, int]]:
    """(offset, numel) of each of the unit's parameters: the spans kernels.param_norms takes."""
    return [(e.offset, e.numel) for e in unit.entries]


def _settle(weights: Future, job: Future) -> None:
    if not weights.done():
        exc = job.exception()
        weights.set_result(None) if exc is None else weights.set_exception(exc)
