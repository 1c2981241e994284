"""Any torch optimizer on the host (engine/generic_optim.py), several optimizers, and param groups added
after setup: each bit for bit with ordinary training on the CPU (fp32, torch's own optimizer code on both
sides; the native AdamW path with the torch-op backend)."""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, ModelCheckpoint
from torch import nn

from megatrain_lightning import Engine, EngineConfig, MegatrainStrategy
from megatrain_lightning.engine.generic_optim import GenericHostOptimizer
from megatrain_lightning.engine.optimizer import HostAdamW
from megatrain_lightning.models import LlamaConfig, LlamaForCausalLM
from tests.helpers import CausalLM, fit, hf_llama, loader, params_of, quiet, token_batches, trainer, twin

pytestmark = pytest.mark.usefixtures("torch_adam")


class StepOverride(torch.optim.AdamW):
    """An AdamW subclass whose step changes the math (so it must step itself, not on the native kernel)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(0.5)
        super().step()
        return loss


class PlainSubclass(torch.optim.AdamW):
    """A subclass that keeps torch's step: the native path takes it."""


class SignSGD(torch.optim.Optimizer):
    """A user's own optimizer: sign descent with a momentum buffer and a step count in its state."""

    def __init__(self, params, lr: float = 1e-2, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["buf"], state["n"] = torch.zeros_like(p), 0
                state["buf"].mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
                state["n"] += 1
                p.add_(state["buf"].sign(), alpha=-group["lr"])
        return loss


OPTIMIZERS = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
    "adamw-amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True),
    "adamw-step-override": lambda ps: StepOverride(ps, lr=1e-2),
    "user-optimizer": lambda ps: SignSGD(ps, lr=1e-3),
}


