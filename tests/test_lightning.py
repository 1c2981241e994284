"""strategy='megatrain' as a Lightning citizen: checkpoints and resume, validate/predict, loggers and
callbacks, the model handed back after fit, clear errors for what it does not support, and resolution
of ``Trainer(strategy="megatrain")``.

Equalities with ordinary training are bitwise: fp32 on the CPU with the torch-op optimizer backend.
"""

from __future__ import annotations

import copy
import csv
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn

import megatrain_lightning
import megatrain_lightning.engine.build as build_module
from megatrain_lightning import HostMemoryError, MegatrainStrategy
from megatrain_lightning.lightning.precision import MegatrainPrecision
from tests.helpers import (
    VOCAB,
    CausalLM,
    fit,
    hf_llama,
    hf_loss,
    loader,
    params_of,
    quiet,
    token_batches,
    trainer,
    twin,
    warmup_cosine,
)


def layers_of(module: CausalLM) -> nn.ModuleList:
    return module.model.model.layers


def assert_params_equal(a: nn.Module, b: nn.Module) -> None:
    pa, pb = params_of(a), params_of(b)
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


# -- 1. resume is exact ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["sharded", "torch"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_resume_from_checkpoint_is_exact(accumulate, fmt, tmp_path, torch_adam):
    """2 epochs straight == 1 epoch, save last.ckpt, resume a fresh copy of the initial model for epoch 2."""
    batches = token_batches(10)
    module_kwargs = dict(split_decay=True, schedule=20)
    trainer_kwargs = dict(gradient_clip_val=1.0, accumulate_grad_batches=accumulate)
    a, b = twin(hf_llama)
    c = copy.deepcopy(b)

    straight = CausalLM(a, **module_kwargs)
    fit(straight, batches, max_epochs=2, **trainer_kwargs)

    first = CausalLM(b, **module_kwargs)
    ckpt_cb = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_epochs=1)
    strategy = MegatrainStrategy(checkpoint_format=fmt)
    fit(
        first,
        batches,
        strategy=strategy,
        max_epochs=1,
        enable_checkpointing=True,
        callbacks=[ckpt_cb],
        **trainer_kwargs,
    )
    assert (tmp_path / "last.ckpt").is_file()
    assert first.losses == straight.losses[:10]

    resumed = CausalLM(c, **module_kwargs)
    t = trainer(strategy=MegatrainStrategy(checkpoint_format=fmt), max_epochs=2, **trainer_kwargs)
    with quiet():
        t.fit(resumed, loader(batches), ckpt_path=tmp_path / "last.ckpt")
    assert t.global_step == 20 // accumulate
    assert len(resumed.losses) == 10
    assert resumed.losses == straight.losses[10:]
    assert_params_equal(resumed.model, straight.model)


# -- 2. checkpoint_format="torch" writes an ordinary Lightning checkpoint -------------------------------


def _checkpointed_fit(module: CausalLM, batches, strategy: Any, dirpath: Path, **kwargs) -> tuple[L.Trainer, dict]:
    if strategy == "megatrain":
        strategy = MegatrainStrategy(checkpoint_format="torch")
    cb = ModelCheckpoint(dirpath=dirpath, save_last=True, every_n_epochs=1)
    t = fit(module, batches, strategy=strategy, enable_checkpointing=True, callbacks=[cb], **kwargs)
    return t, torch.load(dirpath / "last.ckpt", weights_only=False, map_location="cpu")


