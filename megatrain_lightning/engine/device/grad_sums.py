"""Gradient sums that stay on the device across the micro-batches of a step.

Without them every micro-batch's block gradient goes down to the host (2 bytes/param in bf16) and is added to
the unit's fp32 accumulator there (a pass over ~14 bytes/param), although only the step's last sum is ever
stepped. With a sum on the device, a block's first micro-batch gradient is cast into an fp32 device buffer,
each later one is added to it, and the sum goes down once, at the step's last backward, into the unit's host
accumulator, where it lands as one gradient (stepped at once where the optimizer overlaps backward).

Bit for bit with the host path: the host computes ``acc = g1; acc += g2; ...`` in fp32 with one rounding per
addition (optim/kernels.accumulate_), and so does the device (``copy_`` of a bf16 or fp32 gradient into fp32
is exact; ``add_`` of a bf16 tensor into an fp32 one adds the exact upcast in fp32). The sums are only ever
started on a unit holding no gradient, so an earlier host sum is never added in another order.

A sum goes to the host early ("spilled", where it goes on as the host path's accumulator) when something
needs the gradient there before the step's last backward: hooks reading ``.grad``, a gradient norm asked
for, a block called again within one backward (its calls are summed on the host, engine/host/host_steps.Held),
or an optimizer step taken on an accumulating backward.

How many blocks get one (``EngineConfig.device_grad_sums``): a count, the first blocks of the model; or
"auto": after the first optimizer step, as many as the device memory left free by the weight slots allows
(none on a device with no memory measure, the CPU). The parameters outside the blocks (embedding, final norm,
head: their gradients come down through autograd's hooks) get sums too whenever a block does; "auto" counts
them first. The buffers are allocated as "auto" grants them, between the first and second steps
(engine/host/host_steps.HostSide.reserve_sums), a count's at each unit's first sum; and kept.
"""

from __future__ import annotations

import torch

from megatrain_lightning.planning.device_memory import SLOT_RESERVE_BYTES


class DeviceGradSums:
    """The fp32 device sums of the units allowed one: the first `count` blocks, and the outer units (the
    parameters outside the blocks) when any block is. `units`: the blocks, then the outer units."""

    def __init__(self, units: list, blocks: int, device: torch.device, count: int) -> None:
        self.units, self.blocks, self.device = units, blocks, device
        self._index = {id(u): i for i, u in enumerate(units)}
        self.count = min(count, blocks)
        self._buffers: dict[int, torch.Tensor] = {}  # by block index, allocated at the block's first sum
        self._open: dict[int, list[bool]] = {}  # block index -> per parameter, whether any micro-batch had one

    def takes(self, unit) -> bool:
        """Whether `unit` is allowed a device sum."""
        i = self._index.get(id(unit))
        return i is not None and self.count > 0 and (i < self.count or i >= self.blocks)

    def is_open(self, unit) -> bool:
        """Whether `unit` holds a sum on the device (a gradient not yet on the host)."""
        return self._index.get(id(unit)) in self._open

    def add(self, unit, grad: torch.Tensor | list[torch.Tensor | None], present: list[bool]) -> None:
        """Add this micro-batch's gradient to the unit's sum; the first one starts it. `grad`: flat in the unit's
        layout (compute dtype), or per parameter of the layout (None: got none, a zero as packing writes
        one). Runs on the compute stream, so a grad slot `grad` lives in is free once it is queued."""
        i = self._index[id(unit)]
        buf = self._buffer(i, grad.numel() if isinstance(grad, torch.Tensor) else unit.device_numel)
        first = i not in self._open
        if isinstance(grad, torch.Tensor):
            _add(buf, grad, first)
        else:
            for e, g in zip(unit.layout, grad):
                # (cast as packing casts: a no-op for the gradients of weights in the compute dtype)
                g = None if g is None else g.reshape(-1).to(unit.compute_dtype)
                _add(buf[e.offset : e.offset + e.numel], g, first)
        self._open[i] = list(present) if first else [a or b for a, b in zip(self._open[i], present)]

    def _buffer(self, i: int, numel: int) -> torch.Tensor:
        buf = self._buffers.get(i)
        if buf is None:
            buf = self._buffers[i] = torch.empty(numel, dtype=torch.float32, device=self.device)
        return buf

    def granted(self) -> list:
        """The units allowed a sum now, in order."""
        return [u for u in self.units if self.takes(u)]

    def reserve(self, unit) -> None:
        """Allocate `unit`'s sum now rather than at its first micro-batch (a whole unit's layout: not for a
        partitioned one, whose sum is its shard's)."""
        self._buffer(self._index[id(unit)], unit.device_numel)

    def close(self, unit) -> tuple[torch.Tensor, list[bool]]:
        """The unit's complete sum (a device buffer, read by the download queued next) and its presence flags."""
        i = self._index[id(unit)]
        return self._buffers[i], self._open.pop(i)

    def drop(self, unit) -> None:
        """``zero_grad``: the sum is discarded (the buffer stays for the next step)."""
        self._open.pop(self._index.get(id(unit)), None)

    def open_units(self) -> list:
        return [self.units[i] for i in sorted(self._open)]

    def grow_to(self, count: int) -> None:
        self.count = max(self.count, min(count, self.blocks))

    def release(self) -> None:
        """Teardown: the buffers go back to the device's allocator."""
        self._buffers.clear()
        self._open.clear()

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def _add(into: torch.Tensor, grad: torch.Tensor | None, first: bool) -> None:
    """into = grad (first) or into += grad, in fp32; None adds a zero, as the zeros packing writes for it do
    (-0.0 + 0.0 is +0.0, so even an all-zero sum keeps the host path's bits)."""
    if grad is None:
        into.zero_() if first else into.add_(0.0)
    elif first:
        into.copy_(grad)
    else:
        into.add_(grad)


def auto_sum_count(free: int, transient: int, block_numels: list[int], have: int, outer_numel: int = 0) -> int:
    """``device_grad_sums="auto"``: `have` plus as many more blocks (in order) as fit in the `free` device memory
    beyond four times the step's `transient` bytes and the slot reserve, at 4 bytes (fp32) per parameter, the
    outer units' `outer_numel` counted first (none fits: 0): the margin the weight slots leave
    (device_memory.auto_slot_count), read after they took theirs."""
    spare = free - 4 * transient - SLOT_RESERVE_BYTES - (4 * outer_numel if have == 0 else 0)
    if spare < 0:
        return have
    count = have
    for numel in block_numels[have:]:
        if spare < 4 * numel:
            break
        spare -= 4 * numel
        count += 1
    return count
