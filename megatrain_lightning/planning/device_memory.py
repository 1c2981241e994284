"""Device memory a new allocation can still get (used by the "auto" choices of tiles and input offload)."""

from __future__ import annotations

import torch


def free_device_bytes(device: torch.device) -> int | None:
    """Free memory of a CUDA device plus what torch's caching allocator holds without using it (the previous
    step's freed activations usually sit there); None for a device with no such measure (the CPU)."""
    if device.type != "cuda":
        return None
    cached_unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return torch.cuda.mem_get_info(device)[0] + cached_unused


def step_transient_bytes(device: torch.device) -> int | None:
    """How far above what is allocated now the device's allocations have peaked: read right after a training
    step, the memory the step needed on top of the engine's persistent buffers (saved inputs, one block's
    recompute, the loss). None for a device with no such measure (the CPU). The peak is torch's since the
    process started (its statistics are not reset here: a callback may be reading them), so anything larger
    that ran before only makes the figure safer."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)


SLOT_RESERVE_BYTES = 1 << 30
"""Device memory ``num_slots="auto"`` leaves free besides four times a step's transient (the allocator's
fragmentation, a slightly longer batch)."""


def auto_slot_count(free: int, transient: int, slot_bytes: int, blocks: int, current: int = 2) -> int:
    """How many weight slots ``num_slots="auto"`` settles on: `current` plus as many more as fit in the `free`
    device memory beyond four times the step's `transient` bytes and :data:`SLOT_RESERVE_BYTES`, at most one
    per block (`blocks`: then every block stays resident between forward and backward).

    Four times the transient keeps the other "auto" choices where the first step made them: input offload
    starts when a pass's saved inputs would take over half the free memory, and token tiles when a block's
    recompute would take over a quarter; both are part of the transient."""
    spare = free - 4 * transient - SLOT_RESERVE_BYTES
    extra = max(0, spare // slot_bytes) if slot_bytes > 0 else 0
    return max(current, min(blocks, current + extra))
