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
