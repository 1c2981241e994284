"""The host optimizer's arithmetic (optim/kernels.py) against torch.optim.AdamW and clip_grad_norm_."""

from __future__ import annotations

import pytest
import torch

from megatrain_lightning.optim import kernels
from megatrain_lightning.optim.kernels import AdamHyper

SIZES = [1, 7, 22, 4096, 4099]


@pytest.mark.parametrize("decoupled", [True, False])
def test_flat_torch_step_equals_adamw_bitwise(monkeypatch, decoupled):
    """One flat buffer over odd-sized parameters steps exactly like per-parameter torch.optim.AdamW/Adam."""
    monkeypatch.setenv("MEGATRAIN_CPU_ADAM", "torch")
    torch.manual_seed(0)
    params = [torch.randn(n, requires_grad=True) for n in SIZES]
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    ref = cls(params, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    master = torch.cat([p.detach() for p in params])
    m, v = torch.zeros_like(master), torch.zeros_like(master)
    copy = torch.empty(master.numel(), dtype=torch.bfloat16)
    hp = AdamHyper(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decoupled=decoupled)
    for step in range(1, 11):
        grads = [torch.randn(n) * 10.0 ** -(step % 6) for n in SIZES]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        ref.step()
        kernels.adam_step_(master, m, v, torch.cat(grads), copy, hp, step)
    assert torch.equal(master, torch.cat([p.detach() for p in params]))
    assert torch.equal(copy, master.to(torch.bfloat16))


def test_clip_coefficient_equals_clip_grad_norm():
    """The norm of per-parameter norms, in the optimizer's order: the same scale clip_grad_norm_ applies."""
    torch.manual_seed(0)
    grads = [torch.randn(n) * s for n, s in zip(SIZES, (1e-3, 1.0, 5.0, 1e-2, 3e-3))]
    params = [torch.zeros(n, requires_grad=True) for n in SIZES]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(params, 0.5)
    flat = torch.cat(grads)
    offsets = torch.tensor([0, *SIZES]).cumsum(0).tolist()
    coef = kernels.clip_coefficient(kernels.param_norms(flat, list(zip(offsets, SIZES))), 0.5)
    assert coef < 1.0
    assert torch.equal(flat * coef, torch.cat([p.grad for p in params]))
    assert kernels.clip_coefficient(kernels.param_norms(flat, list(zip(offsets, SIZES))), 1e9) == 1.0


def test_backend_choice_is_validated(monkeypatch):
    monkeypatch.setenv("MEGATRAIN_CPU_ADAM", "fast")
    with pytest.raises(ValueError, match="MEGATRAIN_CPU_ADAM='fast'"):
        kernels.backend()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accurate_norms_sum_in_fp64_and_the_default_is_torchs_to_the_bit(dtype):
    """A 16M-element span: torch's fp32 norm on the CPU (what ordinary CPU training clips with) is off by about
    1e-3 of the truth; the accurate one (for runs whose ordinary counterpart reduces on a GPU) is within fp32
    rounding; the default is torch's to the last bit."""
    torch.manual_seed(0)
    flat = torch.randn(16 * 2**20 + 5).to(dtype)
    spans = [(0, 5), (5, 16 * 2**20)]
    truth = [flat[o : o + n].double().square().sum().sqrt() for o, n in spans]
    default, accurate = kernels.param_norms(flat, spans), kernels.param_norms(flat, spans, accurate=True)
    for (o, n), d, a, t in zip(spans, default, accurate, truth):
        assert torch.equal(d, torch.linalg.vector_norm(flat[o : o + n], dtype=torch.float32))
        assert a.dtype == torch.float32 and abs(float(a) / float(t) - 1) < 1e-7
    assert abs(float(default[1]) / float(truth[1]) - 1) > 1e-5  # what the accurate norm is for
