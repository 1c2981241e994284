import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` need a CUDA GPU; without one they are skipped, with the reason shown."""
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
