"""A streamed block behaves as the user's own module: train/eval mode, hooks, and tensors that leave it
besides the hidden state (router logits in a tuple output or recorded by a hook, an auxiliary loss kept
as an attribute) carry their gradient back into the block, as in ordinary training.

Each test trains a tiny user-written model with the engine and with a plain loop over the same model and
torch.optim.AdamW, fp32 on the CPU with the torch-op optimizer backend: bit-identical, step for step.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatrain_lightning import Engine, EngineConfig
from megatrain_lightning.engine.device.block_fn import SideOutputs

VOCAB, WIDTH, EXPERTS = 37, 16, 4


class Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(WIDTH, EXPERTS, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        probs = logits.softmax(-1)
        self.aux_loss = (probs.mean((0, 1)) ** 2).sum() * EXPERTS  # read by the loss after the forward
        return logits


class MoEBlock(nn.Module):
    """Soft mixture of experts; returns (hidden, router logits) like older Hugging Face MoE layers."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.router = Router()
        self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(EXPERTS))
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm(x)
        logits = self.router(h)
        weights = logits.softmax(-1)
        mixed = sum(weights[..., e : e + 1] * expert(h) for e, expert in enumerate(self.experts))
        return x + scale * self.drop(mixed), logits


class MoEModel(nn.Module):
    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(MoEBlock() for _ in range(layers))
        self.head = nn.Linear(WIDTH, VOCAB)
        self.hooked: list[torch.Tensor] = []
        for layer in self.layers:  # a user hook recording each router's logits, as HF output capture does
            layer.router.gate.register_forward_hook(lambda module, args, out: self.hooked.append(out))

    def forward(self, ids: torch.Tensor, aux: str) -> torch.Tensor:
        self.hooked.clear()
        h, tuple_logits = self.embed(ids), []
        for layer in self.layers:
            h, logits = layer(h, 0.5)
            tuple_logits.append(logits)
        loss = F.cross_entropy(self.head(h)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        if aux == "tuple":
            return loss + 0.1 * sum(lg.logsumexp(-1).square().mean() for lg in tuple_logits)
        if aux == "hook":
            return loss + 0.1 * sum(lg.logsumexp(-1).square().mean() for lg in self.hooked)
        if aux == "attribute":
            return loss + 0.1 * sum(layer.router.aux_loss for layer in self.layers)
        return loss


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (2, 12), generator=g) for _ in range(n)]


def train(model: nn.Module, aux: str, streamed: bool, steps: int = 4) -> list[float]:
    torch.manual_seed(7)  # dropout masks
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if streamed:
        engine = Engine(model, EngineConfig(device="cpu", precision="32-true"))
        opt = engine.optimizer(opt)
    losses = []
    for ids in batches(steps):
        loss = model(ids, aux)
        with engine.backward() if streamed else nullcontext():
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if streamed:
        engine.close()
    return losses


pytestmark = pytest.mark.usefixtures("torch_adam")  # bitwise comparisons need torch's own AdamW arithmetic


def twin() -> tuple[MoEModel, MoEModel]:
    """Two identical models built apart (a deep copy would copy the hooks, still bound to the first)."""
    torch.manual_seed(0)
    first = MoEModel()
    torch.manual_seed(0)
    return first, MoEModel()


@pytest.mark.parametrize("aux", ["tuple", "hook", "attribute"])
def test_auxiliary_losses_from_side_outputs_train_exactly(aux):
    ref, mt = twin()
    assert train(mt, aux, streamed=True) == train(ref, aux, streamed=False)
    for (name, p), q in zip(ref.named_parameters(), mt.parameters()):
        assert torch.equal(p, q), name


def test_a_dropped_side_gradient_would_be_noticed():
    """The oracle above is sharp: the router gets a different update when the aux loss is left out."""
    with_aux, without = twin()
    train(with_aux, "attribute", streamed=False)
    train(without, "none", streamed=False)
    assert not torch.equal(with_aux.layers[0].router.gate.weight, without.layers[0].router.gate.weight)


def test_blocks_follow_train_and_eval_mode():
    """model.eval() turns the blocks' dropout off, model.train() back on: the blocks are the user's modules."""
    torch.manual_seed(0)
    model = MoEModel()
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true"))
    ids = batches(1)[0]
    model.eval()
    with torch.no_grad():
        first, second = model(ids, "none"), model(ids, "none")
    assert torch.equal(first, second)
    model.train()
    with torch.no_grad():
        assert not torch.equal(model(ids, "none"), first)
    engine.close()
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids, "none"), first)  # the same function as the streamed eval


def test_hooks_see_differentiable_outputs_and_fire_in_recompute():
    """A hook gets the same output objects the loss uses; like torch.utils.checkpoint's recompute, the
    block's recompute calls submodule hooks again (their outputs then carry the recompute's graph)."""
    torch.manual_seed(0)
    model = MoEModel(layers=2)
    Engine(model, EngineConfig(device="cpu", precision="32-true"))
    loss = model(batches(1)[0], "hook")
    assert len(model.hooked) == 2 and all(t.requires_grad for t in model.hooked)
    loss.backward()
    assert len(model.hooked) == 4


def test_no_global_hook_while_no_submodule_carries_one():
    """SideOutputs records hooked submodules' outputs through a global forward hook, registered only while a
    module of the block carries a hook: hook-free blocks keep nn.Module's fast path, and a compiled block
    sees the same global hooks (none) at every call."""
    global_hooks = nn.modules.module._global_forward_hooks
    block = MoEBlock()
    side = SideOutputs(block)
    with side.recording():
        assert not global_hooks
    around = block.register_forward_hook(lambda module, args, out: None)  # fires around the call, not in it
    with side.recording():
        assert not global_hooks
    inside = block.router.gate.register_forward_hook(lambda module, args, out: None)
    with side.recording():
        assert len(global_hooks) == 1
    around.remove()
    inside.remove()
    assert not global_hooks
