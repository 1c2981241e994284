"""A local Ray cluster for the Ray tests: two nodes on this machine, the dashboard taking job submissions.

The cluster keeps its files (Ray's session directory, and the temporary files of every process it starts:
job drivers, trials, workers) in a private temporary directory, removed when the cluster stops: TMPDIR points
there while the cluster runs (Ray puts its session directory in $TMPDIR/ray, and the processes it starts
inherit TMPDIR). The directory is short: Ray's socket paths under it must stay below 108 bytes.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.s3_server import free_port


@contextmanager
def local_cluster(tmp_path_factory: pytest.TempPathFactory, num_gpus: int = 1) -> Iterator[tuple[object, str, str]]:
    """Two Ray nodes, each declaring 1 CPU, `num_gpus` (logical) GPUs and 3 GiB of memory; yields the cluster,
    the dashboard's URL and the private temporary directory. Pytest's own temporary directory is made first,
    where it belongs: made while TMPDIR points into the cluster's directory, it would go with it."""
    import ray
    from ray.cluster_utils import Cluster

    tmp_path_factory.getbasetemp()
    tmp = tempfile.mkdtemp(prefix="mt-ray-")
    port = free_port()
    node = dict(num_cpus=1, num_gpus=num_gpus, memory=3 * 2**30)
    # Every port the head listens on is a free one (the GCS takes a free one itself when 6379 is taken; the
    # dashboard agent's would be 52365): a second cluster on this machine (another checkout's suite) starts too.
    head = dict(
        node,
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        dashboard_port=port,
        dashboard_agent_listen_port=free_port(),
    )
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TMPDIR", tmp)
            # No kills by Ray's memory monitor: it watches the whole machine's memory (both nodes are this
            # machine, beside the rest of the suite and whatever else runs), and at 95% it killed the trials'
            # workers while another checkout's suite loaded half a billion parameters; Ray Train then restarted
            # them, which the tests count. The kernel's OOM killer still guards the machine.
            mp.setenv("RAY_memory_monitor_refresh_ms", "0")
            mp.setattr(tempfile, "tempdir", None)  # this process's own temporary files follow TMPDIR too
            c = Cluster(initialize_head=True, head_node_args=head)
            try:
                c.add_node(**node)
                c.wait_for_nodes()
                yield c, f"http://127.0.0.1:{port}", tmp
            finally:
                ray.shutdown()
                c.shutdown()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def submit(dashboard: str, entrypoint: str, s3_env: dict) -> tuple[object, str]:
    """Submit `entrypoint` as a job (the torch optimizer backend: bitwise comparable runs; Tune's state and Ray
    Train's worker health polled often: less waiting in short tests; worker groups given time to start on a
    busy machine); (client, job id)."""
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(dashboard)
    env = {
        **s3_env,
        "MEGATRAIN_CPU_ADAM": "torch",
        "TUNE_GLOBAL_CHECKPOINT_S": "1",
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
        # Ray Train gives a worker group 60 s to start; on a busy 2-core machine (the suite's other worker
        # beside this one, and other jobs) starting trainers takes longer, and the run would fail, not wait.
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "900",
        # No preemption watcher (an actor process per run) and no Ray Train metrics: the tests read neither, and
        # on a 2-core machine every process Ray starts (each imports Ray, seconds of CPU) slows the whole suite.
        "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
        "RAY_TRAIN_METRICS_ENABLED": "0",
    }
    return client, client.submit_job(entrypoint=entrypoint, runtime_env={"env_vars": env})


def s3():
    """The S3 filesystem of the tests' SeaweedFS, its listings read afresh."""
    import fsspec

    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    return fs


def job_status(client, job: str) -> str:
    return str(client.get_job_status(job)).rsplit(".", 1)[-1]


def wait_job(client, job: str, timeout: float = 1200) -> str:
    """The job's final status (SUCCEEDED, FAILED, STOPPED); fails the test, with the log's tail, after `timeout`."""
    deadline = time.monotonic() + timeout
    while (status := job_status(client, job)) not in ("SUCCEEDED", "FAILED", "STOPPED"):
        assert time.monotonic() < deadline, client.get_job_logs(job)[-3000:]
        time.sleep(1)
    return status


def wait_job_running(client, job: str) -> bool:
    return job_status(client, job) in ("PENDING", "RUNNING")
