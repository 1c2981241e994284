"""Lightning's weight averaging callbacks under strategy='megatrain' (megatrain_lightning/lightning/averaging.py): the
averaged model, the weights handed back, validation with the average swapped in, checkpoints saved with it
and a resume from them are those of ordinary training, bit for bit (fp32 on the CPU, torch-op AdamW)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import (
    Callback,
    EMAWeightAveraging,
    ModelCheckpoint,
    StochasticWeightAveraging,
    WeightAveraging,
)
from torch import nn

from megatrain_lightning import MegatrainStrategy
from megatrain_lightning.engine.engine import Engine
from megatrain_lightning.lightning.convert import lightning_checkpoint, to_lightning
from megatrain_lightning.optim import kernels
from tests.async_streams import install
from tests.helpers import (
    CausalLM,
    hf_llama,
    hf_loss,
    loader,
    own_llama,
    own_loss,
    params_of,
    quiet,
    token_batches,
    trainer,
)

pytestmark = pytest.mark.usefixtures("torch_adam")

TRAIN, HELD_OUT = token_batches(3), token_batches(1, seed=5)


class RecordVal(Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self.values.append(float(trainer.callback_metrics["val_loss"]))


class OddSteps(WeightAveraging):
    """Another average and schedule: a fixed-weight moving average, after odd steps and at each epoch's end."""

    def __init__(self) -> None:
        super().__init__(avg_fn=lambda avg, p, n: avg + (p - avg) * 0.3)

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        return epoch_idx is not None or step_idx % 2 == 1

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:  # a hook of its own that writes the weights
        super().on_train_end(trainer, pl_module)
        with torch.no_grad():
            pl_module.model.lm_head.weight.mul_(0.5)


def fit_with(
    strategy: Any, callback: Callback, make=own_llama, loss=own_loss, layers: int = 2, **kwargs: Any
) -> tuple[CausalLM, list]:
    """Two epochs of 3 steps, validating after each (and a sanity check first); the val losses seen."""
    ckpt_path = kwargs.pop("ckpt_path", None)
    module, rec = CausalLM(make(layers), loss_fn=loss), RecordVal()
    callbacks = [callback, rec, *kwargs.pop("callbacks", [])]
    kwargs.setdefault("num_sanity_val_steps", 1)
    t = trainer(strategy, max_epochs=2, callbacks=callbacks, **kwargs)
    with quiet():
        t.fit(module, loader(TRAIN), loader(HELD_OUT), ckpt_path=ckpt_path)
    return module, rec.values


def averaged(callback: Callback) -> dict[str, torch.Tensor]:
    model = callback._average_model
    return params_of(model.module if isinstance(callback, WeightAveraging) else model)


def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and len(a) > 0
    for name in a:
        assert torch.equal(a[name], b[name]), name


def assert_runs_equal(ref: tuple, mt: tuple, validations: int = 3) -> None:
    """Final module weights, the averaged model and every validation loss."""
    (ref_module, ref_cb, ref_vals), (mt_module, mt_cb, mt_vals) = ref, mt
    assert_equal(params_of(mt_module.model), params_of(ref_module.model))
    assert_equal(averaged(mt_cb), averaged(ref_cb))
    assert len(ref_vals) == validations and mt_vals == ref_vals  # (by default a sanity check, then each epoch)


def checkpoint_at(directory: Path, epoch: int, sharded: bool) -> dict[str, Any]:
    (path,) = directory.glob(f"epoch={epoch}-*.ckpt")
    return lightning_checkpoint(str(path), optimizer=False) if sharded else torch.load(path, weights_only=False)


def assert_checkpoints_equal(ref: dict[str, Any], mt: dict[str, Any]) -> None:
    """The average as the state dict, the module's own weights beside it (WeightAveraging's layout)."""
    assert_equal(mt["state_dict"], ref["state_dict"])
    assert_equal(mt["current_model_state"], ref["current_model_state"])
    assert not all(torch.equal(ref["state_dict"][k], v) for k, v in ref["current_model_state"].items())


def test_ema_equals_ordinary_with_sharded_checkpoints_and_resume(tmp_path):
    """EMA: averaged model, final weights, validation with the average swapped in; each epoch's sharded
    checkpoint holds the average as its weights, and resuming from the first one finishes as if unbroken."""
    runs = {}
    for strategy in ("auto", "megatrain"):
        cb = EMAWeightAveraging(decay=0.5)
        saver = ModelCheckpoint(dirpath=tmp_path / strategy, save_top_k=-1)
        module, vals = fit_with(strategy, cb, callbacks=[saver], enable_checkpointing=True)
        runs[strategy] = (module, cb, vals)
    assert_runs_equal(runs["auto"], runs["megatrain"])
    for epoch in (0, 1):
        ref = checkpoint_at(tmp_path / "auto", epoch, sharded=False)
        assert_checkpoints_equal(ref, checkpoint_at(tmp_path / "megatrain", epoch, sharded=True))

    (first,) = (tmp_path / "megatrain").glob("epoch=0-*.ckpt")
    cb = EMAWeightAveraging(decay=0.5)
    module, _ = fit_with("megatrain", cb, ckpt_path=str(first))
    assert_equal(params_of(module.model), params_of(runs["auto"][0].model))
    assert_equal(averaged(cb), averaged(runs["auto"][1]))


