"""One run over two Ray Train workers end to end, on a local two-node cluster (CPU, gloo) with SeaweedFS as S3.

Slow (a Ray cluster, three job submissions, five Ray Train runs): `pytest -m slow tests/test_ray_train.py` runs
them alone. Jobs are submitted as in tests/test_ray_sweep.py (without `--working-dir`, running the installed
package).

The oracle is a 2-worker run of the same config that nothing interrupted (a trial of the sweep test, which runs
first): a run whose worker is killed after a reported checkpoint, and whose job is then stopped and submitted
again, ends with the same weights, bit for bit (the torch optimizer backend; checkpoints do not depend on the
number of ranks, so one process reads them back). One run goes through both faults, each of which costs a Ray
Train restart (tens of seconds): the two tests check what each fault left.
"""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import time
from pathlib import Path

import pytest
import yaml

from tests.ray_cluster import s3, submit, wait_job, wait_job_running

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]  # (one worker runs every Ray test: one cluster)

STEPS = 20
LR = 1e-3  # the run file's learning rate, and one of the sweep's


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    """The Ray cluster every Ray test shares (tests/conftest.py): two nodes of 1 CPU and 3 GiB each, a worker
    on each (the run asks for no GPU; the nodes' logical ones stay unused)."""
    return ray_cluster


def run_yaml(tmp_path: Path, name: str, steps: int = STEPS, **extra) -> str:
    """The shipped tiny run (configs/run/tiny-dp.yaml) on S3, `steps` long, checkpointing every 5 steps (about
    a second and a half here: time for a test to act between two checkpoints)."""
    cfg = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs/run/tiny-dp.yaml").read_text())
    cfg.update(name=name, storage="s3://megatrain/runs", checkpoint_every=5, **extra)
    cfg["base"]["model"].update(lr=LR)
    cfg["base"]["trainer"]["max_steps"] = steps
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def attempts(name: str) -> list[dict]:
    fs = s3()
    root = f"megatrain/runs/{name}/attempts"
    files = sorted(fs.find(root)) if fs.exists(root) else []
    return [json.loads(fs.cat_file(f)) for f in files if f.endswith(".json")]


def reported(name: str) -> list[str]:
    """The checkpoint directories Ray Train has committed for the run (its snapshot in storage)."""
    fs = s3()
    snapshot = f"megatrain/runs/{name}/checkpoint_manager_snapshot.json"
    if not fs.exists(snapshot):
        return []
    state = json.loads(fs.cat_file(snapshot))
    return [r["checkpoint_dir_name"] for r in state.get("checkpoint_results", [])]


