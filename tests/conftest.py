from contextlib import ExitStack

import pytest
import torch

# One intra-op thread for the tests' own torch work (the main thread's team, and the default of threads started
# later; the engine's host worker sets its own). The tests' models are tiny: a second OpenMP thread splits ops too
# small to gain from it, and on a busy machine every parallel region waits for a descheduled teammate while the
# other spins: one twenty-step test measured 250-270 s with two threads beside another CPU-heavy job, 12 s with
# one (hf-llama in tests/test_strategy.py). Processes the tests start keep their own defaults.
torch.set_num_threads(1)

# The Ray cluster the Ray end-to-end tests share (the `ray_cluster` fixture), and the last collected test that
# uses it: the cluster stops after that test, not at the end of the session (pytest_runtest_teardown).
_RAY = ExitStack()
_LAST_RAY: list[pytest.Item] = []


def _module_fixtures(item: pytest.Item) -> bool:
    """Whether `item` uses a module-scoped fixture (a shared run, a launch of processes, a dry benchmark)."""
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(d.scope == "module" for defs in info.name2fixturedefs.values() for d in defs)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` need a CUDA GPU; without one they are skipped, with the reason shown."""
    # A module's tests that share a module-scoped fixture run on one worker (`--dist loadgroup`), so that
    # fixture is built once: spread over both workers each would build it (one dry benchmark run measured 44 s
    # on each). Tests already in a group (the Ray tests) keep theirs.
    for item in items:
        if item.get_closest_marker("xdist_group") is None and _module_fixtures(item):
            item.add_marker(pytest.mark.xdist_group(f"module:{item.module.__name__}"))
    # The Ray tests first: under `-n 2 --dist loadgroup` (the README's command) one worker runs all of them,
    # the longest unit of the suite, and started first they overlap everything the other worker runs.
    items.sort(key=lambda item: "ray_cluster" not in getattr(item, "fixturenames", ()))
    _LAST_RAY[:] = [item for item in items if "ray_cluster" in getattr(item, "fixturenames", ())][-1:]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        # the marker itself: `in item.keywords` also matches a test or parameter id that merely says "cuda"
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture
def torch_adam(monkeypatch):
    """The torch-op optimizer backend, bitwise equal to torch.optim.AdamW (the native kernel rounds 1-2 ulp
    apart). Files comparing bitwise throughout take it for every test: `pytest.mark.usefixtures("torch_adam")`."""
    monkeypatch.setenv("MEGATRAIN_CPU_ADAM", "torch")


@pytest.fixture(scope="session")
def s3_env():
    """A real S3-compatible server (SeaweedFS) on 127.0.0.1 with the bucket `megatrain`; yields the AWS
    variables that reach it. They are set in os.environ meanwhile, so s3fs, pyarrow and subprocesses see them."""
    import os

    from tests.s3_server import seaweedfs

    with seaweedfs() as env:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        yield env
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def ray_cluster(s3_env, tmp_path_factory):
    """One local Ray cluster for every Ray end-to-end test (tests/ray_cluster.py: two nodes, each declaring 1
    CPU, 1 logical GPU and 3 GiB of memory), started once; (cluster, dashboard URL, private temporary
    directory). It stops after the last test that uses it: while it runs, TMPDIR points into its directory,
    and its processes would take CPU time from every test after it."""
    from tests.ray_cluster import local_cluster

    with _RAY:
        yield _RAY.enter_context(local_cluster(tmp_path_factory, num_gpus=1))


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test using `ray_cluster` (and the module fixtures built on it) the cluster stops."""
    if _LAST_RAY and item is _LAST_RAY[0]:
        _RAY.close()
