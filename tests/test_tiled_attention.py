"""The attention core tiled over query blocks (models/tiled_attention.py) against the model's untiled core.

Never bit for bit: the fused kernel sums each row's keys in one pass, the tiled core merges key blocks online
(each merge rescales by exp(m_old - m_new)), so the sums are ordered differently. Bounds, norm-wise relative
over the whole tensor, q/k/v given in the dtype compared:

- fp32: both compute in fp32, each within a few units of rounding (u = 2^-24 = 6e-8) of the exact result;
  they are measured ~3e-7 apart (5u), so 1e-6 (17u) holds with room and would catch any wrong term (a
  dropped or doubled key block moves the output by ~1/T).
- bf16: both accumulate in fp32 and round each output to bf16 once (u = 2^-8 = 4e-3), so they may part
  by up to a bf16 rounding each: 2^-7 apart, and the tiled core no farther from the fp64 truth than 1.25 x
  the fused one.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from megatrain_lightning.models import LlamaConfig
from megatrain_lightning.models.llama import Attention, document_segments
from megatrain_lightning.models.tiled_attention import (
    _block_bounds,
    backward_blocks,
    forward_blocks,
    tiled_attention,
    workspace_bytes,
)
from megatrain_lightning.planning.measure import DeviceBytes

HEADS, KV, T, D = 4, 2, 29, 16  # grouped-query attention (2 query heads per kv head), an uneven length
SEGMENTS = document_segments(torch.tensor([[*range(11), *range(7), *range(11)], list(range(T))]))


def untiled_core(dtype: torch.dtype) -> Attention:
    config = LlamaConfig(
        vocab_size=8, hidden_size=HEADS * D, intermediate_size=8, num_hidden_layers=1, num_attention_heads=HEADS,
        num_key_value_heads=KV,
    )  # fmt: skip
    return Attention(config).to(dtype)


def inputs(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    shapes = [(2, HEADS, T, D), (2, KV, T, D), (2, KV, T, D), (2, HEADS, T, D)]
    return tuple(torch.randn(s, generator=g, dtype=torch.float64) for s in shapes)


def run(core, dtype: torch.dtype, q, k, v, grad_out) -> list[torch.Tensor]:
    """Output and q, k, v gradients of `core(q, k, v)` with inputs given in `dtype`."""
    q, k, v = (x.to(dtype).requires_grad_() for x in (q, k, v))
    out = core(q, k, v)
    return [out, *torch.autograd.grad(out, (q, k, v), grad_out.to(dtype))]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


@pytest.mark.parametrize("segments", [None, SEGMENTS], ids=["causal", "documents"])
@pytest.mark.parametrize("block", [1, 4, 7, 29, 64])
def test_fp32_tiled_core_equals_the_untiled_core(segments, block):
    untiled = untiled_core(torch.float32)
    x = inputs(torch.float32)
    ref = run(lambda q, k, v: untiled.core(q, k, v, segments), torch.float32, *x)
    got = run(lambda q, k, v: tiled_attention(q, k, v, segments, block), torch.float32, *x)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        assert rel(a, b) <= 1e-6, name


@pytest.mark.parametrize("segments", [None, SEGMENTS], ids=["causal", "documents"])
@pytest.mark.parametrize("block", [4, 7])
def test_bf16_tiled_core_is_as_exact_as_the_untiled_core(segments, block):
    untiled = untiled_core(torch.bfloat16)
    x = inputs(torch.bfloat16)
    exact_inputs = [t.to(torch.bfloat16).double() for t in x]  # the truth for the inputs as bf16 holds them
    exact = run(lambda q, k, v: untiled.double().core(q, k, v, segments), torch.float64, *exact_inputs)
    ref = run(lambda q, k, v: untiled.core(q, k, v, segments), torch.bfloat16, *x)
    got = run(lambda q, k, v: tiled_attention(q, k, v, segments, block), torch.bfloat16, *x)
    for name, a, b, e in zip(("out", "dq", "dk", "dv"), got, ref, exact):
        assert a.dtype == torch.bfloat16 and rel(a, b) <= 2**-7, name
        assert rel(a, e) <= 1.25 * rel(b, e), name


def test_documents_see_only_themselves():
    """A packed row's documents give what each gives alone (and the block bounds skip earlier documents)."""
    q, k, v, _ = inputs(torch.float32)
    q, k, v = (x.float()[:1] for x in (q, k, v))
    spans = SEGMENTS[0]
    packed = tiled_attention(q, k, v, (spans,), 4)
    alone = torch.cat([tiled_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], None, 4) for s, e in spans], dim=2)
    assert torch.allclose(packed, alone, rtol=1e-6, atol=1e-6)
    first, last = _block_bounds([[s for s, _ in spans]], T, 8)  # query blocks 0-7, 8-15, 16-23, 24-28
    assert (first, last) == ([0, 0, 11, 18], [0, 11, 18, 18])