def test_checkpoint_is_portable_to_plain_torch(tmp_path, torch_adam):
    """state_dict: fp32 tensors under the plain module's keys; optimizer_states[0] loads into torch AdamW."""
    batches = token_batches(6)
    a, b = twin(hf_llama)
    plain = CausalLM(copy.deepcopy(a), split_decay=True)  # never trained, never touched by a strategy
    ref, mt = CausalLM(a, split_decay=True), CausalLM(b, split_decay=True)
    ref_trainer, ref_ckpt = _checkpointed_fit(ref, batches, "auto", tmp_path / "ref", gradient_clip_val=1.0)
    _, ckpt = _checkpointed_fit(mt, batches, "megatrain", tmp_path / "mt", gradient_clip_val=1.0)

    state = ckpt["state_dict"]
    assert list(state.keys()) == list(plain.state_dict().keys())
    for key, value in state.items():
        assert isinstance(value, torch.Tensor) and value.dtype == torch.float32, key
        assert value.device.type == "cpu", key
        assert torch.equal(value, ref_ckpt["state_dict"][key]), key

    # Load the whole checkpoint into plain torch: weights into the model, optimizer state into AdamW.
    plain.load_state_dict(state)
    opt = plain.configure_optimizers()
    assert type(opt) is torch.optim.AdamW
    assert len(ckpt["optimizer_states"]) == 1
    opt.load_state_dict(ckpt["optimizer_states"][0])
    assert ckpt["optimizer_states"][0]["param_groups"] == ref_ckpt["optimizer_states"][0]["param_groups"]

    ref_opt = ref_trainer.optimizers[0]
    ref_params = dict(ref.named_parameters())
    for name, p in plain.named_parameters():
        mine, theirs = opt.state[p], ref_opt.state[ref_params[name]]
        assert torch.equal(mine["step"], theirs["step"]), name
        assert torch.equal(mine["exp_avg"], theirs["exp_avg"]), name
        assert torch.equal(mine["exp_avg_sq"], theirs["exp_avg_sq"]), name
        assert torch.equal(p, ref_params[name]), name

    # And the restored plain optimizer keeps going exactly like the ordinary one.
    batch = token_batches(1, seed=7)[0]
    for module, optimizer in ((plain, opt), (ref, ref_opt)):
        optimizer.zero_grad()
        hf_loss(module.model, batch).backward()
        optimizer.step()
    assert_params_equal(plain.model, ref.model)


@pytest.mark.parametrize("first,second", [("megatrain", "auto"), ("auto", "megatrain")])
def test_resume_across_strategies_is_exact(first, second, tmp_path, torch_adam):
    """A checkpoint written by one strategy resumes under the other, bitwise like an uninterrupted run."""
    batches = token_batches(6)
    kwargs = dict(split_decay=True, schedule=12)
    a, b = twin(hf_llama)
    c = copy.deepcopy(b)
    straight = CausalLM(a, **kwargs)
    fit(straight, batches, strategy="auto", max_epochs=2)

    _checkpointed_fit(CausalLM(b, **kwargs), batches, first, tmp_path)
    resumed = CausalLM(c, **kwargs)
    t = trainer(
        strategy=MegatrainStrategy(checkpoint_format="torch") if second == "megatrain" else second, max_epochs=2
    )
    with quiet():
        t.fit(resumed, loader(batches), ckpt_path=tmp_path / "last.ckpt")
    assert resumed.losses == straight.losses[6:]
    assert_params_equal(resumed.model, straight.model)


# -- 3. validate / predict ---------------------------------------------------------------------------


def _validate_and_predict(t: L.Trainer, module: CausalLM, batches) -> tuple[list[dict], list[torch.Tensor]]:
    with quiet():
        val = t.validate(module, loader(batches), verbose=False)
        pred = t.predict(module, loader(batches))
    return val, pred


def _assert_same_eval(got, want) -> None:
    (val, pred), (ref_val, ref_pred) = got, want
    assert len(val) == 1 and set(val[0]) == {"val_loss"}
    assert val == ref_val
    assert len(pred) == len(ref_pred) > 0
    for x, y in zip(pred, ref_pred):
        assert torch.equal(x, y)


def test_validate_and_predict_without_fit_equal_ordinary():
    batches = token_batches(3, seed=5)
    a, b = twin(hf_llama)
    ref, mt = CausalLM(a), CausalLM(b)
    want = _validate_and_predict(trainer("auto"), ref, batches)
    got = _validate_and_predict(trainer("megatrain"), mt, batches)
    _assert_same_eval(got, want)
    assert_params_equal(mt.model, ref.model)  # evaluation changed nothing
    assert all("forward" not in layer.__dict__ for layer in layers_of(mt))


