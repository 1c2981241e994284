"""measure_step: one training step's device memory, counted on fake tensors (megatrain_lightning/planning/measure.py).

The long-context cases use llama-3.1-8b shapes at 128k tokens; on fake tensors they cost time in the
number of ops (about 3 s for 8 layers, 7 s for 32), not in memory.
"""

from __future__ import annotations

import functools
import threading

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megatrain_lightning import Engine, EngineConfig
from megatrain_lightning.engine.host.pinned import host_empty
from megatrain_lightning.engine.self_checks import FINGERPRINT_BYTES
from megatrain_lightning.models import LlamaConfig, LlamaForCausalLM
from megatrain_lightning.planning.measure import (
    DeviceBytes,
    Measured,
    flash_workspace,
    measure_step,
    observe_host_allocations,
)

GiB = 2**30
LONG = 131072


def tiny(layers: int) -> LlamaConfig:
    return LlamaConfig.from_preset("tiny", num_hidden_layers=layers, token_chunk_size=None)


def llama(layers: int) -> LlamaConfig:
    return LlamaConfig.from_preset("llama-3.1-8b", num_hidden_layers=layers, token_chunk_size=None)


@functools.cache
def tiny_step(layers: int, precision: str = "bf16-mixed") -> Measured:
    return measure_step(tiny(layers), 256, precision=precision)


@functools.cache
def llama8b(layers: int, offload: bool) -> Measured:
    return measure_step(llama(layers), LONG, offload_inputs=offload)


def one_input(config: LlamaConfig, tokens: int, elt: int = 2) -> int:
    """One block's input hidden state: what each saved input holds."""
    return tokens * config.hidden_size * elt


def test_persistent_is_the_engines_device_buffers_not_its_host_buffers():
    """After construction the device holds exactly the weight slots, gradient slots and outer parameters
    (as a real engine reports them); the host buffers, which grow with depth, are not counted."""
    real = {
        n: Engine(LlamaForCausalLM(tiny(n)), EngineConfig(device="cpu", precision="bf16-true", pin_memory=False))
        for n in (4, 16)
    }
    measured = {n: tiny_step(n) for n in (4, 16)}
    for n in (4, 16):
        assert measured[n].persistent == sum(real[n].device_bytes().values())
    assert measured[4].persistent == measured[16].persistent
    assert sum(real[16].host_bytes().values()) > 3 * sum(real[4].host_bytes().values())
    for engine in real.values():
        engine.close()


def test_saved_inputs_are_seen_and_workspace_is_modelled():
    """12 more blocks keep 12 more inputs on the device (and their outputs' fingerprints for the self-check of
    their recompute); the flash backward's workspace is bf16-only."""
    shallow, deep = tiny_step(4), tiny_step(16)
    assert deep.peak - shallow.peak == 12 * (one_input(tiny(4), 256) + FINGERPRINT_BYTES)
    # dq accumulator (fp32, head_dim 16 rounded up to 32) + softmax row sums + dk, dv expanded to 4 heads
    assert shallow.workspace == 256 * 4 * 32 * 4 + 4 * 256 * 4 + 2 * 256 * 4 * 16 * 2
    assert shallow.peak >= shallow.persistent + shallow.workspace
    assert tiny_step(4, "32-true").workspace == 0


def test_long_context_is_flat_in_depth_with_offloaded_inputs():
    shallow, deep = llama8b(8, True), llama8b(32, True)
    assert abs(deep.peak - shallow.peak) <= 0.05 * shallow.peak
    assert deep.persistent == shallow.persistent


def test_saved_inputs_grow_with_depth_without_offload():
    shallow, deep = llama8b(8, False), llama8b(32, False)
    step = one_input(llama(32), LONG)
    assert deep.peak - shallow.peak == pytest.approx(24 * step, rel=0.02)


def test_offloading_moves_the_saved_inputs():
    """The peak is in the recompute of the last block, where without offloading every block's input is on
    the device. With offloading only that block's own input is: the input of the block below is prefetched
    after the recompute has been issued, when its temporaries are already freed (the planner counts two
    inputs, one in use and one coming back, which is the most ever held, but not at the peak). So the
    difference is layers - 1 inputs, in forward too (each block's input is freed once the next block ran)."""
    layers = 32
    on, off = llama8b(layers, True), llama8b(layers, False)
    step = one_input(llama(32), LONG)
    assert off.peak - on.peak == pytest.approx((layers - 1) * step, rel=0.01)
    assert off.forward_peak - on.forward_peak == pytest.approx((layers - 1) * step, rel=0.01)


