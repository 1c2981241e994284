"""Cross-entropy over a large vocabulary without materializing the full logits.

For Llama 3 (128k vocabulary) the logits of 8k tokens in fp32 are 4 GiB, plus as much again for
their gradient: often more than a whole decoder layer. ``chunked_cross_entropy`` walks the tokens in
chunks, keeping only ``chunk_size x vocab`` logits alive at a time, and recomputes them in backward
instead of saving them. Only the inputs and one fp32 log-sum-exp per token are kept for backward.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .ops import rms_norm


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # The matmul runs in the compute dtype (bf16 tensor cores when training in bf16, as HF's
    # lm_head does) and only its output is upcast, so no fp32 copy of the V x H weight is made.
    return (hidden @ weight.t()).float()


# The backward's passes over a chunk's [tokens, vocab] logits (the largest tensors of a step) write fp32 only where
# fp32 is kept: the subtraction of the log-sum-exp takes the compute-dtype logits and writes fp32 (its operand
# upcast exactly, as .float() would), the scaling writes the dtype the products take (rounded once, as .to() or
# autocast's cast would), and the weight's fp32 gradient sum adds each chunk's compute-dtype product in place. The
# same bits as upcasting first, in fewer passes: no fp32 copy of the logits or of each chunk's weight product, and
# the scaled gradient written once in the products' dtype.


def _target_logits(logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    # Ignored positions may hold any value (usually -100): gather at index 0 and mask afterwards.
    safe = torch.where(valid, targets, torch.zeros_like(targets))
    return logits.gather(1, safe.unsqueeze(1)).squeeze(1)


def _normed(hidden: torch.Tensor, norm_weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    # The model's own final RMSNorm, applied chunk by chunk.
    return hidden if norm_weight is None else rms_norm(hidden, norm_weight, eps)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, ignore_index, norm_weight, norm_eps):
        w = weight.to(hidden.dtype)  # no-op in the normal same-dtype case
        valid = targets != ignore_index
        # Clamped so that an all-ignored batch gives 0 / 1 = 0 rather than 0 / 0 = NaN. Kept as a
        # tensor: calling .item() here would force a GPU sync every step.
        n_valid = valid.sum().clamp_(min=1).to(torch.float32)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            end = start + chunk_size
            logits = _chunk_logits(_normed(hidden[start:end], norm_weight, norm_eps), w)
            lse[start:end] = torch.logsumexp(logits, dim=-1)
            nll = lse[start:end] - _target_logits(logits, targets[start:end], valid[start:end])
            total += torch.where(valid[start:end], nll, torch.zeros_like(nll)).sum()
        ctx.save_for_backward(hidden, weight, targets, lse, n_valid, norm_weight)
        ctx.chunk_size, ctx.ignore_index, ctx.norm_eps = chunk_size, ignore_index, norm_eps
        ctx.autocast = _autocast_state(hidden.device.type)
        return total / n_valid

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        # The recomputed logits and the gradient products under the forward's autocast, as ordinary autograd
        # runs an autocast matmul's backward: without it (autograd leaves autocast off in backward) they would
        # be fp32, slower on a GPU and off the forward's log-sum-exp by the compute dtype's rounding.
        device_type, enabled, dtype = ctx.autocast
        with torch.autocast(device_type, dtype=dtype, enabled=enabled):
            return _ChunkedCrossEntropy._backward(ctx, grad_loss)

    @staticmethod
    def _backward(ctx, grad_loss):
        hidden, weight, targets, lse, n_valid, norm_weight = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_nw = norm_weight is not None and ctx.needs_input_grad[5]
        w = weight.to(hidden.dtype)
        valid = targets != ctx.ignore_index
        # d(mean loss)/d(logit) = (softmax - onehot) * grad / n_valid, zero on ignored rows.
        scale = grad_loss.float() / n_valid
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w32 = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_nw32 = torch.zeros(norm_weight.shape, dtype=torch.float32, device=hidden.device) if need_nw else None
        # The gradient of the logits in the dtype its two products take it in: under autocast an fp32 one would be
        # cast for each (twice, the same rounding each time), so it is written rounded once instead.
        _, autocast, autocast_dtype = ctx.autocast
        g_dtype = autocast_dtype if autocast and hidden.dtype == torch.float32 else hidden.dtype
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = start + ctx.chunk_size
            h, v = _ChunkNorm(hidden[start:end], norm_weight, ctx.norm_eps, need_h, need_nw), valid[start:end]
            g = _logit_grad(h.out @ w.t(), lse[start:end], targets[start:end], v, scale, g_dtype)
            if need_w:
                # Each chunk's product may round to the compute dtype, but the running sum over
                # chunks stays fp32 so long sequences do not lose small contributions.
                grad_w32 += g.t() @ h.out
            if need_h or need_nw:
                gh, gnw = h.backward(g @ w)
                if need_h:
                    grad_h[start:end] = gh
                if need_nw:
                    grad_nw32 += gnw
        grad_w = grad_w32.to(weight.dtype) if need_w else None
        grad_nw = grad_nw32.to(norm_weight.dtype) if need_nw else None
        return grad_h, grad_w, None, None, None, grad_nw, None


def _autocast_state(device_type: str) -> tuple[str, bool, torch.dtype]:
    return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


class _ChunkNorm:
    """One chunk's final norm, recomputed with grad in the loss's backward (or the chunk itself unnormed)."""

    def __init__(self, hidden: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, need_h: bool, need_nw: bool):
        self.inputs = []
        if norm_weight is None:
            self.out = hidden
            return
        with torch.enable_grad():
            h = hidden.detach().requires_grad_(need_h)
            nw = norm_weight.detach().requires_grad_(need_nw)
            self.inputs = [h, nw]
            self.out = _normed(h, nw, eps)

    def backward(self, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Gradients of the chunk's hidden states and of the norm weight for `grad_out` of its output."""
        if not self.inputs:
            return grad_out, None
        wanted = [t for t in self.inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(self.out, wanted, grad_out))
        return tuple(next(grads) if t.requires_grad else None for t in self.inputs)


