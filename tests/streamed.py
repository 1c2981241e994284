"""Test support: the precision flag for a compute dtype (tests choose the dtype the blocks compute in)."""

from __future__ import annotations

import torch


def precision_of(dtype: torch.dtype) -> str:
    """fp32 streams fp32 weights; bf16 streams bf16 copies (without autocast: the test runs as it is)."""
    return {torch.float32: "32-true", torch.bfloat16: "bf16-true"}[dtype]
