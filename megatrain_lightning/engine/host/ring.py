"""A ring of host buffers for the lean host layout: memory for what is in flight, not one buffer per unit.

The default layout keeps, per unit, a pinned compute-dtype copy of the weights (rewritten by each Adam
step) and a pinned gradient slab: 2 + 2 bytes/param in bf16. ``host_layout="lean"`` keeps neither:

- uploads: just before a unit's weights go to the device, its fp32 master is cast into the next staging
  buffer of a ring, and the H2D copy reads from there (the cast is what the step would have written: the
  same rounding, so the same bits reach the device);
- gradients: when the host worker consumes a unit's gradient as it lands (an overlapped optimizer step,
  or accumulation into the fp32 accumulator), the D2H copy goes into the next buffer of a gradient ring,
  free again when that landing job is done. A gradient that must wait for the optimizer step (clipping
  needs the global norm first) still goes to a per-unit slab.

A buffer is handed out again only after what last used it is complete: the H2D copy that read it (an
event), or the host job that consumed it (a future).

Both rings, and the NVMe tier's working buffers (engine/host/nvme.py), hold *pieces*, not units: a unit's
elements 0..n are cut into runs of :func:`piece_numel` elements, and an upload, a gradient landing, an
Adam step and an NVMe read or write each go piece by piece. What the host holds in flight is then a few
pieces, independent of how large the largest unit (a 128k x 16k embedding: 2B parameters) is:

    staging ring   STAGING_PIECES pieces in the compute dtype (a cast waits for the upload 4 pieces back)
    gradient ring  one block's pieces + 1 in the compute dtype (the GPU may run a block ahead of the host)
    NVMe buffers   nvme.BUFFERS pieces of fp32 m and v (one stepping, one writing, two read ahead)
"""

from __future__ import annotations

from typing import Any

import torch

from megatrain_lightning.engine.host.pinned import host_empty

PIECE_MIN = 1 << 22
"""Elements per piece at least (16 MiB of fp32): each NVMe read or write stays one large sequential IO."""
PIECES_PER_UNIT = 32
"""The largest unit is cut into about this many pieces, so the buffers in flight are a few % of it."""
STAGING_PIECES = 4


def piece_numel(largest: int) -> int:
    """Elements per piece for a model whose largest unit has `largest` elements: 1/32 of it rounded up to a
    multiple of 2^20, at least 2^22, at most the unit itself."""
    want = -(-largest // PIECES_PER_UNIT)
    return min(largest, max(PIECE_MIN, -(-want // (1 << 20)) * (1 << 20)))


def pieces(numel: int, size: int) -> list[tuple[int, int]]:
    """The (lo, hi) element ranges of a unit of `numel` elements cut into pieces of `size`."""
    return [(lo, min(lo + size, numel)) for lo in range(0, numel, size)]


def ring_counts(largest_block: int, piece: int) -> tuple[int, int]:
    """(staging, gradient) ring lengths in pieces: see the module docstring."""
    return STAGING_PIECES, -(-largest_block // piece) + 1


class HostRing:
    """`count` host buffers of `numel` elements, handed out in turn; `kind` names it ("staging", "gradient")."""

    def __init__(self, kind: str, count: int, numel: int, dtype: torch.dtype, pin: bool) -> None:
        self.kind = kind
        self.buffers = [host_empty(numel, dtype, pin) for _ in range(count)]
        self._busy: list[Any] = [None] * count  # event (synchronize) or future (result) of the last user
        self._next = 0

    def take(self, numel: int) -> tuple[int, torch.Tensor]:
        """The next buffer (its first `numel` elements), once its last user is done with it."""
        i, self._next = self._next, (self._next + 1) % len(self.buffers)
        self.wait(i)
        return i, self.buffers[i][:numel]

    def hold(self, i: int, until: Any) -> None:
        """Buffer `i` is in use until `until` (an event or a future) completes."""
        self._busy[i] = until

    def wait(self, i: int | None = None) -> None:
        """Block until buffer `i` (every buffer when None) is free."""
        for j in range(len(self.buffers)) if i is None else [i]:
            busy, self._busy[j] = self._busy[j], None
            if busy is not None:
                busy.synchronize() if hasattr(busy, "synchronize") else busy.result()

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)
