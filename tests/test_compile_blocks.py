"""compile_blocks=True: each decoder block's forward and its recompute in backward run through torch.compile
(engine/device/block_fn.py, CompiledBlock).

The oracle is ordinary Lightning training with torch.optim.AdamW of an identical copy of the model, as in
tests/test_strategy.py and tests/test_zoo.py, but within round-off instead of bitwise: Inductor's fused
kernels sum (RMSNorm statistics, softmax, LayerNorm) in another order than eager kernels. Over 3 steps,
fp32 on the CPU, the measured differences are: losses 0 to 3e-7 relative; each tensor's update error
||p_compiled - p_ref|| / ||p_ref - p_0|| at most 2e-4 (this project's Llama) and 6e-6 (GPT-2, whose key
bias third is left out as in tests/test_zoo.py: its true gradient is zero and Adam turns its round-off into
+-lr steps, 5e-4 here). The bounds are 1e-5 and 1e-3; a real fault (a block's stale weights or lost
gradient, a recompute that draws other dropout masks than its forward) moves them by O(1).

Inductor compiles C++ on the CPU: each model compiles one graph in grad mode (the forward and the recompute)
and its backward, 15 to 45 s on two busy cores without a warm cache, so the models are tiny
and each fit runs once per module (fixtures) for several tests to read. The tests of the wiring's errors
compile with Dynamo's eager backend instead (fixture eager_backend): what they check happens before Inductor.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch._dynamo.utils import counters

from megatrain_lightning import Engine, EngineConfig, MegatrainStrategy
from megatrain_lightning.engine.device import block_fn
from megatrain_lightning.engine.device.block_fn import CompiledBlock, compile_block_calls
from megatrain_lightning.models import LlamaConfig, LlamaForCausalLM
from tests.helpers import (
    SEED,
    ZOO,
    CausalLM,
    Zoo,
    excluded_mask,
    fit,
    own_llama,
    own_loss,
    params_of,
    token_batches,
    twin,
    update_error,
)

STEPS = 3
LOSS_BOUND, UPDATE_BOUND = 1e-5, 1e-3


class KeepRunners(Callback):
    """Keeps what each block runner calls, read at the start of fit (the engine is gone after it)."""

    def __init__(self) -> None:
        self.inner: list[Any] = []

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.inner = [runner.inner for runner in trainer.strategy.engine.runners]


@dataclass
class Run:
    ref: CausalLM
    mt: CausalLM
    start: dict[str, torch.Tensor]
    inner: list[Any]  # what each block's runner called
    graphs: int  # graphs Dynamo compiled during the megatrain fit


def run_pair(
    make: Callable[[], nn.Module],
    loss_fn: Callable | None,
    compile_blocks: bool = True,
    reference: Any = "auto",
    **trainer_kwargs: Any,
) -> Run:
    """`reference` training (by default ordinary training) and megatrain training (`compile_blocks`) of two
    copies of one model on the same batches from the same RNG state, with the torch-op optimizer backend."""
    a, b = twin(make)
    start = params_of(a)
    kwargs = {} if loss_fn is None else {"loss_fn": loss_fn}
    ref, mt = CausalLM(a, **kwargs), CausalLM(b, **kwargs)
    batches, keep = token_batches(STEPS), KeepRunners()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEGATRAIN_CPU_ADAM", "torch")
        torch.manual_seed(SEED)
        fit(ref, batches, reference, **trainer_kwargs)
        torch._dynamo.reset()  # count this fit's compilations only, from an empty code cache
        counters.clear()
        torch.manual_seed(SEED)
        fit(mt, batches, MegatrainStrategy(compile_blocks=compile_blocks), callbacks=[keep], **trainer_kwargs)
    return Run(ref, mt, start, keep.inner, counters["stats"]["unique_graphs"])


def assert_trains_like_ordinary(run: Run, entry: Zoo | None = None) -> None:
    """Losses and each tensor's update within the bounds; a zoo `entry` names the elements whose true
    gradient is zero (a key bias), whose round-off Adam turns into +-lr steps: those are left out."""
    assert len(run.mt.losses) == len(run.ref.losses) == STEPS
    rel = max(abs(a - b) / abs(b) for a, b in zip(run.mt.losses, run.ref.losses))
    assert rel <= LOSS_BOUND, f"loss relative difference {rel:.3g}"
    pr, pm = params_of(run.ref.model), params_of(run.mt.model)
    errors = {}
    for n in pr:
        mask = None if entry is None else excluded_mask(entry, n, pr[n])
        keep = torch.ones_like(pr[n], dtype=torch.bool) if mask is None else ~mask
        errors[n] = ((pm[n] - pr[n])[keep].norm() / (pr[n] - run.start[n])[keep].norm()).item()
    worst = max(errors, key=errors.get)
    assert errors[worst] <= UPDATE_BOUND, f"{worst}: update error {errors[worst]:.3g}"


@pytest.fixture
def eager_backend(monkeypatch):
    """For tests of the wiring (routing, errors), not of the kernels: Dynamo traces, guards and raises as
    under Inductor, but runs the graph eagerly, with no C++ to compile. A fresh per-class cache for the
    test, so no Inductor-compiled function leaks in and no eager one leaks out."""
    compile_ = torch.compile

    def eager(fn, **kwargs):
        return compile_(fn, **{**kwargs, "backend": "eager", "options": None})  # options are Inductor's

    monkeypatch.setattr(torch, "compile", eager)
    monkeypatch.setattr(block_fn, "_shared_compiled", functools.cache(block_fn._shared_compiled.__wrapped__))


@pytest.fixture(scope="module")
def own_run() -> Run:
    return run_pair(own_llama, own_loss)  # 4 blocks


@pytest.fixture(scope="module")
def gpt2_run() -> Run:
    return run_pair(ZOO["gpt2"].make, ZOO["gpt2"].loss_fn)  # dropout in attention, residuals and embeddings


def test_own_llama_trains_like_ordinary_training(own_run):
    assert_trains_like_ordinary(own_run)


def test_hf_gpt2_with_dropout_trains_like_ordinary_training(gpt2_run):
    """The recompute, replaying the forward's RNG state, draws the forward's dropout masks (fallback_random)."""
    assert_trains_like_ordinary(gpt2_run, ZOO["gpt2"])


@pytest.mark.parametrize("run", ["own_run", "gpt2_run"])
def test_blocks_compile_once_per_grad_mode_and_run_compiled(run, request):
    """Every block call, forward and recompute, goes into the compiled function, which all blocks share; it
    compiles once (the forward runs in grad mode, as the recompute does), not per block or per step, although
    the engine re-points the parameters at another device slot for every call (graph inputs, not constants)."""
    run = request.getfixturevalue(run)
    assert len(run.inner) >= 2 and all(isinstance(inner, CompiledBlock) for inner in run.inner)
    assert [inner.calls for inner in run.inner] == [2 * STEPS] * len(run.inner)  # forward + recompute per step
    assert len({inner.fn.func for inner in run.inner}) == 1  # one compiled callable for the block class
    assert run.graphs == 1


def test_bf16_follows_eager_bf16_streaming():
    """Compiled kernels round intermediates to bf16 where eager ones do (emulate_precision_casts): measured
    equal to eager bf16-mixed streaming; without it the update differs by 8e-2, as much as bf16 from fp32."""

    def make() -> nn.Module:
        return LlamaForCausalLM(LlamaConfig.from_preset("tiny", num_hidden_layers=2))

    run = run_pair(make, own_loss, reference=MegatrainStrategy(), precision="bf16-mixed")
    rel = max(abs(a - b) / abs(b) for a, b in zip(run.mt.losses, run.ref.losses))
    assert rel <= 1e-4, f"loss relative difference {rel:.3g}"
    error = update_error(params_of(run.mt.model), params_of(run.ref.model), run.start)
    assert error <= 2e-2, f"update error {error:.3g}"


def test_blocks_run_eagerly_by_default():
    run = run_pair(own_llama, own_loss, compile_blocks=False)
    assert run.inner and not any(isinstance(inner, CompiledBlock) for inner in run.inner)
    assert run.graphs == 0
    assert run.mt.losses == run.ref.losses  # eager streaming is bitwise ordinary training


def test_blocks_with_hooks_are_refused_naming_the_class(eager_backend):
    """Hugging Face's output recorders (here: router logits for the auxiliary loss) are hooks inside the block."""
    entry = ZOO["mixtral-aux"]
    module = CausalLM(entry.make(), loss_fn=entry.loss_fn)
    with pytest.raises(RuntimeError, match=r"MixtralDecoderLayer carry hooks .*compile_blocks=False"):
        fit(module, token_batches(1), MegatrainStrategy(compile_blocks=True))


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(x)


