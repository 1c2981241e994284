"""One run over several workers on a Ray cluster: Ray Train's ``TorchTrainer``, each worker one data-parallel rank.

    ray job submit --address http://HEAD:8265 --working-dir . -- \\
        python -m ray_jobs.train --config configs/run/tiny-dp.yaml

The run file (:class:`ray_jobs.config.TrainConfig`) is a sweep file's keys for one trial plus `scaling`. Each
of `scaling.num_workers` workers runs ``Trainer(strategy="megatrain")`` with Ray's cluster environment: the
workers are the ranks of one data-parallel run and partition the host state among them (a worker holds
1/num_workers of the master, Adam moments and the rest), so Ray is asked, per worker, for the planner's host
figure for that share (ray_jobs/resources.py). A run the cluster's nodes cannot hold is refused before it
starts, naming what a worker needs and what each node holds.

Checkpoints: every `checkpoint_every` optimizer steps and at the end, every worker writes its shards of
``<storage>/<name>/checkpoints/step-NNNNNNNN/model.ckpt`` (the project's sharded checkpoint, which does not
depend on the number of workers) and the run reports that directory to Ray Train as it lies in storage,
without a copy (``CheckpointUploadMode.NO_UPLOAD``); Ray Train keeps the newest `num_to_keep` and deletes the
older directories. When a worker process or node dies, Ray Train restarts all workers (`failure_budget`
times), and they resume from the last reported checkpoint (step, data position, RNG, optimizer state): the run
ends as it would have without the failure, bit for bit with the torch optimizer backend. Submitting the same
run file again (same `name` and `storage`) after the job stopped resumes the run from its storage; a run file
that differs from the one it was started with (other than in `strategy`, the resources in `scaling`,
`checkpoint_every`, `num_to_keep` and `failure_budget`) is refused, as for sweeps.

Rank 0 prints the step, its micro-batch loss and the run's tokens per second every ``log_every_n_steps``
(the job's log); each report carries them with the validation metrics, and the job prints rank 0's final
metrics (Ray's ``Result.return_value``) and writes them to ``<storage>/<name>/result.json``. Every worker
that starts training leaves ``attempts/<time_ns>-rank<r>.json`` (``pid``, ``rank``, ``ranks``,
``start_step``, ``time``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import fsspec

from megatrain_lightning.checkpoint import is_checkpoint
from megatrain_lightning.planning.planner import format_size
from ray_jobs.config import SweepConfigError, TrainConfig, error_line, is_shipped, load, resolve
from ray_jobs.resources import SweepRefused, Tier, check_workers_fit, planned_tier, strategy_options, trial_resources
from ray_jobs.sweep import check_data_paths, check_unchanged, connect, driver_main, record_config
from ray_jobs.trial import CHECKPOINT, checkpoint_dir, trial_strategy

# ------------------------------------------------------------------------------------------- the workers


def validations_to_tune() -> Any:
    """Ray Train's callback that hands a run's reports to the Tune trial driving it, made to hand over only the
    validation reports (those without a checkpoint): a checkpoint is usually taken before that step's
    validation, and a report without the sweep's metric would stop the sweep."""
    from ray.tune.integration.ray_train import TuneReportCallback

    class ValidationsToTune(TuneReportCallback):
        def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
            if checkpoint is None:
                super().after_report(run_context, metrics, checkpoint)

    return ValidationsToTune()


def resume_url(root: str) -> str | None:
    """The checkpoint Ray Train hands a (re)started worker (its last reported one, also after the job was
    resubmitted under the same name and storage), as the URL this run wrote it to; None: start at step 0."""
    import ray.train

    reported = ray.train.get_checkpoint()
    if reported is None:
        return None
    url = f"{root.rstrip('/')}/checkpoints/{reported.path.rstrip('/').rsplit('/', 1)[-1]}/{CHECKPOINT}"
    if not is_checkpoint(url):
        raise RuntimeError(
            f"Ray Train reports checkpoint {reported.path}, but {url} holds no committed checkpoint: the run's "
            "storage was edited; remove the run's directory to start it over"
        )
    return url


def worker_loop(config: dict[str, Any]) -> dict[str, float]:
    """One rank of the run (Ray Train's ``train_loop_per_worker``): the training config `config["run"]`,
    checkpointing into `config["root"]`."""
    import lightning.pytorch as L
    import ray.train
    import torch
    from ray.train.lightning import RayLightningEnvironment

    from megatrain_lightning.lightning.data import TextDataModule
    from megatrain_lightning.lightning.module import CausalLMModule
    from ray_jobs.callbacks import Attempt, Progress, ReportedCheckpoints, metrics

    run, root = config["run"], config["root"]
    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(int(run.get("seed", 0)))  # every rank builds the same initial model; the engine shards it
    module = CausalLMModule(**run.get("model", {}))
    data = TextDataModule(**run.get("data", {"path": "builtin:python-docs"}))
    name = root.rstrip("/").rsplit("/", 1)[-1]
    strategy = trial_strategy(config["strategy"], f"{root}/{name}-rank{rank}")  # scratch: one per rank
    attempt = Attempt(root, rank=rank)
    callbacks = [Progress(), ReportedCheckpoints(root, config["checkpoint_every"]), attempt]
    trainer_kwargs = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}
    trainer_kwargs.update({"enable_checkpointing": False, **run.get("trainer", {})})
    trainer = L.Trainer(strategy=strategy, plugins=[RayLightningEnvironment()], callbacks=callbacks, **trainer_kwargs)
    trainer.fit(module, data, ckpt_path=resume_url(root))
    if not attempt.recorded:
        attempt.record(trainer)  # resumed at the end: nothing left to train
    return metrics(trainer)  # rank 0's is the run's ``Result.return_value``: the metrics after the last validation


