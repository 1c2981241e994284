"""Hooks that read or edit gradients, clipping by value, and hyper-parameters on resume: strategy='megatrain'
trains exactly as ordinary training (``strategy="auto"`` with torch.optim.AdamW), bit for bit in fp32 with the
torch-op optimizer backend."""

from __future__ import annotations

import copy
import logging

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import LambdaCallback, LearningRateMonitor
from lightning.pytorch.utilities import grad_norm

from megatrain_lightning import Engine, EngineConfig
from megatrain_lightning.checkpoint import ModelCheckpoint as MegatrainCheckpoint
from megatrain_lightning.lightning.callbacks import ExportAndSample, MegatrainMonitor
from megatrain_lightning.lightning.strategy import gradient_hooks
from tests.helpers import (
    CausalLM,
    assert_same,
    fit,
    hf_llama,
    own_llama,
    own_loss,
    params_of,
    token_batches,
    trainer,
    twin,
)

pytestmark = pytest.mark.usefixtures("torch_adam")


class EditsGradients(CausalLM):
    """Edits gradients in every way a hook can (in place, by assignment, dropping one) and logs their norms."""

    def on_after_backward(self) -> None:
        blocks = self.model.model.layers
        blocks[1].mlp.up_proj.weight.grad.zero_()  # in place, a streamed block
        emb = self.model.model.embed_tokens.weight  # an outer parameter, by assignment
        emb.grad = emb.grad.clamp(-1e-3, 1e-3)
        blocks[0].input_layernorm.weight.grad = None  # dropped: not stepped (unless a later micro-batch adds one)
        for p in blocks[2].parameters():
            p.grad.mul_(torch.linspace(0.0, 2.0, p.numel()).view(p.shape))

    def on_before_optimizer_step(self, optimizer) -> None:
        self.log_dict(grad_norm(self, norm_type=2))
        optimizer.param_groups[0]["lr"] = 1e-2 / (1 + self.trainer.global_step)  # for this very step
        with torch.no_grad():  # weights too, a block's and an outer one (the step then updates them)
            self.model.model.layers[1].self_attn.q_proj.weight.clamp_(-0.03, 0.03)
            self.model.lm_head.weight.clamp_(-0.03, 0.03)


class GradNorms(L.Callback):
    """The logged gradient norms after each optimizer step."""

    def __init__(self) -> None:
        self.by_step: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_end(self, trainer, *args) -> None:
        logged = {k: v.clone() for k, v in trainer.callback_metrics.items() if k.startswith("grad_2.0_norm")}
        if logged:  # (none before the first step)
            self.by_step[trainer.global_step] = logged


def run_both(module_cls, batches, module_kwargs=None, **trainer_kwargs):
    a, b = twin(hf_llama)
    ref, mt = module_cls(a, **(module_kwargs or {})), module_cls(b, **(module_kwargs or {}))
    logged = GradNorms(), GradNorms()
    fit(ref, batches, strategy="auto", callbacks=[logged[0]], **trainer_kwargs)
    fit(mt, batches, strategy="megatrain", callbacks=[logged[1]], **trainer_kwargs)
    return ref, mt, logged


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(accumulate_grad_batches=2, gradient_clip_val=0.05),
        dict(accumulate_grad_batches=2, gradient_clip_val=1e-3, gradient_clip_algorithm="value"),
    ],
    ids=["plain", "accumulate-clip-norm", "accumulate-clip-value"],
)
def test_hooks_edit_and_read_gradients_as_in_ordinary_training(kwargs, caplog):
    with caplog.at_level(logging.INFO, logger="megatrain_lightning"):
        ref, mt, (logged_ref, logged_mt) = run_both(EditsGradients, token_batches(4), **kwargs)
    assert_same(ref, mt)
    assert len(logged_ref.by_step) == 4 // kwargs.get("accumulate_grad_batches", 1)
    assert logged_mt.by_step.keys() == logged_ref.by_step.keys()
    for step, norms in logged_ref.by_step.items():
        assert "grad_2.0_norm_total" in norms and len(norms) > 20
        assert logged_mt.by_step[step].keys() == norms.keys(), step
        assert all(torch.equal(logged_mt.by_step[step][k], v) for k, v in norms.items()), step
    notes = [r.getMessage() for r in caplog.records if "read or edit gradients" in r.getMessage()]
    assert len(notes) == 1 and "EditsGradients.on_after_backward, EditsGradients.on_before_optimizer_step" in notes[0]
    assert "4 bytes/param" in notes[0]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_clipping_by_value_equals_ordinary_training(accumulate):
    ref, mt, _ = run_both(
        CausalLM,
        token_batches(4),
        accumulate_grad_batches=accumulate,
        gradient_clip_val=2e-3,
        gradient_clip_algorithm="value",
    )
    assert_same(ref, mt)
    unclipped = CausalLM(hf_llama())
    fit(unclipped, token_batches(4), strategy="auto", accumulate_grad_batches=accumulate)
    assert not torch.equal(params_of(unclipped.model)["lm_head.weight"], params_of(mt.model)["lm_head.weight"])


