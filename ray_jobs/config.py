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
strategy: {host_layout: lean, nvme_dir: /mnt/nvme, host_threads: 7}   # each trial's MegatrainStrategy
# scaling: {num_workers: 2, cpus_per_worker: 8}   # instead of `resources`: each trial a Ray Train run of 2 workers
```

Numbers may be written ``1e-5``: PyYAML reads that (no dot, or no exponent sign) as a string, and a string
that spells a number is taken as that number wherever a number is expected (and, in `base` and grid or
choice values, wherever the argument's type reads it as one).

Where the file is looked up: see :func:`resolve`. Everything is checked here, in the driver, before
anything runs on the cluster; an error is one line naming the file, the key and the fix.

Why one file of about 500 lines: it is the sweep file's whole schema, each key with its check and its
one-line error, and the record compared on resubmission; a reader looking up a key finds it here.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
import inspect
import os
import re
from collections.abc import Callable
from dataclasses import field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass

from megatrain_lightning.engine import EngineConfig, check_host_layout, check_nvme_dir
from megatrain_lightning.planning.planner import parse_size

SAMPLERS = ("grid", "choice", "uniform", "loguniform", "randint")
SECTIONS = ("model", "data", "trainer", "seed")
ASHA_KEYS = ("max_t", "grace_period", "reduction_factor", "brackets", "stop_last_trials")
# run_trial sets these itself; a sweep file setting them would break every trial.
TRAINER_RESERVED = ("strategy", "callbacks")
# Keys that may differ between a sweep's stored config and a resubmitted one (see `changes`).
RESTORE_MAY_CHANGE = ("name", "storage", "resources", "strategy")
RECORD = "sweep.yaml"


class SweepConfigError(ValueError):
    """A sweep file that cannot run. The message is one line: the file, the key, the fix."""


def _yaml_number(value: Any) -> Any:
    """PyYAML reads ``1e-5`` (no dot, or no exponent sign) as a string: take a string that spells a number as it."""
    return float(value) if isinstance(value, str) and _NUMERIC.fullmatch(value.strip()) else value


_NUMERIC = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
# Strict: YAML's `true` where a number is expected, or `4.0` where an integer is, is a mistake to report.
Int = Annotated[int, Field(strict=True)]
Number = Annotated[float, BeforeValidator(_yaml_number), Field(strict=True)]
_INT, _NUMBER, _POSITIVE = TypeAdapter(Int), TypeAdapter(Number), TypeAdapter(Annotated[Number, Field(gt=0)])


# ------------------------------------------------------------------------------------------ checks


def _checked(adapter: TypeAdapter | None, key: str, value: Any) -> Any:
    """`value` checked against `adapter`'s type (None: any). A string that type reads as a value (``1e-5``, which
    PyYAML reads as text, for a float) becomes that value; anything else stays as written."""
    if adapter is None:
        return value
    try:
        checked = adapter.validate_python(value)
    except ValidationError as err:
        text = " or ".join(dict.fromkeys(e["msg"] for e in err.errors())).replace(" or Input should be ", " or ")
        raise ValueError(f"{key}={value!r}: {text}") from None
    return checked if isinstance(value, str) else value


def _check_name(name: str) -> str:
    if "/" in name or name.strip(". ") == "":
        raise ValueError(f"name={name!r} must be a plain directory name (no '/')")
    return name


def _expand_home(storage: str) -> str:
    """A local `storage` may start with `~` (the shipped tiny configs write under `~/megatrain_runs`): the
    driver expands it, so trials and Ray read the same absolute directory."""
    return storage if "://" in storage else os.path.expanduser(storage)


def _check_size(size: str) -> str:
    parse_size(size)  # its ValueError names the size and the units
    return size


def _check_nvme_dir(path: str | None) -> str | None:
    """The engine's check, then what a directory on other nodes must be beside it."""
    check_nvme_dir(path)
    if path is not None and re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", path):
        raise ValueError(
            f"nvme_dir={path!r} is a URL, but the Adam moments are read and written every step on a local drive: "
            "give a directory that exists on every node, e.g. /mnt/nvme (checkpoints go to `storage`)"
        )
    if path is not None and not path.startswith("/"):
        raise ValueError(
            f"nvme_dir={path!r} is relative; trials run in Ray's directories on each node, so give an absolute "
            "path that exists on every node, e.g. /mnt/nvme"
        )
    return path


def _check_scheduler(scheduler: dict[str, Any]) -> dict[str, Any]:
    kind = scheduler.get("type")
    if kind not in ("none", "asha"):
        raise ValueError(
            f"scheduler.type={kind!r}; choose 'asha' or 'none' (scheduler: {{type: asha, max_t: 10, grace_period: 2}})"
        )
    extra = sorted(set(scheduler) - {"type"} - (set(ASHA_KEYS) if kind == "asha" else set()))
    if extra:
        allowed = f"asha takes {list(ASHA_KEYS)}" if kind == "asha" else "type none takes no other keys"
        raise ValueError(f"scheduler: unknown keys {extra}; {allowed}")
    positive = ("max_t", "grace_period", "reduction_factor", "brackets")
    return {k: _checked(_POSITIVE, f"scheduler.{k}", v) if k in positive else v for k, v in scheduler.items()}


def _check_base(base: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(base) - set(SECTIONS))
    if unknown:
        raise ValueError(f"base: unknown sections {unknown}; a trial config has {list(SECTIONS)}")
    out = {"seed": _checked(_INT, "base.seed", base["seed"])} if "seed" in base else {}
    for section in ("model", "data", "trainer"):
        values = base.get(section) or {}
        if not isinstance(values, dict):
            raise ValueError(f"base.{section} must be a mapping of keyword arguments, got {values!r}")
        for key, value in values.items():
            where = f"base.{section}.{key}"
            out.setdefault(section, {})[key] = _checked(_argument(where, f"{section}.{key}"), where, value)
    for section in ("model", "data", "trainer"):
        for key, value in (out.get(section) or {}).items():
            _check_range(f"{section}.{key}", value, "base: ")
    model = out.get("model") or {}
    if not model.get("model") and not model.get("init_from"):
        raise ValueError("base.model needs `model` (a preset such as llama-3.1-8b, or a config.json) or `init_from`")
    if "data" in base and not (out.get("data") or {}).get("path"):
        raise ValueError(
            "base.data needs `path` (a text, JSONL or token file every node reads, or builtin:python-docs)"
        )
    return {k: out.get(k, base[k]) for k in base}  # in the file's order, an empty section as written


def _range_checks() -> dict[str, Callable[..., None]]:
    from megatrain_lightning.lightning.data import check_data_args
    from megatrain_lightning.lightning.module import check_optimizer_args
    from megatrain_lightning.lightning.strategy import check_trainer_args

    return {"model": check_optimizer_args, "data": check_data_args, "trainer": check_trainer_args}


def _check_range(key: str, value: Any, where: str) -> None:
    """A model, data or trainer number out of its valid range (``model.lr: -1``), by the same check as
    ``megatrain fit`` (each names the value and the range); other keys pass."""
    section, _, name = key.partition(".")
    check = _range_checks().get(section)
    if check is None or name not in inspect.signature(check).parameters:
        return
    try:
        check(**{name: value})
    except ValueError as err:
        raise ValueError(f"{where}{err}") from None


def _argument(where: str, key: str) -> TypeAdapter | None:
    """The type of the keyword argument that `key` (dotted: `section.name[.deeper]`, or `seed`) sets, as a
    TypeAdapter; None where any value goes (a key below an argument, a section that takes ``**kwargs``)."""
    section, _, rest = key.partition(".")
    if section == "seed":
        if rest:
            raise ValueError(f"{where}: seed takes no sub-keys")
        return _INT
    if section not in ("model", "data", "trainer") or not rest:
        raise ValueError(f"{where} must start with model., data., trainer. (or be seed)")
    name, _, deeper = rest.partition(".")
    params = _parameters(section)
    if params is None:
        return None
    if section == "trainer" and name in TRAINER_RESERVED:
        raise ValueError(
            f"{where}: the sweep sets trainer.{name} itself (strategy=megatrain, its checkpoint and report "
            "callbacks); remove it"
        )
    if name not in params:
        close = [p for p in params if p.lower().startswith(name.lower()[:3])][:5]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ValueError(
            f"{where}: {name!r} is not an argument of the {section} section{hint}; valid: {', '.join(params)}"
        )
    return None if deeper else params[name]


@functools.cache
def _parameters(section: str) -> dict[str, TypeAdapter] | None:
    """Keyword arguments (name -> type) of the class a base section configures; None: any keyword."""
    if section == "model":
        from megatrain_lightning.lightning.module import CausalLMModule as target
    elif section == "data":
        from megatrain_lightning.lightning.data import TextDataModule as target
    else:
        import lightning.pytorch as L

        target = L.Trainer
    params = [p for p in inspect.signature(target.__init__, eval_str=True).parameters.values() if p.name != "self"]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    known = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    # A class pydantic does not know (a Logger, a Callback) is checked with isinstance.
    any_class = ConfigDict(arbitrary_types_allowed=True)
    return {p.name: TypeAdapter(Any if p.annotation is p.empty else p.annotation, config=any_class) for p in known}


def _check_sampler(key: str, spec: dict[str, list]) -> dict[str, list]:
    adapter = _argument(f"search_space key {key!r}", key)
    if len(spec) != 1:
        raise ValueError(f"search_space.{key} must be one of {{{'|'.join(SAMPLERS)}: [...]}}, got {spec!r}")
    ((kind, values),) = spec.items()
    where = f"search_space.{key}.{kind}"
    if kind not in SAMPLERS:
        raise ValueError(f"search_space.{key}: unknown sampler {kind!r}; use one of {', '.join(SAMPLERS)}")
    if not values:
        raise ValueError(f"{where} takes a non-empty list")
    if kind in ("grid", "choice"):
        checked = [_checked(adapter, where, value) for value in values]
        for value in checked:
            _check_range(key, value, f"{where}: ")
        return {kind: checked}
    if len(values) != 2:
        raise ValueError(f"{where} takes [low, high], got {values!r}")
    low, high = (_checked(_INT if kind == "randint" else _NUMBER, where, value) for value in values)
    for value in (low, high):
        _check_range(key, value, f"{where}: ")
    if not low < high:
        raise ValueError(f"{where}: low {low!r} must be below high {high!r}")
    if kind == "loguniform" and low <= 0:
        raise ValueError(f"{where}: low {low!r} must be above 0")
    return {kind: [low, high]}


# ---------------------------------------------------------------------------------------- the file


# Unknown keys are refused: a misspelt option would otherwise silently keep its default.
_SECTION = ConfigDict(extra="forbid")


@dataclass(config=_SECTION)
class Resources:
    cpus_per_trial: Annotated[Number, Field(gt=0)] = 1
    """CPU cores Ray reserves per trial (the host optimizer and data loading use them)."""
    gpus_per_trial: Literal[1] = 1
    """GPUs per trial: one, a trial is a single-GPU trainer."""
    node_resource: Annotated[str, Field(min_length=1)] | None = None
    """A custom node resource (e.g. `bigmem`) that only the big-memory nodes declare; None: no such filter."""
    memory_headroom: Annotated[str, AfterValidator(_check_size)] = "4GiB"
    """Host memory added to the planner's figure for the Python process, data and allocator slack."""


_ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
"""Each engine option's default, as EngineConfig declares it (the trial strategy's keys default to them)."""


@dataclass(config=_SECTION)
class TrialStrategy:
    """Options of each trial's ``MegatrainStrategy`` (the trial builds the strategy itself, so
    ``base.trainer.strategy`` cannot set them). None of them changes what a trial computes: training is
    bit-identical across host layouts, with or without the NVMe tier, and at any thread count. Each is the
    engine option of its name (engine/config.py): its default and the engine's check, with what a sweep adds
    (host_layout "auto", an absolute nvme_dir, threads against the cores Ray reserves)."""

    host_layout: Annotated[str, BeforeValidator(functools.partial(check_host_layout, allow_auto=True))] = (
        _ENGINE_DEFAULTS["host_layout"]
    )
    """"default" (16 B/param in bf16), "lean" (12) or "auto": the first of default, lean and (given
    `nvme_dir`) lean with Adam on NVMe whose memory request fits the largest node that can run a trial,
    chosen by the driver once the cluster is known (ray_jobs/resources.py)."""
    nvme_dir: Annotated[str | None, AfterValidator(_check_nvme_dir)] = _ENGINE_DEFAULTS["nvme_dir"]
    """An absolute local directory on every node that runs trials (not a URL): the Adam moments go there,
    8 B/param per trial, taking them off the memory request. Each trial uses its own subdirectory."""
    host_threads: Annotated[Int, Field(ge=1)] | None = _ENGINE_DEFAULTS["host_threads"]
    """Threads of the trial's host optimizer; None: resources.cpus_per_trial minus one (at least 1). Checked
    against cpus_per_trial, not this machine's cores (the engine's check): trials run on other nodes."""


@dataclass(config=_SECTION)
class Scaling:
    """One run over several workers (Ray Train): each worker is one data-parallel rank of
    ``Trainer(strategy="megatrain")``, the ranks together holding one copy of the host state."""

    num_workers: Annotated[Int, Field(ge=1)]
    """Workers (ranks) of the run, one device each; Ray places them on any nodes that have room."""
    use_gpu: bool = True
    """Each worker on a GPU (NCCL); false: on the CPU (gloo), for trying a run anywhere."""
    cpus_per_worker: Annotated[Number, Field(gt=0)] = 1
    """CPU cores Ray reserves per worker (its share of the host optimizer and data loading)."""
    node_resource: Annotated[str, Field(min_length=1)] | None = None
    """A custom node resource (e.g. `bigmem`) that only the big-memory nodes declare; None: no such filter."""
    memory_headroom: Annotated[str, AfterValidator(_check_size)] = "4GiB"
    """Host memory added to the planner's per-worker figure for the Python process, data and allocator slack."""


def _check_scaled_trainer(base: dict[str, Any], where: str) -> None:
    """With `scaling`, Ray decides the ranks and each worker's device: the trainer keys that would say otherwise
    are refused."""
    said = sorted(set(base.get("trainer") or {}) & {"devices", "num_nodes", "plugins", "accelerator"})
    if said:
        raise ValueError(
            f"{where}base.trainer sets {said}, but with `scaling` Ray gives each of scaling.num_workers workers its "
            "device (scaling.use_gpu) and cluster environment: remove them"
        )


@dataclass(config=_SECTION)
class SweepConfig:
    name: Annotated[str, AfterValidator(_check_name)]
    """Sweep name: its directory under `storage` and Ray's experiment name."""
    storage: Annotated[str, AfterValidator(_expand_home)]
    """fsspec URL of shared storage (s3://..., or a directory every node mounts; `~` is the driver's home)."""
    base: dict[str, Any]
    """The base training config: `model`, `data`, `trainer` sections as for `megatrain fit`, optional `seed`."""
    search_space: dict[str, dict[str, list]] = field(default_factory=dict)
    """Dotted key into `base` -> {grid|choice|uniform|loguniform|randint: [...]}."""
    num_samples: Annotated[Int, Field(ge=1)] = 1
    scheduler: dict[str, Any] = field(default_factory=lambda: {"type": "none"})
    max_concurrent_trials: Annotated[Int, Field(ge=0)] = 0
    """0: as many as the cluster fits."""
    failure_budget: Annotated[Int, Field(ge=0)] = 2
    """Retries per trial; a trial that fails more often counts as errored and fails the job."""
    checkpoint_every: Annotated[Int, Field(ge=1)] = 100
    metric: Annotated[str, Field(min_length=1)] = "val_loss"
    mode: Literal["min", "max"] = "min"
    resources: Resources = field(default_factory=Resources)
    strategy: TrialStrategy = field(default_factory=TrialStrategy)
    scaling: Scaling | None = None
    """Each trial a Ray Train run of `scaling.num_workers` workers (then `resources` is not used); None: each
    trial one single-GPU trainer in one process, as `resources` says."""

    def __post_init__(self) -> None:
        """What the types above cannot say (each message names its key)."""
        self.base = _check_base(self.base)
        if self.scaling is not None:
            _check_scaled_trainer(self.base, "")
        self.search_space = {key: _check_sampler(key, spec) for key, spec in self.search_space.items()}
        self.scheduler = _check_scheduler(self.scheduler)
        threads = self.strategy.host_threads
        cpus, key = (
            (self.scaling.cpus_per_worker, "scaling.cpus_per_worker")
            if self.scaling is not None
            else (self.resources.cpus_per_trial, "resources.cpus_per_trial")
        )
        if threads is not None and threads > cpus:
            raise ValueError(
                f"strategy.host_threads={threads} is more than the {cpus:g} cores Ray reserves per "
                f"{key.split('.')[0] == 'scaling' and 'worker' or 'trial'} ({key}): raise {key.split('.')[1]} to "
                f"{threads} or lower host_threads"
            )

    @property
    def root(self) -> str:
        return f"{self.storage.rstrip('/')}/{self.name}"


@dataclass(config=_SECTION)
class TrainConfig:
    """One run over several workers (``python -m ray_jobs.train``): a sweep file's keys for one trial.

    ```yaml
    name: tiny-dp                      # the run's directory under `storage`, and Ray Train's run name
    storage: s3://bucket/runs          # any fsspec URL all nodes reach
    base: {model: {model: tiny}, data: {path: "builtin:python-docs"}, trainer: {max_steps: 40}}
    scaling: {num_workers: 2, use_gpu: true, cpus_per_worker: 8, node_resource: bigmem}
    checkpoint_every: 100              # optimizer steps between checkpoints (and one at the end)
    num_to_keep: 2                     # checkpoints kept in storage (Ray Train's CheckpointConfig)
    failure_budget: 3                  # restarts of the workers (Ray Train's FailureConfig.max_failures)
    strategy: {host_layout: default}
    ```
    """

    name: Annotated[str, AfterValidator(_check_name)]
    """The run's directory under `storage` and Ray Train's run name: resubmitting the same name resumes it."""
    storage: Annotated[str, AfterValidator(_expand_home)]
    """fsspec URL of shared storage (s3://..., or a directory every node mounts; `~` is the driver's home)."""
    base: dict[str, Any]
    """The training config: `model`, `data`, `trainer` sections as for `megatrain fit`, optional `seed`."""
    scaling: Scaling
    checkpoint_every: Annotated[Int, Field(ge=1)] = 100
    num_to_keep: Annotated[Int, Field(ge=1)] = 2
    failure_budget: Annotated[Int, Field(ge=0)] = 2
    """Times the workers are restarted from the last checkpoint after one dies; beyond it the job fails."""
    strategy: TrialStrategy = field(default_factory=TrialStrategy)

    def __post_init__(self) -> None:
        self.base = _check_base(self.base)
        _check_scaled_trainer(self.base, "")
        threads, cpus = self.strategy.host_threads, self.scaling.cpus_per_worker
        if threads is not None and threads > cpus:
            raise ValueError(
                f"strategy.host_threads={threads} is more than the {cpus:g} cores Ray reserves per worker "
                f"(scaling.cpus_per_worker): raise cpus_per_worker to {threads} or lower host_threads"
            )

    @property
    def root(self) -> str:
        return f"{self.storage.rstrip('/')}/{self.name}"


_SWEEP = TypeAdapter(SweepConfig)
_TRAIN = TypeAdapter(TrainConfig)


# ---------------------------------------------------------------------------------------------- finding


def shipped_config_dirs() -> list[Path]:
    """Where the project's own `configs/` are: inside the installed package (a wheel ships them as
    `megatrain_lightning/configs`), and in the source checkout this module runs from (an editable install,
    whose import hooks do not expose `megatrain_lightning/configs`)."""
    dirs = []
    spec = importlib.util.find_spec("megatrain_lightning")
    for location in (spec.submodule_search_locations or []) if spec else []:
        dirs.append(Path(location) / "configs")
    checkout = Path(__file__).resolve().parents[1]
    if (checkout / "pyproject.toml").is_file():
        dirs.append(checkout / "configs")
    return list(dict.fromkeys(d for d in dirs if d.is_dir()))


def resolve(config: str | Path, kind: str = "sweep") -> str:
    """The `kind` file (sweep, or run: see :class:`TrainConfig`) `config` names: a URL as is; a path as given
    (absolute, or relative to the current directory); else a relative path looked up among the shipped
    configs, with or without its leading `configs/` (so `configs/sweep/tiny-lr.yaml` works wherever the
    driver runs, e.g. in the head node's start directory when `ray job submit` has no `--working-dir`)."""
    text = str(config)
    if "://" in text:
        return text
    path = Path(text).expanduser()
    if path.is_file():
        return str(path)
    tried = [str(path if path.is_absolute() else Path.cwd() / path)]
    if not path.is_absolute():
        rel = Path(*path.parts[1:]) if path.parts[:1] == ("configs",) and len(path.parts) > 1 else path
        for base in shipped_config_dirs():
            candidate = base / rel
            if candidate.is_file():
                return str(candidate)
            tried.append(str(candidate))
    shipped = sorted(f"configs/{kind}/{p.name}" for d in shipped_config_dirs()[:1] for p in (d / kind).glob("*.yaml"))
    raise SweepConfigError(
        f"{kind} config {text} not found (tried {', '.join(tried)}); pass a path that exists where the driver "
        f"runs (`ray job submit --working-dir DIR` ships DIR there), a URL on shared storage, "
        f"or a shipped {kind}: {', '.join(shipped) or 'none found'}"
    )


def is_shipped(path: str) -> bool:
    """Whether `path` (as :func:`resolve` returned it) is one of the configs shipped with the package."""
    return "://" not in path and any(Path(path).resolve().is_relative_to(d.resolve()) for d in shipped_config_dirs())


# ---------------------------------------------------------------------------------------------- loading


def load(path: str | Path, schema: type = SweepConfig) -> Any:
    """Read and check a sweep file, or with ``schema=TrainConfig`` a run file (a path, see :func:`resolve`, or an
    fsspec URL)."""
    kind = "run" if schema is TrainConfig else "sweep"
    where = resolve(path, kind)
    try:
        if "://" in where:
            import fsspec

            with fsspec.open(where, "rt") as f:
                text = f.read()
        else:
            text = Path(where).read_text()
    except Exception as err:  # noqa: BLE001  (any storage backend's error)
        raise SweepConfigError(f"{kind} config {where} cannot be read: {error_line(err)}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise SweepConfigError(
            f"{where}: not valid YAML{at}: {getattr(err, 'problem', None) or error_line(err)}"
        ) from None
    return from_dict(raw if raw is not None else {}, where, schema)


def from_dict(raw: Any, where: str = "<sweep>", schema: type = SweepConfig) -> Any:
    """A checked :class:`SweepConfig` (or `schema`) from the parsed YAML mapping `raw`; `where` names it in
    errors. A key left empty (None) takes its default."""
    if not isinstance(raw, dict):
        got = type(raw).__name__
        kind = "run" if schema is TrainConfig else "sweep"
        raise SweepConfigError(f"{where}: a {kind} file is a mapping of keys (name, storage, base, ...), got {got}")
    try:
        return (_TRAIN if schema is TrainConfig else _SWEEP).validate_python(
            {k: v for k, v in raw.items() if v is not None}
        )
    except ValidationError as err:
        raise SweepConfigError(f"{where}: {_describe(err.errors(), schema)}") from None


# Reported first, as a whole: a misspelt or missing key explains the errors that follow from it.
_FIRST = ("unexpected_keyword_argument", "missing")
_PHRASES = {"greater_than_equal": "must be an integer >= {ge}", "greater_than": "must be a number above {gt}"}


def _describe(errors: list[Any], schema: type = SweepConfig) -> str:
    """Pydantic's errors as one line: the first one's dotted key, its value and the fix."""
    errors = sorted(errors, key=lambda e: _FIRST.index(e["type"]) if e["type"] in _FIRST else len(_FIRST))
    first = errors[0]
    kind, loc, value = first["type"], tuple(str(part) for part in first["loc"]), first["input"]
    key, parent = ".".join(loc), ".".join(loc[:-1])
    if kind == "value_error":  # from a check here, or the engine's
        text = str(first["ctx"]["error"])
        if loc and not text.startswith(loc[-1]):  # about the value alone (parse_size's)
            return f"{key}: {text}"
        return f"{parent}.{text}" if parent else text  # it names its key (the engine's: the last part)
    if kind in _FIRST:
        keys = [e["loc"][-1] for e in errors if e["type"] == kind and e["loc"][:-1] == first["loc"][:-1]]
        if kind == "missing":
            return f"missing {keys} (see ray_jobs/config.py for a complete example)"
        section = {"": schema, "resources": Resources, "strategy": TrialStrategy, "scaling": Scaling}[parent]
        known = [f.name for f in dataclasses.fields(section)]
        return f"{parent + ': ' if parent else ''}unknown keys {sorted(keys)}; known keys are {known}"
    phrase = _PHRASES.get(kind)
    return f"{key}={value!r} {phrase.format(**first['ctx'])}" if phrase else f"{key}={value!r}: {first['msg']}"


def error_line(err: BaseException) -> str:
    """An exception as one line of at most ~300 characters: its type and message."""
    text = " ".join(str(err).split())
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


# ----------------------------------------------------------------------------------- the stored record


def as_dict(cfg: SweepConfig) -> dict[str, Any]:
    """The whole sweep file, defaults filled in, as plain YAML values (what `sweep.yaml` stores)."""
    out = yaml.safe_load(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    if out.get("scaling", True) is None:
        del out["scaling"]  # a sweep of single-GPU trials: its record as before `scaling` existed
    return out


# Keys of `scaling` that say where a trial's or run's workers may run, not how many: they may change too.
SCALING_MAY_CHANGE = ("scaling.use_gpu", "scaling.cpus_per_worker", "scaling.node_resource", "scaling.memory_headroom")
# A run (not a sweep, whose Tune experiment keeps them) may also change these on resubmission.
RUN_MAY_CHANGE = ("checkpoint_every", "num_to_keep", "failure_budget")


def changes(stored: dict[str, Any], current: dict[str, Any], run: bool = False) -> list[str]:
    """What differs between a sweep's stored config and `current`, one `key: old -> new` per leaf.

    `name` and `storage` (where the sweep lives), `resources` (where its trials may run) and `strategy`
    (how much memory a trial needs; training is bit-identical across its options) may change, and do apply
    to resumed trials; anything else changes what the trials compute or how Ray schedules them, which
    restoring the stored sweep would not honour. Of `scaling`, the workers' resources may change, not their
    number (it is the data-parallel world: each global batch is num_workers micro-batches). A `run`
    (:class:`TrainConfig`) may also change :data:`RUN_MAY_CHANGE`, which Ray Train does not keep with the run.
    """
    a, b = _flatten(stored), _flatten(current)
    out = []
    for key in sorted(set(a) | set(b)):
        if key.split(".", 1)[0] in RESTORE_MAY_CHANGE or key in SCALING_MAY_CHANGE or (run and key in RUN_MAY_CHANGE):
            continue
        if key not in a:
            out.append(f"{key}: added ({b[key]!r})")
        elif key not in b:
            out.append(f"{key}: removed (was {a[key]!r})")
        elif a[key] != b[key]:
            out.append(f"{key}: {a[key]!r} -> {b[key]!r}")
    return out


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict) or (prefix and not d):
        return {prefix.rstrip("."): d} if prefix else {}
    out: dict[str, Any] = {}
    for key, value in d.items():
        out.update(_flatten(value, f"{prefix}{key}."))
    return out


# ------------------------------------------------------------------------------------------- for Ray


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

    build = {
        "grid": tune.grid_search,
        "choice": tune.choice,
        "uniform": lambda a: tune.uniform(*a),
        "loguniform": lambda a: tune.loguniform(*a),
        "randint": lambda a: tune.randint(*a),
    }
    return {key: build[kind](values) for key, spec in cfg.search_space.items() for kind, values in spec.items()}
