"""The host worker's thread budget (megatrain_lightning/optim/threads.py): how it resolves, the NUMA placement
read from a fake sysfs tree, torch's threads on the worker only, and the kernel's results under it."""

from __future__ import annotations

import glob
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from megatrain_lightning.optim import native
from megatrain_lightning.optim.threads import (
    configure_host_threads,
    kernel_cpus,
    numa_nodes,
    parse_cpulist,
    resolve_host_threads,
    usable_cpus,
)
from tests.helpers import as_bits, assert_adamw_matches, own_llama, requires_native, run_adamw_pair

CORES = len(usable_cpus())


@pytest.fixture(autouse=True)
def _restore_kernel_threads():
    yield
    if native.available():
        native.set_num_threads(None)


def fake_sysfs(root: Path, nodes: dict[int, str]) -> str:
    """A sysfs tree with `nodes` (number -> cpulist text), and the files beside them a real one has."""
    base = root / "devices/system/node"
    for node, cpulist in nodes.items():
        (base / f"node{node}").mkdir(parents=True)
        (base / f"node{node}/cpulist").write_text(cpulist + "\n")
    base.mkdir(parents=True, exist_ok=True)
    (base / "possible").write_text(f"0-{max(nodes, default=0)}\n")
    (base / "power").mkdir()
    return str(root)


def on_worker(host_threads, fn=lambda: None, sysfs_root: str = "/sys"):
    """Configure a fresh thread as the engine's host worker is configured, then run `fn` on it."""

    def job():
        setup = configure_host_threads(host_threads, sysfs_root=sysfs_root)
        return setup, torch.get_num_threads(), fn()

    with ThreadPoolExecutor(max_workers=1) as worker:
        return worker.submit(job).result()


# ------------------------------------------------------------------------------------- the budget


def test_default_budget_is_the_usable_cores_minus_one():
    assert resolve_host_threads(None) == max(1, CORES - 1)
    assert resolve_host_threads(None, cores=16) == 15
    assert resolve_host_threads(None, cores=1) == 1
    assert resolve_host_threads(1, cores=16) == 1 and resolve_host_threads(16, cores=16) == 16


@pytest.mark.parametrize("bad", [0, -2, 17, 2.0, True, "4"])
def test_bad_budget_names_the_value_and_the_range(bad):
    with pytest.raises(ValueError, match=rf"host_threads={bad!r}: give an integer from 1 to 16 .* unset for 15"):
        resolve_host_threads(bad, cores=16)


def test_strategy_checks_host_threads_when_built():
    from megatrain_lightning import MegatrainStrategy

    assert MegatrainStrategy(host_threads=1).host_threads == 1
    assert MegatrainStrategy().host_threads is None
    for bad in (0, CORES + 1):
        with pytest.raises(ValueError, match=f"host_threads={bad}: give an integer from 1 to {CORES}"):
            MegatrainStrategy(host_threads=bad)


# ---------------------------------------------------------------------------------- NUMA from sysfs


def test_cpulists_parse_like_the_kernel_writes_them():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("5") == [5] and parse_cpulist("\n") == []


def test_numa_nodes_read_from_a_sysfs_root(tmp_path):
    root = fake_sysfs(tmp_path, {0: "0-3,8-11", 1: "4-7,12-15", 2: ""})
    assert numa_nodes(root) == {0: [0, 1, 2, 3, 8, 9, 10, 11], 1: [4, 5, 6, 7, 12, 13, 14, 15], 2: []}
    assert numa_nodes(str(tmp_path / "no-sysfs")) == {}


def test_threads_spread_over_the_nodes_of_the_affinity_mask_in_order():
    nodes = {0: [0, 1, 2, 3, 8, 9, 10, 11], 1: [4, 5, 6, 7, 12, 13, 14, 15]}
    everything = set(range(16))
    assert kernel_cpus(4, everything, nodes) == (0, 8, 4, 12)  # every 4th of node 0's CPUs, then node 1's
    fifteen = kernel_cpus(15, everything, nodes)
    assert len(set(fifteen)) == 15 and sum(c in nodes[1] for c in fifteen) == 7
    assert kernel_cpus(3, {1, 2, 5, 6}, nodes) == (1, 2, 5)  # only the CPUs this process may use