def test_validate_and_predict_after_fit_equal_ordinary(torch_adam):
    train, held_out = token_batches(6), token_batches(3, seed=5)
    a, b = twin(hf_llama)
    ref, mt = CausalLM(a, split_decay=True), CausalLM(b, split_decay=True)
    t_ref, t_mt = trainer("auto"), trainer("megatrain")
    with quiet():
        t_ref.fit(ref, loader(train))
        t_mt.fit(mt, loader(train))
    assert mt.losses == ref.losses
    _assert_same_eval(_validate_and_predict(t_mt, mt, held_out), _validate_and_predict(t_ref, ref, held_out))


class RecordVal(Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.values.append(float(trainer.callback_metrics["val_loss"]))


def test_validation_during_fit_logs_ordinary_val_loss(torch_adam):
    train, held_out = token_batches(10), token_batches(2, seed=5)
    a, b = twin(hf_llama)
    runs = {}
    for strategy, model in (("auto", a), ("megatrain", b)):
        module, rec = CausalLM(model, split_decay=True, schedule=10), RecordVal()
        t = trainer(strategy, val_check_interval=5, num_sanity_val_steps=2, callbacks=[rec])
        with quiet():
            t.fit(module, loader(train), loader(held_out))
        runs[strategy] = (module, rec.values)
    (ref, ref_vals), (mt, mt_vals) = runs["auto"], runs["megatrain"]
    assert len(ref_vals) == 2 and all(math.isfinite(v) for v in ref_vals)
    assert mt_vals == ref_vals
    assert mt.losses == ref.losses
    assert_params_equal(mt.model, ref.model)


# -- 4. an ordinary model again after fit -------------------------------------------------------------


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_fit_hands_back_an_ordinary_fp32_model(precision, torch_adam):
    batches = token_batches(4)
    a, b = twin(hf_llama)
    ref, mt = CausalLM(a), CausalLM(b)
    fit(ref, batches, strategy="auto", gradient_clip_val=1.0)
    fit(mt, batches, strategy="megatrain", precision=precision, gradient_clip_val=1.0)

    for name, p in mt.named_parameters():
        assert type(p) is nn.Parameter and p.dtype == torch.float32 and p.device.type == "cpu", name
        assert p.requires_grad and p.grad is None, name
    for name, buf in mt.named_buffers():
        assert buf.device.type == "cpu", name
    for layer in layers_of(mt):
        assert "forward" not in layer.__dict__
        assert type(layer).forward is layer.forward.__func__

    # A plain forward and backward (no hooks left behind: every parameter receives its .grad).
    batch = token_batches(1, seed=9)[0]
    mt.model.zero_grad()
    out = mt.model(input_ids=batch, labels=batch)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert all(p.grad is not None for p in mt.parameters())
    if precision == "32-true":
        ref.model.zero_grad()
        ref_out = ref.model(input_ids=batch, labels=batch)
        ref_out.loss.backward()
        assert torch.equal(out.logits, ref_out.logits)
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        for n, p in mt.named_parameters():
            assert torch.equal(p.grad, ref_grads[n]), n


# -- 5. loggers, progress bar, LR monitor -------------------------------------------------------------


class LoggingLM(CausalLM):
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, prog_bar=True)
        return loss


def _csv_rows(t: L.Trainer) -> list[dict[str, str]]:
    with open(Path(t.logger.log_dir) / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def _logged_run(strategy: str, model: nn.Module, batches, tmp_path: Path, schedule: int | None):
    module = LoggingLM(model, split_decay=True, schedule=schedule)
    t = trainer(
        strategy,
        logger=CSVLogger(tmp_path / strategy),
        log_every_n_steps=1,
        enable_progress_bar=True,
        callbacks=[LearningRateMonitor(logging_interval="step")],
    )
    with quiet():
        t.fit(module, loader(batches))
    return t, module, _csv_rows(t)


def _column(rows: list[dict[str, str]], key: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[key])) for r in rows if r.get(key)]


