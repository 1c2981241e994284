"""The Lightning callbacks of a trial (ray_jobs/trial.py) and of a Ray Train run's workers (ray_jobs/train.py).

They live apart from the drivers' code so that the processes which only drive (the job's driver, a Ray Train
controller unpickling the worker loop, a sweep's trial that launches a run of workers) never import Lightning:
the functions that train import this module when they start.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import fsspec
import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import Callback

from ray_jobs.trial import CHECKPOINT, Report, checkpoint_dir


class ReportValidations(Callback):
    """Hands the validation metrics (and the step) to Ray Tune after each validation."""

    def __init__(self, report: Report) -> None:
        self.report = report

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self.report(metrics(trainer))


class FinalCheckpoint(Callback):
    """Saves the final state to `last.ckpt` whatever the interval (at train end the engine is still up)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The whole training state, said outright: unsaid, Lightning logs "`weights_only` was not set,
        # defaulting to `False`" (about what a save holds, not about unpickling anything on load).
        trainer.save_checkpoint(self.path, weights_only=False)


class Attempt(Callback):
    """Records where each attempt of the trial started (after any resume); with `rank`, of that rank of a run of
    several workers (``<time_ns>-rank<r>.json``, which also holds the rank and the number of ranks)."""

    def __init__(self, trial_dir: str, rank: int | None = None) -> None:
        self.trial_dir, self.rank = trial_dir, rank
        self.recorded = False

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.record(trainer)

    def record(self, trainer: L.Trainer) -> None:
        self.recorded = True
        fs, root = fsspec.core.url_to_fs(f"{self.trial_dir}/attempts")
        record = {"pid": os.getpid(), "start_step": trainer.global_step, "time": time.time()}
        name = f"{time.time_ns()}"
        if self.rank is not None:
            record.update(rank=self.rank, ranks=trainer.world_size)  # ranks: the strategy's, Ray's workers
            name = f"{name}-rank{self.rank}"
        fs.makedirs(root, exist_ok=True)  # a local directory must exist; object stores have none
        fs.pipe_file(f"{root}/{name}.json", json.dumps(record).encode())


# ------------------------------------------------------------------------------------------- the workers


class ReportedCheckpoints(Callback):
    """Every `every` optimizer steps and at the end of training: a checkpoint written by every rank straight to
    the run's storage, then reported to Ray Train where it lies (no copy), with the step's metrics.

    `root` is the run's directory as an fsspec URL; Ray Train's own path for it (``get_storage()``) names the
    same directory in its pyarrow filesystem. Saving and reporting are collective: every rank calls both, in the
    same order (the report is also Ray's barrier)."""

    def __init__(self, root: str, every: int) -> None:
        self.root, self.every = root.rstrip("/"), every
        self.saved = -1

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        step = trainer.global_step
        if step and step % self.every == 0 and step != self.saved:
            self.save(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step != self.saved:
            self.save(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Each validation's metrics are a report of their own (no checkpoint): what a sweep's Tune sees."""
        if not trainer.sanity_checking and trainer.state.fn == "fit":
            import ray.train

            ray.train.report(metrics(trainer))

    def save(self, trainer: L.Trainer) -> None:
        import ray.train
        from ray.train import Checkpoint, CheckpointUploadMode

        step = trainer.global_step
        # weights_only=False: the whole training state, said outright (unsaid, Lightning logs that it defaulted)
        trainer.save_checkpoint(f"{self.root}/{checkpoint_dir(step)}/{CHECKPOINT}", weights_only=False)
        self.saved = step
        storage = ray.train.get_context().get_storage()
        reported = Checkpoint(
            f"{storage.experiment_fs_path}/{checkpoint_dir(step)}", filesystem=storage.storage_filesystem
        )
        ray.train.report(metrics(trainer), checkpoint=reported, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)


class Progress(Callback):
    """Rank 0 prints the step, its micro-batch loss and the run's tokens per second (all ranks' tokens) every
    ``log_every_n_steps`` optimizer steps; the latest figures also go into each report (:func:`metrics`)."""

    def __init__(self) -> None:
        self.tokens, self.since, self.step = 0, time.perf_counter(), -1
        self.tokens_per_s = 0.0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.tokens += batch[0].numel() * trainer.world_size
        step = trainer.global_step
        if step == self.step or step % max(1, trainer.log_every_n_steps):
            return
        self.step, now = step, time.perf_counter()
        self.tokens_per_s = self.tokens / max(now - self.since, 1e-9)
        self.tokens, self.since = 0, now
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if trainer.is_global_zero:  # (not print: Ray Train's patched print would show each line twice)
            of = f"/{trainer.max_steps}" if trainer.max_steps > 0 else ""
            sys.stdout.write(f"step {step}{of} loss {float(loss):.4f} tokens/s {self.tokens_per_s:,.0f}\n")
            sys.stdout.flush()
        trainer.callback_metrics["tokens_per_s"] = torch.tensor(self.tokens_per_s)


def metrics(trainer: L.Trainer) -> dict[str, float]:
    """The scalar metrics Lightning holds (train_loss, val_loss, tokens_per_s, ...) and the step."""
    out = {k: float(v) for k, v in trainer.callback_metrics.items() if isinstance(v, torch.Tensor) and v.numel() == 1}
    return {**out, "step": trainer.global_step}
