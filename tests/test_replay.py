"""What a block's recompute replays beyond torch's RNG, and what the engine refuses (engine/device/replay.py).

- Python's ``random``, NumPy's global generator and ``torch.Generator`` objects a block owns or is passed
  draw in the recompute what they drew in the forward, and every draw after training continues as in
  ordinary training.
- Reentrant checkpoints inside a block (Hugging Face's ``gradient_checkpointing_enable`` with
  ``use_reentrant=True``, a block's own ``checkpoint(..., use_reentrant=True)``) train as ordinary training
  with the same checkpoints does.
- A model compiled whole is refused at setup in one line naming ``compile_blocks=True``.

fp32 on the CPU with the torch-op optimizer backend: bitwise equal, step for step.
"""

from __future__ import annotations

import copy
import random
import re
import warnings
from contextlib import nullcontext

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from megatrain_lightning import Engine, EngineConfig
from tests.helpers import CausalLM, Zoo, fit, hf_llama, token_batches
from tests.test_zoo import ACCUMULATE, TRAIN_KWARGS, assert_bitwise, run_pair

pytestmark = pytest.mark.usefixtures("torch_adam")

VOCAB, WIDTH = 29, 16


class StackLM(nn.Module):
    def __init__(self, block: type[nn.Module], layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(block() for _ in range(layers))
        self.head = nn.Linear(WIDTH, VOCAB)
        self.noise = torch.Generator().manual_seed(7)  # handed to every block as an argument

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h, self.noise)
        return F.cross_entropy(self.head(h)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def train(model: nn.Module, streamed: bool, steps: int = 3) -> list[float]:
    """A plain loop, with or without the engine, from seeded generators; the losses."""
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true")) if streamed else None
    if engine is not None:
        opt = engine.optimizer(opt)
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(steps):
        loss = model(torch.randint(0, VOCAB, (3, 10), generator=g))
        with engine.backward() if engine is not None else nullcontext():
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if engine is not None:
        engine.close()
    return losses


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


# -- generators besides torch's --------------------------------------------------------------------------


class DrawingBlock(nn.Module):
    """Draws a branch from Python's random, a scale from NumPy's global generator, noise from a generator it
    owns and from one it is passed."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.own = torch.Generator().manual_seed(3)

    def forward(self, x: torch.Tensor, noise: torch.Generator) -> torch.Tensor:
        h = self.lin(x)
        if random.random() < 0.5:
            h = 2 * h
        h = h * float(np.random.rand() + 0.5)
        h = h + torch.randn(h.shape, generator=self.own) + torch.rand(h.shape, generator=noise)
        return x + torch.tanh(h)


def test_a_block_drawing_from_any_generator_trains_like_ordinary_training():
    torch.manual_seed(0)
    ref = StackLM(DrawingBlock)
    mt = copy.deepcopy(ref)
    losses = train(mt, streamed=True)
    next_draws = [random.random(), np.random.rand()]
    assert losses == train(ref, streamed=False)
    assert_same_weights(ref, mt)
    # Every generator is where ordinary training left it: the next draws are the same.
    assert next_draws == [random.random(), np.random.rand()]
    assert [torch.equal(a.own.get_state(), b.own.get_state()) for a, b in zip(ref.layers, mt.layers)] == [True] * 3
    assert torch.equal(ref.noise.get_state(), mt.noise.get_state())


# -- reentrant checkpoints -------------------------------------------------------------------------------


def _llama_checkpointed(reentrant: bool) -> nn.Module:
    model = hf_llama(layers=3, attention_dropout=0.1)
    model.config.use_cache = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (the deprecated name is the one users call)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_hugging_face_gradient_checkpointing_trains_like_ordinary_training(reentrant):
    """Lightning, accumulation, clipping, dropout: the same checkpointed model trained both ways."""
    entry = Zoo(lambda: _llama_checkpointed(reentrant))
    ref, mt, _ = run_pair(entry, token_batches(2 * ACCUMULATE), steps=2, **TRAIN_KWARGS)
    assert_bitwise(ref, mt)
    assert torch_checkpoint.CheckpointFunction.__name__ == "CheckpointFunction"  # torch's own again


class CheckpointingBlock(nn.Module):
    """Calls a reentrant checkpoint itself, around a dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor, noise: torch.Generator) -> torch.Tensor:
        return x + torch_checkpoint.checkpoint(self.inner, x, use_reentrant=True)

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.tanh(self.lin(x)))


def test_a_block_calling_a_reentrant_checkpoint_trains_like_ordinary_training():
    torch.manual_seed(0)
    ref = StackLM(CheckpointingBlock)
    mt = copy.deepcopy(ref)
    assert train(mt, streamed=True) == train(ref, streamed=False)
    assert_same_weights(ref, mt)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True")
def test_a_reentrant_checkpoint_on_inputs_needing_no_grad_is_refused_in_one_line():
    """With a frozen embedding, ordinary training's reentrant checkpoint cuts the graph at the first block (its
    weights, and every block after it, get no gradient); a streamed block's output always needs grad."""
    torch.manual_seed(0)
    model = StackLM(CheckpointingBlock)
    model.embed.requires_grad_(False)
    Engine(model, EngineConfig(device="cpu", precision="32-true"))
    with pytest.raises(RuntimeError, match=r"checkpoint\(use_reentrant=True\) on inputs none of which") as err:
        model(torch.randint(0, VOCAB, (2, 6))).backward()  # (refused in the block's first call, a forward)
    assert "use_reentrant=False" in str(err.value) and "\n" not in str(err.value)


# -- a model compiled whole ------------------------------------------------------------------------------


def _compiled_inside() -> nn.Module:
    model = hf_llama(layers=2)
    model.model = torch.compile(model.model)
    return model


def _compiled_in_place() -> nn.Module:
    model = hf_llama(layers=2)
    model.compile()
    return model


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda: torch.compile(hf_llama(layers=2)), "LlamaForCausalLM"),
        (_compiled_inside, "module 'model' (LlamaModel) of LlamaForCausalLM"),
        (_compiled_in_place, "LlamaForCausalLM"),
    ],
    ids=["torch.compile(model)", "a-compiled-submodule", "model.compile()"],
)
def test_a_model_compiled_whole_is_refused_at_setup(make, named):
    with pytest.raises(
        ValueError, match=f"^strategy='megatrain': {re.escape(named)} is compiled with torch.compile"
    ) as err:
        Engine(make(), EngineConfig(device="cpu", precision="32-true"))
    assert "compile_blocks=True" in str(err.value) and "\n" not in str(err.value)


def test_a_lightning_module_holding_a_compiled_model_is_refused_at_setup():
    module = CausalLM(torch.compile(hf_llama(layers=2)))
    named = "module 'model' (LlamaForCausalLM) of CausalLM is compiled"
    with pytest.raises(ValueError, match=f"^strategy='megatrain': {re.escape(named)} .*compile_blocks=True"):
        fit(module, token_batches(2))
