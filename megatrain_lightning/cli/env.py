"""``megatrain env``: what this machine offers a run (versions, devices, memory, cores, the optimizer backend)."""

from __future__ import annotations

import os
import platform
import resource
from importlib import metadata

import torch

from megatrain_lightning.engine import HostLimit, optimizer_backend, tightest_host_limit


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _devices() -> list[str]:
    if not torch.cuda.is_available():
        return ["devices: none (no CUDA GPU visible; training runs on the CPU)"]
    lines = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        lines.append(f"device {i}: {props.name}, {props.total_memory / 2**30:.1f} GiB")
    return lines


def _memlock() -> str:
    """The limit, and whom it binds. The engine pins its host buffers with ``cudaHostRegister``, and NVIDIA's
    Linux driver pins those pages itself (``get_user_pages`` in its ``os_lock_user_pages``) without counting
    them against RLIMIT_MEMLOCK, which only ``mlock`` and RDMA registrations (InfiniBand/RoCE: NCCL between
    nodes, GPUDirect RDMA) are charged to. So a low limit does not cap a run on one node, and matters where
    NCCL talks over InfiniBand or RoCE."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return "unlimited"
    return (
        f"{soft / 2**20:.0f} MiB (does not cap the engine's pinned buffers, which the CUDA driver pins outside "
        "this limit; NCCL over InfiniBand/RoCE between nodes registers memory against it: raise it to unlimited "
        "there)"
    )


def _available(limit: HostLimit) -> str:
    """The host memory available, naming the limit that sets it when it is not the machine's free memory."""
    under = "" if limit.name == "MemAvailable" else f" (under {limit.name})"
    return f"{limit.room / 2**30:.1f} GiB available{under}"


def env_lines() -> list[str]:
    """What ``megatrain env`` prints: versions, devices, memory, CPU cores and the optimizer backend."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    versions = [f"{name} {_version(name)}" for name in ("torch", "lightning", "megatrain_lightning", "transformers")]
    return [
        f"python {platform.python_version()}, " + ", ".join(versions),
        *_devices(),
        f"host memory: {total / 2**30:.1f} GiB total, {_available(tightest_host_limit())}",
        f"pinned-memory limit (ulimit -l, RLIMIT_MEMLOCK): {_memlock()}",
        f"CPU cores: {os.cpu_count()} (usable by this process: {len(os.sched_getaffinity(0))})",
        f"optimizer backend: {optimizer_backend()}",
    ]