def test_custom_weight_averaging_equals_ordinary(tmp_path, monkeypatch):
    """Another avg_fn and schedule, a hook of its own, a Hugging Face model, checkpoints in Lightning's format. Host steps made
    slow and copies run late: the average reads each block after its step, and the strategy waits for the
    host steps only where the average is updated."""
    install(monkeypatch, hold=1.0)  # a copy runs only once something waits for it
    adam_step = kernels.adam_step_
    monkeypatch.setattr(kernels, "adam_step_", lambda *a: time.sleep(0.01) or adam_step(*a))
    reads = []
    host_view = Engine.host_view
    monkeypatch.setattr(Engine, "host_view", lambda self, write=True: reads.append(write) or host_view(self, write))
    runs = {}
    for name, strategy in (
        ("auto", "auto"),
        ("megatrain", MegatrainStrategy(checkpoint_format="torch", overlap_optimizer=False)),
    ):
        cb, saver = OddSteps(), ModelCheckpoint(dirpath=tmp_path / name, save_top_k=-1)
        module, vals = fit_with(strategy, cb, hf_llama, hf_loss, 4, callbacks=[saver], enable_checkpointing=True)
        runs[name] = (module, cb, vals)
    assert_runs_equal(runs["auto"], runs["megatrain"])
    for epoch in (0, 1):
        ref = checkpoint_at(tmp_path / "auto", epoch, sharded=False)
        assert_checkpoints_equal(ref, checkpoint_at(tmp_path / "megatrain", epoch, sharded=False))
    # Of steps 0..5 the odd ones, and both epochs' ends: 5 updates; the 2 saves read the masters too.
    assert int(runs["megatrain"][1]._average_model.n_averaged) == 5
    assert reads.count(False) == 5 + 2


def test_swa_equals_ordinary():
    """SWA from the first epoch: the average at each epoch's start, SWALR's rates, the average copied in at
    the end (SWA does not swap it in for validation)."""
    runs = {}
    for strategy in ("auto", "megatrain"):
        cb = StochasticWeightAveraging(swa_lrs=5e-3, swa_epoch_start=1, annealing_epochs=1)
        module, vals = fit_with(strategy, cb)
        runs[strategy] = (module, cb, vals)
    assert_runs_equal(runs["auto"], runs["megatrain"])
    assert int(runs["megatrain"][1].n_averaged) == 2


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_average_reads_fp32_masters_under_bf16(precision):
    """In bf16 the average reads the fp32 masters, not the bf16 device copies of the embedding, head and
    norm: averaging 'the latest weights' gives exactly the weights a run without the callback ends with."""

    class Latest(WeightAveraging):
        def __init__(self) -> None:
            super().__init__(avg_fn=lambda avg, p, n: p)

    plain, _ = fit_with("megatrain", Callback(), precision=precision)
    cb = Latest()
    module, _ = fit_with("megatrain", cb, precision=precision)
    assert_equal(averaged(cb), params_of(plain))
    assert_equal(params_of(module.model), params_of(plain.model))


def test_swa_refuses_batch_norm():
    module = CausalLM(own_llama(2), loss_fn=own_loss)
    module.norm = nn.BatchNorm1d(4)
    t = trainer("megatrain", callbacks=[StochasticWeightAveraging(swa_lrs=1e-2)])
    with pytest.raises(ValueError, match="StochasticWeightAveraging on a model with BatchNorm") as err, quiet():
        t.fit(module, loader(TRAIN))
    assert "\n" not in str(err.value)


def test_ema_resumes_from_a_sharded_checkpoint_saved_without_it(tmp_path):
    """The average starts from the checkpoint's weights (WeightAveraging reads them from its state dict, which
    a sharded checkpoint holds in its shards): as ordinary training resuming from the same checkpoint."""
    module, saver = CausalLM(own_llama(2), loss_fn=own_loss), ModelCheckpoint(dirpath=tmp_path, filename="plain")
    with quiet():
        trainer("megatrain", callbacks=[saver], enable_checkpointing=True).fit(module, loader(TRAIN))
    to_lightning(str(tmp_path / "plain.ckpt"), tmp_path / "plain-torch.ckpt")
    runs = {}
    for strategy, path in (("auto", "plain-torch.ckpt"), ("megatrain", "plain.ckpt")):
        cb = EMAWeightAveraging(decay=0.5)
        module, vals = fit_with(strategy, cb, ckpt_path=str(tmp_path / path))
        runs[strategy] = (module, cb, vals)
    # The sanity check validates with the average loaded (the first update then copies the weights over it).
    assert_runs_equal(runs["auto"], runs["megatrain"], validations=2)
