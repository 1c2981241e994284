import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` need a CUDA GPU; without one they are skipped, with the reason shown."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3-compatible server (moto) on 127.0.0.1, reached through the standard AWS variables, which
    s3fs and Ray's pyarrow storage both read. Yields the endpoint URL; the bucket `megatrain` exists."""
    import os

    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": endpoint}  # fmt: skip
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import fsspec

    fsspec.filesystem("s3", skip_instance_cache=True).mkdir("megatrain")
    yield endpoint
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
