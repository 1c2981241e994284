"""The engine's self-checks (engine/self_checks.py): a recompute that differs from its forward stops the step,
gradients that reach block parameters outside the engine's path are added as ordinary training adds them,
and parameters pruned or re-parametrized after setup are followed, each against ordinary training."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize, prune

from megatrain_lightning import Engine, EngineConfig
from megatrain_lightning.engine.self_checks import differs, fingerprint, tolerance

pytestmark = pytest.mark.usefixtures("torch_adam")  # bitwise comparisons need torch's own AdamW arithmetic

VOCAB, WIDTH = 29, 16


def token_batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (3, 10), generator=g) for _ in range(n)]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.tanh(self.lin(x)))


class StackLM(nn.Module):
    def __init__(self, block: Callable[[], nn.Module] = Block, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(block() for _ in range(layers))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def stack_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def penalty_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """A weight penalty over the blocks' parameters, added to the loss after the forward."""
    loss = stack_loss(model, ids)
    return loss + 1e-2 * sum(p.pow(2).sum() for p in model.layers.parameters())


def two_models(build: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    first = build()
    torch.manual_seed(0)
    return first, build()


def train(
    model, streamed, loss_fn=stack_loss, steps=3, between=None, close=True, engines=None, **config
) -> list[float]:
    """A plain loop with or without the engine (`between(model, step)` runs after each step); the losses.
    `engines`: a list the engine is added to as soon as it is built (to reach it after an error)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true", **config)) if streamed else None
    if engines is not None:
        engines.append(engine)
    if engine is not None:
        opt = engine.optimizer(opt)
    losses = []
    for step, ids in enumerate(token_batches(steps)):
        loss = loss_fn(model, ids)
        with engine.backward() if engine is not None else nullcontext():
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if between is not None:
            between(model, step)
    if engine is not None and close:
        engine.close()
    return losses


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name, t in sa.items():
        assert torch.equal(sb[name], t), name


# -- the recompute agrees with the forward --------------------------------------------------------------


class Tally:
    """A plain object: its count is not a buffer or a number attribute of the block, so nothing replays it."""

    def __init__(self) -> None:
        self.n = 0


class HiddenStateBlock(Block):
    """Its output depends on how often it ran: the recompute sees another count than the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.tally = Tally()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.tally.n += 1
        return x + self.out(torch.tanh(self.lin(x))) * (1 + 0.1 * self.tally.n)


def test_a_recompute_that_differs_from_its_forward_stops_the_step_naming_the_block():
    torch.manual_seed(0)
    model = StackLM()
    model.layers[1] = HiddenStateBlock()
    before = {n: p.detach().clone() for n, p in model.layers[1].named_parameters()}
    engines: list[Engine] = []
    with pytest.raises(RuntimeError, match=r"^block layers\.1: its recompute in backward did not reproduce") as err:
        train(model, streamed=True, steps=1, close=False, engines=engines)
    assert "\n" not in str(err.value) and "bitwise" in str(err.value)
    engine = engines[0]
    engine.flush()
    for name, p in model.layers[1].named_parameters():  # never stepped with the wrong gradient
        assert torch.equal(p, before[name]), name
    engine.close()


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_on_a_gpu_a_differing_recompute_stops_its_blocks_host_jobs_and_rounding_does_not(precision):
    """On a GPU the comparison is read by the block's host jobs (no sync in backward): the landing and the
    step fail, the error comes out of the next wait on them, the block's weights stay; the other blocks,
    whose recomputes round alike, train."""
    torch.manual_seed(0)
    model = StackLM()
    model.layers[1] = HiddenStateBlock()
    before = {n: p.detach().clone() for n, p in model.layers[1].named_parameters()}
    other = model.layers[2].lin.weight.detach().clone()
    engine = Engine(model, EngineConfig(device="cuda", precision=precision))
    opt = engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    with engine.autocast():
        loss = stack_loss(model, token_batches(1)[0].cuda())
    with engine.backward():
        loss.backward()
    with pytest.raises(RuntimeError, match=r"^block layers\.1: its recompute in backward did not reproduce"):
        opt.step()  # its last uploads wait on the blocks' host jobs, so the error can come out here already
        engine.flush()
    for unit in engine.all_units():  # the error stays on layers.1's jobs; the others' run to the end
        if unit.name != "layers.1":
            unit.wait()
    for name, p in model.layers[1].named_parameters():
        assert torch.equal(p, before[name]), name
    assert not torch.equal(model.layers[2].lin.weight, other)


def test_a_kept_graph_is_not_recomputed_so_not_compared():
    """recompute=False keeps every call's graph: the block runs once, as in ordinary training."""
    build = lambda: StackLM(lambda: HiddenStateBlock())  # noqa: E731
    a, b = two_models(build)
    assert train(b, streamed=True, recompute=False) == train(a, streamed=False)
    assert_same_state(b, a)


def test_fingerprints_tell_a_different_output_from_rounding():
    torch.manual_seed(0)
    t = torch.randn(4, 7, 32)
    assert not differs(fingerprint([t]), fingerprint([t.clone()]), None)
    moved = t.clone()
    moved[2, 3, 5] += 1e-3  # one element, by a thousandth
    assert differs(fingerprint([t]), fingerprint([moved]), None)
    # Within the device tolerance: bf16 rounding of every element; beyond it: a different dropout mask.
    rtol = tolerance(torch.bfloat16)
    rounded = t.bfloat16().float()
    assert not bool(differs(fingerprint([t]), fingerprint([rounded]), rtol))
    h = torch.randn(4, 7, 32)
    masks = [torch.rand(4, 7, 32, generator=torch.Generator().manual_seed(s)) > 0.1 for s in (1, 2)]
    outs = [t + h * m / 0.9 for m in masks]
    assert bool(differs(fingerprint([outs[0]]), fingerprint([outs[1]]), rtol))


def test_a_run_that_diverges_to_nan_goes_on_with_nan_as_ordinary_training_does():
    """A NaN output reproduces itself in the recompute: the bitwise comparison is of bit patterns, so a
    diverged run is not stopped as a differing recompute (ordinary training goes on with NaN losses)."""

    def poisoned() -> nn.Module:
        model = StackLM()
        with torch.no_grad():
            model.layers[1].lin.weight[0, 0] = float("nan")
        return model

    a, b = two_models(poisoned)
    want, got = train(a, streamed=False), train(b, streamed=True)
    assert all(map(math.isnan, want)) and all(map(math.isnan, got))
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        torch.testing.assert_close(y, x, rtol=0, atol=0, equal_nan=True, msg=name)
    assert differs(fingerprint([torch.full((2, 3), float("nan"))]), fingerprint([torch.ones(2, 3)]), None)


# -- no stray gradients ---------------------------------------------------------------------------------


def test_a_weight_penalty_over_block_parameters_trains_exactly():
    a, b = two_models(StackLM)
    assert train(b, streamed=True, loss_fn=penalty_loss) == train(a, streamed=False, loss_fn=penalty_loss)
    assert_same_state(b, a)


def test_a_penalty_reaching_a_block_already_stepped_is_refused_in_one_line_and_works_without_overlap():
    def early_penalty(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:  # built before the forward
        penalty = 1e-2 * sum(p.pow(2).sum() for p in model.layers.parameters())
        return penalty + stack_loss(model, ids)

    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match=r"^block layers\.\d: a gradient reached parameter .* overlap_optimizer=Fa"):
        train(StackLM(), streamed=True, loss_fn=early_penalty, steps=1)
    a, b = two_models(StackLM)
    losses = train(b, streamed=True, loss_fn=early_penalty, overlap_optimizer=False)
    assert losses == train(a, streamed=False, loss_fn=early_penalty)
    assert_same_state(b, a)


class RevBlock(nn.Module):
    """A reversible block: (x1, x2) -> (y1, y2) = (x1 + f(x2), x2 + g(y1)), inputs recomputable from outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(WIDTH, WIDTH)
        self.g = nn.Linear(WIDTH, WIDTH)

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y1 = x1 + torch.tanh(self.f(x2))
        return y1, x2 + torch.tanh(self.g(y1))


class _Reversible(torch.autograd.Function):
    """Reformer's scheme: the layers run without a graph; backward rebuilds each layer's inputs from its
    outputs and differentiates the layer's parts with ``torch.autograd.backward``, so the parameters'
    gradients land in ``.grad``."""

    @staticmethod
    def forward(ctx, x1, x2, layers):
        for layer in layers:
            x1, x2 = layer(x1, x2)
        ctx.layers = layers
        ctx.save_for_backward(x1, x2)
        return x1, x2

    @staticmethod
    def backward(ctx, dy1, dy2):
        y1, y2 = ctx.saved_tensors
        for layer in reversed(ctx.layers):
            with torch.no_grad():
                x2 = y2 - torch.tanh(layer.g(y1))
                x1 = y1 - torch.tanh(layer.f(x2))
            with torch.enable_grad():
                a, b = x1.detach().requires_grad_(), x2.detach().requires_grad_()
                out1 = a + torch.tanh(layer.f(b))
                out2 = b + torch.tanh(layer.g(out1))
                torch.autograd.backward((out1, out2), (dy1, dy2))
            dy1, dy2, y1, y2 = a.grad, b.grad, x1, x2
        return dy1, dy2, None


class ReversibleLM(StackLM):
    def __init__(self) -> None:
        super().__init__(RevBlock, layers=3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        y1, y2 = _Reversible.apply(h, h, self.layers)
        return self.head(y1 + y2)


def test_reversible_layers_whose_custom_backward_fills_grad_train_exactly():
    a, b = two_models(ReversibleLM)
    start = {n: p.detach().clone() for n, p in b.layers.named_parameters()}
    assert train(b, streamed=True) == train(a, streamed=False)
    assert_same_state(b, a)
    assert all(not torch.equal(p, start[n]) for n, p in b.layers.named_parameters())  # the layers trained


# -- the model is what the engine adopted ---------------------------------------------------------------


def prune_after_first_step(model: nn.Module, step: int) -> None:
    if step == 0:
        for layer in model.layers:
            prune.l1_unstructured(layer.lin, "weight", amount=0.5)


def test_pruning_after_setup_trains_exactly_and_its_masks_survive_close():
    a, b = two_models(StackLM)
    assert train(b, streamed=True, between=prune_after_first_step) == train(
        a, streamed=False, between=prune_after_first_step
    )
    assert_same_state(b, a)  # weight_orig and weight_mask
    assert "layers.0.lin.weight_mask" in b.state_dict()
    for model in (a, b):  # made permanent: the masked values are the parameter's
        for layer in model.layers:
            prune.remove(layer.lin, "weight")
    assert_same_state(b, a)
    zeros = float((b.layers[0].lin.weight == 0).float().mean())
    assert zeros == 0.5


def test_pruning_made_permanent_before_close_keeps_the_masked_values():
    """``prune.remove`` assigns the parameter's ``.data`` (ModelPruning's make_pruning_permanent at the end
    of training, before the strategy closes the engine): close() takes those values, not the unmasked master."""

    def prune_then_remove(model: nn.Module, step: int) -> None:
        prune_after_first_step(model, step)
        if step == 2:
            for layer in model.layers:
                prune.remove(layer.lin, "weight")

    a, b = two_models(StackLM)
    assert train(b, streamed=True, between=prune_then_remove) == train(a, streamed=False, between=prune_then_remove)
    assert_same_state(b, a)
    assert float((b.layers[1].lin.weight == 0).float().mean()) == 0.5


class Symmetric(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.triu() + w.triu(1).transpose(0, 1)


def test_a_parametrization_registered_after_setup_trains_exactly():
    def parametrize_first(model: nn.Module, step: int) -> None:
        if step == 0:
            parametrize.register_parametrization(model.layers[0].out, "weight", Symmetric())

    a, b = two_models(StackLM)
    assert train(b, streamed=True, between=parametrize_first) == train(a, streamed=False, between=parametrize_first)
    assert_same_state(b, a)


def test_a_parameter_replaced_after_setup_is_refused_in_one_line():
    torch.manual_seed(0)
    model = StackLM()
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true"))
    model.layers[2].out.weight = nn.Parameter(torch.zeros(WIDTH, WIDTH))
    with pytest.raises(RuntimeError, match=r"^parameter layers\.2\.out\.weight appeared after") as err:
        stack_loss(model, token_batches(1)[0])
    assert "\n" not in str(err.value)
    engine.close()


@pytest.mark.parametrize("lottery", [False, True])
def test_lightnings_model_pruning_callback_trains_exactly_and_keeps_its_zeros(lottery):
    """``ModelPruning`` prunes at an epoch's end (with the lottery ticket reset: the kept weights back to their
    initial values) and makes the pruning permanent at the end of training, before the strategy closes the
    engine: the same losses and weights as ordinary training, and the zeros.

    With the reset, pruning once: ordinary training's parameter shares its storage with the saved initial
    weights after the first reset (``dst.data = src.data``), so later resets restore trained values there;
    the engine copies them into its master, so each reset restores the initial values."""
    from lightning.pytorch.callbacks import ModelPruning

    from tests.helpers import CausalLM, assert_same, fit

    def pruning(model: nn.Module) -> ModelPruning:
        return ModelPruning(
            "l1_unstructured",
            parameters_to_prune=[(layer.lin, "weight") for layer in model.layers],
            amount=0.5,
            apply_pruning=(lambda epoch: epoch == 0) if lottery else True,
            use_lottery_ticket_hypothesis=lottery,
            verbose=0,
        )

    a, b = two_models(StackLM)
    ref, mt = CausalLM(a, loss_fn=stack_loss), CausalLM(b, loss_fn=stack_loss)
    batches = token_batches(2)
    fit(ref, batches, strategy="auto", max_epochs=2, callbacks=[pruning(a)])
    fit(mt, batches, strategy="megatrain", max_epochs=2, callbacks=[pruning(b)])
    assert_same(mt, ref)
    assert "layers.0.lin.weight_orig" not in b.state_dict()  # (made permanent)
    assert float((b.layers[0].lin.weight == 0).float().mean()) > 0.45  # (pruned to half, or more)