class Branching(Residual):
    """Python control flow on a tensor's value: not one graph."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) if x.sum().item() > 0 else x


class Stack(nn.Module):
    def __init__(self, block: type[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(block() for _ in range(2))
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def streamed_compiled(block: type[nn.Module]) -> tuple[nn.Module, Engine]:
    model = Stack(block)
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true"))
    compile_block_calls(engine.blocks, engine.runners)
    return model, engine


def test_a_block_that_cannot_compile_names_its_class_and_the_fix(eager_backend):
    model, engine = streamed_compiled(Branching)
    with pytest.raises(RuntimeError, match=r"could not compile decoder block class Branching .*compile_blocks=False"):
        with torch.no_grad():
            model(torch.ones(2, 8))
    engine.close()


def test_too_many_variants_raise_naming_the_class_and_the_fix(eager_backend):
    """Each sequence length compiles a variant; past Dynamo's recompile limit the call raises (here: limit 1)."""
    model, engine = streamed_compiled(Residual)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1), torch.no_grad():
        model(torch.ones(1, 4, 8))
        model(torch.ones(1, 4, 8))  # the same shape: no new variant
        too_many = r"class Residual needs more compiled variants.*fixed length.*compile_blocks=False"
        with pytest.raises(RuntimeError, match=too_many):
            model(torch.ones(1, 5, 8))
    engine.close()


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_bad_compile_blocks_value_is_refused(value):
    with pytest.raises(ValueError, match=rf"compile_blocks={value!r}"):
        MegatrainStrategy(compile_blocks=value)