def counted(shape: tuple[int, ...], block: int, dtype: torch.dtype) -> tuple[int, int]:
    """What forward_blocks and backward_blocks allocate beyond their outputs at their peak, on fake tensors."""
    b, heads, kv, t, d = shape
    with FakeTensorMode():
        q, k = torch.empty(b, heads, t, d, dtype=dtype), torch.empty(b, kv, t, d, dtype=dtype)
        lse = torch.empty(b, heads, t)
        first, last = _block_bounds([[0]], t, block)
        with DeviceBytes() as counter:
            outputs = forward_blocks(q, k, k, None, block, first, last)
            forward = counter.peak - sum(x.untyped_storage().nbytes() for x in outputs)
            del outputs
            counter.reset_peak()
            grads = backward_blocks(q, q, k, k, q, lse, None, block, first, last)
            backward = counter.peak - sum(x.untyped_storage().nbytes() for x in grads)
    return forward, backward


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_workspace_bounds_what_the_operators_allocate(dtype):
    """measure.py and the planner count the operators' insides by workspace_bytes: at llama-3.1-8b's heads
    (32 of 128, 8 kv heads) with blocks of 1024 it is at most 15% above what they allocate (it counts every
    block kind as fp32 copies, which fp32 inputs partly skip), and never below, also for odd small shapes."""
    shape = (1, 32, 8, 1536, 128)
    forward, backward = counted(shape, 1024, dtype)
    assert forward <= workspace_bytes(*shape[:4], 128, 1024, False) <= 1.15 * forward
    assert backward <= workspace_bytes(*shape[:4], 128, 1024, True) <= 1.15 * backward
    for shape, block in [((2, 4, 2, 60, 16), 7), ((1, 4, 4, 64, 16), 16), ((2, 6, 2, 33, 8), 40)]:
        forward, backward = counted(shape, block, dtype)
        assert forward <= workspace_bytes(*shape[:4], shape[4], block, False)
        assert backward <= workspace_bytes(*shape[:4], shape[4], block, True)


def test_grouped_kv_heads_are_never_repeated():
    """Nothing the operators allocate has a query head's worth of rows for the whole sequence but their own
    outputs (the output, dq): k and v are never repeated to the query heads, nor is any other whole-sequence
    tensor made."""
    b, heads, kv, t, d, block = 1, 8, 2, 64, 16, 16
    sizes = []

    class Allocations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            sizes.extend(x.numel() for x in (out if isinstance(out, (tuple, list)) else [out]) if hasattr(x, "numel"))
            return out

    with FakeTensorMode():
        q, k = torch.empty(b, heads, t, d, dtype=torch.bfloat16), torch.empty(b, kv, t, d, dtype=torch.bfloat16)
        first, last = _block_bounds([[0]], t, block)
        with Allocations():
            forward_blocks(q, k, k, None, block, first, last)
            backward_blocks(q, q, k, k, q, torch.empty(b, heads, t), None, block, first, last)
    assert sorted(sizes)[-2:] == [b * heads * t * d] * 2 and sorted(sizes)[-3] < b * heads * t * d
