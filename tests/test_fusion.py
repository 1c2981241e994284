"""``compile_blocks=True`` in the schedule model (megatrain_lightning/schedule/fusion.py): what the recording
scales is the work the measurement counts, by the measured ratios, and the measurement reads inductor's own
fused kernels."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatrain_lightning.models import LlamaConfig
from megatrain_lightning.schedule import PROFILES
from megatrain_lightning.schedule.fusion import Fusion, _eager, block_call, block_fusion
from megatrain_lightning.schedule.modelled import modelled_step
from megatrain_lightning.schedule.report import gpu_kind
from megatrain_lightning.schedule.steps import record_steps
from megatrain_lightning.schedule.trace import Kernel

TOKENS, STEPS = 32, 2


def tiny() -> LlamaConfig:
    return LlamaConfig.from_preset("tiny", loss_chunk_size=16)


def kernels(fusion: Fusion | None, rows: int = 1) -> tuple[list[Kernel], dict[str, int]]:
    """The recorded kernels of STEPS steps of `rows` x TOKENS (in calls of one row each when more), and the eager
    bytes the recording scaled per compiled graph."""
    trace = record_steps(tiny(), TOKENS, steps=STEPS, fusion=fusion, batch_size=rows, row_chunk=1 if rows > 1 else None)
    return [k for k in trace.issue if isinstance(k, Kernel)], trace.eager_block_bytes


def eager_block(config: LlamaConfig, tokens: int) -> list[tuple[int, int]]:
    """(memory-bound kernels, bytes) of one block's eager forward and backward, bf16 under autocast."""
    block, x, cos, sin, grad = block_call(config, tokens, torch.bfloat16)
    return _eager(block, torch.bfloat16, x, cos, sin, grad)


@pytest.mark.parametrize("rows", [1, 2], ids=["whole", "layer-major-rows"])
def test_the_recorded_block_work_is_the_work_the_measurement_counts_eager(rows):
    """What the recording classes as a compiled block's forward (the model's code in each block call: the forward
    and its recompute) and backward (autograd running the block's nodes) is, byte for byte, the eager work the
    measurement takes its ratios against: per step, each block's forward twice (recompute) and backward once, per
    chunk of rows in layer-major calls (the engine's own work between the chunks, concatenating outputs and summing
    gradients, is in no compiled graph)."""
    unity = Fusion(1.0, 1.0, (0, 0), (0, 0), 0.0)
    _, counted = kernels(unity, rows)
    (_, forward), (_, backward) = eager_block(tiny(), TOKENS)
    calls = STEPS * tiny().num_hidden_layers * rows
    assert counted == {"forward": 2 * calls * forward, "backward": calls * backward}


def test_a_compiled_block_moves_its_graphs_share_of_the_eager_bytes_and_nothing_else_changes():
    """With ratios 0.5 (forward) and 0.25 (backward) the recording's memory-bound bytes drop by half the forward's
    eager bytes and three quarters of the backward's; every kernel is still issued (their launches are counted,
    an upper bound), matmuls, attention and the engine's own kernels move what they moved."""
    plain, _ = kernels(None)
    fused, counted = kernels(Fusion(0.5, 0.25, (0, 0), (0, 0), 0.0))
    assert [(k.name, k.flops, k.origin, k.phase) for k in fused] == [
        (k.name, k.flops, k.origin, k.phase) for k in plain
    ]
    kept = [
        (a.nbytes, b.nbytes)
        for a, b in zip(plain, fused)
        if gpu_kind(a.name) != "memory-bound" or a.origin != "model" or "block" not in a.phase
    ]
    assert any(a.origin.startswith("engine:") for a in plain)  # (the engine's own are among those kept)
    assert all(a == b for a, b in kept)
    saved = sum(a.nbytes for a in plain) - sum(b.nbytes for b in fused)
    expected = 0.5 * counted["forward"] + 0.75 * counted["backward"]
    assert counted["forward"] > 0 and counted["backward"] > 0
    assert abs(saved - expected) <= len(plain)  # (each kernel's bytes rounded to a whole byte)


@pytest.mark.slow
def test_block_fusion_reads_inductors_fused_kernels():
    """Inductor compiles the block's forward and backward (on the CPU), fusing its elementwise work into fewer
    kernels that move a fraction of eager code's bytes per token; the eager side is what the block dispatches."""
    config = tiny()
    fusion = block_fusion(config)
    assert 0.05 < fusion.forward < 1 and 0.05 < fusion.backward < 1
    assert all(0 < f < e for f, e in zip(fusion.fused_kernels, fusion.eager_kernels))
    assert list(fusion.eager_kernels) == [n for n, _ in eager_block(config, 128)]
    assert block_fusion(dataclasses.replace(config, num_hidden_layers=7)) is fusion  # (one block's: measured once)
    assert "compile_blocks" in fusion.describe()


def test_compile_blocks_with_token_tiles_is_refused_before_anything_is_recorded():
    """An 8B block of 131,072 tokens is tiled on an h100 (the planner): the tiled block runs other code than
    the one measured, so the model refuses it in one line naming what to change."""
    with pytest.raises(ValueError, match=r"compile_blocks=True with token tiles of \d+ is not modelled") as err:
        modelled_step(LlamaConfig.from_preset("llama-3.1-8b"), PROFILES["h100-sxm"], 131072, compile_blocks=True)
    assert "\n" not in str(err.value)


def test_the_row_chunks_own_work_is_the_engines_not_the_models():
    """In layer-major calls the engine sums each chunk's weight gradients in fp32 and gathers the chunks' input
    gradients (engine/device/rows.py) between the block's ops: the report counts that as the engine's own work
    (and a compiled block does not fuse it), while autograd differentiating the block stays the model's."""
    found, _ = kernels(None, rows=2)
    rows_work = {k.name for k in found if k.origin == "engine:backward"}
    assert {"_to_copy", "add_"} <= rows_work
    assert any(k.origin == "model" and "backward block" in k.phase and k.name == "mm" for k in found)
