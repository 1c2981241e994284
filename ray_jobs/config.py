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
```

Write numbers in exponent form with a dot and a signed exponent (``1.0e-5``): YAML reads ``1e-5`` as a
string, which is refused.

Where the file is looked up: see :func:`resolve`. Everything is checked here, in the driver, before
anything runs on the cluster; an error is one line naming the file, the key and the fix.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import inspect
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import yaml

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


@dataclass
class Resources:
    cpus_per_trial: float = 1
    """CPU cores Ray reserves per trial (the host optimizer and data loading use them)."""
    gpus_per_trial: int = 1
    """GPUs per trial: one, a trial is a single-GPU trainer."""
    node_resource: str | None = None
    """A custom node resource (e.g. `bigmem`) that only the big-memory nodes declare; None: no such filter."""
    memory_headroom: str = "4GiB"
    """Host memory added to the planner's figure for the Python process, data and allocator slack."""


@dataclass
class TrialStrategy:
    """Options of each trial's ``MegatrainStrategy`` (the trial builds the strategy itself, so
    ``base.trainer.strategy`` cannot set them). None of them changes what a trial computes: training is
    bit-identical across host layouts, with or without the NVMe tier, and at any thread count."""

    host_layout: Literal["default", "lean", "auto"] = "default"
    """"default" (16 B/param in bf16), "lean" (12) or "auto": the first of default, lean and (given
    `nvme_dir`) lean with Adam on NVMe whose memory request fits the largest node that can run a trial,
    chosen by the driver once the cluster is known (ray_jobs/resources.py)."""
    nvme_dir: str | None = None
    """An absolute local directory on every node that runs trials (not a URL): the Adam moments go there,
    8 B/param per trial, taking them off the memory request. Each trial uses its own subdirectory."""
    host_threads: int | None = None
    """Threads of the trial's host optimizer; None: resources.cpus_per_trial minus one (at least 1)."""


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
    strategy: TrialStrategy = field(default_factory=TrialStrategy)

    @property
    def root(self) -> str:
        return f"{self.storage.rstrip('/')}/{self.name}"


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


def resolve(config: str | Path) -> str:
    """The sweep file `config` names: a URL as is; a path as given (absolute, or relative to the current
    directory); else a relative path looked up among the shipped configs, with or without its leading
    `configs/` (so `configs/sweep/tiny-lr.yaml` works wherever the driver runs, e.g. in the head node's
    start directory when `ray job submit` has no `--working-dir`)."""
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
    shipped = sorted(f"configs/sweep/{p.name}" for d in shipped_config_dirs()[:1] for p in (d / "sweep").glob("*.yaml"))
    raise SweepConfigError(
        f"sweep config {text} not found (tried {', '.join(tried)}); pass a path that exists where the driver "
        f"runs (`ray job submit --working-dir DIR` ships DIR there), a URL on shared storage, "
        f"or a shipped sweep: {', '.join(shipped) or 'none found'}"
    )


def is_shipped(path: str) -> bool:
    """Whether `path` (as :func:`resolve` returned it) is one of the configs shipped with the package."""
    return "://" not in path and any(Path(path).resolve().is_relative_to(d.resolve()) for d in shipped_config_dirs())


# ---------------------------------------------------------------------------------------------- loading


def load(path: str | Path) -> SweepConfig:
    """Read and check a sweep file (a path, see :func:`resolve`, or an fsspec URL)."""
    where = resolve(path)
    try:
        if "://" in where:
            import fsspec

            with fsspec.open(where, "rt") as f:
                text = f.read()
        else:
            text = Path(where).read_text()
    except Exception as err:  # noqa: BLE001  (any storage backend's error)
        raise SweepConfigError(f"sweep config {where} cannot be read: {one_line(err)}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise SweepConfigError(
            f"{where}: not valid YAML{at}: {getattr(err, 'problem', None) or one_line(err)}"
        ) from None
    return from_dict(raw if raw is not None else {}, where)


def from_dict(raw: Any, where: str = "<sweep>") -> SweepConfig:
    """A checked :class:`SweepConfig` from the parsed YAML mapping `raw`; `where` names it in errors."""
    if not isinstance(raw, dict):
        got = type(raw).__name__
        raise SweepConfigError(f"{where}: a sweep file is a mapping of keys (name, storage, base, ...), got {got}")
    known = [f.name for f in fields(SweepConfig)]
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise SweepConfigError(f"{where}: unknown keys {unknown}; known keys are {sorted(known)}")
    missing = [k for k in ("name", "storage", "base") if not raw.get(k)]
    if missing:
        raise SweepConfigError(f"{where}: missing {missing} (see ray_jobs/config.py for a complete example)")
    raw = dict(raw)
    raw["resources"] = _section(raw, "resources", Resources, where)
    raw["strategy"] = _section(raw, "strategy", TrialStrategy, where)
    cfg = SweepConfig(**raw)
    _check(cfg, where)
    return cfg


def _section(raw: dict[str, Any], key: str, cls: type, where: str) -> Any:
    """The mapping `raw[key]` as a `cls` dataclass (its defaults where it is absent)."""
    values = raw.get(key) or {}
    known = [f.name for f in fields(cls)]
    if not isinstance(values, dict) or set(values) - set(known):
        bad = sorted(set(values) - set(known)) if isinstance(values, dict) else values
        raise SweepConfigError(f"{where}: {key}: unknown keys {bad}; known keys are {known}")
    return cls(**values)


def _check(cfg: SweepConfig, where: str) -> None:
    def fail(msg: str) -> None:
        raise SweepConfigError(f"{where}: {msg}")

    if not isinstance(cfg.name, str) or "/" in cfg.name or cfg.name.strip(". ") == "":
        fail(f"name={cfg.name!r} must be a plain directory name (no '/')")
    if not isinstance(cfg.storage, str):
        fail(f"storage={cfg.storage!r} must be a URL or directory, e.g. s3://bucket/sweeps")
    for key, low in (("num_samples", 1), ("max_concurrent_trials", 0), ("failure_budget", 0), ("checkpoint_every", 1)):
        value = getattr(cfg, key)
        if not _is_int(value) or value < low:
            fail(f"{key}={value!r} must be an integer >= {low}")
    if cfg.mode not in ("min", "max"):
        fail(f"mode={cfg.mode!r}; choose 'min' or 'max'")
    if not isinstance(cfg.metric, str) or not cfg.metric:
        fail(f"metric={cfg.metric!r} must be the name of a logged metric, e.g. val_loss")
    _check_scheduler(cfg.scheduler, fail)
    _check_resources(cfg.resources, fail)
    _check_strategy(cfg.strategy, cfg.resources, fail)
    _check_base(cfg.base, fail)
    if not isinstance(cfg.search_space, dict):
        fail(f"search_space must map dotted keys to {{sampler: [...]}}, got {cfg.search_space!r}")
    for key, spec in cfg.search_space.items():
        annotation = _check_key(str(key), fail, where_key=f"search_space key {key!r}")
        _check_sampler(key, spec, annotation, fail)


def _check_scheduler(scheduler: Any, fail) -> None:
    if not isinstance(scheduler, dict) or scheduler.get("type") not in ("none", "asha"):
        kind = scheduler.get("type") if isinstance(scheduler, dict) else scheduler
        fail(
            f"scheduler.type={kind!r}; choose 'asha' or 'none' (scheduler: {{type: asha, max_t: 10, grace_period: 2}})"
        )
    extra = sorted(set(scheduler) - {"type"} - (set(ASHA_KEYS) if scheduler["type"] == "asha" else set()))
    if extra:
        allowed = f"asha takes {list(ASHA_KEYS)}" if scheduler["type"] == "asha" else "type none takes no other keys"
        fail(f"scheduler: unknown keys {extra}; {allowed}")
    for key in ("max_t", "grace_period", "reduction_factor", "brackets"):
        value = scheduler.get(key, 1)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            fail(f"scheduler.{key}={value!r} must be a positive number")


def _check_resources(res: Resources, fail) -> None:
    from megatrain_lightning.planner import parse_size

    if res.gpus_per_trial != 1:
        fail(f"resources.gpus_per_trial={res.gpus_per_trial!r}; a trial is a single-GPU trainer, set it to 1")
    if (
        not isinstance(res.cpus_per_trial, (int, float))
        or isinstance(res.cpus_per_trial, bool)
        or res.cpus_per_trial <= 0
    ):
        fail(f"resources.cpus_per_trial={res.cpus_per_trial!r} must be a positive number")
    if res.node_resource is not None and (not isinstance(res.node_resource, str) or not res.node_resource):
        fail(f"resources.node_resource={res.node_resource!r} must be the name of a custom node resource, e.g. bigmem")
    try:
        parse_size(res.memory_headroom)
    except (ValueError, TypeError) as err:
        fail(f"resources.memory_headroom: {err}")


def _check_strategy(st: TrialStrategy, res: Resources, fail) -> None:
    from megatrain_lightning.planner import HOST_LAYOUTS

    if st.host_layout not in HOST_LAYOUTS:
        fail(
            f"strategy.host_layout={st.host_layout!r}; choose one of {', '.join(HOST_LAYOUTS)} (auto: the first of "
            "default, lean and lean with Adam on nvme_dir whose trials fit the largest node)"
        )
    if st.nvme_dir is not None:
        if not isinstance(st.nvme_dir, str) or not st.nvme_dir:
            fail(f"strategy.nvme_dir={st.nvme_dir!r} must be a local directory on every node, e.g. /mnt/nvme")
        if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", st.nvme_dir):
            fail(
                f"strategy.nvme_dir={st.nvme_dir!r} is a URL, but the Adam moments are read and written every "
                "step on a local drive: give a directory that exists on every node, e.g. /mnt/nvme (checkpoints "
                "go to `storage`)"
            )
        if not st.nvme_dir.startswith("/"):
            fail(
                f"strategy.nvme_dir={st.nvme_dir!r} is relative; trials run in Ray's directories on each node, so "
                "give an absolute path that exists on every node, e.g. /mnt/nvme"
            )
    if st.host_threads is not None:
        if not _is_int(st.host_threads) or st.host_threads < 1:
            fail(
                f"strategy.host_threads={st.host_threads!r} must be an integer >= 1, or unset for "
                "resources.cpus_per_trial minus one"
            )
        if st.host_threads > res.cpus_per_trial:
            fail(
                f"strategy.host_threads={st.host_threads} is more than the {res.cpus_per_trial:g} cores Ray "
                f"reserves per trial (resources.cpus_per_trial): raise cpus_per_trial to {st.host_threads} "
                "or lower host_threads"
            )


def _check_base(base: Any, fail) -> None:
    if not isinstance(base, dict):
        fail(f"base must be a mapping with model / data / trainer sections, got {base!r}")
    unknown = sorted(set(base) - set(SECTIONS))
    if unknown:
        fail(f"base: unknown sections {unknown}; a trial config has {list(SECTIONS)}")
    if "seed" in base and not _is_int(base["seed"]):
        fail(f"base.seed={base['seed']!r} must be an integer")
    for section in ("model", "data", "trainer"):
        values = base.get(section) or {}
        if not isinstance(values, dict):
            fail(f"base.{section} must be a mapping of keyword arguments, got {values!r}")
        for key, value in values.items():
            _check_key(f"{section}.{key}", fail, value=value, where_key=f"base.{section}.{key}")
    model = base.get("model") or {}
    if not model.get("model") and not model.get("init_from"):
        fail("base.model needs `model` (a preset such as llama-3.1-8b, or a config.json) or `init_from`")
    if "data" in base and not (base.get("data") or {}).get("path"):
        fail("base.data needs `path` (a text, JSONL or token file every node reads, or builtin:python-docs)")


_NO_VALUE = object()


def _check_key(key: str, fail, value: Any = _NO_VALUE, where_key: str = "") -> str:
    """`key` (dotted, `section.name[.deeper]`) must name a keyword argument of that section's class.
    Returns that argument's annotation as text ("" when unknown)."""
    section, _, rest = key.partition(".")
    if section == "seed":
        if rest:
            fail(f"{where_key}: seed takes no sub-keys")
        return "int"
    if section not in ("model", "data", "trainer") or not rest:
        fail(f"{where_key} must start with model., data., trainer. (or be seed)")
    name = rest.split(".", 1)[0]
    params = _parameters(section)
    if params is None:
        return ""
    if section == "trainer" and name in TRAINER_RESERVED:
        fail(
            f"{where_key}: the sweep sets trainer.{name} itself (strategy=megatrain, its checkpoint and report "
            "callbacks); remove it"
        )
    if name not in params:
        close = [p for p in params if p.lower().startswith(name.lower()[:3])][:5]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        fail(f"{where_key}: {name!r} is not an argument of the {section} section{hint}; valid: {', '.join(params)}")
    annotation = params[name] if "." not in rest else ""
    if value is not _NO_VALUE:
        _check_number(where_key, value, annotation, fail)
    return annotation


def _check_number(where_key: str, value: Any, annotation: str, fail) -> None:
    """A numeric argument given as text: YAML reads `1e-3` (no dot, or no exponent sign) as a string."""
    if not isinstance(value, str) or not _NUMERIC.search(annotation) or _TEXTUAL.search(annotation):
        return
    try:
        float(value)
    except ValueError:
        return  # not a number at all: the class's own check names it
    mantissa, e, exponent = value.strip().lower().partition("e")
    if e:
        mantissa = mantissa if "." in mantissa else f"{mantissa}.0"
        exponent = exponent if exponent[:1] in ("+", "-") else f"+{exponent}"
        fix = f"YAML reads {value} as a string; write {mantissa}e{exponent} (with a dot and a signed exponent)"
    else:
        fix = f"write {value.strip()} without quotes"
    fail(f"{where_key}: {value!r} is text, not a number: {fix}")


_NUMERIC = re.compile(r"\b(int|float)\b")
_TEXTUAL = re.compile(r"\b(str|Literal)\b")


def _parameters(section: str) -> dict[str, str] | None:
    """Keyword arguments (name -> annotation text) of the class a base section configures; None: any."""
    if section == "model":
        from megatrain_lightning.module import CausalLMModule as target
    elif section == "data":
        from megatrain_lightning.data import TextDataModule as target
    else:
        import lightning.pytorch as L

        target = L.Trainer
    sig = inspect.signature(target.__init__)
    params = [p for p in sig.parameters.values() if p.name != "self"]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name: str(p.annotation) for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _check_sampler(key: Any, spec: Any, annotation: str, fail) -> None:
    usage = f"{{{'|'.join(SAMPLERS)}: [...]}}"
    if not isinstance(spec, dict) or len(spec) != 1:
        fail(f"search_space.{key} must be one of {usage}, got {spec!r}")
    kind, values = next(iter(spec.items()))
    if kind not in SAMPLERS:
        fail(f"search_space.{key}: unknown sampler {kind!r}; use one of {', '.join(SAMPLERS)}")
    if not isinstance(values, list) or not values:
        fail(f"search_space.{key}.{kind} takes a non-empty list, got {values!r}")
    if kind in ("grid", "choice"):
        for value in values:
            _check_number(f"search_space.{key}.{kind}", value, annotation, fail)
        return
    if len(values) != 2:
        fail(f"search_space.{key}.{kind} takes [low, high], got {values!r}")
    for value in values:
        _check_number(f"search_space.{key}.{kind}", value, "float", fail)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            fail(f"search_space.{key}.{kind}: {value!r} must be a number")
    low, high = values
    if not low < high:
        fail(f"search_space.{key}.{kind}: low {low!r} must be below high {high!r}")
    if kind == "loguniform" and low <= 0:
        fail(f"search_space.{key}.loguniform: low {low!r} must be above 0")
    if kind == "randint" and not (_is_int(low) and _is_int(high)):
        fail(f"search_space.{key}.randint takes integers [low, high), got {values!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def one_line(err: BaseException) -> str:
    """An exception as one line of at most ~300 characters: its type and message."""
    text = " ".join(str(err).split())
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


# ----------------------------------------------------------------------------------- the stored record


def as_dict(cfg: SweepConfig) -> dict[str, Any]:
    """The whole sweep file, defaults filled in, as plain YAML values (what `sweep.yaml` stores)."""
    return yaml.safe_load(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))


def changes(stored: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs between a sweep's stored config and `current`, one `key: old -> new` per leaf.

    `name` and `storage` (where the sweep lives), `resources` (where its trials may run) and `strategy`
    (how much memory a trial needs; training is bit-identical across its options) may change, and do apply
    to resumed trials; anything else changes what the trials compute or how Ray schedules them, which
    restoring the stored sweep would not honour.
    """
    a, b = _flatten(stored), _flatten(current)
    out = []
    for key in sorted(set(a) | set(b)):
        if key.split(".", 1)[0] in RESTORE_MAY_CHANGE:
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