def test_csv_logger_progress_bar_and_lr_monitor(tmp_path, torch_adam):
    steps = 8
    batches = token_batches(steps)
    a, b = twin(hf_llama)
    t_ref, ref, ref_rows = _logged_run("auto", a, batches, tmp_path, schedule=steps)
    t_mt, mt, rows = _logged_run("megatrain", b, batches, tmp_path, schedule=steps)

    losses = _column(rows, "train_loss")
    assert [s for s, _ in losses] == list(range(steps))  # one row per step
    assert all(math.isfinite(v) for _, v in losses)
    assert losses == _column(ref_rows, "train_loss")
    assert [v for _, v in losses] == pytest.approx(mt.losses, rel=1e-6)
    assert t_mt.progress_bar_callback is not None
    assert math.isfinite(float(t_mt.progress_bar_metrics["train_loss"]))

    schedule = warmup_cosine(3, steps)
    for key in ("lr-AdamW/pg1", "lr-AdamW/pg2"):
        lrs = _column(rows, key)
        assert lrs == _column(ref_rows, key)
        assert [s for s, _ in lrs] == list(range(steps))
        assert [v for _, v in lrs] == pytest.approx([1e-2 * schedule(s) for s in range(steps)], rel=1e-12)


@pytest.mark.parametrize("schedule", [None, 4], ids=["no-scheduler", "scheduler"])
def test_lr_monitor_keys_equal_ordinary(schedule, tmp_path):
    batches = token_batches(4)
    a, b = twin(hf_llama)
    _, _, ref_rows = _logged_run("auto", a, batches, tmp_path, schedule=schedule)
    _, _, rows = _logged_run("megatrain", b, batches, tmp_path, schedule=schedule)
    ref_keys = {k for k in ref_rows[0] if k.startswith("lr-")}
    assert ref_keys  # the ordinary run logs lr under lr-AdamW/pg1, lr-AdamW/pg2
    assert {k for k in rows[0] if k.startswith("lr-")} == ref_keys


# -- 6. clear errors -----------------------------------------------------------------------------------


def _fit_raises(module: L.LightningModule, exc: type[BaseException], match: str, **kwargs: Any) -> None:
    with pytest.raises(exc, match=match):
        fit(module, token_batches(2), **kwargs)


def _assert_ordinary(module: CausalLM) -> None:
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in module.parameters())
    assert all("forward" not in layer.__dict__ for layer in layers_of(module))


def test_a_non_adam_optimizer_trains_as_ordinary_training():
    """Once refused; now SGD steps itself on the host masters (engine/generic_optim.py), bit for bit."""

    class SGDModule(CausalLM):
        def configure_optimizers(self):
            return torch.optim.SGD(self.model.parameters(), lr=0.1)

    a, b = twin(hf_llama)
    ref, mt = SGDModule(a), SGDModule(b)
    fit(ref, token_batches(2), strategy="auto")
    fit(mt, token_batches(2))
    assert mt.losses == ref.losses
    assert_params_equal(mt.model, ref.model)
    _assert_ordinary(mt)  # the trained model handed back


def test_two_optimizers_train_as_ordinary_training():
    # With automatic optimization Lightning itself refuses several optimizers first; with manual
    # optimization they reach the strategy, which steps each over its own parameters (once refused).
    class TwoOptimizers(CausalLM):
        def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
            loss = self.loss_fn(self.model, batch)
            self.losses.append(loss.item())
            for opt in self.optimizers():
                opt.zero_grad()
            self.manual_backward(loss)
            for opt in self.optimizers():
                opt.step()

        def configure_optimizers(self):
            head = list(self.model.lm_head.parameters())
            rest = [p for p in self.model.parameters() if all(p is not q for q in head)]
            return [torch.optim.AdamW(rest, lr=1e-2), torch.optim.SGD(head, lr=0.1)]

    a, b = twin(hf_llama)
    ref, mt = TwoOptimizers(a, manual=1), TwoOptimizers(b, manual=1)
    fit(ref, token_batches(2), strategy="auto")
    fit(mt, token_batches(2))
    assert mt.losses == ref.losses
    assert_params_equal(mt.model, ref.model)


