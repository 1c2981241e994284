"""The host-memory reading takes the tightest of MemAvailable, the cgroup v1/v2 limits and ulimit -v.

Every source is a fake here: /proc and /sys/fs/cgroup trees written under tmp_path, and a getrlimit stand-in.
"""

from __future__ import annotations

import resource
from pathlib import Path

import pytest
from torch import nn

from megatrain_lightning.engine.config import EngineConfig
from megatrain_lightning.engine.engine import Engine, HostMemoryError
from megatrain_lightning.engine.host import host_memory
from megatrain_lightning.engine.host.host_memory import Sources, available_host_bytes, host_limits, tightest_host_limit

GiB = 1 << 30
INF = resource.RLIM_INFINITY


def no_rlimit(_: int) -> tuple[int, int]:
    return INF, INF


def machine(tmp_path: Path, available: int, cgroup_line: str = "0::/", vm_size: int = GiB) -> Sources:
    """A fake /proc with `available` bytes of MemAvailable, this process in `cgroup_line`, and no cgroup files."""
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: {4 * available // 1024} kB\nMemAvailable: {available // 1024} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup_line + "\n")
    (proc / "self" / "status").write_text(f"Name: python\nVmSize: {vm_size // 1024} kB\n")
    (tmp_path / "cgroup").mkdir()
    return Sources(proc=proc, cgroup_root=tmp_path / "cgroup", getrlimit=no_rlimit)


def cgroup_files(directory: Path, **files: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name.replace("_", ".", 1)).write_text(text + "\n")


def test_machine_alone_is_mem_available(tmp_path):
    sources = machine(tmp_path, 64 * GiB)
    assert [(limit.room, limit.name) for limit in host_limits(sources)] == [(64 * GiB, "MemAvailable")]


def test_cgroup_v2_limit_less_its_use_without_inactive_file_cache(tmp_path):
    """A container: its own cgroup mounted at the root. 8 GiB limit, 3 GiB charged of which 1 GiB is
    inactive file cache (the kernel drops it before killing): 6 GiB of room, not MemAvailable's 64."""
    sources = machine(tmp_path, 64 * GiB)
    cgroup_files(
        sources.cgroup_root, memory_max=str(8 * GiB), memory_current=str(3 * GiB), memory_stat=f"inactive_file {GiB}"
    )
    tightest = tightest_host_limit(sources)
    assert tightest.room == 6 * GiB and tightest.name == f"the cgroup limit {sources.cgroup_root}/memory.max"


def test_cgroup_v2_reads_every_level_above_the_process(tmp_path):
    """A systemd-style tree: the process's own cgroup has no limit ("max"), its parent slice has 2 GiB."""
    sources = machine(tmp_path, 64 * GiB, cgroup_line="0::/jobs.slice/run-7.scope")
    slice_ = sources.cgroup_root / "jobs.slice"
    cgroup_files(slice_, memory_max=str(2 * GiB), memory_current=str(GiB // 2))
    cgroup_files(slice_ / "run-7.scope", memory_max="max", memory_current=str(GiB // 4))
    assert tightest_host_limit(sources).room == 2 * GiB - GiB // 2
    assert tightest_host_limit(sources).name == f"the cgroup limit {slice_}/memory.max"


def test_cgroup_v1_limit_and_its_no_limit_value(tmp_path):
    sources = machine(tmp_path, 64 * GiB, cgroup_line="4:memory:/docker/abc\n0::/")
    memory = sources.cgroup_root / "memory"
    cgroup_files(memory, memory_limit_in_bytes="9223372036854771712", memory_usage_in_bytes=str(5 * GiB))
    cgroup_files(
        memory / "docker" / "abc",
        memory_limit_in_bytes=str(4 * GiB),
        memory_usage_in_bytes=str(GiB),
        memory_stat=f"inactive_file 7\ntotal_inactive_file {GiB // 2}",
    )
    rooms = {limit.name: limit.room for limit in host_limits(sources)}
    assert rooms == {
        "MemAvailable": 64 * GiB,
        f"the cgroup limit {memory}/docker/abc/memory.limit_in_bytes": 4 * GiB - GiB + GiB // 2,
    }


def test_rlimit_as_less_the_address_space_mapped(tmp_path):
    """ulimit -v 10 GiB with 7 GiB mapped: 3 GiB left, whatever the machine has free."""
    sources = machine(tmp_path, 64 * GiB, vm_size=7 * GiB)
    limited = Sources(sources.proc, sources.cgroup_root, getrlimit=lambda r: (10 * GiB, INF))
    tightest = tightest_host_limit(limited)
    assert (tightest.room, tightest.name, tightest.fix) == (3 * GiB, "ulimit -v (RLIMIT_AS)", "raise ulimit -v")


def test_no_readable_source_falls_back_to_physical_memory(tmp_path):
    empty = Sources(tmp_path / "none", tmp_path / "none", getrlimit=no_rlimit)
    assert tightest_host_limit(empty).name == "physical memory" and tightest_host_limit(empty).room > 0


def test_the_real_machine_reads_at_most_mem_available(monkeypatch):
    # The machine's own files, each read once: MemAvailable and a cgroup's usage move between two reads while
    # other processes run, so both readings below see the same snapshot of them.
    snapshot: dict[Path, str | None] = {}
    real_read = host_memory._read
    monkeypatch.setattr(host_memory, "_read", lambda path: snapshot.setdefault(path, real_read(path)))
    real = host_limits()
    assert available_host_bytes() == min(limit.room for limit in real) > 0


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))


@pytest.mark.parametrize("limit", ["cgroup", "rlimit"])
def test_engine_refuses_at_construction_naming_the_limit(tmp_path, monkeypatch, limit):
    """The check at construction reads the limits: a cgroup or ulimit -v that leaves 1 KiB refuses the
    model before anything is allocated, naming the limit and how to raise it."""
    sources = machine(tmp_path, 64 * GiB, vm_size=GiB)
    if limit == "cgroup":
        cgroup_files(sources.cgroup_root, memory_max=str(GiB), memory_current=str(GiB - 1024))
        named = r"under the cgroup limit .*/memory\.max \(raise the container's memory limit\)"
    else:
        sources = Sources(sources.proc, sources.cgroup_root, getrlimit=lambda r: (GiB + 1024, INF))
        named = r"under ulimit -v \(RLIMIT_AS\) \(raise ulimit -v\)"
    monkeypatch.setattr(host_memory, "SOURCES", sources)
    with pytest.raises(HostMemoryError, match=r"but about 0\.0 GiB is available " + named):
        Engine(Tiny(), EngineConfig(device="cpu", precision="32-true", blocks="layers"))
