"""A block called more than once before one backward (two forwards in one loss: two views, chosen and
rejected sequences): its gradients are summed first, then land as one, as autograd adds the contributions a
weight gets within one backward before they reach ``.grad``.

fp32 on the CPU with the torch-op optimizer, against ordinary training bit for bit: through Lightning with
the optimizer overlapping backward (which refused such a model before), accumulation, clipping and the lean
layout; at the engine, the association an accumulated gradient takes, forwards whose backwards run
separately, a graph dropped or kept without a backward, and the sum's dtype (bf16, as autograd's).
"""

from __future__ import annotations

import pytest
import torch

from megatrain_lightning import Engine, EngineConfig, MegatrainStrategy
from megatrain_lightning.models import LlamaForCausalLM
from tests.helpers import CausalLM, fit, hf_llama, hf_loss, own_llama, params_of, token_batches
from tests.streamed import precision_of

pytestmark = pytest.mark.usefixtures("torch_adam")  # bitwise comparisons need torch's own AdamW arithmetic


def two_views(model: LlamaForCausalLM, batch: torch.Tensor) -> torch.Tensor:
    """One loss over two forwards of the model: each block is called twice before the backward."""
    flipped = batch.flip(1)
    return model(batch, targets=batch) + 0.5 * model(flipped, targets=flipped)