# "16-mixed" never reaches the strategy on a CPU: Lightning rewrites it to "bf16-mixed" with a warning
# (fp16 AMP is not supported on CPU), so the fp16 and fp64 refusals are tested with "16-true"/"64-true".
@pytest.mark.parametrize("precision", ["16-true", "64-true"])
def test_rejects_unsupported_precision(precision):
    with pytest.raises(ValueError, match=rf"precision='{precision}' is not supported.*bf16-mixed"):
        trainer(precision=precision)


def test_rejects_model_without_repeated_blocks():
    class Flat(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB))

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return nn.functional.cross_entropy(self.net(batch).flatten(0, 1), batch.flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

    _fit_raises(Flat(), ValueError, r"repeated blocks.*nn\.ModuleList")


def test_amsgrad_trains_as_ordinary_training():
    """Once refused; AdamW(amsgrad=True) now steps itself on the host masters, bit for bit."""

    class AmsgradModule(CausalLM):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), amsgrad=True)

    a, b = twin(hf_llama)
    ref, mt = AmsgradModule(a), AmsgradModule(b)
    fit(ref, token_batches(2), strategy="auto")
    fit(mt, token_batches(2))
    assert mt.losses == ref.losses
    assert_params_equal(mt.model, ref.model)


def test_host_memory_check(monkeypatch):
    monkeypatch.setattr(build_module, "available_host_bytes", lambda: 1024)
    module = CausalLM(hf_llama())
    _fit_raises(module, HostMemoryError, r"GiB of host memory")
    _assert_ordinary(module)


def test_rejects_single_slot():
    with pytest.raises(ValueError, match="num_slots=1.*at least 2 slots"):
        MegatrainStrategy(num_slots=1)
    with pytest.raises(ValueError, match="num_slots='max'.*or 'auto'"):
        MegatrainStrategy(num_slots="max")
    assert MegatrainStrategy().num_slots == "auto"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"nvme_dir": ""}, r"^nvme_dir='': give a directory on a local drive .*, or leave nvme_dir unset \(None\)"),
        ({"recompute": "yes"}, r"^recompute='yes': choose True"),
        ({"storage_options": "key=abc"}, r"^storage_options is a str, not a mapping of option names: give a dict"),
        ({"storage_options": {"key": "<redacted>"}}, r"^storage_options\['key'\] is '<redacted>', the placeholder"),
    ],
)
def test_empty_or_wrongly_typed_options_are_refused_at_construction(options, message):
    """Refused where they enter, not at the first save (storage_options) or never (an empty nvme_dir turned
    the NVMe tier off); the message never quotes a storage_options value (it may be a credential)."""
    with pytest.raises(ValueError, match=message) as err:
        MegatrainStrategy(**options)
    assert "\n" not in str(err.value) and "abc" not in str(err.value)
    assert MegatrainStrategy(storage_options={"profile": "ci"}).storage_options == {"profile": "ci"}


# -- 7. Trainer(strategy="megatrain") -----------------------------------------------------------------


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true", "32-true"])
def test_trainer_resolves_strategy_and_precision(precision):
    with quiet():
        t = L.Trainer(strategy="megatrain", precision=precision, logger=False)
    assert isinstance(t.strategy, megatrain_lightning.MegatrainStrategy)
    assert t.strategy.root_device == torch.device("cpu")
    assert t.precision == precision
    plugin = t.strategy.precision_plugin
    assert isinstance(plugin, MegatrainPrecision)
    assert plugin.compute_dtype == (torch.float32 if precision == "32-true" else torch.bfloat16)
