"""One trial: one ``Trainer(strategy="megatrain")`` in one process, resumable from shared storage.

A trial's files live under ``<storage>/<sweep>/trials/<trial_id>/``; the trial id is stable across
Ray's retries and across restoring the sweep, so a restarted trial finds its own ``checkpoints/last.ckpt``
and resumes from it instead of from step 0. Each attempt that gets to training also leaves
``attempts/<time_ns>.json`` (named by the nanosecond time it started, so names sort in order; it holds
``pid``, ``start_step`` and ``time``) so a person, or a test, can see what was retried and from where.

:func:`run_trial` needs no Ray; :func:`tune_trainable` wraps it for Ray Tune.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import fsspec

from megatrain_lightning.checkpoint import is_checkpoint
from megatrain_lightning.engine import NVME_SCRATCH_PREFIX, usable_cpus

if TYPE_CHECKING:
    from megatrain_lightning.lightning.strategy import MegatrainStrategy

Report = Callable[[dict[str, Any]], None]
CHECKPOINT = "model.ckpt"  # a Ray Train run's checkpoint name inside each reported directory (ray_jobs/train.py)


def checkpoint_dir(step: int) -> str:
    """A Ray Train run's reported directory of its checkpoint at optimizer step `step`, within the run's."""
    return f"checkpoints/step-{step:08d}"


def trial_strategy(options: dict[str, Any] | None, trial_dir: str) -> MegatrainStrategy:
    """The trial's strategy from :func:`ray_jobs.resources.strategy_options` (None: the defaults).

    `host_threads` is capped at the cores of this node (a node may declare more CPUs to Ray than it has).
    With `nvme_dir`, the moments go to ``<nvme_dir>/megatrain-trial-<trial id>``. The engine already makes a
    fresh scratch directory of its own in there, so concurrent trials on one node never share files; the
    per-trial directory is for the attempts of one trial: an attempt killed outright (out of memory, node
    agent) leaves its scratch files behind (8 B/param), and the next attempt of the same trial, which Ray
    starts only after the previous one is gone, removes them before the engine checks the free space.
    """
    from megatrain_lightning.lightning.strategy import MegatrainStrategy

    options = dict(options or {})
    if options.get("host_threads"):
        options["host_threads"] = min(options["host_threads"], len(usable_cpus()))
    if options.get("nvme_dir"):
        options["nvme_dir"] = _trial_scratch(options["nvme_dir"], trial_dir.rstrip("/").rsplit("/", 1)[-1])
    return MegatrainStrategy(**options)


def _trial_scratch(nvme_dir: str, trial_id: str) -> str:
    """This trial's directory inside `nvme_dir`, emptied of earlier attempts' scratch (see trial_strategy).
    A missing `nvme_dir` is left for the engine to report (it names the bytes needed and the fix)."""
    if not os.path.isdir(nvme_dir):
        return nvme_dir
    own = os.path.join(nvme_dir, f"megatrain-trial-{trial_id}")
    os.makedirs(own, exist_ok=True)
    for name in os.listdir(own):
        if name.startswith(NVME_SCRATCH_PREFIX):
            shutil.rmtree(os.path.join(own, name), ignore_errors=True)
    return own


def run_trial(
    run: dict[str, Any],
    trial_dir: str,
    checkpoint_every: int,
    report: Report | None = None,
    strategy: dict[str, Any] | None = None,
) -> dict:
    """Train the config `run` (model / data / trainer sections), checkpointing to `trial_dir`, with
    ``MegatrainStrategy(**strategy)`` (see :func:`trial_strategy`)."""
    import lightning.pytorch as L
    import torch

    from megatrain_lightning.checkpoint import ModelCheckpoint
    from megatrain_lightning.lightning.data import TextDataModule
    from megatrain_lightning.lightning.module import CausalLMModule
    from ray_jobs.callbacks import Attempt, FinalCheckpoint, ReportValidations, metrics

    torch.manual_seed(int(run.get("seed", 0)))
    module = CausalLMModule(**run.get("model", {}))
    data = TextDataModule(**run.get("data", {"path": "builtin:python-docs"}))
    ckpt_dir = f"{trial_dir}/checkpoints"
    last = f"{ckpt_dir}/last.ckpt"
    attempt = Attempt(trial_dir)
    callbacks: list[L.Callback] = [
        ModelCheckpoint(dirpath=ckpt_dir, save_last=True, save_top_k=0, every_n_train_steps=checkpoint_every),
        attempt,
        FinalCheckpoint(last),
    ]
    if report is not None:
        callbacks.append(ReportValidations(report))
    trainer_kwargs = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}
    trainer_kwargs.update(run.get("trainer", {}))
    megatrain = trial_strategy(strategy, trial_dir)
    trainer = L.Trainer(strategy=megatrain, callbacks=callbacks, **trainer_kwargs)
    try:
        trainer.fit(module, data, ckpt_path=resume_from(last))
    finally:
        if megatrain.nvme_dir and os.path.isdir(megatrain.nvme_dir) and not os.listdir(megatrain.nvme_dir):
            os.rmdir(megatrain.nvme_dir)  # the trial's own directory, emptied by the engine's release
    if not attempt.recorded:
        # Resumed from a checkpoint already at the end (the trial finished, but the sweep had not recorded
        # it when it stopped): Lightning trains nothing and validates nothing. Record the attempt, and
        # validate the final weights so the trial still reports its metric.
        attempt.record(trainer)
        trainer.validate(module, data, verbose=False)
    return {**metrics(trainer), "checkpoint": last}


def resume_from(last: str) -> str | None:
    """`last` when the trial committed a checkpoint there (its marker exists): resuming then reads it, and a
    damaged one stops the trial with a line naming the damaged file rather than silently starting over.
    None when no save ever committed (data of an interrupted first save is removed by the next save)."""
    fs, path = fsspec.core.url_to_fs(last)
    return last if fs.exists(path) and is_checkpoint(last) else None


def tune_trainable(
    root: str,
    base: dict[str, Any],
    checkpoint_every: int,
    strategy: dict[str, Any] | None = None,
    scaled: tuple[Any, dict[str, float], Any] | None = None,
) -> Callable[[dict[str, Any]], None]:
    """The Ray Tune function trainable for a sweep rooted at `root` with base config `base`, each trial with
    ``MegatrainStrategy(**strategy)``. With `scaled` = (sweep config, request per worker, tier), each trial is a
    Ray Train run of ``scaling.num_workers`` workers (ray_jobs/train.py) named by the trial id under
    ``<root>/trials``, so its directory is the trial's, and a retried or restored trial resumes from the run's
    last reported checkpoint; Tune gets each validation's metrics, and the final ones."""

    def trainable(params: dict[str, Any]) -> None:
        from ray import tune

        from ray_jobs.config import apply

        trial_id = tune.get_context().get_trial_id()
        if scaled is not None:
            from ray_jobs.train import absolute_data_paths, torch_trainer, validations_to_tune

            cfg, request, tier = scaled
            run = absolute_data_paths(apply(base, params))
            trainer = torch_trainer(run, trial_id, f"{root}/trials", cfg, request, tier, [validations_to_tune()])
            result = trainer.fit()
            final = result.return_value or result.metrics
        else:
            trial_dir = f"{root}/trials/{trial_id}"
            final = run_trial(apply(base, params), trial_dir, checkpoint_every, report=tune.report, strategy=strategy)
        tune.report({**final, "done": True})

    return trainable