def _logit_grad(logits, lse, targets, valid, scale, dtype):
    """(softmax - onehot(target)) * scale for one chunk, zeroed on ignored rows, computed in fp32 from the chunk's
    `logits` (any float dtype) and given `dtype`; in place where the dtypes allow (see above)."""
    shifted = logits.sub_(lse.unsqueeze(1)) if logits.dtype == torch.float32 else torch.sub(logits, lse.unsqueeze(1))
    probs = shifted.exp_()
    rows = torch.arange(probs.shape[0], device=probs.device)
    safe = torch.where(valid, targets, torch.zeros_like(targets))
    probs[rows, safe] -= valid.to(probs.dtype)
    factor = torch.where(valid, scale, torch.zeros_like(scale)).unsqueeze(1)
    if dtype == torch.float32:
        return probs.mul_(factor)
    return torch.mul(probs, factor, out=torch.empty(probs.shape, dtype=dtype, device=probs.device))


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int = 4096,
    ignore_index: int = -100,
    norm: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets`` over non-ignored tokens.

    Args:
        hidden: [N, H] final (normed) hidden states.
        weight: [V, H] output projection (``lm_head.weight``).
        targets: [N] int64 labels, already aligned with ``hidden``; ``ignore_index`` marks tokens
            that do not count.
        chunk_size: tokens whose logits are live at once; memory is ``chunk_size * V * 4`` bytes.
        norm: (weight [H], eps) of an RMSNorm applied to ``hidden`` first, chunk by chunk (recomputed in
            backward): the final norm folded into the loss, so no normed copy of all tokens is kept.

    Returns a fp32 scalar. Unlike ``F.cross_entropy``, an all-ignored batch gives 0 (with zero
    gradients) instead of NaN, so a fully padded micro-batch cannot poison an accumulated step.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or targets.dim() != 1:
        raise ValueError(
            f"expected hidden [N,H], weight [V,H], targets [N]; got {tuple(hidden.shape)}, "
            f"{tuple(weight.shape)}, {tuple(targets.shape)}"
        )
    if hidden.shape[0] != targets.shape[0] or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"shape mismatch: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, "
            f"targets {tuple(targets.shape)}"
        )
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size} must be positive")
    norm_weight, norm_eps = norm if norm is not None else (None, 0.0)
    return _ChunkedCrossEntropy.apply(
        hidden, weight, targets, int(chunk_size), int(ignore_index), norm_weight, norm_eps
    )