def torch_trainer(
    run: dict[str, Any],
    name: str,
    storage: str,
    cfg: Any,
    request: dict[str, float],
    tier: Tier,
    callbacks: list[Any] | None = None,
) -> Any:
    """Ray Train's ``TorchTrainer`` for the training config `run`, as run `name` under `storage` (its directory
    ``<storage>/<name>``), with `cfg`'s scaling, checkpoint and failure settings and `request` per worker."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    scaling = cfg.scaling
    loop_config = {
        "run": run,
        "root": f"{storage.rstrip('/')}/{name}",
        "checkpoint_every": cfg.checkpoint_every,
        "strategy": strategy_options(cfg, tier),
    }
    return TorchTrainer(
        worker_loop,
        train_loop_config=loop_config,
        scaling_config=ScalingConfig(
            num_workers=scaling.num_workers, use_gpu=scaling.use_gpu, resources_per_worker=dict(request)
        ),
        run_config=RunConfig(
            name=name,
            storage_path=storage,
            checkpoint_config=CheckpointConfig(num_to_keep=getattr(cfg, "num_to_keep", 2)),
            failure_config=FailureConfig(max_failures=cfg.failure_budget),
            callbacks=callbacks,
        ),
    )


# ------------------------------------------------------------------------------------------- the driver


def absolute_data_paths(run: dict[str, Any]) -> dict[str, Any]:
    """`run` with its local data paths made absolute: Ray Train runs each worker in a directory of its own."""
    data = dict(run.get("data") or {})
    for key in ("path", "val_path", "tokenizer"):
        value = data.get(key)
        if isinstance(value, str) and "://" not in value and not value.startswith("builtin:"):
            data[key] = os.path.abspath(os.path.expanduser(value))
    return {**run, "data": data} if data else run


def main(argv: list[str] | None = None) -> int:
    return driver_main(
        "train",
        "one megatrain run over several Ray Train workers",
        "run YAML: a path where the driver runs, a URL, or a shipped one (configs/run/tiny-dp.yaml)",
        _run,
        argv,
    )


def _run(args: argparse.Namespace) -> int:
    path = resolve(args.config, "run")
    cfg: TrainConfig = load(path, TrainConfig)
    if is_shipped(path) and path != args.config:
        print(f"run config: {path} (shipped with the package; {args.config} is not in {os.getcwd()})", flush=True)
    try:
        request = trial_resources(cfg)
    except ValueError as err:
        raise SweepConfigError(f"{path}: cannot size a worker: {err}") from None
    check_data_paths(cfg)
    recorded = check_unchanged(cfg)
    nodes = connect(args.address, args.connect_timeout)
    tier = planned_tier(cfg, nodes)
    if cfg.strategy.host_layout == "auto":
        request = trial_resources(cfg, tier=tier)
        print(f"strategy.host_layout auto: {tier[0]}{', Adam on NVMe' if tier[1] else ''}", flush=True)
    workers = cfg.scaling.num_workers
    try:
        check_workers_fit(request, workers, nodes)
    except SweepRefused as err:
        print(f"run {cfg.name} refused: {err}", file=sys.stderr, flush=True)
        return 2
    if not recorded:
        record_config(cfg)
    print(
        f"run {cfg.name}: {workers} workers, each asking for CPU {request['CPU']:g}"
        f"{', GPU 1' if 'GPU' in request else ''}, memory {format_size(request['memory'])}; storage {cfg.root}",
        flush=True,
    )
    from ray.train import TrainingFailedError

    trainer = torch_trainer(absolute_data_paths(cfg.base), cfg.name, cfg.storage, cfg, request, tier)
    try:
        result = trainer.fit()
    except TrainingFailedError as err:
        print(f"run {cfg.name} failed beyond failure_budget={cfg.failure_budget}: {error_line(err)}", file=sys.stderr)
        return 1
    final = result.return_value or result.metrics  # (the last report's: the one at the final checkpoint)
    step = int(final.get("step", -1))
    summary = {"metrics": final, "checkpoint": f"{cfg.root}/{checkpoint_dir(step)}/{CHECKPOINT}"}
    fs, where = fsspec.core.url_to_fs(f"{cfg.root}/result.json")
    fs.pipe_file(where, json.dumps(summary, indent=1).encode())
    shown = ", ".join(f"{k} {v:.4g}" for k, v in sorted(final.items()) if isinstance(v, float))
    print(f"result: step {step}: {shown}; checkpoint {summary['checkpoint']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