def test_host_buffers_are_uncounted_and_leave_the_peak_alone():
    with FakeTensorMode(), DeviceBytes() as counter, observe_host_allocations(counter.host_buffer):
        device = torch.empty(1000, dtype=torch.bfloat16)
        del device
        buffers = [host_empty(10_000, torch.float32, pin=False) for _ in range(3)]
        assert (counter.live, counter.peak) == (0, 2000)
        x = torch.empty(10)  # a later device allocation is counted again
        assert (counter.live, counter.peak) == (40, 2000)
    del buffers, x


def test_work_on_other_threads_is_not_counted():
    """The host worker's arithmetic (accumulation, Adam) runs on its own thread: dispatch modes are
    thread-local, so it never reaches the counter, nor does a host buffer it allocates."""
    with FakeTensorMode(), DeviceBytes() as counter, observe_host_allocations(counter.host_buffer):
        a = torch.empty(100)
        kept = []
        worker = threading.Thread(target=lambda: kept.extend([a * 2, host_empty(500, torch.float32, pin=False)]))
        worker.start()
        worker.join()
        assert len(kept) == 2 and counter.live == counter.peak == 400


def test_auto_tiles_are_refused():
    """ "auto" sizes tiles from the GPU's free memory, which the fake run does not have."""
    with pytest.raises(ValueError, match="auto"):
        measure_step(LlamaConfig.from_preset("tiny", token_chunk_size="auto"), 256)


def test_workspace_only_for_the_flash_backward():
    q = torch.empty(2, 8, 100, 64, dtype=torch.bfloat16, device="meta")
    k = torch.empty(2, 2, 100, 64, dtype=torch.bfloat16, device="meta")
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    dq_accum, softmax_d, expanded = 2 * 128 * 8 * 64 * 4, 2 * 8 * 128 * 4, 2 * (2 * 100 * 8 * 64 * 2)
    assert flash_workspace(backward, (q, q, k, k)) == dq_accum + softmax_d + expanded
    assert flash_workspace(backward, (q, q, q, q)) == dq_accum + softmax_d  # no GQA: nothing to expand
    assert flash_workspace(forward, (q, k, k)) == 0


def test_kept_graphs_are_measured_on_fake_tensors_as_the_planner_counts_them():
    """recompute="auto" on fake tensors: the engine measures each block's saved tensors (storages told apart
    though fake tensors have no data pointer) and, reading as free the capacity less the live bytes, keeps
    as many graphs as the planner's formula predicts where memory, not the slots, is the limit: here room
    for 2.5 blocks' activations in half the free memory, with 5 slots (3 could be pinned)."""
    from megatrain_lightning.planning.planner import CUDA_CONTEXT_BYTES, RunShape, kept_bytes_per_token, plan

    config, tokens = tiny(4), 256
    base = plan(RunShape(config, tokens, 1), EngineConfig(num_slots=5), gpu_mem=64 * GiB)
    live = sum(base.gpu[k] for k in ("weight_slots", "grad_slots", "outer", "rope", "cuda_context"))
    per_block = kept_bytes_per_token(config, 2, None) * tokens
    gpu_mem = live + one_input(config, tokens) + 5 * per_block  # half of it: 2.5 blocks
    assert plan(RunShape(config, tokens, 1), EngineConfig(num_slots=5), gpu_mem=gpu_mem).kept_blocks == 2
    measured = measure_step(config, tokens, num_slots=5, recompute="auto", capacity=gpu_mem - CUDA_CONTEXT_BYTES)
    assert measured.kept_calls == 2


def test_the_tiled_attention_core_is_measured_as_planned():
    """One step with the tiled attention core on fake tensors against the planner's formula: llama-3.1-8b's
    attention heads and widths scaled down 16-fold (so that 16k tokens in tiles of 512 put the peak in the
    core's backward, as 1M tokens do at full size). They agree within 1%: the formula counts every weight
    gradient of the block, where the q, k, v projections' arrive only after the core's backward, and the
    workspace model bounds the block pair's allocations from above (tests/test_tiled_attention.py)."""
    from megatrain_lightning.planning.planner import RunShape, plan

    config = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=896, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=32, token_chunk_size=512, tiled_attention=True, loss_chunk_size=4096,
    )  # fmt: skip
    p = plan(
        RunShape(config, 16384, 1),
        EngineConfig(num_slots=2, offload_inputs=True, recompute=True),
        gpu_mem=80 * GiB,
        measure=True,
    )
    assert p.tiled_core and p.measured.workspace > 0
    assert p.gpu["recompute"] > p.gpu["loss"]  # the peak is the block's recompute
    assert abs(p.gpu_peak - p.measured_peak) <= 0.01 * p.measured_peak
