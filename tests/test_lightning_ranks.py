"""The Trainer strategy's rank code (megatrain_lightning/lightning/ranks.py): the one-process policy's collectives
are the identity and call no ``torch.distributed`` function, the several-ranks policy answers as DDP does and
refuses what no rank holds, and no strategy module outside the rank code tests the number of ranks.

No process group is started here: the collectives of several ranks run in tests/test_data_parallel.py.
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import StochasticWeightAveraging
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

import megatrain_lightning
from megatrain_lightning import MegatrainStrategy
from megatrain_lightning.lightning import ranks
from megatrain_lightning.lightning.ranks import OneProcess, ScriptLauncher, SeveralRanks, policy

ROOT = Path(megatrain_lightning.__file__).parent
CPU = torch.device("cpu")

# -- no count test outside the rank code --------------------------------------------------------------------
RANK_COUNTS = ("ranks", "world_size", "get_world_size", "num_processes", "num_nodes", "nodes", "devices", "workers")
"""Names whose comparison with a number is a test of the rank count: ``ranks > 1``, ``self.ranks == 1``,
``world_size > 1``, ``torch.distributed.get_world_size() == 1``, ``self.num_nodes > 1``, ``workers > 1``, and
the same written the other way round (``1 < self.ranks``), as a name, an attribute or a call."""
RANK_CODE = ("lightning/ranks.py", "planning/ranks.py", "schedule/ranks.py")
"""The modules whose work is to answer by the rank count (the Trainer strategy's, the planner's, the schedule
model's)."""
COUNT_FREE = sorted(
    str(p.relative_to(ROOT))
    for p in ROOT.rglob("*.py")
    if p.relative_to(ROOT).parts[0] not in ("engine", "checkpoint") and str(p.relative_to(ROOT)) not in RANK_CODE
)
"""Every module outside the rank code and the engine's packages (engine/ and checkpoint/, whose rank code is
engine/ranks.py and checkpoint/ranks.py): the Trainer and Fabric strategies, the planner, the plots, the
command line, the models."""


def _count_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def count_tests(source: str) -> list[str]:
    """Every comparison in `source` of a rank count (:data:`RANK_COUNTS`) with a number, as source text."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        numbers = [o for o in operands if isinstance(o, ast.Constant) and isinstance(o.value, int)]
        if numbers and any(_count_name(o) in RANK_COUNTS for o in operands):
            found.append(ast.unparse(node))
    return found


def test_the_count_test_finder_finds_every_spelling_and_nothing_else():
    source = """
if self.ranks > 1: pass
x = 0 if self.ranks == 1 else 1
y = 1 < self.ranks
if torch.distributed.get_world_size() > 1: pass
if world_size == 1: pass
if workers > 1: pass
z = f"{self.devices}" if self.nodes * 1 else ""
a = self.global_rank == 0
b = len(counts) > 1
c = value < 1
"""
    assert sorted(count_tests(source)) == sorted(
        [
            "self.ranks > 1",
            "self.ranks == 1",
            "1 < self.ranks",
            "torch.distributed.get_world_size() > 1",
            "world_size == 1",
            "workers > 1",
        ]
    )


@pytest.mark.parametrize("module", COUNT_FREE)
def test_no_module_outside_the_rank_code_tests_the_number_of_ranks(module):
    assert count_tests((ROOT / module).read_text()) == []


def test_the_strategies_and_the_planner_are_checked():
    assert {"lightning/strategy.py", "lightning/fabric.py", "planning/planner.py", "lightning/plots.py"} <= set(
        COUNT_FREE
    )


def test_the_rank_code_is_where_the_count_is_tested():
    """The finder sees the rank modules' own tests (one each way the count decides), so the check above can fail."""
    assert sorted(count_tests((ROOT / "lightning" / "ranks.py").read_text())) == ["strategy.ranks > 1", "workers > 1"]
    assert sorted(count_tests((ROOT / "planning" / "ranks.py").read_text())) == ["ranks <= 1", "ranks > 1"]


# -- choosing the policy ---------------------------------------------------------------------------------------
class Environment:
    """A cluster environment that says who this process is and records what it is told."""

    def __init__(self, world: int = 4, rank: int = 3, local: int = 1, node: int = 1) -> None:
        self.world, self.rank, self.local, self.node = world, rank, local, node
        self.told: list[tuple[str, int]] = []
        self.torn_down = False

    def world_size(self) -> int:
        return self.world

    def global_rank(self) -> int:
        return self.rank

    def local_rank(self) -> int:
        return self.local

    def node_rank(self) -> int:
        return self.node

    def set_global_rank(self, rank: int) -> None:
        self.told.append(("rank", rank))

    def set_world_size(self, size: int) -> None:
        self.told.append(("world", size))

    def teardown(self) -> None:
        self.torn_down = True

    creates_processes_externally = True
    main_address = "127.0.0.1"
    main_port = 29500


def strategy(devices: int = 1, nodes: int = 1, **kwargs) -> MegatrainStrategy:
    s = MegatrainStrategy(parallel_devices=[CPU] * devices, cluster_environment=Environment(), **kwargs)
    s.num_nodes = nodes
    s.accelerator = CPUAccelerator()
    return s


@pytest.mark.parametrize(
    ("devices", "nodes", "kind"), [(1, 1, OneProcess), (2, 1, SeveralRanks), (1, 2, SeveralRanks), (4, 2, SeveralRanks)]
)
def test_the_policy_follows_the_count_as_lightning_sets_it(devices, nodes, kind):
    s = strategy()
    assert isinstance(policy(s), OneProcess)  # as built: one process
    s.parallel_devices, s.num_nodes = [CPU] * devices, nodes  # as Lightning's connector sets them
    assert isinstance(policy(s), kind)
    assert s.is_distributed is (kind is SeveralRanks)


# -- one process: a single-device strategy ---------------------------------------------------------------------
@pytest.fixture
def no_collectives(monkeypatch):
    """Every torch.distributed call raises, and a process group seems to exist (so nothing skips a call only
    because there is none)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a torch.distributed call with one process")

    for name in (
        "barrier",
        "broadcast_object_list",
        "all_reduce",
        "all_gather",
        "all_gather_object",
        "get_world_size",
        "get_backend",
        "init_process_group",
    ):
        monkeypatch.setattr(torch.distributed, name, refuse)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(ranks, "_init_dist_connection", refuse)
    monkeypatch.setattr(ranks, "_sync_ddp_if_available", refuse)
    monkeypatch.setattr(ranks, "_all_gather_ddp_if_available", refuse)


def test_one_process_is_rank_zero_of_one_whatever_the_environment_says():
    s = strategy()  # its environment says rank 3 of 4
    assert (s.global_rank, s.local_rank, s.node_rank, s.world_size) == (0, 0, 0, 1)
    assert s.is_global_zero and not s.is_distributed
    assert s.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}


def test_one_process_collectives_are_the_identity(no_collectives):
    s = strategy()
    obj, tensor = {"a": 1}, torch.arange(3.0)
    s.barrier("x")
    assert s.broadcast(obj) is obj
    assert s.reduce(tensor) is tensor
    assert s.all_gather(tensor) is tensor
    assert s.reduce_boolean_decision(False) is False and s.reduce_boolean_decision(True, all=False) is True
    loader = [1, 2, 3]
    assert s.process_dataloader(loader) is loader


def test_one_process_starts_no_launcher_no_process_group_and_tells_the_environment_nothing(no_collectives):
    s = strategy()
    s.set_world_ranks()
    s._configure_launcher()
    policy(s).setup_environment()
    assert s._launcher is None
    assert s.cluster_environment.told == []
    assert policy(s).process_group() is None  # the engine's group: its host state not partitioned


def test_one_process_teardown_leaves_the_environment_alone():
    s = strategy()
    s.teardown()
    assert not s.cluster_environment.torn_down


def test_one_process_refuses_nothing_that_needs_whole_weights(monkeypatch):
    s = strategy(device="cpu", checkpoint_format="torch")
    s.grad_hooks, s._layer_sync, s._released = ["M.on_after_backward"], object(), object()
    one = policy(s)
    one.refuse(SimpleNamespace(callbacks=[StochasticWeightAveraging(swa_lrs=0.1)]))
    one.refuse_save_after_fit()
    one.refuse_single_file("model.ckpt")
    engine = SimpleNamespace(master_state_dict=lambda: {"w": 1})
    assert one.module_state_dict(engine) == {"w": 1}
    calls = []
    monkeypatch.setattr(ranks, "replaced_weights", lambda e, sd: calls.append((e, sd)) or "weights")
    assert one.saved_weights(engine, {"state_dict": {"w": 2}}) == "weights"
    assert calls == [(engine, {"w": 2})]


# -- several ranks: DDP's answers, and what no rank holds refused ------------------------------------------------
def test_several_ranks_are_the_environments():
    s = strategy(devices=2, nodes=2)
    assert (s.global_rank, s.local_rank, s.node_rank, s.world_size) == (3, 1, 1, 4)
    assert not s.is_global_zero and s.is_distributed
    assert s.distributed_sampler_kwargs == {"num_replicas": 4, "rank": 3}


def test_several_ranks_tell_the_environment_their_rank(monkeypatch):
    monkeypatch.setattr(rank_zero_only, "rank", rank_zero_only.rank)  # (restored after the test)
    monkeypatch.setattr(utils_rank_zero_only, "rank", utils_rank_zero_only.rank)
    s = strategy(devices=2, nodes=2)
    s.set_world_ranks()
    assert s.cluster_environment.told == [("rank", 1 * 2 + 1), ("world", 4)]
    assert rank_zero_only.rank == utils_rank_zero_only.rank == 3


def test_several_ranks_launch_with_lightnings_script_launcher():
    s = strategy(devices=2)
    s._configure_launcher()
    assert isinstance(s._launcher, ScriptLauncher) and s._launcher.strategy is s


def test_several_ranks_teardown_tears_the_environment_down():
    s = strategy(devices=2)
    s.teardown()
    assert s.cluster_environment.torn_down


def test_several_ranks_skip_collectives_before_the_process_group(monkeypatch):
    """Lightning may ask before setup_environment made the group: barrier and broadcast do nothing then."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "barrier", lambda *a, **k: pytest.fail("barrier without a group"))
    s, obj = strategy(devices=2), object()
    s.barrier()
    assert s.broadcast(obj) is obj
    assert s.reduce("not a tensor") == "not a tensor"


def test_several_ranks_use_lightnings_collectives(monkeypatch):
    calls = []
    monkeypatch.setattr(ranks, "_sync_ddp_if_available", lambda t, g, reduce_op: calls.append(("reduce", reduce_op)))
    monkeypatch.setattr(ranks, "_all_gather_ddp_if_available", lambda t, group, sync_grads: calls.append("gather"))
    s, tensor = strategy(devices=2), torch.ones(2)
    s.reduce(tensor, reduce_op="sum")
    s.all_gather(tensor)
    assert calls == [("reduce", "sum"), "gather"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"device": "cuda:1"}, r"MegatrainStrategy\(device='cuda:1'\) names one device, but data parallel over 2"),
        ({"checkpoint_format": "torch"}, "checkpoint_format='torch' builds the whole model in one process"),
    ],
)
def test_several_ranks_refuse_options_before_any_process_starts(options, message):
    s = strategy(devices=2, **options)
    with pytest.raises(ValueError, match=message):
        s._configure_launcher()
    assert s._launcher is None