def test_one_node_places_nothing(tmp_path):
    nodes = {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    assert kernel_cpus(3, {0, 1, 2, 3}, nodes) is None  # the mask lies on one node (e.g. numactl)
    assert kernel_cpus(3, {0, 1, 2, 3}, {0: [0, 1, 2, 3]}) is None
    assert kernel_cpus(3, {0, 1, 2, 3}, {}) is None  # no sysfs


def test_on_one_node_configuring_is_a_no_op_for_placement(tmp_path):
    root = fake_sysfs(tmp_path, {0: f"0-{max(usable_cpus())}"})
    setup, torch_threads, _ = on_worker(None, sysfs_root=root)
    assert setup.cpus is None and setup.threads == torch_threads == max(1, CORES - 1)
    if len(numa_nodes()) <= 1:  # this machine itself: nothing placed either
        assert on_worker(None)[0].cpus is None


# ---------------------------------------------------------------------------- threads and placement


def _fresh_thread_default() -> int:
    """torch's thread count in a thread that starts now."""
    seen = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return seen[0]


def test_torch_threads_change_on_the_worker_only():
    main, default = torch.get_num_threads(), _fresh_thread_default()
    budget = 1 if default != 1 else min(2, CORES)
    _, worker_threads, _ = on_worker(budget)
    assert worker_threads == budget
    assert torch.get_num_threads() == main  # the thread that built the model keeps its team
    assert _fresh_thread_default() == default  # and threads that start later the process default


@requires_native
def test_the_kernel_gets_the_budget():
    _, _, seen = on_worker(1, fn=native.get_num_threads)
    assert seen == 1


def _allowed_cpus() -> list[str]:
    """Cpus_allowed_list of every thread of this process."""
    out = []
    for status in glob.glob("/proc/self/task/*/status"):
        try:
            text = Path(status).read_text()
        except OSError:  # the thread ended meanwhile
            continue
        out += [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Cpus_allowed_list")]
    return out


@requires_native
@pytest.mark.skipif(CORES < 2 or not os.path.isdir("/proc/self/task"), reason="needs 2 CPUs and Linux")
def test_two_nodes_place_the_kernels_helper_threads(tmp_path):
    a, b = sorted(usable_cpus())[:2]
    root = fake_sysfs(tmp_path, {0: str(a), 1: str(b)})
    if not native.info()["openmp"]:
        pytest.skip("a build without OpenMP runs the kernel on the calling thread")

    def step_and_look():
        n = 1 << 18  # large enough for two threads
        master, m, v, g = torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.ones(n)
        native.adamw_step_(master, m, v, g, None, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
        placed = _allowed_cpus()
        native.set_team_cpus(None)  # helpers go back at the next call
        native.adamw_step_(master, m, v, g, None, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=2)
        return placed, _allowed_cpus()

    setup, _, (placed, after) = on_worker(2, fn=step_and_look, sysfs_root=root)
    assert setup.cpus == (a, b)
    assert str(b) in placed  # the helper moved onto node 1's CPU; the worker itself was not moved
    assert placed.count(str(b)) == 1 and str(b) not in after


# ------------------------------------------------------------------------------------------ results


@requires_native
def test_one_and_two_threads_give_the_same_bits_and_match_torch(tmp_path):
    """The kernel under budgets 1 and 2 (placed over two fake nodes) gives identical bits, which match
    torch.optim.AdamW as tests/test_native_adamw.py checks them."""
    nodes = sorted(usable_cpus())[:2]
    root = fake_sysfs(tmp_path, {i: str(c) for i, c in enumerate(nodes)})
    n = 200_003  # several 32K-element ranges and a scalar tail
    runs = {}
    for threads in sorted({1, min(2, CORES)}):
        _, _, runs[threads] = on_worker(
            threads, lambda: run_adamw_pair(n, "fused", torch.bfloat16, 0.1, 0.37, steps=10), sysfs_root=root
        )
    for ours, theirs in runs.values():
        assert_adamw_matches(ours, theirs)
    (ours1, _), (ours2, _) = runs[1], runs[max(runs)]
    assert all(torch.equal(as_bits(x), as_bits(y)) for x, y in zip(ours1, ours2))


# ------------------------------------------------------------------------------------ in the engine


def test_the_engines_host_worker_runs_on_its_budget():
    from megatrain_lightning.engine.engine import Engine, EngineConfig

    engine = Engine(own_llama(2), EngineConfig(device="cpu", precision="bf16-true", host_threads=1))
    try:
        probe = (torch.get_num_threads, native.get_num_threads) if native.available() else (torch.get_num_threads,)
        assert [engine.host.worker.submit(f).result() for f in probe] == [1] * len(probe)
    finally:
        engine.close()
    with pytest.raises(ValueError, match="host_threads=0"):
        Engine(own_llama(2), EngineConfig(device="cpu", precision="bf16-true", host_threads=0))
