"""Lists and dicts passed into a block that the block adds tensors to (engine/device/sinks.py) train as ordinary
training does: the tensors get their gradient from the loss that uses them, and the recompute in backward
adds nothing a second time. What the engine cannot follow (items removed, tensors hidden in an object) is
refused in one line.

fp32 on the CPU with the torch-op optimizer backend: bitwise equal, step for step.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatrain_lightning import Engine, EngineConfig

pytestmark = pytest.mark.usefixtures("torch_adam")

VOCAB, WIDTH, LAYERS = 29, 16, 3


class SinkBlock(nn.Module):
    """Adds to the containers it is passed: an aux loss appended to a list, a running sum set in a dict, a
    list inside that dict, and its own input appended (a tensor the caller's graph reaches it by)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.gate = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor, aux: list, stats: dict) -> torch.Tensor:
        h = self.lin(x)
        aux.append(self.gate(h).softmax(-1).pow(2).mean() * (1 + len(aux)))
        stats["energy"] = stats.get("energy", 0) + h.pow(2).mean()  # (from the second block on: a grad input)
        stats.setdefault("inputs", []).append(x)
        if "peak" in stats:  # the largest so far: the earlier one taken out when this one is larger
            stats["peak"].append(torch.maximum(stats["peak"].pop(), h.abs().mean()))
        else:
            stats["peak"] = [h.abs().mean()]
        return x + torch.tanh(h)


class SinkLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(SinkBlock() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, list, dict]:
        h, aux, stats = self.embed(ids), [], {}
        for layer in self.layers:
            h = layer(h, aux, stats)
        loss = F.cross_entropy(self.head(h)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        inputs = torch.stack(stats["inputs"]).pow(2).mean()
        return loss + 0.1 * sum(aux) + 0.01 * stats["energy"] + 0.01 * inputs + 0.1 * stats["peak"][0], aux, stats


def train(model: nn.Module, config: EngineConfig | None, steps: int = 3) -> tuple[list[float], list[tuple]]:
    """A plain loop, with the engine (`config`) or without; the losses and what the containers held."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    engine = Engine(model, config) if config is not None else None
    if engine is not None:
        opt = engine.optimizer(opt)
    g = torch.Generator().manual_seed(5)
    losses, held = [], []
    for _ in range(steps):
        loss, aux, stats = model(torch.randint(0, VOCAB, (3, 10), generator=g))
        with engine.backward() if engine is not None else nullcontext():
            loss.backward()
        held.append((len(aux), sorted(stats), len(stats["inputs"]), len(stats["peak"])))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if engine is not None:
        engine.close()
    return losses, held


@pytest.mark.parametrize("recompute", [True, False], ids=["recomputed", "graph-kept"])
def test_tensors_a_block_adds_to_its_arguments_train_exactly(recompute):
    torch.manual_seed(0)
    ref = SinkLM()
    mt = copy.deepcopy(ref)
    config = EngineConfig(device="cpu", precision="32-true", recompute=recompute)
    assert train(mt, config) == train(ref, None)
    for (name, p), q in zip(ref.named_parameters(), mt.parameters()):
        assert torch.equal(p, q), name


def test_the_containers_hold_each_tensor_once_with_its_graph():
    """After the forward the list holds one tensor per block, each an output of the block's autograd node; the
    backward adds nothing."""
    torch.manual_seed(0)
    model = SinkLM()
    Engine(model, EngineConfig(device="cpu", precision="32-true"))
    ids = torch.randint(0, VOCAB, (2, 6))
    loss, aux, stats = model(ids)
    assert len(aux) == LAYERS and len(stats["inputs"]) == LAYERS and len(stats["peak"]) == 1
    nodes = [t.grad_fn.name() for t in [*aux, stats["energy"], *stats["inputs"]]]
    assert nodes == ["_BlockFunctionBackward"] * len(nodes)
    with torch.no_grad():
        assert torch.equal(stats["inputs"][0], model.embed(ids))  # (a block's own input goes in as a copy)
    loss.backward()
    assert len(aux) == LAYERS and len(stats["inputs"]) == LAYERS


class Box:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class BoxingBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, aux: list) -> torch.Tensor:
        aux.append(Box(self.lin(x).mean()))
        return x + self.lin(x)


def test_an_object_hiding_tensors_in_a_sink_is_refused_in_one_line():
    torch.manual_seed(0)
    model = nn.Module()
    model.layers = nn.ModuleList(BoxingBlock() for _ in range(2))
    Engine(model, EngineConfig(device="cpu", precision="32-true"))
    message = r"^strategy='megatrain': block layers.0 put a Box holding tensors into a list it was passed \(at 0\)"
    with pytest.raises(TypeError, match=message) as err:
        model.layers[0](torch.randn(2, 3, WIDTH, requires_grad=True), [])
    assert "\n" not in str(err.value)
