"""Run a hyper-parameter sweep of single-GPU megatrain trainers on a Ray cluster.

    ray job submit --address http://HEAD:8265 --working-dir . -- \\
        python -m ray_jobs.sweep --config configs/sweep/tiny-lr.yaml

Each trial is one Lightning trainer in one process, placed by Ray on a node with a GPU and enough host
memory (sized by the memory planner); with a `scaling` section, each trial is instead a Ray Train run of
several workers (ray_jobs/train.py). Trials checkpoint to the sweep's storage and a failed trial is
retried, on any node, from its last checkpoint. Submitting the same command again after the driver
died continues the sweep: finished trials are kept, unfinished ones resume. The sweep file a sweep was
started with is stored as `<storage>/<name>/sweep.yaml`; a resubmitted sweep file that differs from it
(other than in `resources` or `strategy`) is refused rather than restored. The job exits non-zero when
trials errored beyond the failure budget, after writing the results table to storage and stdout; a bad
sweep file, storage or cluster ends it with exit code 2 and one line saying what to fix.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

import fsspec
import yaml

from megatrain_lightning.planning.planner import format_size
from ray_jobs.config import (
    RECORD,
    SweepConfig,
    SweepConfigError,
    TrainConfig,
    as_dict,
    changes,
    error_line,
    is_shipped,
    load,
    param_space,
    resolve,
)
from ray_jobs.resources import SweepRefused, Tier, check_workers_fit, planned_tier, strategy_options, trial_resources
from ray_jobs.trial import CHECKPOINT, checkpoint_dir, tune_trainable

TRIAL_CPU = 0.01
"""CPU a trial of multi-worker trials asks for itself: it only drives its Ray Train run."""


class SweepError(RuntimeError):
    """The sweep cannot start (changed since it was stored, storage or cluster unreachable); one line."""


class SweepChanged(SweepError):
    """The sweep file differs from the one the stored sweep was started with."""


def record_url(cfg: SweepConfig | TrainConfig) -> str:
    """Where the file a sweep (`<root>/sweep.yaml`) or a run (`<root>/run.yaml`) started with is stored."""
    return f"{cfg.root}/{'run.yaml' if isinstance(cfg, TrainConfig) else RECORD}"


def stored_config(cfg: SweepConfig | TrainConfig) -> dict[str, Any] | None:
    """The sweep (or run) file recorded in storage when it started (:func:`record_url`); None if none."""
    url = record_url(cfg)
    try:
        fs, path = fsspec.core.url_to_fs(url)
        if not fs.exists(path):
            return None
        return yaml.safe_load(fs.cat_file(path))
    except Exception as err:  # noqa: BLE001  (any backend's error: credentials, endpoint, protocol)
        raise SweepError(f"storage {cfg.storage} cannot be read ({error_line(err)}); {_STORAGE_FIX}") from None


def check_unchanged(cfg: SweepConfig | TrainConfig) -> bool:
    """Refuse (:class:`SweepChanged`) a sweep or run whose stored config differs; True when one is stored."""
    stored = stored_config(cfg)
    if stored is None:
        return False
    diff = changes(stored, as_dict(cfg), run=isinstance(cfg, TrainConfig))
    if diff:
        kind = "run" if isinstance(cfg, TrainConfig) else "sweep"
        shown = "; ".join(diff[:3]) + (f"; and {len(diff) - 3} more" if len(diff) > 3 else "")
        raise SweepChanged(
            f"{cfg.root} was started with another config ({shown}), and restoring it would "
            f"not apply the edits: give the edited {kind} a new `name` (or `storage`) to start it fresh, or "
            f"resubmit with --config {record_url(cfg)} to continue the stored one"
        )
    return True


def record_config(cfg: SweepConfig | TrainConfig) -> None:
    """Store the sweep (or run) file at :func:`record_url` (also proves the driver can write to storage)."""
    try:
        fs, path = fsspec.core.url_to_fs(record_url(cfg))
        if "file" in fs.protocol:  # a local directory must exist; object stores have none (and no bucket is created)
            fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(path, yaml.safe_dump(as_dict(cfg), sort_keys=False).encode())
    except Exception as err:  # noqa: BLE001
        raise SweepError(f"storage {cfg.storage} cannot be written ({error_line(err)}); {_STORAGE_FIX}") from None


_STORAGE_FIX = (
    "use a bucket/directory that exists and every node reaches; for S3 set AWS_ENDPOINT_URL, "
    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY on every node or in the job's env_vars"
)


def check_data_paths(cfg: SweepConfig | TrainConfig) -> None:
    """Refuse local data paths (base.data and any data.* path the search space tries) that do not exist where
    the driver runs, before anything starts on the cluster: every trial reads them on its own node, so they
    belong on a mount all nodes share (a URL or builtin: corpus is left to the trials)."""
    data = cfg.base.get("data") or {}
    paths = [(f"base.data.{k}", data.get(k)) for k in ("path", "val_path", "tokenizer")]
    for key, spec in getattr(cfg, "search_space", {}).items():
        if key in ("data.path", "data.val_path", "data.tokenizer"):
            paths += [(f"search_space.{key}", v) for values in spec.values() for v in values]
    for key, path in paths:
        if isinstance(path, str) and "://" not in path and not path.startswith("builtin:"):
            if not os.path.exists(os.path.expanduser(path)):
                raise SweepConfigError(
                    f"{key}={path!r} does not exist where the driver runs; trials read it on every node: give a "
                    "path on a mount all nodes share (or builtin:python-docs)"
                )


def check_reachable(address: str | None, timeout: float) -> None:
    """A TCP probe of the Ray address, `timeout` seconds at most: ray.init keeps retrying an address nothing
    answers on for many minutes. ``auto`` (no address) is probed only when RAY_ADDRESS names one; without it
    ray.init finds the local cluster or fails at once."""
    address = address if address not in (None, "auto") else os.environ.get("RAY_ADDRESS")
    if not address or address in ("auto", "local"):
        return
    rest = address.split("://", 1)[-1]
    host, _, port = rest.rpartition(":") if ":" in rest else (rest, "", "")
    default = 10001 if address.startswith("ray://") else 6379
    try:
        with socket.create_connection((host.strip("[]"), int(port or default)), timeout=timeout):
            return
    except ValueError:
        raise SweepError(f"--address {address!r} is not HOST:PORT (e.g. 10.0.0.1:6379 or ray://head:10001)") from None
    except OSError as err:
        raise SweepError(
            f"no Ray cluster answers at {address} within {timeout:g} s ({error_line(err)}); start one with "
            "`ray start --head`, check the address and port (the head's GCS, 6379 by default), or submit with "
            "`ray job submit` and no --address"
        ) from None


def connect(address: str | None, timeout: float) -> list[dict[str, Any]]:
    """Join the Ray cluster at `address` (probed first: :func:`check_reachable`); its nodes (``ray.nodes()``)."""
    check_reachable(address, timeout)
    import ray

    try:
        ray.init(address=address or "auto", ignore_reinit_error=True)
    except (ConnectionError, RuntimeError, ValueError) as err:
        raise SweepError(
            f"no Ray cluster at {address or 'auto'} ({error_line(err)}); start one with `ray start --head` "
            "and submit with `ray job submit`, or pass --address HEAD:6379"
        ) from None
    return ray.nodes()


def build_tuner(cfg: SweepConfig, tier: Tier | None = None) -> Any:
    """A new Tuner, or the restored one when this sweep's experiment already exists in storage. Every trial
    runs with `tier` (default: :func:`planned_tier` without a cluster); a restored sweep takes the current
    file's `strategy` and `resources`, which do not change what a trial computes."""
    from ray import tune

    tier = planned_tier(cfg) if tier is None else tier
    request = trial_resources(cfg, tier=tier)
    if cfg.scaling is None:
        trainable = tune.with_resources(
            tune_trainable(cfg.root, cfg.base, cfg.checkpoint_every, strategy_options(cfg, tier)), request
        )
    else:  # the trial only drives its Ray Train run (a sliver of a CPU: Ray needs some); the workers ask for theirs
        trainable = tune.with_resources(
            tune_trainable(cfg.root, cfg.base, cfg.checkpoint_every, scaled=(cfg, request, tier)), {"CPU": TRIAL_CPU}
        )
    if tune.Tuner.can_restore(cfg.root):
        print(f"restoring sweep {cfg.name} from {cfg.root}: finished trials are kept, the others resume", flush=True)
        return tune.Tuner.restore(cfg.root, trainable, resume_unfinished=True, resume_errored=True)
    tune_config = tune.TuneConfig(
        metric=cfg.metric,
        mode=cfg.mode,
        num_samples=cfg.num_samples,
        scheduler=_scheduler(cfg),
        max_concurrent_trials=cfg.max_concurrent_trials or None,
    )
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
        row.update(
            {
                f"best_{cfg.metric}": best,
                "status": "error" if result.error else "ok",
                "checkpoint": f"{cfg.root}/trials/{trial_id}/{_final_checkpoint(cfg, result)}",
            }
        )
        rows.append(row)
    return rows


