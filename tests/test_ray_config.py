"""The sweep driver's checks, without a Ray cluster: where the sweep file is found (and that a wheel ships
it), refusing an edited sweep instead of restoring the stored one, one-line errors for bad input, the
files a trial leaves, and test hygiene (nothing left in /tmp)."""

from __future__ import annotations

import fnmatch
import json
import os
import runpy
import tempfile
import types
import warnings
from pathlib import Path

import pytest
import yaml

from ray_jobs import config as config_mod
from ray_jobs.config import SweepConfigError, as_dict, changes, load, resolve
from ray_jobs.sweep import SweepChanged, check_unchanged, main, record_config, stored_config

REPO = Path(__file__).resolve().parents[1]
BASE = {
    "seed": 0,
    "model": {"model": "tiny", "warmup_steps": 5},
    "data": {"path": "builtin:python-docs", "seq_len": 64, "batch_size": 8},
    "trainer": {"max_steps": 30, "precision": "32-true", "val_check_interval": 10},
}


def sweep_file(tmp_path: Path, name: str = "cfg", **overrides) -> str:
    cfg = {
        "name": name,
        "storage": str(tmp_path / "storage"),
        "base": BASE,
        "search_space": {"model.lr": {"grid": [1.0e-3, 3.0e-3]}},
        "checkpoint_every": 10,
    }
    cfg.update(overrides)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.fixture
def no_ray(monkeypatch):
    """The driver must stop before it contacts a cluster."""
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("ray.init called")

    monkeypatch.setattr(ray, "init", refuse)


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


# ------------------------------------------------------------------------------ finding the sweep file


def test_documented_config_path_works_from_any_directory(tmp_path, monkeypatch):
    """`ray job submit` without --working-dir runs the driver in the head node's start directory."""
    monkeypatch.chdir(tmp_path)
    path = resolve("configs/sweep/tiny-lr.yaml")
    assert Path(path).read_text() == (REPO / "configs/sweep/tiny-lr.yaml").read_text()
    assert load("configs/sweep/tiny-lr.yaml").name == "tiny-lr"
    assert load("sweep/llama-8b-lr.yaml").name == "llama-8b-lr"  # relative to configs/ too


def test_a_file_in_the_current_directory_wins_over_the_shipped_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs" / "sweep").mkdir(parents=True)
    Path(sweep_file(tmp_path, "mine")).rename(tmp_path / "configs/sweep/tiny-lr.yaml")
    assert resolve("configs/sweep/tiny-lr.yaml") == "configs/sweep/tiny-lr.yaml"
    assert load("configs/sweep/tiny-lr.yaml").name == "mine"


def test_missing_config_is_one_line_naming_the_paths_tried(tmp_path, monkeypatch, capsys, no_ray):
    monkeypatch.chdir(tmp_path)
    assert main(["--config", "configs/sweep/nope.yaml"]) == 2
    err = one_line_error(capsys)
    assert f"{tmp_path}/configs/sweep/nope.yaml" in err and f"{REPO}/configs/sweep/nope.yaml" in err
    assert "--working-dir" in err and "configs/sweep/tiny-lr.yaml" in err


def test_config_from_a_url(tmp_path):
    record_config(load(sweep_file(tmp_path, storage="memory://sweeps")))
    assert load("memory://sweeps/cfg/sweep.yaml").storage == "memory://sweeps"


def test_a_wheel_ships_configs_as_package_data(monkeypatch):
    """setup.py's packages, package_dir and package_data, after pyproject.toml's [tool.setuptools] is
    applied (a packages table there would replace setup.py's): every YAML file of configs/ is included."""
    import setuptools
    from setuptools.dist import Distribution

    captured: dict = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: captured.update(kw))
    monkeypatch.chdir(REPO)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runpy.run_path(str(REPO / "setup.py"))
        dist = Distribution(captured)
        dist.parse_config_files()
    dirs = {pkg: Path((dist.package_dir or {}).get(pkg, pkg.replace(".", "/"))) for pkg in dist.packages}
    shipped = {
        str(Path(d) / name)
        for pkg, d in dirs.items()
        for pattern in (dist.package_data or {}).get(pkg, [])
        for name in os.listdir(REPO / d)
        if fnmatch.fnmatch(name, pattern)
    }
    wanted = {str(p.relative_to(REPO)) for p in (REPO / "configs").rglob("*.yaml")}
    assert wanted and wanted <= shipped, sorted(wanted - shipped)
    assert dirs["megatrain_lightning.configs"] == Path("configs")  # installed as megatrain_lightning/configs
    python_packages = {
        str(p.parent.relative_to(REPO)).replace("/", ".")
        for top in ("megatrain_lightning", "ray_jobs")
        for p in (REPO / top).rglob("__init__.py")
    }
    assert python_packages <= set(dist.packages)


