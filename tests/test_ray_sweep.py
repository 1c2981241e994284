"""Ray sweeps end to end on a local two-node cluster (logical GPUs) with SeaweedFS on 127.0.0.1.

Slow (a Ray cluster, three job submissions): `pytest -m slow tests/test_ray_sweep.py` runs them alone.

Jobs are submitted without `--working-dir`, running the installed package: two Ray nodes on one machine
share one session directory, and the second node unpacking a job's working_dir replaces the directory
the driver runs in. Nodes of a real cluster each unpack into their own; both modes are documented.

The cluster (tests/ray_cluster.py), shared with tests/test_ray_train.py (the `ray_cluster` fixture of
tests/conftest.py), keeps its files in a private temporary directory, removed when the last Ray test ends.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from tests.ray_cluster import s3, wait_job, wait_job_running
from tests.ray_cluster import submit as submit_job

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]  # (one worker runs every Ray test: one cluster)

REPO = Path(__file__).resolve().parents[1]


def sweep_yaml(
    tmp_path: Path, name: str, lrs: list[float], steps: int, concurrent: int = 2, strategy: dict | None = None
) -> str:
    cfg = {
        "name": name,
        "storage": "s3://megatrain/sweeps",
        "base": {
            "seed": 0,
            "model": {"model": "tiny", "warmup_steps": 5},
            "data": {"path": "builtin:python-docs", "seq_len": 64, "batch_size": 8, "val_fraction": 0.02},
            "trainer": {
                "max_steps": steps,
                "precision": "32-true",
                "val_check_interval": 10,
                "limit_val_batches": 2,
                "gradient_clip_val": 1.0,
            },
        },
        "search_space": {"model.lr": {"grid": lrs}},
        "max_concurrent_trials": concurrent,
        "failure_budget": 2,
        "checkpoint_every": 10,
        "resources": {"cpus_per_trial": 1, "gpus_per_trial": 1, "memory_headroom": "1GiB"},
        "strategy": strategy or {},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    """The Ray cluster every Ray test shares (tests/conftest.py): two nodes, each declaring 1 CPU, 1 (logical)
    GPU and 3 GiB of memory."""
    return ray_cluster


def test_cluster_keeps_its_files_in_its_private_temp_dir(cluster):
    c, _, tmp = cluster
    assert c.head_node.get_session_dir_path().startswith(f"{tmp}/ray/session_")
    assert all(n.get_session_dir_path() == c.head_node.get_session_dir_path() for n in c.worker_nodes)


def submit(dashboard: str, config: str, s3_env: dict) -> tuple[object, str]:
    return submit_job(dashboard, f"python -m ray_jobs.sweep --config {config}", s3_env)


def trial_dirs(name: str) -> list[str]:
    fs = s3()
    root = f"megatrain/sweeps/{name}/trials"
    return sorted(p for p in fs.ls(root, detail=False)) if fs.exists(root) else []


def attempts(trial_dir: str) -> list[dict]:
    fs = s3()
    files = sorted(fs.find(f"{trial_dir}/attempts"))
    return [json.loads(fs.cat_file(f)) for f in files if f.endswith(".json")]


def fault_scenario(dashboard: str, s3_env: dict, tmp_path: Path) -> dict:
    """A trial with the lean layout and the Adam moments on a local directory (both nodes are this machine),
    killed after a checkpoint; waits for the sweep to end. Returns the trial's directory and the drive."""
    drive = tmp_path / "nvme"
    drive.mkdir()
    config = sweep_yaml(tmp_path, "fault", [2e-3], steps=40, strategy={"host_layout": "lean", "nvme_dir": str(drive)})
    client, job = submit(dashboard, config, s3_env)
    deadline = time.monotonic() + 900
    while not any(s3().exists(f"{d}/checkpoints/last.ckpt") for d in trial_dirs("fault")):
        assert time.monotonic() < deadline and wait_job_running(client, job), client.get_job_logs(job)[-3000:]
        time.sleep(0.2)
    (trial,) = trial_dirs("fault")
    os.kill(attempts(trial)[0]["pid"], signal.SIGKILL)
    assert wait_job(client, job) == "SUCCEEDED", client.get_job_logs(job)[-3000:]
    return {"trial": trial, "drive": drive}


def restore_scenario(dashboard: str, s3_env: dict, tmp_path: Path) -> str:
    """A sweep of two trials, one at a time, stopped once the first has finished and the second has started,
    then submitted again and run to the end; returns the sweep file."""
    config = sweep_yaml(tmp_path, "restore", [1e-3, 3e-3], steps=50, concurrent=1)
    client, job = submit(dashboard, config, s3_env)
    deadline = time.monotonic() + 900
    # The first trial finished (one at a time) and Tune's state in storage, which the restore reads, says so;
    # the second has started.
    while not (
        len(trial_dirs("restore")) == 2
        and all(attempts(d) for d in trial_dirs("restore"))
        and "TERMINATED" in recorded_statuses("restore")
    ):
        assert time.monotonic() < deadline and wait_job_running(client, job), client.get_job_logs(job)[-3000:]
        time.sleep(0.5)
    assert recorded_statuses("restore").count("TERMINATED") == 1  # the second not yet: the stop cuts it short
    client.stop_job(job)
    assert wait_job(client, job) == "STOPPED"
    client, job = submit(dashboard, config, s3_env)
    assert wait_job(client, job) == "SUCCEEDED", client.get_job_logs(job)[-3000:]
    return config


