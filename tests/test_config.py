"""EngineConfig declares each option once (type, default, check, help); the strategies, ``megatrain plan`` and the
planner derive theirs from it."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import pytest

from megatrain_lightning import MegatrainFabricStrategy, MegatrainStrategy
from megatrain_lightning.cli.commands import plan_parser
from megatrain_lightning.engine import EngineConfig, declared
from megatrain_lightning.models import LlamaConfig
from megatrain_lightning.planning.planner import RunShape, plan


def test_both_strategies_take_every_option_with_its_default():
    trainer = inspect.signature(MegatrainStrategy.__init__).parameters
    fabric = inspect.signature(MegatrainFabricStrategy.__init__).parameters
    options = declared("option")
    assert {"num_slots", "overlap_optimizer", "host_layout", "blocks", "device"} <= {d.name for d in options}
    for d in options:
        assert trainer[d.name].default == fabric[d.name].default == d.default, d.name
        assert trainer[d.name].annotation == fabric[d.name].annotation == d.type, d.name
        assert f"{d.name}: " in MegatrainStrategy.__doc__ and f"{d.name}: " in MegatrainFabricStrategy.__doc__
    assert trainer["overlap_optimizer"].default is True  # the Trainer's default, under Fabric too
    assert MegatrainFabricStrategy().overlap_optimizer is MegatrainStrategy().overlap_optimizer is True
    # What a Fabric loop declares (the Trainer reads it from the Trainer): Fabric's only.
    assert {"clipping", "accumulating"} <= set(fabric) and not {"clipping", "accumulating"} & set(trainer)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"offload_inputs": 1}, "offload_inputs=1: choose True"),
        ({"num_slots": 1}, "num_slots=1: give at least 2 slots"),
        ({"preserve_rng_state": "no"}, "preserve_rng_state='no': pass True or False"),
    ],
)
def test_one_check_everywhere(bad, message):
    """The same value is refused with the same line by the config, both strategies and the planner."""
    tiny = LlamaConfig.from_preset("tiny")
    for make in (
        lambda: EngineConfig(**bad),
        lambda: MegatrainStrategy(**bad),
        lambda: MegatrainFabricStrategy(**bad),
        lambda: plan(RunShape(tiny, 32, 1), EngineConfig(**bad)),
    ):
        with pytest.raises(ValueError, match=message):
            make()


def test_plan_flags_are_the_declared_ones():
    flags = {a.dest for a in plan_parser()._actions}
    declared_flags = {d.name for d in declared() if d.option.flag is not None}
    assert declared_flags == {
        "precision",
        "num_slots",
        "offload_inputs",
        "recompute",
        "offload_inputs_dtype",
        "host_layout",
        "nvme_dir",
        "device_grad_sums",
        "row_chunk",
        "speculative_step",
        "keep_attention",
    }
    assert declared_flags <= flags


# Declares one more option (a subclass of EngineConfig standing for a field added to it), then loads the clients
# again: they are not edited, and each takes the option under its name, with its default and its check.
ADDED_OPTION = textwrap.dedent(
    """
    import dataclasses, importlib, inspect

    import megatrain_lightning.engine as facade
    import megatrain_lightning.engine.config as cfg

    def check_priority(value):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"stream_priority={value!r}: give an int >= 0")
        return value

    @dataclasses.dataclass(frozen=True)
    class Extended(cfg.EngineConfig):
        stream_priority: int = cfg.option(0, "priority of the copy streams.", check_priority, flag={"type": int})

    cfg.EngineConfig = facade.EngineConfig = Extended
    from megatrain_lightning.cli import commands
    from megatrain_lightning.lightning import fabric, strategy
    from megatrain_lightning.planning import planner, plan_any
    for module in (planner, plan_any, commands, fabric, strategy):
        importlib.reload(module)

    for cls in (strategy.MegatrainStrategy, fabric.MegatrainFabricStrategy):
        assert inspect.signature(cls.__init__).parameters["stream_priority"].default == 0, cls
        assert "stream_priority: priority of the copy streams." in cls.__doc__, cls
        assert cls(stream_priority=3).options["stream_priority"] == 3, cls
        try:
            cls(stream_priority=-1)
        except ValueError as err:
            assert "stream_priority=-1: give an int >= 0" in str(err), err
        else:
            raise AssertionError(f"{cls.__name__} took stream_priority=-1")
    built = fabric.MegatrainFabricStrategy(stream_priority=2).engine_config()
    assert isinstance(built, Extended) and built.stream_priority == 2

    args = commands.plan_parser().parse_args(["--model", "tiny", "--stream-priority", "5"])
    assert args.stream_priority == 5
    planned = commands.plan_command(["--model", "tiny", "--seq-len", "32", "--no-measure", "--stream-priority", "5"])
    assert isinstance(planned.options, Extended) and planned.options.stream_priority == 5
    print("reached")
    """
)


def test_an_option_added_to_engine_config_reaches_the_strategies_the_cli_and_the_planner():
    out = subprocess.run([sys.executable, "-c", ADDED_OPTION], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("reached")