class WithOptimizer(CausalLM):
    def __init__(self, model: nn.Module, make: Any, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.make = make

    def configure_optimizers(self) -> Any:
        return self.make([p for p in self.model.parameters() if p.requires_grad])


def small() -> nn.Module:
    return hf_llama(layers=2)


def assert_same(a: nn.Module, b: nn.Module) -> None:
    pa, pb = params_of(a), params_of(b)
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


# -- any optimizer, Trainer and plain loop -----------------------------------------------------------------


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_any_optimizer_trains_as_ordinary_training(name):
    """Two steps, clipped, two micro-batches each: losses and weights equal to the bit."""
    batches = token_batches(4)
    a, b = twin(small)
    kwargs = dict(gradient_clip_val=0.5, accumulate_grad_batches=2)
    ref = WithOptimizer(a, OPTIMIZERS[name])
    fit(ref, batches, strategy="auto", **kwargs)
    mt = WithOptimizer(b, OPTIMIZERS[name])
    t = fit(mt, batches, **kwargs)
    assert isinstance(t.optimizers[0], GenericHostOptimizer)
    assert mt.losses == ref.losses
    assert_same(mt.model, ref.model)


def test_an_adamw_subclass_keeping_torchs_step_takes_the_native_path():
    batches = token_batches(3)
    a, b = twin(small)
    ref, mt = (WithOptimizer(m, lambda ps: PlainSubclass(ps, lr=1e-2)) for m in (a, b))
    fit(ref, batches, strategy="auto")
    t = fit(mt, batches)
    assert isinstance(t.optimizers[0], HostAdamW)
    assert mt.losses == ref.losses
    assert_same(mt.model, ref.model)


def tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig.from_preset("tiny")
    cfg.num_hidden_layers = 2
    return LlamaForCausalLM(cfg)


def loop(model: nn.Module, opt: torch.optim.Optimizer, batches: list, engine: Engine | None = None) -> list[float]:
    """A plain loop, clipping by norm: ordinary (no engine) or through the engine's phases."""
    losses = []
    for x in batches:
        loss = model(x, targets=x)
        if engine is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        else:
            with engine.backward(clip=True):
                loss.backward()
            engine.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_plain_engine_loop_steps_sgd_as_ordinary_training():
    batches = token_batches(2)
    a, b = tiny(), tiny()
    expected = loop(a, OPTIMIZERS["sgd-momentum"](a.parameters()), batches)
    with Engine(b, EngineConfig(device="cpu", precision="32-true")) as engine:
        opt = engine.optimizer(OPTIMIZERS["sgd-momentum"](b.parameters()))
        assert loop(b, opt, batches, engine) == expected
    assert_same(b, a)


# -- checkpoints -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["save-load", "state-dict"])
def test_a_generic_optimizers_state_resumes_exactly(how, tmp_path):
    """A step, the state kept, another; a fresh engine given that state takes the same one (Adafactor's
    factored moments and step count, SignSGD's Python int, come back)."""
    batches = token_batches(2)
    for make in (OPTIMIZERS["adafactor"], OPTIMIZERS["user-optimizer"]):
        model = tiny()
        with Engine(model, EngineConfig(device="cpu", precision="32-true")) as engine:
            opt = engine.optimizer(make(model.parameters()))
            loop(model, opt, batches[:1], engine)
            if how == "save-load":
                engine.save(str(tmp_path / "ckpt"))
            else:
                state = copy.deepcopy(engine.state_dict(opt))
            expected = loop(model, opt, batches[1:], engine)
        fresh = tiny()
        with Engine(fresh, EngineConfig(device="cpu", precision="32-true")) as engine:
            opt = engine.optimizer(make(fresh.parameters()))
            if how == "save-load":
                engine.load(str(tmp_path / "ckpt"))
            else:
                engine.load_state_dict(state, opt)
            assert loop(fresh, opt, batches[1:], engine) == expected
        assert_same(fresh, model)


class Unstorable(SignSGD):
    @torch.no_grad()
    def step(self, closure=None):
        super().step(closure)
        for p in self.state:
            self.state[p]["clock"] = object()


def test_a_state_a_checkpoint_cannot_hold_is_refused_at_save(tmp_path):
    """One line naming the value; the checkpoint saved before stays in force."""
    model = tiny()
    url = str(tmp_path / "ckpt")
    with Engine(model, EngineConfig(device="cpu", precision="32-true")) as engine:
        opt = engine.optimizer(Unstorable(model.parameters()))
        engine.save(url)  # (no state yet)
        saved = {k: v.clone() for k, v in engine.master_state_dict().items()}
        loop(model, opt, token_batches(1), engine)
        with pytest.raises(ValueError, match=r"Unstorable\.state\[0\]\['clock'\] holds a object.*never pickles"):
            engine.save(url)
        engine.load(url, optimizer=False)
        assert all(torch.equal(v, saved[k]) for k, v in engine.master_state_dict().items())


@pytest.mark.parametrize("fmt", ["sharded", "torch"])
def test_trainer_resume_with_sgd_is_exact(fmt, tmp_path):
    """2 epochs straight == 1 epoch, save last.ckpt, resume a fresh copy for epoch 2 (momentum buffers)."""
    batches = token_batches(3)
    a, b = twin(small)
    c = copy.deepcopy(b)
    make = OPTIMIZERS["sgd-momentum"]
    straight = WithOptimizer(a, make)
    fit(straight, batches, strategy="auto", max_epochs=2, gradient_clip_val=1.0)
    cb = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_epochs=1)
    first = WithOptimizer(b, make)
    strategy = MegatrainStrategy(checkpoint_format=fmt)
    fit(
        first,
        batches,
        strategy=strategy,
        max_epochs=1,
        enable_checkpointing=True,
        callbacks=[cb],
        gradient_clip_val=1.0,
    )
    resumed = WithOptimizer(c, make)
    t = trainer(strategy=MegatrainStrategy(checkpoint_format=fmt), max_epochs=2, gradient_clip_val=1.0)
    with quiet():
        t.fit(resumed, loader(batches), ckpt_path=tmp_path / "last.ckpt")
    assert resumed.losses == straight.losses[3:]
    assert_same(resumed.model, straight.model)


# -- several optimizers ------------------------------------------------------------------------------------