# ----------------------------------------------------------------------- an edited sweep is not restored


def test_resubmitting_an_edited_sweep_is_refused_with_what_changed(tmp_path, capsys, no_ray):
    path = sweep_file(tmp_path, "lr")
    cfg = load(path)
    assert stored_config(cfg) is None and not check_unchanged(cfg)
    record_config(cfg)  # what the first submission stores before Tune starts
    assert check_unchanged(cfg)  # the same file again: restored
    edited = sweep_file(
        tmp_path,
        "lr",
        base={**BASE, "trainer": {**BASE["trainer"], "max_steps": 60}},
        search_space={"model.lr": {"grid": [1.0e-3, 1.0e-2]}},
    )
    with pytest.raises(SweepChanged) as err:
        check_unchanged(load(edited))
    assert "base.trainer.max_steps: 30 -> 60" in str(err.value) and "search_space.model.lr.grid" in str(err.value)
    assert main(["--config", edited]) == 2
    err = one_line_error(capsys)
    assert "base.trainer.max_steps: 30 -> 60" in err and "new `name`" in err and f"{cfg.root}/sweep.yaml" in err
    # The stored record is a complete sweep file: resubmitting it continues the stored sweep.
    assert as_dict(load(f"{cfg.root}/sweep.yaml")) == as_dict(cfg)


def test_resources_may_change_on_resubmission(tmp_path):
    cfg = load(sweep_file(tmp_path, "res"))
    record_config(cfg)
    moved = load(sweep_file(tmp_path, "res", resources={"cpus_per_trial": 4, "memory_headroom": "2GiB"}))
    assert check_unchanged(moved)


def test_changes_lists_added_removed_and_changed_leaves():
    a = {"name": "a", "base": {"model": {"lr": 1.0}}, "num_samples": 1, "resources": {"cpus_per_trial": 1}}
    b = {"name": "b", "base": {"model": {"lr": 2.0, "warmup_steps": 3}}, "resources": {"cpus_per_trial": 8}}
    assert changes(a, b) == [
        "base.model.lr: 1.0 -> 2.0",
        "base.model.warmup_steps: added (3)",
        "num_samples: removed (was 1)",
    ]


# ------------------------------------------------------------------------------- bad input: one line


BAD = [
    ({"serach_space": {}}, "unknown keys ['serach_space']"),
    ({"storage": None}, "missing ['storage']"),
    ({"search_space": {"model.lr": {"logunif": [1.0e-5, 1.0e-3]}}}, "unknown sampler 'logunif'"),
    ({"search_space": {"model.lr": {"loguniform": ["fast", 1.0e-3]}}}, "model.lr.loguniform='fast': Input should be"),
    ({"search_space": {"model.lr": {"uniform": [1.0, 0.5]}}}, "low 1.0 must be below high 0.5"),
    ({"search_space": {"model.learning_rate": {"grid": [0.1]}}}, "'learning_rate' is not an argument of the model"),
    ({"search_space": {"optim.lr": {"grid": [0.1]}}}, "must start with model., data., trainer."),
    ({"base": {**BASE, "model": {"model": "tiny", "lr": "x"}}}, "base.model.lr='x': Input should be a valid number"),
    ({"base": {**BASE, "trainer": {"max_steps": "1e3"}}}, "trainer.max_steps='1e3': Input should be a valid integer"),
    ({"base": {**BASE, "trainer": {"max_step": 5}}}, "'max_step' is not an argument of the trainer section"),
    ({"base": {**BASE, "trainer": {"strategy": "ddp"}}}, "the sweep sets trainer.strategy itself"),
    ({"base": {**BASE, "optimizer": {}}}, "unknown sections ['optimizer']"),
    ({"base": {**BASE, "model": {"model": "llama-9b"}}}, "model='llama-9b' is neither a preset"),
    ({"base": {**BASE, "data": {"seq_len": 64}}}, "base.data needs `path`"),
    ({"scheduler": {"type": "hyperband"}}, "scheduler.type='hyperband'"),
    ({"scheduler": {"type": "asha", "grace": 2}}, "unknown keys ['grace']; asha takes"),
    ({"resources": {"cpus": 2}}, "resources: unknown keys ['cpus']"),
    ({"resources": {"gpus_per_trial": 2}}, "gpus_per_trial=2"),
    ({"resources": {"memory_headroom": "8g"}}, "unit 'g' is ambiguous"),
    ({"num_samples": 0}, "num_samples=0 must be an integer >= 1"),
    ({"storage": "nosuch://bucket/sweeps"}, "storage nosuch://bucket/sweeps cannot be read"),
]


