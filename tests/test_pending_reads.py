"""Block weights read while their optimizer step still runs in the background (engine/host/pending_reads.py) are the
stepped weights, as in ordinary training: the host steps are slowed here, so the window is always open."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from megatrain_lightning import Engine, EngineConfig
from megatrain_lightning.engine.host.pending_reads import PendingReads
from tests.test_self_checks import StackLM, stack_loss, token_batches, two_models

pytestmark = pytest.mark.usefixtures("torch_adam")  # bitwise comparisons need torch's own AdamW arithmetic


def early_penalty(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """A weight penalty over the blocks' parameters computed before the forward, from held references."""
    penalty = 1e-2 * sum(p.pow(2).sum() for p in model.held)
    return penalty + stack_loss(model, ids)


def run(
    model: nn.Module, streamed: bool, steps: int = 3, watched: bool = True, **config
) -> tuple[list[float], list[torch.Tensor]]:
    """A plain loop; the losses, and after each step the block weights' norms read through a held list."""
    model.held = list(model.layers.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true", **config)) if streamed else None
    if engine is not None:
        opt = engine.optimizer(opt)
        engine.host.gate = lambda unit: time.sleep(0.03)  # every host job (landing, step) starts late
    losses, norms = [], []
    for ids in token_batches(steps):
        loss = early_penalty(model, ids)
        if engine is not None:
            with engine.backward():
                loss.backward()
        else:
            loss.backward()
        opt.step()
        with torch.no_grad():
            norms.append(torch.stack([p.norm() for p in model.held]))
        opt.zero_grad()
        losses.append(loss.item())
    if engine is not None:
        assert (
            engine.reads.waits > 0 or not watched
        )  # the reads did fall in the window: the comparison below means something
        engine.close()
    return losses, norms


@pytest.mark.parametrize("overlap", [False, True], ids=["steps-after-backward", "overlapped"])
def test_weights_read_before_their_pending_step_is_done_are_the_stepped_ones(overlap):
    a, b = two_models(StackLM)
    ref_losses, ref_norms = run(a, streamed=False)
    if overlap:  # the penalty's gradient reaches the blocks after they stepped: refused, nothing silent
        with pytest.raises(RuntimeError, match="overlap_optimizer=False"):
            run(b, streamed=True, overlap_optimizer=True)
        return
    losses, norms = run(b, streamed=True, overlap_optimizer=False)
    assert losses == ref_losses
    for got, want in zip(norms, ref_norms):
        assert torch.equal(got, want)


def test_without_the_wait_the_reads_are_stale(monkeypatch):
    """The double: with nothing watched, the same loop reads weights the step has not written yet."""
    monkeypatch.setattr(PendingReads, "watch", lambda self, units: None)
    a, b = two_models(StackLM)
    ref_norms = run(a, streamed=False)[1]
    norms = run(b, streamed=True, watched=False, overlap_optimizer=False)[1]
    assert any(not torch.equal(got, want) for got, want in zip(norms, ref_norms))


def test_metadata_and_zero_grad_do_not_wait_and_the_mode_leaves_with_the_forward():
    torch.manual_seed(0)
    model = StackLM()
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true", overlap_optimizer=False))
    opt = engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    engine.host.gate = lambda unit: time.sleep(0.03)
    ids = token_batches(1)[0]
    with engine.backward():
        stack_loss(model, ids).backward()
    opt.step()
    assert torch._C._len_torch_function_stack() == 1  # blocks 1 and 2 are still stepping
    p = model.layers[2].lin.weight
    assert (p.shape, p.dtype, p.requires_grad, p.grad, p.is_leaf) == ((16, 16), torch.float32, True, None, True)
    _ = {p: 1}[p]  # hashing, as an optimizer's state lookup does
    opt.zero_grad()
    assert engine.reads.waits == 0
    stack_loss(model, ids)  # the forward loads every block, each after its step
    assert torch._C._len_torch_function_stack() == 0
    engine.close()