SETTINGS = {
    "overlapped": ({}, {}),  # the optimizer steps each block during backward: after its last call's gradient
    "accumulate": ({}, dict(accumulate_grad_batches=2)),
    "accumulate-clip": ({}, dict(accumulate_grad_batches=2, gradient_clip_val=0.5)),
    "not-overlapped": (dict(overlap_optimizer=False), {}),
    "lean-accumulate-clip": (dict(host_layout="lean"), dict(accumulate_grad_batches=2, gradient_clip_val=0.5)),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_two_forwards_in_one_loss_train_as_ordinary_training(name):
    strategy_kwargs, trainer_kwargs = SETTINGS[name]
    ref, mt = CausalLM(own_llama(2), loss_fn=two_views), CausalLM(own_llama(2), loss_fn=two_views)
    fit(ref, token_batches(6), strategy="auto", **trainer_kwargs)
    fit(mt, token_batches(6), strategy=MegatrainStrategy(**strategy_kwargs), **trainer_kwargs)
    assert mt.losses == ref.losses and len(ref.losses) == 6
    pr, pm = params_of(ref.model), params_of(mt.model)
    assert all(torch.equal(pm[k], pr[k]) for k in pr)


def engine_pair(dtype: torch.dtype = torch.float32) -> tuple[LlamaForCausalLM, LlamaForCausalLM, Engine]:
    """(ordinary model, streamed model, its engine) with the same weights; accumulating, an optimizer attached."""
    ref, mt = own_llama(2), own_llama(2)
    engine = Engine(mt, EngineConfig(device="cpu", precision=precision_of(dtype)))
    engine.optimizer(torch.optim.AdamW(mt.parameters(), lr=1e-3))
    return ref, mt, engine


def assert_accumulated(engine: Engine, ref: LlamaForCausalLM) -> None:
    """Every block's fp32 accumulator equals the ordinary model's `.grad`, bit for bit."""
    engine.flush()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for unit in engine.units:
        assert unit.grad.held is None
        for name, e in zip(engine.qualified_names(unit), unit.entries):
            assert torch.equal(unit.acc[e.offset : e.offset + e.numel].view(e.shape), grads[name]), name


def test_a_sum_over_two_calls_adds_to_the_accumulated_gradient_once():
    """A first micro-batch, then a loss over two forwards: ordinary training adds the two calls' gradients
    together, then to `.grad` ((g + (c2 + c1)), not ((g + c2) + c1)); so does the engine."""
    ref, mt, engine = engine_pair()
    x, y = token_batches(2)
    with engine.backward(accumulate=True):
        for model in (ref, mt):
            model(x, targets=x).backward()
            two_views(model, y).backward()
    assert_accumulated(engine, ref)


def test_forwards_whose_backwards_run_separately():
    """Two forwards, then a backward of each loss: two backward passes, so ordinary training adds each
    call's gradient to `.grad` in turn; the engine holds the first (the other call is still open) and lands
    it when the second arrives from another pass."""
    ref, mt, engine = engine_pair()
    x, y, z = token_batches(3)
    with engine.backward(accumulate=True):
        for model in (ref, mt):
            model(x, targets=x).backward()
            first, second = model(y, targets=y), model(z, targets=z)
            first.backward()
            second.backward()
    assert_accumulated(engine, ref)


def test_a_graph_dropped_before_its_backward_leaves_nothing_open():
    """A forward whose loss is dropped (an evaluation under grad) closes its calls with its graph: the next
    backward lands each block's gradient at once."""
    ref, mt, engine = engine_pair()
    x, y = token_batches(2)
    with engine.backward(accumulate=True):
        for model in (ref, mt):
            model(x, targets=x)  # dropped
            model(y, targets=y).backward()
    assert all(not calls for calls in engine.streamer.open_calls)
    assert_accumulated(engine, ref)


def test_a_graph_kept_without_a_backward_lands_at_the_optimizer_step():
    """A loss kept but never backpropagated leaves each block with a call that never comes back: the
    gradients of the calls that did are held, and the optimizer step lands and steps them, as ordinary
    training steps on the `.grad` it has."""
    ref, mt = own_llama(2), own_llama(2)
    engine = Engine(mt, EngineConfig(device="cpu", precision="32-true"))
    opts = [
        torch.optim.AdamW(ref.parameters(), lr=1e-2),
        engine.optimizer(torch.optim.AdamW(mt.parameters(), lr=1e-2)),
    ]
    x, y = token_batches(2)
    kept = []
    for model, opt in zip((ref, mt), opts):
        kept.append(model(x, targets=x))
        with engine.backward():
            model(y, targets=y).backward()
        assert model is ref or all(unit.grad.held is not None for unit in engine.units)
        opt.step()
    engine.flush()
    pr, pm = params_of(ref), params_of(mt)
    assert all(torch.equal(pm[k], pr[k]) for k in pr)


def test_the_calls_are_summed_in_the_compute_dtype():
    """Autograd adds a weight's contributions in the dtype the weight is used in (bf16 under autocast, at
    the one cast of the weight it caches), then `.grad` takes the sum: with bf16 weights the held sum is the
    ordinary bf16 `.grad` bit for bit (the fp32 sum of the two bf16 gradients differs from it)."""
    ref = own_llama(2).to(torch.bfloat16)  # ordinary bf16 training; the streamed model computes in bf16 too
    mt = own_llama(2)
    mt.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
    engine = Engine(mt, EngineConfig(device="cpu", precision="bf16-true"))
    x = token_batches(1)[0]
    for model in (ref, mt):
        two_views(model, x).backward()
    engine.flush()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for unit in engine.units:
        for name, e in zip(engine.qualified_names(unit), unit.entries):
            assert torch.equal(unit.slab[e.offset : e.offset + e.numel].view(e.shape), grads[name]), name


@pytest.mark.parametrize("accurate", [False, True])
def test_the_clipping_norm_is_ordinary_cpu_trainings_to_the_bit_or_accurate_as_a_gpus(accurate):
    """Two accumulated micro-batches land on the host, where their norms are taken. On a CPU device they are
    torch's fp32 norms, bit for bit what ordinary CPU training clips with; where the engine computes on a GPU
    (`accurate_norms`, set here as a GPU engine sets it) they are summed in fp64, as accurate as a GPU's
    reductions, where torch's CPU norm of the 2M-element embedding is not."""
    build = lambda: hf_llama(layers=2, vocab_size=32768, hidden_size=64)  # noqa: E731
    ref, model = build(), build()
    batches = token_batches(2)
    for batch in batches:
        (hf_loss(ref, batch) / 2).backward()
    truth = sum(float(p.grad.double().square().sum()) for p in ref.parameters()) ** 0.5
    ordinary = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true", blocks="model.layers"))
    assert engine.host.accurate_norms is False  # the CPU device's own
    engine.host.accurate_norms = accurate
    engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    for i, batch in enumerate(batches):
        with engine.backward(accumulate=i == 0, clip="norm"):
            (hf_loss(model, batch) / 2).backward()
    norm = engine.grad_norm()
    engine.close()
    if accurate:
        assert abs(float(norm) / truth - 1) < 1e-6 and not torch.equal(norm, ordinary)
    else:
        assert torch.equal(norm, ordinary)