@pytest.mark.parametrize("overrides,expected", BAD, ids=[e for _, e in BAD])
def test_bad_input_ends_in_one_line_naming_value_and_fix(tmp_path, capsys, no_ray, overrides, expected):
    assert main(["--config", sweep_file(tmp_path, **overrides)]) == 2
    err = one_line_error(capsys)
    assert expected in err and err.startswith("sweep: ")


def test_not_yaml_is_one_line_with_the_position(tmp_path, capsys, no_ray):
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\nstorage: [/tmp/x\nbase: 3\n")
    assert main(["--config", str(path)]) == 2
    assert "not valid YAML at line 3" in one_line_error(capsys)


def test_no_cluster_is_one_line(tmp_path, capsys, monkeypatch):
    import ray

    def no_cluster(*args, **kwargs):
        raise ConnectionError("Could not find any running Ray instance.\nPlease specify one.")

    monkeypatch.setattr(ray, "init", no_cluster)
    assert main(["--config", sweep_file(tmp_path)]) == 2
    err = one_line_error(capsys)
    assert "no Ray cluster at auto" in err and "ray start --head" in err


def test_shipped_sweeps_pass_the_checks():
    shipped = sorted((REPO / "configs/sweep").glob("*.yaml"))
    assert {"llama-8b-lr.yaml", "tiny-lr.yaml"} <= {p.name for p in shipped}, shipped  # the loop checks something
    for path in shipped:
        load(path)


def test_shipped_tiny_configs_write_under_the_users_own_home(tmp_path, monkeypatch):
    """Two users of one machine must not share a run directory (a fixed path under /tmp did): `~` expands to the
    driver's home."""
    from ray_jobs.config import TrainConfig

    monkeypatch.setenv("HOME", str(tmp_path))
    assert load(REPO / "configs/sweep/tiny-lr.yaml").root == f"{tmp_path}/megatrain_runs/sweeps/tiny-lr"
    assert load(REPO / "configs/run/tiny-dp.yaml", TrainConfig).root == f"{tmp_path}/megatrain_runs/runs/tiny-dp"
    assert load(sweep_file(tmp_path, storage="s3://bucket/~x")).storage == "s3://bucket/~x"  # URLs as given


def test_sweep_config_error_names_the_file(tmp_path):
    with pytest.raises(SweepConfigError, match=r"cfg\.yaml: num_samples"):
        load(sweep_file(tmp_path, num_samples="four"))


def test_numbers_written_like_1e_5_are_numbers(tmp_path):
    """PyYAML reads `1e-5` (no dot, or no exponent sign) as a string: the sweep takes it as the number it spells
    in its own numbers, a range's bounds, and the values of arguments that are numbers."""
    path = tmp_path / "exp.yaml"
    path.write_text(
        f"name: exp\nstorage: {tmp_path / 'storage'}\nresources: {{cpus_per_trial: 2e0}}\n"
        "base: {model: {model: tiny, lr: 1e-5, weight_decay: 1E-2}, data: {path: 'builtin:python-docs'}}\n"
        "search_space: {model.lr: {loguniform: [1e-5, 3e-4]}, model.weight_decay: {grid: [0, 1e-2]}}\n"
    )
    raw = yaml.safe_load(path.read_text())
    assert raw["base"]["model"]["lr"] == "1e-5" and raw["search_space"]["model.lr"]["loguniform"] == ["1e-5", "3e-4"]
    cfg = load(path)
    assert cfg.base["model"] == {"model": "tiny", "lr": 1e-5, "weight_decay": 1e-2}
    assert cfg.search_space == {"model.lr": {"loguniform": [1e-5, 3e-4]}, "model.weight_decay": {"grid": [0, 1e-2]}}
    assert cfg.resources.cpus_per_trial == 2.0
    stored = yaml.safe_load(yaml.safe_dump(as_dict(cfg)))  # what sweep.yaml keeps: numbers, read back as numbers
    assert stored["base"]["model"]["lr"] == 1e-5 and stored["search_space"]["model.lr"]["loguniform"][0] == 1e-5


# ------------------------------------------------------------------------------------- trial files


def test_the_final_checkpoint_says_it_holds_the_whole_state():
    """Lightning logs "`weights_only` was not set, defaulting to `False`" for a save that does not say: in a
    trial's log it read like an unrestricted load."""
    from ray_jobs.callbacks import FinalCheckpoint

    saves = []
    trainer = types.SimpleNamespace(save_checkpoint=lambda path, **kwargs: saves.append((path, kwargs)))
    FinalCheckpoint("memory://t/last.ckpt").on_train_end(trainer, None)
    assert saves == [("memory://t/last.ckpt", {"weights_only": False})]


def test_attempt_files_are_named_by_start_time_as_documented(tmp_path):
    from ray_jobs.callbacks import Attempt

    attempt = Attempt(str(tmp_path / "trial"))
    for step in (0, 10):
        attempt.on_train_start(types.SimpleNamespace(global_step=step), None)
    files = sorted((tmp_path / "trial" / "attempts").iterdir())
    assert [f.suffix for f in files] == [".json", ".json"] and all(f.stem.isdigit() for f in files)
    records = [json.loads(f.read_text()) for f in files]
    assert [r["start_step"] for r in records] == [0, 10] and all(r["pid"] == os.getpid() for r in records)
    assert abs(int(files[0].stem) / 1e9 - records[0]["time"]) < 60  # the name is the start time in ns
    doc = (REPO / "docs/ray.md").read_text()
    assert "attempts/<time_ns>.json" in doc and "attempts/<n>.json" not in doc


# ----------------------------------------------------------------------------------- test hygiene


def test_passing_tests_leave_no_tmp_path_behind(pytestconfig):
    """One checkpoint test alone writes 2.4 GB into its tmp_path; pytest keeps three runs by default."""
    assert pytestconfig.getini("tmp_path_retention_policy") == "failed"


def test_seaweedfs_leaves_nothing_behind(tmp_path, monkeypatch):
    import subprocess

    from tests import s3_server

    started, real_popen = [], subprocess.Popen

    def popen(cmd, **kwargs):
        started.append((cmd, real_popen(cmd, **kwargs)))
        return started[-1][1]

    monkeypatch.setattr(s3_server.subprocess, "Popen", popen)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # its data directory is made in here
    with s3_server.seaweedfs():
        assert [p.name.startswith("seaweedfs-") for p in tmp_path.iterdir()] == [True]
    assert list(tmp_path.iterdir()) == []
    [(cmd, proc)] = started
    ports = [int(a.split("=")[1]) for a in cmd if a.split("=")[0].endswith(".port") and a.split("=")[1] != "0"]
    assert len(ports) == 4  # master, volume, filer, s3
    numbers = {str(p) for port in ports for p in (port, port + 10000)}  # gRPC ports are port + 10000
    left = [n for n in os.listdir("/tmp") if n.startswith("weed.") and n.endswith(f".{proc.pid}")]  # weed's logs
    left += [
        n
        for n in os.listdir("/tmp")
        if n.startswith("seaweedfs-") and n.removesuffix(".sock").rsplit("-", 1)[-1] in numbers
    ]
    assert left == []


def test_config_module_documents_every_key():
    """The example at the top of ray_jobs/config.py parses and passes the checks (minus its data path)."""
    doc = config_mod.__doc__.split("```yaml")[1].split("```")[0]
    raw = yaml.safe_load(doc)
    assert set(raw) <= {f for f in config_mod.SweepConfig.__dataclass_fields__}
    config_mod.from_dict(raw, "ray_jobs/config.py")


def test_a_trial_resumed_at_its_end_still_reports_its_metric(tmp_path):
    """A trial that finished training before the sweep recorded it is run again from its last checkpoint:
    Lightning then trains and validates nothing, yet the trial must report its metric (Tune refuses a
    result without it) and leave an attempt record."""
    from ray_jobs.trial import run_trial

    run = {
        "seed": 0,
        "model": {"model": "tiny", "warmup_steps": 1},
        "data": {"path": "builtin:python-docs", "seq_len": 32, "batch_size": 2, "val_fraction": 0.02},
        "trainer": {
            "max_steps": 4,
            "precision": "32-true",
            "val_check_interval": 2,
            "limit_val_batches": 1,
            "enable_checkpointing": True,
            "accelerator": "cpu",
        },
    }
    trial = str(tmp_path / "trial")
    first = run_trial(run, trial, checkpoint_every=2)
    again = run_trial(run, trial, checkpoint_every=2)
    assert "val_loss" in first and again["step"] == first["step"] == 4
    assert again["val_loss"] == first["val_loss"]  # the same final weights, validated again
    starts = [json.loads(p.read_text())["start_step"] for p in sorted((tmp_path / "trial" / "attempts").iterdir())]
    assert starts == [0, 4]


# ------------------------------------------------------------------ the trials' strategy and its memory


def strategy_cfg(
    tmp_path: Path, strategy: dict | None = None, trainer: dict | None = None, layers: int = 16, **overrides
):
    """A sweep of the tiny Llama with 16 blocks: enough parameters that the lean rings and the NVMe tier's
    working buffers (a few units' worth) are well below the 4 and 8 B/param they replace."""
    model = {**BASE["model"], "overrides": {"num_hidden_layers": layers}}
    base = {**BASE, "model": model, "trainer": {**BASE["trainer"], **(trainer or {})}}
    return load(
        sweep_file(tmp_path, base=base, **({"strategy": strategy} if strategy is not None else {}), **overrides)
    )


def test_strategy_section_round_trips_through_the_stored_record(tmp_path):
    cfg = strategy_cfg(
        tmp_path, {"host_layout": "lean", "nvme_dir": "/mnt/nvme", "host_threads": 3}, resources={"cpus_per_trial": 4}
    )
    assert (cfg.strategy.host_layout, cfg.strategy.nvme_dir, cfg.strategy.host_threads) == ("lean", "/mnt/nvme", 3)
    assert config_mod.from_dict(as_dict(cfg)) == cfg
    record_config(cfg)
    stored = load(f"{cfg.root}/sweep.yaml")
    assert stored == cfg and as_dict(stored)["strategy"] == {
        "host_layout": "lean",
        "nvme_dir": "/mnt/nvme",
        "host_threads": 3,
    }
    assert strategy_cfg(tmp_path).strategy == config_mod.TrialStrategy()  # absent: the strategy's defaults


def test_strategy_may_change_on_resubmission(tmp_path):
    """A leaner layout, the NVMe tier or another thread count changes no result, only what a trial asks for."""
    record_config(strategy_cfg(tmp_path))
    assert check_unchanged(strategy_cfg(tmp_path, {"host_layout": "lean", "nvme_dir": "/mnt/nvme"}))


BAD_STRATEGY = [
    ({"host_layout": "compact"}, "strategy.host_layout='compact': choose one of default, lean, auto"),
    ({"nvme_dir": "s3://bucket/nvme"}, "strategy.nvme_dir='s3://bucket/nvme' is a URL"),
    ({"nvme_dir": "scratch/nvme"}, "strategy.nvme_dir='scratch/nvme' is relative"),
    ({"host_threads": 0}, "strategy.host_threads=0 must be an integer >= 1"),
    ({"host_threads": 4}, "strategy.host_threads=4 is more than the 1 cores Ray reserves per trial"),
    (
        {"nvme": "/mnt/nvme"},
        "strategy: unknown keys ['nvme']; known keys are ['host_layout', 'nvme_dir', 'host_threads']",
    ),
]


@pytest.mark.parametrize("strategy,expected", BAD_STRATEGY, ids=[e for _, e in BAD_STRATEGY])
def test_bad_strategy_ends_in_one_line(tmp_path, capsys, no_ray, strategy, expected):
    assert main(["--config", sweep_file(tmp_path, strategy=strategy)]) == 2
    err = one_line_error(capsys)
    assert expected in err and err.startswith("sweep: ")


def _expected_request(cfg, layout: str, nvme: bool) -> float:
    """What a trial should ask for: the engine's own bytes per parameter, less the moments on NVMe, plus what
    is not per parameter (the lean rings, the NVMe working buffers: the planner's items), plus headroom."""
    import torch

    from megatrain_lightning.engine import EngineConfig
    from megatrain_lightning.engine.host.units import host_bytes_per_param
    from megatrain_lightning.lightning.module import resolve_config
    from megatrain_lightning.planning.planner import RunShape, parse_size, plan

    trainer = cfg.base["trainer"]
    config = resolve_config("tiny", cfg.base["model"].get("overrides"))
    n = config.num_parameters()
    dtype = torch.float32 if trainer["precision"] == "32-true" else torch.bfloat16
    accumulate, clipping = trainer.get("accumulate_grad_batches", 1), bool(trainer.get("gradient_clip_val"))
    need = host_bytes_per_param(dtype, True, accumulate > 1, layout, clipping) * n - (8 * n if nvme else 0)
    p = plan(
        RunShape(config, 64, 8, accumulate),
        EngineConfig(
            precision=trainer["precision"],
            host_layout=layout,
            nvme_dir="/mnt/nvme" if nvme else None,
            clipping=clipping,
        ),
    )
    buffers = {k: v for k, v in p.host.items() if k in ("staging", "grad_ring", "nvme_buffers")}
    assert set(buffers) == ({"staging", "grad_ring"} if layout == "lean" else set()) | (
        {"nvme_buffers"} if nvme else set()
    )
    return float(need + sum(buffers.values()) + parse_size(cfg.resources.memory_headroom))


TIERS = [("default", False), ("lean", False), ("default", True), ("lean", True)]


@pytest.mark.parametrize(
    "trainer",
    [
        {},
        {"precision": "bf16-mixed", "gradient_clip_val": 1.0},
        {"precision": "bf16-mixed", "accumulate_grad_batches": 4},
    ],
    ids=["fp32", "bf16-clip", "bf16-accumulate"],
)
def test_memory_request_follows_the_layout_and_nvme(tmp_path, trainer):
    from ray_jobs.resources import planned_tier, trial_resources

    requests = {}
    for layout, nvme in TIERS:
        cfg = strategy_cfg(tmp_path, {"host_layout": layout, "nvme_dir": "/mnt/nvme" if nvme else None}, trainer)
        assert planned_tier(cfg) == (layout, nvme)
        requests[layout, nvme] = trial_resources(cfg)["memory"]
        assert requests[layout, nvme] == _expected_request(cfg, layout, nvme)
    assert requests["default", False] > requests["lean", False] > requests["lean", True]
    assert requests["default", False] > requests["default", True]


def _node(memory: float, gpu: float = 1.0) -> dict:
    return {"Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 8.0, "GPU": gpu, "memory": memory}}


def test_auto_takes_the_first_tier_that_fits_the_largest_node_for_trials(tmp_path):
    from ray_jobs.resources import SweepRefused, check_fits, planned_tier, trial_resources

    cfg = strategy_cfg(tmp_path, {"host_layout": "auto", "nvme_dir": "/mnt/nvme"}, {"precision": "bf16-mixed"})
    need = {t: trial_resources(cfg, tier=t)["memory"] for t in (("default", False), ("lean", False), ("lean", True))}
    assert planned_tier(cfg) == ("default", False)  # no cluster known yet
    assert planned_tier(cfg, [_node(need["default", False])]) == ("default", False)
    assert planned_tier(cfg, [_node(need["lean", False]), _node(1e15, gpu=0)]) == ("lean", False)  # no GPU there
    assert planned_tier(cfg, [_node(need["lean", True]), _node(need["lean", True] - 1)]) == ("lean", True)
    too_small = [_node(need["lean", True] - 1)]
    tier = planned_tier(cfg, too_small)  # none fits: the closest, which the driver then refuses
    assert tier == ("lean", True)
    with pytest.raises(SweepRefused, match="a leaner strategy"):
        check_fits(trial_resources(cfg, tier=tier), too_small)
    no_drive = strategy_cfg(tmp_path, {"host_layout": "auto"}, {"precision": "bf16-mixed"})
    assert planned_tier(no_drive, too_small) == ("lean", False)  # NVMe only given nvme_dir
    explicit = strategy_cfg(tmp_path, {"host_layout": "lean"}, {"precision": "bf16-mixed"})
    assert planned_tier(explicit, [_node(1e15)]) == ("lean", False)  # a named layout is used as given


def test_driver_resolves_auto_and_hands_the_tier_to_the_tuner(tmp_path, capsys, monkeypatch):
    import ray

    from ray_jobs import sweep
    from ray_jobs.resources import trial_resources

    path = sweep_file(
        tmp_path,
        base={**BASE, "trainer": {**BASE["trainer"], "precision": "bf16-mixed"}},
        strategy={"host_layout": "auto"},
    )
    lean = trial_resources(load(path), tier=("lean", False))["memory"]
    monkeypatch.setattr(ray, "init", lambda **kwargs: None)
    monkeypatch.setattr(ray, "nodes", lambda: [_node(lean)])
    built = []
    monkeypatch.setattr(sweep, "build_tuner", lambda cfg, tier: built.append(tier) or types.SimpleNamespace(fit=list))
    assert main(["--config", path]) == 0
    assert built == [("lean", False)]
    assert "strategy.host_layout auto: lean (a trial asks for" in capsys.readouterr().out


def test_each_trial_gets_the_strategy_options(tmp_path, monkeypatch):
    from ray_jobs import sweep
    from ray_jobs.resources import strategy_options, trial_resources

    cfg = strategy_cfg(tmp_path, {"host_layout": "lean", "nvme_dir": "/mnt/nvme"}, resources={"cpus_per_trial": 8})
    assert strategy_options(cfg, ("lean", True)) == {"host_layout": "lean", "nvme_dir": "/mnt/nvme", "host_threads": 7}
    assert strategy_options(cfg, ("lean", False))["nvme_dir"] is None  # auto left the moments in host memory
    one_core = strategy_cfg(tmp_path, {"host_threads": None})
    assert strategy_options(one_core, ("default", False))["host_threads"] == 1
    seen = {}
    monkeypatch.setattr(
        sweep,
        "tune_trainable",
        lambda root, base, every, strategy: seen.update(strategy=strategy) or (lambda params: None),
    )
    monkeypatch.setattr("ray.tune.with_resources", lambda fn, res: seen.update(resources=res) or fn)
    sweep.build_tuner(cfg, ("lean", True))
    assert seen == {
        "strategy": strategy_options(cfg, ("lean", True)),
        "resources": trial_resources(cfg, tier=("lean", True)),
    }


def test_a_trials_strategy_and_its_own_nvme_directory(tmp_path):
    from megatrain_lightning.engine.host.nvme import PREFIX
    from megatrain_lightning.optim.threads import usable_cpus
    from ray_jobs.trial import trial_strategy

    drive = tmp_path / "nvme"
    own = drive / "megatrain-trial-abc_00001"
    (own / f"{PREFIX}left-by-a-killed-attempt").mkdir(parents=True)
    (own / "notes.txt").write_text("not ours to remove")
    st = trial_strategy(
        {"host_layout": "lean", "nvme_dir": str(drive), "host_threads": 10**6}, "s3://b/sweeps/x/trials/abc_00001"
    )
    assert (st.host_layout, st.nvme_dir, st.host_threads) == ("lean", str(own), len(usable_cpus()))
    assert sorted(p.name for p in own.iterdir()) == ["notes.txt"]
    missing = str(tmp_path / "no-such-drive")
    assert trial_strategy({"nvme_dir": missing}, "/x/trials/t").nvme_dir == missing  # the engine names the fix
    assert trial_strategy(None, "/x/trials/t").host_layout == "default"


def test_a_trial_trains_with_its_strategy(tmp_path, monkeypatch):
    from megatrain_lightning.lightning import strategy as strategy_mod
    from megatrain_lightning.lightning.strategy import MegatrainStrategy
    from ray_jobs import trial as trial_mod

    used = []

    class Recording(MegatrainStrategy):
        def setup(self, trainer):
            super().setup(trainer)
            used.append((self.engine.config.host_layout, self.engine.tier is not None, os.listdir(self.nvme_dir)))

    monkeypatch.setattr(strategy_mod, "MegatrainStrategy", Recording)  # (the trial imports it when it runs)
    drive = tmp_path / "nvme"
    drive.mkdir()
    run = {
        "seed": 0,
        "model": {"model": "tiny", "warmup_steps": 1},
        "data": {"path": "builtin:python-docs", "seq_len": 32, "batch_size": 2, "val_fraction": 0.02},
        "trainer": {
            "max_steps": 2,
            "precision": "32-true",
            "val_check_interval": 2,
            "limit_val_batches": 1,
            "accelerator": "cpu",
        },
    }
    result = trial_mod.run_trial(
        run,
        str(tmp_path / "trials" / "t1"),
        checkpoint_every=2,
        strategy={"host_layout": "lean", "nvme_dir": str(drive), "host_threads": 1},
    )
    assert result["step"] == 2
    (layout, tier, scratch) = used[0]
    assert layout == "lean" and tier and len(scratch) == 1
    assert list(drive.iterdir()) == []  # the trial's directory went with the engine's scratch


# ------------------------------------------------------------------- one run over several workers (Ray Train)


def run_cfg(**overrides):
    from ray_jobs.config import TrainConfig, from_dict

    raw = {"name": "run", "storage": "/tmp/runs", "base": BASE, "scaling": {"num_workers": 4}}
    raw.update(overrides)
    return from_dict(raw, "run.yaml", TrainConfig)


def test_shipped_runs_pass_the_checks_and_the_docstring_example_parses():
    from ray_jobs.config import TrainConfig

    shipped = sorted((REPO / "configs/run").glob("*.yaml"))
    assert {"llama-70b-dp.yaml", "tiny-dp.yaml"} <= {p.name for p in shipped}, shipped
    for path in shipped:
        assert load(path, TrainConfig).scaling.num_workers >= 2
    doc = TrainConfig.__doc__.split("```yaml")[1].split("```")[0]
    assert config_mod.from_dict(yaml.safe_load(doc), "TrainConfig", TrainConfig).scaling.num_workers == 2


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"scaling": None}, "run.yaml: missing ['scaling']"),
        ({"scaling": {"num_workers": 0}}, "scaling.num_workers=0 must be an integer >= 1"),
        ({"scaling": {"num_workers": 2, "gpus": 1}}, "scaling: unknown keys ['gpus']; known keys are ['num_workers',"),
        ({"search_space": {}}, "unknown keys ['search_space']"),
        (
            {"base": {**BASE, "trainer": {"devices": 2}}},
            "base.trainer sets ['devices'], but with `scaling` Ray gives each of scaling.num_workers workers",
        ),
        (
            {"strategy": {"host_threads": 4}, "scaling": {"num_workers": 2, "cpus_per_worker": 2}},
            "more than the 2 cores Ray reserves per worker (scaling.cpus_per_worker): raise cpus_per_worker to 4",
        ),
    ],
    ids=["no-scaling", "no-workers", "unknown-key", "sweep-key", "devices", "threads"],
)
def test_bad_run_file_is_one_line_naming_the_key(overrides, expected):
    with pytest.raises(SweepConfigError) as err:
        run_cfg(**overrides)  # (a key given as None is left out: `scaling: None` is a run file without it)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_a_worker_asks_for_its_share_of_the_host_state():
    """A worker of W asks for the planner's figure for one rank of W (W nodes of one device), which shrinks
    with W; without a GPU none is asked for."""
    from megatrain_lightning.engine import EngineConfig
    from megatrain_lightning.lightning.module import resolve_config
    from megatrain_lightning.planning.planner import RunShape, parse_size, plan
    from ray_jobs.resources import trial_resources

    base = {**BASE, "model": {"model": "llama-3.2-1b"}}
    asked = {}
    for workers in (1, 2, 8):
        cfg = run_cfg(base=base, scaling={"num_workers": workers, "cpus_per_worker": 3, "node_resource": "bigmem"})
        asked[workers] = trial_resources(cfg)
        expected = plan(
            RunShape(resolve_config("llama-3.2-1b"), 64, 8, nodes=workers), EngineConfig(precision="32-true")
        )
        assert asked[workers]["memory"] == expected.host_total + parse_size("4GiB")
        assert {k: v for k, v in asked[workers].items() if k != "memory"} == {"GPU": 1.0, "CPU": 3.0, "bigmem": 1.0}
    assert asked[1]["memory"] > asked[2]["memory"] > asked[8]["memory"]
    cpu = run_cfg(base=base, scaling={"num_workers": 2, "use_gpu": False})
    assert "GPU" not in trial_resources(cpu)