class Stack(nn.Module):
    """Residual MLP blocks in a ModuleList (streamed), a head outside them."""

    def __init__(self, width: int, out: int, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))
        self.head = nn.Linear(width, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


class GAN(L.LightningModule):
    """Manual optimization with two optimizers over disjoint parameters: the discriminator steps on its
    loss, then the generator on its own (whose backward also reaches the discriminator, left for its next
    zero_grad, as in the usual GAN loop)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.generator, self.discriminator = Stack(16, 16), Stack(16, 1)
        self.automatic_optimization = False
        self.losses: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        real, noise = batch
        bce = nn.functional.binary_cross_entropy_with_logits
        fake = self.generator(noise)
        d_real, d_fake = self.discriminator(real), self.discriminator(fake.detach())
        loss_d = bce(d_real, torch.ones_like(d_real)) + bce(d_fake, torch.zeros_like(d_fake))
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        self.clip_gradients(opt_d, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        opt_d.step()
        d_gen = self.discriminator(fake)
        loss_g = bce(d_gen, torch.ones_like(d_gen))
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()
        self.losses += [loss_d.item(), loss_g.item()]

    def configure_optimizers(self) -> Any:
        return [
            torch.optim.AdamW(self.generator.parameters(), lr=1e-2),
            torch.optim.SGD(self.discriminator.parameters(), lr=0.05, momentum=0.9),
        ]


def test_a_gan_with_two_optimizers_trains_as_ordinary_training():
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)) for _ in range(4)]
    ref, mt = GAN(), GAN()
    for module, strategy in (
        (ref, "auto"),
        (mt, MegatrainStrategy(blocks=["generator.layers", "discriminator.layers"])),
    ):
        with quiet():
            trainer(strategy=strategy).fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    assert mt.losses == ref.losses
    assert_same(mt, ref)


def test_a_gan_resumes_exactly_from_a_sharded_checkpoint(tmp_path):
    """2 epochs straight == 1 epoch, save, resume a fresh GAN for epoch 2: both optimizers' state comes back."""
    g = torch.Generator().manual_seed(3)
    batches = torch.utils.data.DataLoader(
        [(torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)) for _ in range(2)], batch_size=None
    )
    blocks = ["generator.layers", "discriminator.layers"]
    straight, first, resumed = GAN(), GAN(), GAN()
    with quiet():
        trainer(strategy=MegatrainStrategy(blocks=blocks), max_epochs=2).fit(straight, batches)
        cb = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_epochs=1)
        strategy = MegatrainStrategy(blocks=blocks)
        trainer(strategy=strategy, enable_checkpointing=True, callbacks=[cb]).fit(first, batches)
        t = trainer(strategy=MegatrainStrategy(blocks=blocks), max_epochs=2)
        t.fit(resumed, batches, ckpt_path=tmp_path / "last.ckpt")
    assert resumed.losses == straight.losses[4:]
    assert_same(resumed, straight)


def test_what_several_optimizers_cannot_follow_is_refused():
    model = tiny()
    block = list(model.model.layers[0].parameters())
    with Engine(model, EngineConfig(device="cpu", precision="32-true")) as engine:
        with pytest.raises(ValueError, match=r"layers\.0 are split between optimizers 0 and 1.*to one optimizer"):
            engine.optimizers([torch.optim.SGD(block[:1], lr=0.1), torch.optim.SGD(block[1:], lr=0.1)])
        with pytest.raises(ValueError, match=r"a parameter of model\.layers\.0 is in two optimizers"):
            engine.optimizers([torch.optim.SGD(block, lr=0.1), torch.optim.Adam(block[:1])])


# -- param groups added after setup (BackboneFinetuning) ------------------------------------------------------


class Finetuned(WithOptimizer):
    @property
    def backbone(self) -> nn.Module:
        return self.model.model.layers


@pytest.mark.parametrize("name", ["adamw", "sgd-momentum"])
def test_backbone_finetuning_adds_a_group_that_steps_at_once(name):
    """The blocks frozen for epoch 0 and added as a param group at epoch 1 (the native path and a generic one)."""
    make = (lambda ps: torch.optim.AdamW(ps, lr=1e-2)) if name == "adamw" else OPTIMIZERS[name]
    batches = token_batches(2)
    a, b = twin(small)
    runs = []
    for model, strategy in ((a, "auto"), (b, "megatrain")):
        module = Finetuned(model, make)
        finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.5, verbose=False)
        fit(module, batches, strategy=strategy, max_epochs=2, callbacks=[finetuning])
        runs.append(module)
    ref, mt = runs
    assert len(mt.trainer.optimizers[0].param_groups) == 2
    assert mt.losses == ref.losses
    assert_same(mt.model, ref.model)
    assert not torch.equal(
        params_of(mt.model)["model.layers.0.mlp.up_proj.weight"],
        params_of(small())["model.layers.0.mlp.up_proj.weight"],
    )