@pytest.fixture(scope="module")
def scenarios(cluster, s3_env, tmp_path_factory):
    """The fault and restore sweeps, submitted together and driven each from a thread of its own: each keeps
    about one CPU busy (one trial at a time), and the cluster holds a trial of each (one GPU per node). The
    tests read their outcomes ({name: future}; a failed wait or check inside re-raises in the test)."""
    _, dashboard, _ = cluster
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {
            "fault": pool.submit(fault_scenario, dashboard, s3_env, tmp_path_factory.mktemp("fault")),
            "restore": pool.submit(restore_scenario, dashboard, s3_env, tmp_path_factory.mktemp("restore")),
        }


def test_killed_trial_resumes_from_its_checkpoint(scenarios, tmp_path, monkeypatch):
    """The fault sweep's trial, killed after a checkpoint: Tune retries it, the retry clears the killed attempt's
    scratch files and resumes, and the trial ends with the parameters of the same trial run without Ray,
    without interruption and with the default layout, bit for bit."""
    monkeypatch.setenv("MEGATRAIN_CPU_ADAM", "torch")
    from ray_jobs.config import apply, load
    from ray_jobs.trial import run_trial

    # The reference first: it runs here while the sweeps run on the cluster.
    cfg = load(sweep_yaml(tmp_path, "fault", [2e-3], steps=40))
    reference = str(tmp_path / "reference")
    run_trial(apply(cfg.base, {"model.lr": 2e-3}), reference, cfg.checkpoint_every)

    fault = scenarios["fault"].result()
    trial, drive = fault["trial"], fault["drive"]
    runs = attempts(trial)
    assert len(runs) == 2 and runs[1]["start_step"] >= 10  # resumed from a checkpoint, not from step 0
    assert list(drive.iterdir()) == []  # the killed attempt's scratch went with the retry, the retry's with its engine
    rows = s3().cat_file("megatrain/sweeps/fault/results.csv").decode().strip().splitlines()
    assert len(rows) == 2 and ",ok," in rows[1] and rows[1].endswith(f"s3://{trial}/checkpoints/last.ckpt")
    stored = yaml.safe_load(s3().cat_file("megatrain/sweeps/fault/sweep.yaml"))  # what a resubmission must match
    assert stored["search_space"] == {"model.lr": {"grid": [2e-3]}}
    assert stored["strategy"] == {"host_layout": "lean", "nvme_dir": str(drive), "host_threads": None}
    assert final_masters(f"s3://{trial}/checkpoints/last.ckpt") == final_masters(f"{reference}/checkpoints/last.ckpt")


def recorded_statuses(name: str) -> list[str]:
    """The trials' statuses in the newest experiment state Tune has written to storage (what a restore reads)."""
    fs = s3()
    states = sorted(fs.glob(f"megatrain/sweeps/{name}/experiment_state-*.json"))
    if not states:
        return []
    return [json.loads(trial)["status"] for trial, _ in json.loads(fs.cat_file(states[-1]))["trial_data"]]


def final_masters(url: str) -> list[bytes]:
    from megatrain_lightning import Engine, EngineConfig
    from megatrain_lightning.checkpoint import restore
    from megatrain_lightning.lightning.module import CausalLMModule
    from megatrain_lightning.models import LlamaConfig, LlamaForCausalLM

    module = CausalLMModule(model="tiny")
    engine = Engine(module, EngineConfig(device="cpu", precision="32-true"))
    restore(engine, url, optimizer=False)
    del LlamaConfig, LlamaForCausalLM
    return [u.master.numpy().tobytes() for u in engine.all_units()]


def test_restored_sweep_finishes_only_unfinished_trials(scenarios, tmp_path, capsys):
    scenarios["restore"].result()
    counts = sorted(len(attempts(d)) for d in trial_dirs("restore"))
    assert counts == [1, 2]  # the finished trial did not run again; the interrupted one resumed
    rows = s3().cat_file("megatrain/sweeps/restore/results.csv").decode().strip().splitlines()
    assert len(rows) == 3 and all(",ok," in r for r in rows[1:])

    # The sweep edited and resubmitted under the same name is refused, not restored with the old space (the
    # driver's own check, before it reaches the cluster: run here, as in the job).
    from ray_jobs.sweep import main

    edited = sweep_yaml(tmp_path, "restore", [1e-3, 3e-3, 1e-2], steps=50, concurrent=1)
    assert main(["--config", edited]) == 2
    err = capsys.readouterr().err
    assert "search_space.model.lr.grid: [0.001, 0.003] -> [0.001, 0.003, 0.01]" in err and "new `name`" in err
    assert sorted(len(attempts(d)) for d in trial_dirs("restore")) == [1, 2]  # nothing ran


def test_sweep_that_fits_no_node_is_refused_before_running(cluster, s3_env, tmp_path, capsys):
    c, _, _ = cluster
    cfg = yaml.safe_load(Path(sweep_yaml(tmp_path, "too-big", [1e-3], steps=5)).read_text())
    cfg["base"]["model"]["model"] = "llama-3.1-70b"
    path = tmp_path / "too-big.yaml"
    path.write_text(yaml.safe_dump(cfg))
    from ray_jobs.sweep import main

    assert main(["--config", str(path), "--address", c.address]) == 2
    err = capsys.readouterr().err
    assert "refused" in err and "memory 3.0 GiB" in err and "GPU 1" in err
    assert trial_dirs("too-big") == []
