"""The host optimizer's arithmetic on flat buffers: one AdamW step, gradient accumulation, norms.

Two backends compute the same thing:

- ``native``: the one-pass C++ kernel in ``csrc/`` (reads master, m, v and the gradient in the dtype
  it arrived in, writes master, m, v and the compute-dtype copy);
- ``torch``: the same element-wise operations as ``torch.optim.AdamW``'s single-tensor path, applied to
  a whole flat segment. Element-wise ops give each element the same result whether it sits in its own
  tensor or in a flat buffer, so this backend equals ordinary training bit for bit; it costs a few extra
  passes over memory (gradient cast, scale, the final copy).

``MEGATRAIN_CPU_ADAM=torch|native|auto`` picks one (default ``auto``: native when it loaded).
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass

import torch

_CHOICES = ("auto", "native", "torch")


@dataclass(frozen=True)
class AdamHyper:
    """Hyper-parameters of one param group at the moment of a step."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool  # AdamW-style decay of the weights; False: Adam's L2 term added to the gradient


def backend() -> str:
    """The backend steps run on: 'native' or 'torch'."""
    choice = os.environ.get("MEGATRAIN_CPU_ADAM", "auto")
    if choice not in _CHOICES:
        raise ValueError(f"MEGATRAIN_CPU_ADAM={choice!r}: choose one of {', '.join(_CHOICES)}")
    if choice == "torch":
        return "torch"
    native = _native()
    if native is not None and native.available():
        return "native"
    if choice == "native":
        reason = native.load_error() if native is not None else "megatrain_lightning.optim.native is missing"
        raise RuntimeError(f"MEGATRAIN_CPU_ADAM=native but the native optimizer did not load: {reason}")
    _warn_fallback_once()
    return "torch"


def _native_hyper(hp: AdamHyper) -> dict:
    """`hp` as the native kernel's keywords."""
    return dict(
        lr=hp.lr, beta1=hp.beta1, beta2=hp.beta2, eps=hp.eps, weight_decay=hp.weight_decay, decoupled=hp.decoupled
    )


def adam_step_(
    master: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    grad: torch.Tensor,
    copy: torch.Tensor | None,
    hp: AdamHyper,
    step: int,
    grad_scale: float = 1.0,
) -> None:
    """One Adam(W) step of a flat fp32 segment; `copy` (bf16/fp32) receives the new weights."""
    if backend() == "native":
        _native().adamw_step_(master, m, v, grad, copy, **_native_hyper(hp), step=step, grad_scale=grad_scale)
        return
    g = grad if grad.dtype == torch.float32 else grad.float()
    if grad_scale != 1.0:
        g = g * grad_scale  # a new tensor: the slab/accumulator is not ours to change
    if hp.weight_decay != 0:
        if hp.decoupled:
            master.mul_(1 - hp.lr * hp.weight_decay)
        else:
            g = g.add(master, alpha=hp.weight_decay)
    m.lerp_(g, 1 - hp.beta1)
    v.mul_(hp.beta2).addcmul_(g, g, value=1 - hp.beta2)
    step_size = hp.lr / (1 - hp.beta1**step)
    bias_correction2_sqrt = (1 - hp.beta2**step) ** 0.5
    denom = (v.sqrt() / bias_correction2_sqrt).add_(hp.eps)
    master.addcdiv_(m, denom, value=-step_size)
    if copy is not None:
        copy.copy_(master)


PEEK_CHUNK = 1 << 20
"""Elements of master, m and v :func:`adam_peek_` steps at a time in its scratch (12 MiB in fp32)."""


def adam_peek_(
    master: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    grad: torch.Tensor,
    copy: torch.Tensor,
    hp: AdamHyper,
    step: int,
    scratch: torch.Tensor,
) -> None:
    """Write into `copy` what :func:`adam_step_` (unscaled) would, leaving master, m and v as they are. The
    native kernel reads them and writes the copy alone (its ``adamw_peek_``); torch's arithmetic copies each
    chunk of them into `scratch` (fp32, 3 x :data:`PEEK_CHUNK`) and steps it there: the step is element-wise,
    so a chunk's elements come out as the whole segment's would."""
    if backend() == "native":
        _native().adamw_peek_(master, m, v, grad, copy, **_native_hyper(hp), step=step)
        return
    peek_in_scratch(master, m, v, grad, copy, hp, step, scratch)