def test_workers_are_counted_over_all_nodes_before_the_run_starts():
    from ray_jobs.resources import SweepRefused, check_workers_fit

    gib = 2**30
    request = {"CPU": 4.0, "GPU": 1.0, "memory": 100.0 * gib}
    nodes = [_node(250.0 * gib, gpu=8), _node(150.0 * gib, gpu=8)]
    nodes.append({"Alive": False, "Resources": {"CPU": 64.0, "GPU": 8.0, "memory": 1e15}})
    check_workers_fit(request, 3, nodes)  # 2 on the first node (by memory; 8 CPUs), 1 on the second
    nodes[0]["Resources"]["GPU"] = 1.0
    with pytest.raises(SweepRefused) as err:
        check_workers_fit(request, 3, nodes)  # 1 + 1 in all; the dead node counts for nothing
    assert "3 workers each need CPU 4, GPU 1, memory 100.0 GiB" in str(err.value) and "hold 2" in str(err.value)
    assert "memory 250.0 GiB (1 workers)" in str(err.value) and "\n" not in str(err.value)


def test_a_resubmitted_run_may_change_where_it_runs_not_what_it_computes():
    stored = as_dict(run_cfg())
    moved = as_dict(
        run_cfg(scaling={"num_workers": 4, "cpus_per_worker": 8, "memory_headroom": "16GiB"}, num_to_keep=5)
    )
    assert changes(stored, moved, run=True) == []
    assert changes(stored, as_dict(run_cfg(scaling={"num_workers": 8})), run=True) == ["scaling.num_workers: 4 -> 8"]
    assert changes(stored, moved) == ["num_to_keep: 2 -> 5"]  # a sweep's Tune experiment keeps what it started with
    assert "scaling" not in as_dict(load(sweep_file(Path(tempfile.mkdtemp()))))  # a sweep's record as before


def test_a_trainer_in_a_ray_train_worker_without_rays_environment_is_refused(monkeypatch):
    """Lightning finds no cluster environment under Ray Train (Ray sets LOCAL_RANK, not what torchrun sets) and
    would take each worker for a run of one: the strategy refuses that in one line."""
    import lightning.pytorch as L

    context = types.SimpleNamespace(get_world_size=lambda: 2)
    monkeypatch.setitem(__import__("sys").modules, "ray.train", types.SimpleNamespace(get_context=lambda: context))
    with pytest.raises(
        ValueError,
        match=r"one of 2 Ray Train workers, but the Trainer's cluster environment is "
        r"LightningEnvironment.*RayLightningEnvironment\(\)",
    ):
        L.Trainer(strategy="megatrain", accelerator="cpu", devices=1, logger=False)
    context.get_world_size = lambda: 1  # a run of one worker trains alone anyway
    L.Trainer(strategy="megatrain", accelerator="cpu", devices=1, logger=False)
