"""Elementwise ops shared by the decoder (``llama``) and the loss (``loss``).

They live here, below both, so that the loss can apply the model's final RMSNorm without importing the
model module that itself imports the loss.
"""

from __future__ import annotations

import torch


def autograd_records(*tensors: torch.Tensor) -> bool:
    """Whether autograd records ops on `tensors` (then no in-place shortcuts: the graph saves its inputs)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Statistics in fp32, then cast back *before* the weight multiply: this is HF's exact
    # order of operations, which is what makes bf16 outputs bit-compatible with theirs.
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if autograd_records(x, weight) or weight.dtype != x.dtype:
        return weight * (x32 * rstd).to(x.dtype)
    # Without a graph (the engine's forward, evaluation) the same products land in place in this call's
    # own temporaries: one fp32 copy of x (none in fp32) and one output, the same bits as above.
    y = x * rstd if x32 is x else x32.mul_(rstd)
    return y.to(x.dtype).mul_(weight)