def peek_in_scratch(
    master: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    grad: torch.Tensor,
    copy: torch.Tensor,
    hp: AdamHyper,
    step: int,
    scratch: torch.Tensor,
) -> None:
    """:func:`adam_peek_` by copies: each chunk of master, m and v stepped in `scratch` by :func:`adam_step_`
    (the torch backend's way; bench/cpu_adam.py times it against the native peek)."""
    n = master.numel()
    for lo in range(0, n, PEEK_CHUNK):
        hi = min(n, lo + PEEK_CHUNK)
        p, mm, vv = (scratch[i, : hi - lo] for i in range(3))
        p.copy_(master[lo:hi])
        mm.copy_(m[lo:hi])
        vv.copy_(v[lo:hi])
        adam_step_(p, mm, vv, grad[lo:hi], copy[lo:hi], hp, step)


def accumulate_(acc: torch.Tensor, grad: torch.Tensor, first: bool) -> None:
    """acc = grad (first) or acc += grad, in fp32, as autograd accumulates `.grad`."""
    if backend() == "native":
        _native().grad_accumulate_(acc, grad, first)
    elif first:
        acc.copy_(grad)
    else:
        acc.add_(grad)


def param_norms(flat: torch.Tensor, spans: list[tuple[int, int]], accurate: bool = False) -> list[torch.Tensor]:
    """The fp32 L2 norm of each (offset, numel) span: the per-parameter norms clip_grad_norm_ starts from.

    By default torch's fp32 norm, what ordinary training on the CPU computes, to the last bit. It loses
    precision with size on the CPU (about 1e-3 of the norm at 16M elements, 0.5 % at 64M), while a GPU's
    reductions stay within fp32 rounding: `accurate` sums the squares in fp64 (the native kernel's, as fast
    as torch's fp32 norm), for a run whose ordinary counterpart takes its norms on a GPU."""
    if accurate:
        return [_fp64_norm(flat[o : o + n]) for o, n in spans]
    return [torch.linalg.vector_norm(flat[o : o + n], dtype=torch.float32) for o, n in spans]


def _fp64_norm(x: torch.Tensor) -> torch.Tensor:
    if backend() == "native" and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
        return torch.tensor(math.sqrt(_native().sq_norm(x.contiguous())), dtype=torch.float32)
    return torch.linalg.vector_norm(x, dtype=torch.float64).float()


def total_norm(norms: list[torch.Tensor]) -> torch.Tensor:
    """What torch.nn.utils.clip_grad_norm_ returns: the norm of the per-parameter norms, in the optimizer's
    parameter order and in fp32, so the result is the same to the last bit (0 without gradients)."""
    return torch.linalg.vector_norm(torch.stack(norms), 2.0) if norms else torch.tensor(0.0)


def clip_coefficient(norms: list[torch.Tensor], max_norm: float) -> float:
    """The factor torch.nn.utils.clip_grad_norm_ scales every gradient by, from the per-parameter norms."""
    if not norms:
        return 1.0
    return float(torch.clamp(max_norm / (total_norm(norms) + 1e-6), max=1.0))


_warned = False


def _warn_fallback_once() -> None:
    global _warned
    if not _warned:
        _warned = True
        native = _native()
        reason = native.load_error() if native is not None else "not built"
        warnings.warn(
            f"native CPU optimizer unavailable ({reason}); stepping with torch ops "
            "(correct, but several extra passes over memory). Rebuild with `pip install -e .`.",
            RuntimeWarning,
            stacklevel=3,
        )


def _native():
    try:
        from megatrain_lightning.optim import native
    except ImportError:
        return None
    return native
