"""Host-resident state of one streamed unit: flat buffers allocated once, parameters as views.

A unit is a decoder block, or one parameter outside the blocks (embedding, final norm, head). Its
parameters are laid out back to back in every buffer, in the model's own order: the layout (and so a
checkpoint) does not depend on the optimizer, and a param group is stepped as one or more runs of
consecutive parameters (a Llama block with a no-decay group for norms has four runs).

| buffer | dtype          | bytes/param | note                                                 |
|--------|----------------|-------------|------------------------------------------------------|
| master | fp32           | 4           | the truth; pinned and doubling as the copy in fp32   |
| m, v   | fp32           | 8           | only once an optimizer is attached                   |
| copy   | compute dtype  | 2 (bf16)    | pinned DMA source, rewritten by every optimizer step |
| slab   | compute dtype  | 2 / 4       | pinned DMA target for gradients, from first backward |
| acc    | fp32           | 4           | only while gradients are being accumulated          |
| (NVMe) | fp32 m, v      | 0 host      | with nvme_dir: m, v in files, a few units in flight  |

With ``nvme_dir`` (engine/host/nvme.py) ``m`` and ``v`` stay None: the moments live in one file per unit and
come into working buffers a piece at a time for a step (or a checkpoint), through
:meth:`HostUnit.moment_pieces`.

With ``host_layout="lean"`` (engine/host/ring.py) there is no copy, and a slab only for a gradient that waits
for a clipped step: uploads and landings go through rings of a few buffers instead.

Partitioned (data parallel over W ranks, engine/ranks.py), a unit's buffers hold only this rank's
contiguous shard ``lo..hi`` of the flat layout. ``layout`` then describes the whole unit (each parameter,
its offset in the full flat: what a device slot holds and a checkpoint names) and ``entries`` the shard:
one piece per parameter it cuts, offset from ``lo``, flat, ``start`` elements into the parameter. The host
code (landing, norms, Adam, moments) reads only ``entries`` and so works on a shard as on a whole unit;
the device code (binding a slot, packing a gradient) reads ``layout``. Unpartitioned, they are one list.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatrain_lightning.engine.host.nvme import NvmeTier
from megatrain_lightning.engine.host.pinned import host_empty


class GradState(enum.Enum):
    EMPTY = "empty"  # no gradient since the last step / zero_grad
    SLAB = "slab"  # one gradient, still in the transfer slab
    ACC = "acc"  # a sum of gradients in the fp32 accumulator


class UnitGrad:
    """Where a unit's gradient is on its way to the optimizer step, and which of its parameters have one.

    It changes only through the named transitions below, each made by the host worker's job that moved the
    gradient (landing, stepping) or, where noted, by the training thread once the unit's jobs are done:
    EMPTY -> SLAB (:meth:`in_slab`: one gradient kept in the transfer slab) -> ACC (:meth:`accumulating`: a
    sum in the fp32 accumulator, where a second gradient, hooks or a device sum put it) -> EMPTY
    (:meth:`stepped`, or :meth:`empty` when dropped unstepped). :meth:`arriving` records which parameters a
    gradient covers, :meth:`landed` the norms of the complete gradient, :meth:`hold` and :meth:`unhold` a
    block's calls summed before landing (host_steps.Held)."""

    def __init__(self, n: int) -> None:
        self.state = GradState.EMPTY
        # Per parameter, as torch.optim keeps them: a parameter that got no gradient (frozen, or unused by
        # the loss) is skipped by the step and its Adam step count (bias correction) does not advance.
        self.present = [False] * n  # got a gradient since the last step / zero_grad
        self.norms: list[torch.Tensor] | None = None  # per-parameter norms of the complete gradient
        self.device_norms: list[tuple[torch.Tensor, bool]] | None = None  # (norm, got a gradient), on the device
        self.held: Any = None  # host_steps.Held: a block called again in this backward sums its gradients in the slab
        self.version = 0  # counts the changes of the gradient's values (a speculative step checks it)

    def arriving(self, present: list[bool]) -> None:
        """A gradient of the parameters `present` marks is landing (as `.grad`: once any micro-batch gave one)."""
        self.present = [a or b for a, b in zip(self.present, present)]
        self.version += 1

    def in_slab(self) -> None:
        """The step's one gradient so far waits in the transfer slab."""
        self.state = GradState.SLAB

    def accumulating(self) -> None:
        """The gradient is a sum in the fp32 accumulator (the slab's moved there, or more added)."""
        self.state = GradState.ACC

    def landed(self, norms: list[torch.Tensor] | None) -> None:
        """The gradient on the host is complete for now: its per-parameter norms (None: not taken; a later
        micro-batch would make them stale)."""
        self.norms = norms

    def measured_on_device(self, norms: list[tuple[torch.Tensor, bool]] | None) -> None:
        """Norms taken on the device from a gradient that is the whole of the step's (None: none)."""
        self.device_norms = norms

    def hold(self, held: Any) -> None:
        """A block's first call of several in one backward: its gradient waits in the slab for the others."""
        self.held, self.device_norms = held, None  # (norms of a part of the gradient would be wrong)

    def unhold(self) -> Any:
        held, self.held = self.held, None
        return held

    def taken_back(self, present: list[bool]) -> None:
        """Training thread, after hooks read or edited `.grad`: `present` says which parameters keep one; the
        norms are taken again at the step, from what the hooks left."""
        self.present = list(present)
        self.norms = self.device_norms = None
        self.version += 1

    def stepped(self) -> list[bool]:
        """The optimizer step consumed the gradient; returns which parameters it stepped."""
        present = self.present
        self.empty()
        return present

    def empty(self) -> None:
        """No gradient (after a step, or dropped by ``zero_grad``)."""
        self.state, self.norms, self.device_norms = GradState.EMPTY, None, None
        self.version += 1
        self.present = [False] * len(self.present)


