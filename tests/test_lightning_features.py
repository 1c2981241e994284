"""Lightning's own tools give the same result under strategy="megatrain" as under ordinary training.

Each test runs one Lightning feature twice on identical copies of a tiny Llama with identical batches, once
with ``strategy="auto"`` (ordinary training, torch.optim.AdamW) and once with ``strategy="megatrain"``, fp32
on the CPU with the torch optimizer backend, and compares bitwise: what the feature reports (the learning
rate finder's curve and suggestion, the epoch EarlyStopping stops at, ModelCheckpoint's best scores) and
the weights it leaves. Covered elsewhere: EMA/SWA (tests/test_averaging.py), gradient norms and clipping by
value (tests/test_grad_hooks.py), top-k deletion without a monitor (tests/test_checkpoint.py).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, GradientAccumulationScheduler, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.tuner import Tuner

from tests.helpers import (
    CausalLM,
    assert_same,
    assert_same_params,
    fit,
    hf_llama,
    loader,
    quiet,
    token_batches,
    trainer,
)

pytestmark = pytest.mark.usefixtures("torch_adam")

STRATEGIES = ("auto", "megatrain")


def runs(make: Any) -> dict[str, Any]:
    """`make(strategy)` for ordinary training and for megatrain, from the same global RNG state."""
    out = {}
    for strategy in STRATEGIES:
        torch.manual_seed(0)
        out[strategy] = make(strategy)
    return out


def test_lr_find_gives_the_same_curve_suggestion_and_restored_weights(tmp_path):
    """lr_find trains `num_training` steps on an exponential lr ramp, then restores the weights it saved
    before: the recorded curve, the suggested lr and the restored weights must all be ordinary training's.
    A fit on the same Trainer afterwards (the usual next call) trains with the suggested lr as ordinary
    training does, from the restored weights and a fresh optimizer."""

    def run(strategy: str) -> tuple[CausalLM, Any, CausalLM]:
        module = CausalLM(hf_llama(layers=2), lr=1e-3)
        t = trainer(strategy, default_root_dir=tmp_path / strategy)
        with quiet():
            finder = Tuner(t).lr_find(
                module, train_dataloaders=loader(token_batches(16)), min_lr=1e-5, max_lr=1e-1, num_training=16
            )
        restored = copy.deepcopy(module)
        with quiet():
            t.fit(module, loader(token_batches(2, seed=3)))
        return restored, finder, module

    r = runs(run)
    (a, fa, fit_a), (b, fb, fit_b) = r["auto"], r["megatrain"]
    assert fa.results["loss"] == fb.results["loss"] and len(fa.results["loss"]) == 16
    assert fa.results["lr"] == fb.results["lr"]
    assert fa.suggestion() == fb.suggestion() and a.lr == b.lr == fa.suggestion()
    assert_same_params(a, b)
    assert_same_params(a, CausalLM(hf_llama(layers=2)))  # restored: the weights before lr_find
    assert not list(tmp_path.rglob(".lr_find*"))  # its temporary checkpoint removed, sharded or not
    assert_same(fit_a, fit_b)


def test_max_time_generous_trains_as_without_and_zero_stops_before_the_first_step():
    """max_time is measured on the wall clock, so a budget that runs out mid-fit stops at a step that depends
    on the machine's load. Two deterministic cases instead: a budget far beyond the fit changes nothing (the
    same losses and weights as ordinary training without one), and a zero budget stops both strategies at
    the first check, after the same number of steps (none, with Lightning's check before the first batch),
    finished rather than interrupted, with the same weights."""
    batches = token_batches(3)
    plain = runs(lambda s: fit(CausalLM(hf_llama(layers=2)), batches, s).lightning_module)
    timed = runs(lambda s: fit(CausalLM(hf_llama(layers=2)), batches, s, max_time={"hours": 1}).lightning_module)
    assert_same(plain["auto"], timed["megatrain"])
    assert_same(timed["auto"], timed["megatrain"])
    zero = runs(lambda s: fit(CausalLM(hf_llama(layers=2)), batches, s, max_time={"seconds": 0}))
    steps = {s: t.global_step for s, t in zero.items()}
    assert steps["auto"] == steps["megatrain"] < len(batches)
    assert all(t.state.status == TrainerStatus.FINISHED for t in zero.values())
    a, b = zero["auto"].lightning_module, zero["megatrain"].lightning_module
    assert a.losses == b.losses and len(a.losses) == steps["auto"]
    assert_same_params(a, b)


def test_early_stopping_stops_at_the_same_epoch_with_the_same_weights():
    """A learning rate high enough that val_loss rises after the first epoch: with patience 1 both strategies
    stop at the same epoch, before max_epochs, with the same weights."""
    batches, val = token_batches(2), token_batches(1, seed=2)

    def run(strategy: str) -> Any:
        module = CausalLM(hf_llama(layers=2), lr=0.2, weight_decay=0.0)
        t = trainer(strategy, max_epochs=8, callbacks=[EarlyStopping("val_loss", patience=1)])
        with quiet():
            t.fit(module, loader(batches), loader(val))
        return t

    r = runs(run)
    a, b = r["auto"], r["megatrain"]
    assert a.current_epoch == b.current_epoch < 8 and a.should_stop and b.should_stop
    assert_same(a.lightning_module, b.lightning_module)


def test_model_checkpoint_top_k_on_a_monitored_metric_keeps_the_same_best(tmp_path):
    """save_top_k=2 on val_loss over four epochs: the same best scores, kept files and best file name. The
    validation batch is a training batch, so val_loss falls and later epochs replace (delete) earlier ones."""
    batches = token_batches(2)
    val = batches[:1]

    def run(strategy: str) -> Any:
        cb = ModelCheckpoint(dirpath=tmp_path / strategy, monitor="val_loss", save_top_k=2, filename="{epoch}")
        t = trainer(strategy, max_epochs=4, enable_checkpointing=True, callbacks=[cb])
        with quiet():
            t.fit(CausalLM(hf_llama(layers=2), lr=0.05), loader(batches), loader(val))
        return t, cb

    r = runs(run)
    (ta, a), (tb, b) = r["auto"], r["megatrain"]
    names = {s: {p.rsplit("/", 1)[-1]: float(v) for p, v in cb.best_k_models.items()} for s, (_, cb) in r.items()}
    assert names["auto"] == names["megatrain"] and len(names["auto"]) == 2
    assert "epoch=0.ckpt" not in names["auto"]  # the first save, later deleted by top-k
    assert a.best_model_path.rsplit("/", 1)[-1] == b.best_model_path.rsplit("/", 1)[-1]
    assert float(a.best_model_score) == float(b.best_model_score)
    # A megatrain checkpoint is a marker file and its shard folder: the two kept ones whole, the others gone whole.
    kept = {p.name for p in (tmp_path / "megatrain").iterdir()}
    assert kept == {n + suffix for n in names["megatrain"] for suffix in ("", ".d")}, (kept, names)
    assert_same(ta.lightning_module, tb.lightning_module)


def test_gradient_accumulation_scheduler_trains_the_same_over_two_epochs():
    """{0: 1, 1: 2}: one micro-batch per step in the first epoch, two in the second."""
    batches = token_batches(4)
    r = runs(
        lambda s: fit(
            CausalLM(hf_llama(layers=2)),
            batches,
            s,
            max_epochs=2,
            callbacks=[GradientAccumulationScheduler({0: 1, 1: 2})],
        )
    )
    assert r["auto"].global_step == r["megatrain"].global_step == 4 + 2
    assert_same(r["auto"].lightning_module, r["megatrain"].lightning_module)
