"""Run a hyper-parameter sweep of single-GPU megatrain trainers on a Ray cluster.

    ray job submit --address http://HEAD:8265 --working-dir . -- \\
        python -m ray_jobs.sweep --config configs/sweep/tiny-lr.yaml

Each trial is one Lightning trainer in one process, placed by Ray on a node with a GPU and enough host
memory (sized by the memory planner). Trials checkpoint to the sweep's storage and a failed trial is
retried, on any node, from its last checkpoint. Submitting the same command again after the driver
died continues the sweep: finished trials are kept, unfinished ones resume. The job exits non-zero when
trials errored beyond the failure budget, after writing the results table to storage and stdout.
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from typing import Any

import fsspec

from ray_jobs.config import SweepConfig, load, param_space
from ray_jobs.resources import SweepRefused, check_fits, trial_resources
from ray_jobs.trial import tune_trainable


def build_tuner(cfg: SweepConfig) -> Any:
    """A new Tuner, or the restored one when this sweep's experiment already exists in storage."""
    from ray import tune

    trainable = tune.with_resources(
        tune_trainable(cfg.root, cfg.base, cfg.checkpoint_every), trial_resources(cfg)
    )
    if tune.Tuner.can_restore(cfg.root):
        print(f"restoring sweep {cfg.name} from {cfg.root}: finished trials are kept, the others resume", flush=True)
        return tune.Tuner.restore(cfg.root, trainable, resume_unfinished=True, resume_errored=True)
    tune_config = tune.TuneConfig(
        metric=cfg.metric, mode=cfg.mode, num_samples=cfg.num_samples, scheduler=_scheduler(cfg),
        max_concurrent_trials=cfg.max_concurrent_trials or None,
    )  # fmt: skip
    run_config = tune.RunConfig(
        name=cfg.name, storage_path=cfg.storage, failure_config=tune.FailureConfig(max_failures=cfg.failure_budget)
    )
    return tune.Tuner(trainable, param_space=param_space(cfg), tune_config=tune_config, run_config=run_config)


def _scheduler(cfg: SweepConfig) -> Any:
    if cfg.scheduler.get("type") != "asha":
        return None
    from ray.tune.schedulers import ASHAScheduler

    kwargs = {k: v for k, v in cfg.scheduler.items() if k != "type"}
    return ASHAScheduler(time_attr="training_iteration", **kwargs)


def results_table(cfg: SweepConfig, results: Any) -> list[dict[str, Any]]:
    """One row per trial: id, hyper-parameters, best metric, status, checkpoint URL."""
    rows = []
    for result in results:
        trial_id = result.metrics.get("trial_id") if result.metrics else None
        trial_id = trial_id or result.path.rstrip("/").rsplit("_", 2)[-2]
        df = result.metrics_dataframe
        best = None
        if df is not None and cfg.metric in df:
            best = df[cfg.metric].min() if cfg.mode == "min" else df[cfg.metric].max()
        row = {"trial": trial_id, **{k: result.config.get(k) for k in cfg.search_space}}
        row.update({f"best_{cfg.metric}": best, "status": "error" if result.error else "ok",
                    "checkpoint": f"{cfg.root}/trials/{trial_id}/checkpoints/last.ckpt"})  # fmt: skip
        rows.append(row)
    return rows


def write_table(cfg: SweepConfig, rows: list[dict[str, Any]]) -> str:
    """Write results.csv next to the sweep's trials; returns its URL. Prints a markdown table."""
    if not rows:
        return ""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    url = f"{cfg.root}/results.csv"
    fs, path = fsspec.core.url_to_fs(url)
    fs.pipe_file(path, buf.getvalue().encode())
    print("| " + " | ".join(rows[0]) + " |\n|" + "---|" * len(rows[0]))
    for row in rows:
        print("| " + " | ".join(str(v) for v in row.values()) + " |")
    return url


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="hyper-parameter sweep of megatrain trainers on Ray")
    ap.add_argument("--config", required=True, help="sweep YAML, e.g. configs/sweep/tiny-lr.yaml")
    ap.add_argument("--address", default=None, help="Ray address (default: the cluster this job runs in)")
    args = ap.parse_args(argv)
    cfg = load(args.config)
    import ray

    ray.init(address=args.address or "auto", ignore_reinit_error=True)
    try:
        check_fits(trial_resources(cfg), ray.nodes())
    except SweepRefused as err:
        print(f"sweep {cfg.name} refused: {err}", file=sys.stderr, flush=True)
        return 2
    results = build_tuner(cfg).fit()
    rows = results_table(cfg, results)
    url = write_table(cfg, rows)
    errored = [r for r in rows if r["status"] == "error"]
    print(f"results: {url}", flush=True)
    if errored:
        print(f"{len(errored)} trial(s) failed beyond the failure budget of {cfg.failure_budget}: "
              f"{[r['trial'] for r in errored]}", file=sys.stderr, flush=True)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