@dataclass(frozen=True)
class ParamEntry:
    """Where one parameter lives inside its unit's flat buffers."""

    name: str
    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size
    group: int | None  # optimizer param group, None when the optimizer does not own it
    start: int = 0  # a piece of a partitioned unit: its first element within the parameter


SLOT_ALIGN_BYTES = 16
"""Where each parameter starts in a weight slot: a multiple of 16 bytes, what vectorized loads (cuBLAS) and
Inductor's compiled kernels assume of their inputs. A parameter that starts elsewhere (after an odd-sized
one) gets a slower kernel, or a copy per call."""


def slot_layout(
    layout: list[ParamEntry], dtype: torch.dtype, partitioned: bool, device_numel: int
) -> tuple[list[int], int]:
    """Each parameter's offset in a weight slot, and the slot elements the unit takes.

    The host buffers stay packed (their layout is the checkpoint's); in a slot each parameter starts on a
    :data:`SLOT_ALIGN_BYTES` boundary, which costs an upload one copy per run of parameters the padding
    separates, and nothing for models whose parameter sizes are multiples of 16 bytes already (most). A
    partitioned unit keeps the packed layout on the device: its ranks' shards are all-gathered into the slot
    as contiguous chunks of it."""
    if partitioned:
        return [e.offset for e in layout], device_numel
    align = max(1, SLOT_ALIGN_BYTES // dtype.itemsize)
    offsets, at = [], 0
    for e in layout:
        at = -(-at // align) * align
        offsets.append(at)
        at += e.numel
    return offsets, at


class HostUnit:
    """fp32 master, Adam moments, compute copy and gradient slab of one unit, each one flat buffer."""

    def __init__(
        self,
        name: str,
        params: list[tuple[str, nn.Parameter]],
        compute_dtype: torch.dtype,
        pin: bool,
        keep_copy: bool = True,
        bounds: tuple[int, int] | None = None,
        device_numel: int | None = None,
    ) -> None:
        """`keep_copy=False` (the lean layout, engine/host/ring.py): no persistent compute-dtype copy; uploads
        cast the master into a staging ring instead. In fp32 the master is the copy either way. `bounds`:
        partitioned, this rank's shard (lo, hi) of the flat layout; `device_numel`: the length of the unit's
        flat on the device (the layout padded to W equal shards)."""
        self.name = name
        self.compute_dtype = compute_dtype
        self.pin = pin
        layout, offset = [], 0
        for pname, p in params:
            layout.append(ParamEntry(pname, p, offset, p.numel(), p.shape, None))  # groups: set_groups
            offset += p.numel()
        self.layout: list[ParamEntry] = layout
        self.full_numel = offset
        self.partitioned = bounds is not None
        self.lo, self.hi = (0, offset) if bounds is None else bounds
        self.device_numel = offset if device_numel is None else device_numel
        self.entries: list[ParamEntry] = layout
        if self.partitioned:
            self.entries = [
                ParamEntry(e.name, e.param, a - self.lo, b - a, torch.Size([b - a]), None, a - e.offset)
                for e, a, b in self.overlaps(self.lo, self.hi, layout)
            ]
        self.numel = self.hi - self.lo
        self.slot_offsets, self.slot_numel = slot_layout(layout, compute_dtype, self.partitioned, self.device_numel)
        fp32_copy = compute_dtype == torch.float32
        # In fp32 the master is the DMA source itself, so it is the one buffer that must be pinned.
        self.master = host_empty(self.numel, torch.float32, pin and fp32_copy)
        for e in self.entries:
            self.master[e.offset : e.offset + e.numel].copy_(e.param.detach().reshape(-1)[e.start : e.start + e.numel])
        self.copy: torch.Tensor | None = self.master
        if not fp32_copy:
            self.copy = host_empty(self.numel, compute_dtype, pin).copy_(self.master) if keep_copy else None
        self.m: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.slab: torch.Tensor | None = None
        self.acc: torch.Tensor | None = None
        self.grad = UnitGrad(len(self.entries))  # where the gradient is, which parameters have one
        self.steps = [0] * len(self.entries)  # optimizer steps taken
        self.future: Future | None = None  # last host job touching this unit
        self.upload_done: object | None = None  # event: the last H2D read of `copy` finished
        # A speculative step (host_steps.HostSide) writes the next weights into `spare`; when it holds, the
        # two swap, and `weights` is the job after which `copy` is current (None: the unit's last job, `future`).
        self.spare: torch.Tensor | None = None
        self.spare_read: object | None = None  # event: the last H2D read of what is now `spare` finished
        self.weights: Future | None = None

    # -- layout ---------------------------------------------------------------------------------
    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-parameter views (named relative to the unit) of a flat buffer laid out like this unit."""
        return {e.name: flat[e.offset : e.offset + e.numel].view(e.shape) for e in self.entries}

    def segments(self) -> list[tuple[int, int, int, int]]:
        """(group, step, start, end) runs of consecutive parameters the next optimizer step updates: owned
        by one param group, holding a gradient, and at the same Adam step count."""
        runs: list[tuple[int, int, int, int]] = []
        for e, has_grad, step in zip(self.entries, self.grad.present, self.steps):
            if e.group is None or not has_grad:
                continue
            if runs and runs[-1][:2] == (e.group, step) and runs[-1][3] == e.offset:
                runs[-1] = (e.group, step, runs[-1][2], e.offset + e.numel)
            else:
                runs.append((e.group, step, e.offset, e.offset + e.numel))
        return runs

    def set_groups(self, groups: dict[int, int]) -> None:
        """Re-map parameters to param groups (a new optimizer on an existing layout)."""
        self.entries = [dataclasses.replace(e, group=groups.get(id(e.param))) for e in self.entries]
        if self.partitioned:
            self.layout = [dataclasses.replace(e, group=groups.get(id(e.param))) for e in self.layout]
        else:
            self.layout = self.entries

    # -- allocation -----------------------------------------------------------------------------
    tier: NvmeTier | None = None  # set by the engine with nvme_dir: the moments live there, not in m, v

    def alloc_optimizer_state(self) -> None:
        if self.tier is not None:
            self.tier.alloc(self)  # zeros, read from a fresh file
        elif self.m is None:
            self.m = host_empty(self.numel, torch.float32, pin=False).zero_()
            self.v = host_empty(self.numel, torch.float32, pin=False).zero_()

    @property
    def has_moments(self) -> bool:
        """Whether Adam moments exist for this unit (in host memory or on the NVMe tier)."""
        return self.m is not None or (self.tier is not None and self.tier.holds(self))

    def moment_pieces(
        self,
        write: bool = True,
        fresh: bool = False,
        lo: int = 0,
        hi: int | None = None,
        only: list[tuple[int, int]] | None = None,
    ) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """(start, end, m, v) for the elements lo..hi, piece by piece, each valid until the loop moves on:
        the host buffers themselves (one piece), or, on the NVMe tier, a working buffer per piece read from
        the unit's file and written back when the loop moves on if `write` (not if the loop body raised).
        `fresh`: the loop overwrites every element, so the file need not be read first. On the tier, lo and
        hi must fall on piece boundaries (the gradient ring's pieces do: engine/host/ring.py). `only`: skip the
        pieces that overlap none of these (start, end) ranges (a step reads no moments it does not update)."""
        hi = self.numel if hi is None else hi
        if self.tier is None:
            if self.m is None:
                raise RuntimeError(f"{self.name} has no Adam moments: no optimizer is attached")
            yield lo, hi, self.m[lo:hi], self.v[lo:hi]
            return
        for piece in self.tier_pieces(only):
            if piece.lo >= lo and piece.hi <= hi:
                with self.tier.resident(piece, write=write, fresh=fresh) as (m, v):
                    yield piece.lo, piece.hi, m, v
            elif piece.lo < hi and piece.hi > lo:
                raise ValueError(f"elements {lo}..{hi} of {self.name} cut its NVMe piece {piece.lo}..{piece.hi}")

    def tier_pieces(self, only: list[tuple[int, int]] | None = None) -> list:
        """The unit's NVMe pieces that overlap any of the (start, end) ranges `only` (all when None)."""
        return [p for p in self.tier.pieces(self) if only is None or any(a < p.hi and b > p.lo for a, b in only)]

    def overlaps(
        self, lo: int, hi: int, entries: list[ParamEntry] | None = None
    ) -> Iterator[tuple[ParamEntry, int, int]]:
        """(entry, start, end) for each parameter of `entries` (all when None) with elements in lo..hi:
        start..end is the overlap, in the unit's element numbering."""
        for e in self.entries if entries is None else entries:
            start, end = max(lo, e.offset), min(hi, e.offset + e.numel)
            if start < end:
                yield e, start, end

    def ensure_slab(self) -> torch.Tensor:
        if self.slab is None:
            self.slab = host_empty(self.numel, self.compute_dtype, self.pin)
        return self.slab

    def ensure_spare(self) -> torch.Tensor:
        """The spare compute copy a speculative step writes (pinned as the copy is: it becomes the copy)."""
        if self.spare is None:
            self.spare = host_empty(self.numel, self.compute_dtype, self.pin)
        return self.spare

    def ensure_acc(self, pin: bool = False) -> torch.Tensor:
        """The fp32 accumulator, allocated at first use; `pin`: page-locked, as a DMA target must be (an
        unpinned one is replaced: it holds nothing yet whenever a download is to land in it)."""
        if self.acc is None or (pin and not self.acc.is_pinned()):
            self.acc = host_empty(self.numel, torch.float32, pin=pin)
        return self.acc

    def nbytes(self) -> dict[str, int]:
        """Bytes held per buffer kind (the copy counts zero when it is the master itself; on the NVMe tier
        m and v are None: the tier's working buffers are counted by the engine)."""
        out = {"master": _nb(self.master), "copy": 0 if self.copy is self.master else _nb(self.copy)}
        out.update(adam=_nb(self.m) + _nb(self.v), slab=_nb(self.slab), acc=_nb(self.acc), spare=_nb(self.spare))
        return out

    # -- host jobs --------------------------------------------------------------------------------
    def wait(self) -> None:
        """Block until the last host job on this unit has finished (re-raising its error)."""
        if self.future is not None:
            self.future.result()

    def bind(self, flat: torch.Tensor) -> None:
        """Point each parameter of this unit at its slice of `flat` (no copy), a whole unit laid out as
        ``layout``: the master (unpartitioned), a device slot or a device copy."""
        for e in self.layout:
            e.param.data = flat[e.offset : e.offset + e.numel].view(e.shape)

    def bind_slot(self, flat: torch.Tensor) -> None:
        """Point each parameter at its place in a weight slot (`flat`, laid out by :func:`slot_layout`)."""
        for e, at in zip(self.layout, self.slot_offsets):
            e.param.data = flat[at : at + e.numel].view(e.shape)

    def slot_runs(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """(start, end, at): the unit's elements lo..hi (host layout) as runs that go to ``at..`` of a weight
        slot, one run per stretch of parameters that the slot's alignment padding does not separate."""
        runs: list[tuple[int, int, int]] = []
        for e, at in zip(self.layout, self.slot_offsets):
            a, b = max(lo, e.offset), min(hi, e.offset + e.numel)
            if a >= b:
                continue
            if runs and runs[-1][1] == a and runs[-1][2] + (a - runs[-1][0]) == at + (a - e.offset):
                runs[-1] = (runs[-1][0], b, runs[-1][2])
            else:
                runs.append((a, b, at + a - e.offset))
        return runs

    def bind_host(self) -> None:
        """Between calls: each parameter a view of its fp32 master. Partitioned, no rank holds the whole
        of it: each parameter is then a NaN placeholder of its shape (one element, expanded), so that
        reading it yields NaN, never a plausible weight."""
        if not self.partitioned:
            self.bind(self.master)
            return
        nan = torch.full((), math.nan)
        for e in self.layout:
            e.param.data = nan.expand(e.shape)

    def unpartition(self, whole: torch.Tensor) -> None:
        """The whole fp32 master (gathered from every rank's shard) becomes this unit's: at the end of a
        partitioned run, so that the model's parameters can be views of it again."""
        self.master, self.entries, self.partitioned = whole, self.layout, False
        self.lo, self.hi = 0, self.full_numel
        self.numel = self.full_numel

    def piece_flags(self, flags: list[bool]) -> list[bool]:
        """Per-parameter flags of the whole unit (``layout``'s order), as this shard's ``entries`` list them."""
        if not self.partitioned:
            return flags
        by_param = {id(e.param): f for e, f in zip(self.layout, flags)}
        return [by_param[id(e.param)] for e in self.entries]

    def refresh_copy(self) -> None:
        """Rewrite the compute copy from the master (after loading weights)."""
        if self.copy is not None and self.copy is not self.master:
            self.copy.copy_(self.master)


def spans(entries: list[ParamEntry]) -> list[tuple[int, int]]:
    """The (start, end) element ranges of `entries` in their unit."""
    return [(e.offset, e.offset + e.numel) for e in entries]


def _nb(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class HostMemoryError(MemoryError):
    """The run's host-resident state (training state, or the pinned buffers of offloaded block inputs)
    does not fit in this machine's memory; raised before the buffers are allocated."""


def host_bytes_by_kind(
    compute_elt: int,
    training: bool,
    accumulating: bool = False,
    layout: str = "default",
    clipping: bool = False,
    speculative: bool = False,
) -> dict[str, int]:
    """Bytes per parameter of each host buffer kind (the table above), for a compute element size. The lean
    layout (engine/host/ring.py) has no copy, and a per-unit slab only for gradients waiting for a clipped step;
    its rings (a few units' worth, not per parameter) are not in these figures."""
    lean = layout == "lean"
    copy = 0 if compute_elt == 4 or lean else compute_elt  # in fp32 the master is the copy
    return {
        "master": 4,
        "adam": 8 if training else 0,
        "copy": copy,
        "slab": compute_elt if training and (not lean or (clipping and not accumulating)) else 0,
        "acc": 4 if accumulating else 0,
        "spare": copy if training and speculative else 0,  # a speculative step's weights (host_steps.py)
    }


def host_bytes_per_param(
    compute_dtype: torch.dtype,
    training: bool,
    accumulating: bool = False,
    layout: str = "default",
    clipping: bool = False,
    speculative: bool = False,
) -> int:
    """Bytes the engine allocates per parameter (master, copy, and when training m, v and the slab; the
    fp32 accumulator too when gradients are accumulated over micro-batches; a spare copy for speculative
    steps)."""
    elt = torch.tensor([], dtype=compute_dtype).element_size()
    return sum(host_bytes_by_kind(elt, training, accumulating, layout, clipping, speculative).values())