def wait_until(client, job: str, done, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline and wait_job_running(client, job), client.get_job_logs(job)[-3000:]
        time.sleep(0.2)


def final_masters(url: str) -> list[bytes]:
    """The fp32 masters of a checkpoint (a run's directory: its last step's), read back in one process."""
    from megatrain_lightning import Engine, EngineConfig
    from megatrain_lightning.checkpoint import restore
    from megatrain_lightning.lightning.module import CausalLMModule

    module = CausalLMModule(model="tiny")
    engine = Engine(module, EngineConfig(device="cpu", precision="32-true"))
    if not url.endswith(".ckpt"):
        url = f"{url}/checkpoints/step-{STEPS:08d}/model.ckpt"
    restore(engine, url, optimizer=False)
    return [u.master.numpy().tobytes() for u in engine.all_units()]


@pytest.fixture(scope="module")
def sweep(cluster, s3_env, tmp_path_factory) -> dict[float, str]:
    """A 2-trial sweep of 2-worker trials, one trial at a time; {lr: final checkpoint}.
    Its trial at the run file's learning rate is the uninterrupted 2-worker run the other tests compare with."""
    _, dashboard, _ = cluster
    tmp = tmp_path_factory.mktemp("sweep")
    cfg = yaml.safe_load(Path(run_yaml(tmp, "dp-sweep")).read_text())
    del cfg["num_to_keep"]
    cfg["scaling"]["cpus_per_worker"] = 0.45  # two trials on two 1-CPU nodes, beside each trial's own 0.01
    cfg.update(
        search_space={"model.lr": {"grid": [LR, 3e-3]}}, max_concurrent_trials=2, storage="s3://megatrain/sweeps"
    )
    path = tmp / "dp-sweep.yaml"
    path.write_text(yaml.safe_dump(cfg))
    client, job = submit(dashboard, f"python -m ray_jobs.sweep --config {path}", s3_env)
    assert wait_job(client, job) == "SUCCEEDED", client.get_job_logs(job)[-3000:]
    rows = list(csv.DictReader(io.StringIO(s3().cat_file("megatrain/sweeps/dp-sweep/results.csv").decode())))
    assert [r["status"] for r in rows] == ["ok", "ok"]
    return {float(r["model.lr"]): r["checkpoint"] for r in rows}


def test_sweep_of_two_worker_trials(sweep):
    from megatrain_lightning.checkpoint import is_checkpoint

    assert sorted(sweep) == [LR, 3e-3]
    for checkpoint in sweep.values():
        assert checkpoint.endswith(f"/checkpoints/step-{STEPS:08d}/model.ckpt") and is_checkpoint(checkpoint)
        trial = checkpoint.split("://", 1)[1].split("/checkpoints/")[0]
        records = [json.loads(s3().cat_file(f)) for f in s3().find(f"{trial}/attempts")]
        assert sorted(r["rank"] for r in records) == [0, 1]  # each trial one run of two workers, started once
        assert {r["ranks"] for r in records} == {2}  # the workers are the ranks of one data-parallel run
        assert not s3().exists(f"{trial}/checkpoints/step-{STEPS - 10:08d}/model.ckpt")  # pruned (keeps 2)
    assert final_masters(sweep[LR]) != final_masters(sweep[3e-3])


@pytest.fixture(scope="module")
def interrupted(cluster, s3_env, tmp_path_factory) -> dict:
    """The run file submitted; after its first reported checkpoint, rank 1's process is killed (Ray Train
    restarts both workers); after the restarted workers report a checkpoint, the job is stopped; then the same
    command is submitted again and runs to the end. Returns the attempts of the first and second job."""
    _, dashboard, _ = cluster
    command = f"python -m ray_jobs.train --config {run_yaml(tmp_path_factory.mktemp('run'), 'run')}"
    client, job = submit(dashboard, command, s3_env)
    wait_until(client, job, lambda: reported("run") and len(attempts("run")) == 2)
    first = reported("run")
    (victim,) = [a for a in attempts("run") if a["rank"] == 1]
    os.kill(victim["pid"], signal.SIGKILL)
    wait_until(client, job, lambda: len(attempts("run")) == 4 and reported("run")[-1] != first[-1])
    client.stop_job(job)
    assert wait_job(client, job) == "STOPPED"
    before = attempts("run")
    stopped_at = reported("run")[-1]
    client, job = submit(dashboard, command, s3_env)
    assert wait_job(client, job) == "SUCCEEDED", client.get_job_logs(job)[-3000:]
    return {
        "first": first,
        "before": before,
        "stopped_at": stopped_at,
        "after": attempts("run")[len(before) :],
        "logs": client.get_job_logs(job),
    }


def test_killed_worker_restarts_from_the_reported_checkpoint_bit_identical(interrupted, sweep):
    first, restarted = interrupted["first"], interrupted["before"][2:]
    assert sorted(a["rank"] for a in restarted) == [0, 1]
    (start,) = {a["start_step"] for a in restarted}  # both from one checkpoint: the last committed at the kill
    assert start >= int(first[-1].rsplit("-", 1)[1]) and start % 5 == 0
    assert final_masters("s3://megatrain/runs/run") == final_masters(sweep[LR])


def test_stopped_job_resubmitted_resumes_from_its_storage(interrupted, sweep, cluster, tmp_path):
    resumed = interrupted["after"]
    assert sorted(a["rank"] for a in resumed) == [0, 1]
    assert {a["start_step"] for a in resumed} == {int(interrupted["stopped_at"].rsplit("-", 1)[1])}
    logs = interrupted["logs"]
    assert f"step {STEPS}/{STEPS} loss" in logs and "tokens/s" in logs  # rank 0's progress, in the job's log
    assert f"result: step {STEPS}:" in logs and "val_loss" in logs
    result = json.loads(s3().cat_file("megatrain/runs/run/result.json"))
    assert (
        result["checkpoint"].endswith(f"/checkpoints/step-{STEPS:08d}/model.ckpt")
        and result["metrics"]["step"] == STEPS
    )
    assert final_masters("s3://megatrain/runs/run") == final_masters(sweep[LR])

    # The same name with an edited file is refused before anything runs, naming the change.
    from ray_jobs.train import main

    c, _, _ = cluster
    assert main(["--config", run_yaml(tmp_path, "run", steps=2 * STEPS), "--address", c.address]) == 2
    assert len(attempts("run")) == 6


def test_run_that_fits_no_nodes_is_refused_before_running(cluster, s3_env, tmp_path, capsys):
    c, _, _ = cluster
    path = Path(run_yaml(tmp_path, "too-big"))
    cfg = yaml.safe_load(path.read_text())
    cfg["base"]["model"] = {"model": "llama-3.1-8b"}
    path.write_text(yaml.safe_dump(cfg))
    from ray_jobs.train import main

    assert main(["--config", str(path), "--address", c.address]) == 2
    err = capsys.readouterr().err
    assert "refused" in err and "2 workers each need" in err and "memory 3.0 GiB (0 workers)" in err
    assert attempts("too-big") == []