def test_several_ranks_refuse_what_needs_whole_weights_or_gradients():
    s, trainer = strategy(devices=2), SimpleNamespace(callbacks=[])
    s.grad_hooks = ["M.on_after_backward"]
    with pytest.raises(ValueError, match=r"M.on_after_backward read or edit gradients, .* over 2 ranks"):
        policy(s).refuse(trainer)
    s.grad_hooks = []
    with pytest.raises(ValueError, match="StochasticWeightAveraging averages the whole model's weights"):
        policy(s).refuse(SimpleNamespace(callbacks=[StochasticWeightAveraging(swa_lrs=0.1)]))
    s._layer_sync = object()
    with pytest.raises(ValueError, match=r"sync_batchnorm=True is not supported .*over 2 ranks"):
        policy(s).refuse(trainer)


def test_several_ranks_checkpoints_hold_no_whole_weights(monkeypatch):
    s = strategy(devices=2)
    several = policy(s)
    engine = SimpleNamespace(master_state_dict=lambda: pytest.fail("whole masters asked of a rank"))
    assert several.module_state_dict(engine) == {}
    monkeypatch.setattr(ranks, "replaced_weights", lambda *a: pytest.fail("averaged weights asked of a rank"))
    assert several.saved_weights(engine, {"state_dict": {"w": 1}}) is None
    several.refuse_save_after_fit()  # during fit: the engine is not released
    s._released = object()
    with pytest.raises(RuntimeError, match="trainer.save_checkpoint after fit over 2 ranks"):
        several.refuse_save_after_fit()
    with pytest.raises(ValueError, match=r"ckpt_path='m.ckpt' is a single-file checkpoint, .* over 2 ranks"):
        several.refuse_single_file("m.ckpt")