def test_only_overriding_hooks_make_gradients_visible():
    """Lightning's own callbacks (the Trainer's defaults and the usual ones) and this project's do not count."""

    class Reads(L.Callback):
        def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
            pass

    usual = [LearningRateMonitor(), LambdaCallback(on_train_start=print), MegatrainMonitor(), ExportAndSample()]
    t = trainer(callbacks=usual, enable_progress_bar=True, enable_model_summary=True, enable_checkpointing=True)
    t.strategy.connect(CausalLM(hf_llama(layers=1)))  # (fit connects the module this way)
    assert len(t.callbacks) >= 7
    assert gradient_hooks(t) == []
    t.callbacks += [Reads(), LambdaCallback(on_after_backward=print)]
    assert gradient_hooks(t) == ["Reads.on_before_optimizer_step", "LambdaCallback.on_after_backward"]
    t.strategy.connect(EditsGradients(hf_llama(layers=1)))
    assert gradient_hooks(t)[:2] == ["EditsGradients.on_after_backward", "EditsGradients.on_before_optimizer_step"]


def edit(model: torch.nn.Module) -> None:
    """In place in a block, by assignment on the head, dropping the final norm's."""
    for p in model.model.layers[0].parameters():
        p.grad.mul_(0.5)
    model.lm_head.weight.grad = model.lm_head.weight.grad.sign() * 1e-3
    model.model.norm.weight.grad = None


def test_plain_loop_reads_and_edits_gradients():
    """The engine's own calls, as a plain loop uses them: accumulation 2, an edit after every backward."""
    ref, model = twin(lambda: own_llama(layers=2))
    batches = token_batches(4, seq=16)
    adamw = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    engine = Engine(model, EngineConfig(precision="32-true"))
    opt = engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    for i, batch in enumerate(batches):
        own_loss(ref, batch).backward()
        edit(ref)
        with engine.backward(accumulate=i % 2 == 0, visible=True):
            own_loss(model, batch).backward()
        with engine.gradients_visible():
            edit(model)
        if i % 2:
            adamw.step()
            adamw.zero_grad()
            opt.step()
            opt.zero_grad()
    engine.close()
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("accumulate", [1, 2])
def test_clipping_by_value_said_before_backward_keeps_the_overlap(accumulate):
    """A plain loop names the clip before the last backward: the units step as their gradients land (clamped
    on the device, or a sum of micro-batches on the host), still equal to torch's clip_grad_value_."""
    ref, model = twin(lambda: own_llama(layers=2))
    adamw = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    engine = Engine(model, EngineConfig(precision="32-true"))
    opt = engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    for step in range(2):
        for micro, batch in enumerate(token_batches(accumulate, seq=16, seed=step)):
            own_loss(ref, batch).backward()
            last = micro == accumulate - 1
            if last:
                engine.clip_grad_value_(2e-3)
            with engine.backward(accumulate=not last, clip="value"):
                own_loss(model, batch).backward()
        engine.flush()
        assert all(s == [step + 1] * len(s) for s in (u.steps for u in engine.all_units())), "stepped in backward"
        torch.nn.utils.clip_grad_value_(ref.parameters(), 2e-3)
        adamw.step()
        adamw.zero_grad()
        engine.clip_grad_value_(2e-3)  # (what Lightning says after backward: nothing more to do)
        opt.step()
        opt.zero_grad()
    engine.close()
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name


class Resumed(CausalLM):
    """Records the hyper-parameters each optimizer step runs with."""

    def __init__(self, *args, betas=(0.9, 0.95), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.betas, self.seen = betas, []

    def configure_optimizers(self):
        config = super().configure_optimizers()
        opt = config["optimizer"] if isinstance(config, dict) else config
        for group in opt.param_groups:
            group["betas"] = self.betas
        return config

    def on_train_batch_start(self, batch, batch_idx) -> None:
        groups = self.trainer.optimizers[0].param_groups
        self.seen.append([{k: v for k, v in g.items() if k != "params"} for g in groups])


@pytest.mark.parametrize("schedule", [None, 8], ids=["constant", "scheduled"])
def test_changed_hyper_parameters_on_resume_as_in_ordinary_training(tmp_path, schedule):
    """configure_optimizers asks for other lr, weight_decay and betas on resume: what ordinary training does
    (the checkpoint's param groups and scheduler state win) is what the strategy does, from its sharded
    checkpoint and from Lightning's single file that ``trainer.save_checkpoint`` writes after fit."""
    batches = token_batches(2)
    first, again = dict(lr=1e-2, weight_decay=0.1), dict(lr=3e-3, weight_decay=0.0, betas=(0.8, 0.9))
    runs = {}
    for strategy, after_fit in (("auto", False), ("megatrain", False), ("megatrain", True)):
        model, path = hf_llama(), tmp_path / f"{strategy}-{after_fit}" / "last.ckpt"
        saves = MegatrainCheckpoint(dirpath=str(path.parent), save_last=True)
        start = Resumed(model, schedule=schedule, **first)
        t = fit(start, batches, strategy=strategy, callbacks=[saves], enable_checkpointing=True)
        if after_fit:  # (the strategy's buffers are released: this writes Lightning's single file)
            path = tmp_path / "after-fit.ckpt"
            t.save_checkpoint(path)
        resumed = Resumed(copy.deepcopy(model), schedule=schedule, **again)
        fit(resumed, batches, strategy=strategy, max_epochs=2, ckpt_path=str(path))
        runs[strategy, after_fit] = resumed
    ref = runs["auto", False]
    assert ref.seen[0][0]["lr"] != again["lr"] and len(ref.seen) == 2  # the checkpoint's values won
    for mt in runs["megatrain", False], runs["megatrain", True]:
        assert mt.seen == ref.seen  # every setting, with its type (betas a tuple)
        assert_same(ref, mt)
