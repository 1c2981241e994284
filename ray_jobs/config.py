"""The sweep file: a base training config, a search space, and how Ray should run the trials.

```yaml
name: tiny-lr                      # the sweep's directory under `storage`
storage: s3://bucket/sweeps        # any fsspec URL all nodes reach (object store or shared directory)
base:                              # one `megatrain fit` config: model / data / trainer sections
  model: {model: llama-3.1-8b, warmup_steps: 100}
  data: {path: /data/train.jsonl, seq_len: 4096, batch_size: 1}
  trainer: {max_steps: 2000, precision: bf16-mixed, val_check_interval: 200}
search_space:                      # dotted keys into `base`
  model.lr: {loguniform: [1.0e-5, 3.0e-4]}
  model.weight_decay: {grid: [0.0, 0.1]}
num_samples: 4                     # draws of the random dimensions (grids are crossed with them)
scheduler: {type: asha, max_t: 10, grace_period: 2, reduction_factor: 2}   # or {type: none}
max_concurrent_trials: 8
failure_budget: 3                  # retries per trial before it counts as errored
checkpoint_every: 200              # optimizer steps between checkpoints
resources: {cpus_per_trial: 8, gpus_per_trial: 1, node_resource: bigmem, memory_headroom: 8GiB}
```
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import yaml

SAMPLERS = ("grid", "choice", "uniform", "loguniform", "randint")


@dataclass
class Resources:
    cpus_per_trial: int = 1
    """CPU cores Ray reserves per trial (the host optimizer and data loading use them)."""
    gpus_per_trial: int = 1
    """GPUs per trial: one, a trial is a single-GPU trainer."""
    node_resource: str | None = None
    """A custom node resource (e.g. `bigmem`) that only the big-memory nodes declare; None: no such filter."""
    memory_headroom: str = "4GiB"
    """Host memory added to the planner's figure for the Python process, data and allocator slack."""


@dataclass
class SweepConfig:
    name: str
    """Sweep name: its directory under `storage` and Ray's experiment name."""
    storage: str
    """fsspec URL of shared storage (s3://..., or a directory every node mounts)."""
    base: dict[str, Any]
    """The base training config: `model`, `data`, `trainer` sections as for `megatrain fit`, optional `seed`."""
    search_space: dict[str, dict[str, list]] = field(default_factory=dict)
    """Dotted key into `base` -> {grid|choice|uniform|loguniform|randint: [...]}."""
    num_samples: int = 1
    scheduler: dict[str, Any] = field(default_factory=lambda: {"type": "none"})
    max_concurrent_trials: int = 0
    """0: as many as the cluster fits."""
    failure_budget: int = 2
    """Retries per trial; a trial that fails more often counts as errored and fails the job."""
    checkpoint_every: int = 100
    metric: str = "val_loss"
    mode: Literal["min", "max"] = "min"
    resources: Resources = field(default_factory=Resources)

    @property
    def root(self) -> str:
        return f"{self.storage.rstrip('/')}/{self.name}"


def load(path: str | Path) -> SweepConfig:
    """Read and check a sweep file; errors name the file, the key and the fix."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"sweep config {path} does not exist; pass --config configs/sweep/<file>.yaml")
    raw = yaml.safe_load(path.read_text()) or {}
    known = {f.name for f in fields(SweepConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}; known keys are {sorted(known)}")
    missing = [k for k in ("name", "storage", "base") if k not in raw]
    if missing:
        raise ValueError(f"{path}: missing {missing} (see ray_jobs/config.py for a complete example)")
    raw["resources"] = Resources(**raw.get("resources", {}))
    cfg = SweepConfig(**raw)
    _check(cfg, path)
    return cfg


def _check(cfg: SweepConfig, path: Path) -> None:
    for key, spec in cfg.search_space.items():
        if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in SAMPLERS:
            raise ValueError(f"{path}: search_space.{key} must be one of {{{'|'.join(SAMPLERS)}: [...]}}, got {spec!r}")
        section = key.split(".", 1)[0]
        if section not in ("model", "data", "trainer", "seed"):
            raise ValueError(f"{path}: search_space key {key!r} must start with model., data. or trainer.")
    if cfg.scheduler.get("type") not in ("none", "asha"):
        raise ValueError(f"{path}: scheduler.type={cfg.scheduler.get('type')!r}; choose 'asha' or 'none'")
    if cfg.resources.gpus_per_trial != 1:
        raise ValueError(f"{path}: resources.gpus_per_trial={cfg.resources.gpus_per_trial}; a trial is a single-GPU trainer")
    if cfg.failure_budget < 0 or cfg.checkpoint_every < 1:
        raise ValueError(f"{path}: failure_budget must be >= 0 and checkpoint_every >= 1")


def apply(base: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """A copy of `base` with each dotted key of `params` set."""
    out = copy.deepcopy(base)
    for key, value in params.items():
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def param_space(cfg: SweepConfig) -> dict[str, Any]:
    """Ray Tune's search space for the dotted keys."""
    from ray import tune

    build = {"grid": tune.grid_search, "choice": tune.choice, "uniform": lambda a: tune.uniform(*a),
             "loguniform": lambda a: tune.loguniform(*a), "randint": lambda a: tune.randint(*a)}  # fmt: skip
    return {key: build[kind](values) for key, spec in cfg.search_space.items() for kind, values in spec.items()}