def _final_checkpoint(cfg: SweepConfig, result: Any) -> str:
    """Where a trial's final checkpoint is, within its directory (a Ray Train run's: the last step's)."""
    if cfg.scaling is None:
        return "checkpoints/last.ckpt"
    step = int((result.metrics or {}).get("step", 0))
    return f"{checkpoint_dir(step)}/{CHECKPOINT}"


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
    return driver_main(
        "sweep",
        "hyper-parameter sweep of megatrain trainers on Ray",
        "sweep YAML: a path where the driver runs, a URL, or a shipped one (configs/sweep/tiny-lr.yaml)",
        _run,
        argv,
    )


def driver_main(
    prog: str, description: str, config_help: str, run: Callable[[argparse.Namespace], int], argv: list[str] | None
) -> int:
    """A Ray job's driver (`prog`: sweep, train): --config, --address and --connect-timeout, then `run`; a bad
    file, storage or cluster ends it with exit code 2 and one line."""
    ap = argparse.ArgumentParser(prog=f"python -m ray_jobs.{prog}", description=description)
    ap.add_argument("--config", required=True, help=config_help)
    ap.add_argument("--address", default=None, help="Ray address (default: the cluster this job runs in)")
    ap.add_argument(
        "--connect-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds to wait for the Ray address to answer before giving up (default 10)",
    )
    args = ap.parse_args(argv)
    if not args.connect_timeout > 0:
        print(f"{prog}: error: --connect-timeout={args.connect_timeout} must be above 0 seconds", file=sys.stderr)
        return 2
    try:
        return run(args)
    except (SweepConfigError, SweepError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
        return 2


def _run(args: argparse.Namespace) -> int:
    path = resolve(args.config)
    cfg = load(path)
    if is_shipped(path) and path != args.config:
        print(f"sweep config: {path} (shipped with the package; {args.config} is not in {os.getcwd()})", flush=True)
    try:
        request = trial_resources(cfg)
    except ValueError as err:  # e.g. a model preset or config.json the planner cannot read
        raise SweepConfigError(f"{path}: cannot size a trial: {err}") from None
    check_data_paths(cfg)
    recorded = check_unchanged(cfg)  # before anything touches the cluster
    nodes = connect(args.address, args.connect_timeout)
    tier = planned_tier(cfg, nodes)
    if cfg.strategy.host_layout == "auto":
        request = trial_resources(cfg, tier=tier)
        print(
            f"strategy.host_layout auto: {tier[0]}{', Adam on NVMe' if tier[1] else ''} "
            f"(a trial asks for {format_size(request['memory'])} of host memory)",
            flush=True,
        )
    try:
        check_workers_fit(request, cfg.scaling.num_workers if cfg.scaling else 1, nodes)
    except SweepRefused as err:
        print(f"sweep {cfg.name} refused: {err}", file=sys.stderr, flush=True)
        return 2
    if not recorded:
        record_config(cfg)
    results = build_tuner(cfg, tier).fit()
    rows = results_table(cfg, results)
    url = write_table(cfg, rows)
    errored = [r for r in rows if r["status"] == "error"]
    print(f"results: {url}", flush=True)
    if errored:
        print(
            f"{len(errored)} trial(s) failed beyond the failure budget of {cfg.failure_budget}: "
            f"{[r['trial'] for r in errored]}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
