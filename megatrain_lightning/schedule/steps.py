"""Training steps in the order the strategy runs them, recorded on fake tensors at a real size.

One optimizer step under ``Trainer(strategy="megatrain")`` with automatic optimization and one micro-batch
per step is ``HostAdamW.step(closure)``, where Lightning's closure runs the forward (under the precision's
autocast), ``zero_grad``, then backward inside ``engine.backward(clip=...)``; the precision plugin's
``clip_gradients`` (``engine.clip_grad_norm_``) follows the closure, then ``engine.optimizer_step``. With
``accumulate_grad_batches=k`` the first k - 1 micro-batches run the closure outside the step, their
backward inside ``engine.backward(accumulate=True)``, and only the first of the k calls ``zero_grad`` (Lightning's automatic
optimization loop). :func:`train_steps` makes the same calls in the same order.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megatrain_lightning.engine.config import EngineConfig
from megatrain_lightning.engine.engine import Engine
from megatrain_lightning.models import LlamaConfig, LlamaForCausalLM
from megatrain_lightning.planning.measure import release_quietly
from megatrain_lightning.schedule.fusion import Fusion
from megatrain_lightning.schedule.profiles import Profile
from megatrain_lightning.schedule.ranks import DataParallel, RankRecorder
from megatrain_lightning.schedule.record import Recorder
from megatrain_lightning.schedule.replay import LAUNCH_S
from megatrain_lightning.schedule.trace import Trace


def train_steps(
    engine: Engine,
    model: torch.nn.Module,
    batch: torch.Tensor,
    recorder: Recorder,
    steps: int = 3,
    clip: float | None = None,
    autocast: torch.dtype | None = torch.bfloat16,
    micro_batches: int = 1,
) -> None:
    """`steps` optimizer steps of `model` on `batch` (targets = the batch), each over `micro_batches`
    micro-batches, with AdamW on the host."""
    opt = engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1))
    for step in range(1, steps + 1):
        recorder.begin_step(step)
        kept = engine.stats["kept_calls"]
        for micro in range(micro_batches - 1):
            _closure(engine, model, batch, opt, recorder, None, autocast, micro == 0, "accumulate", clip is not None)
        opt.step(
            lambda: _closure(
                engine, model, batch, opt, recorder, clip, autocast, micro_batches == 1, "step", clip is not None
            )
        )
        recorder.trace.kept_calls.append(engine.stats["kept_calls"] - kept)
    recorder.stage = "end"
    engine.flush()


def _closure(
    engine,
    model,
    batch,
    opt,
    recorder: Recorder,
    clip: float | None,
    autocast: torch.dtype | None,
    zero_grad: bool = True,
    mode: str = "step",
    norms: bool = False,
) -> Any:
    """Lightning's closure: training_step, zero_grad (the first micro-batch of a step), backward; then
    clip_gradients after the last micro-batch's."""
    recorder.stage = "forward"
    precision = torch.autocast(batch.device.type, dtype=autocast, cache_enabled=False) if autocast else nullcontext()
    with precision:
        loss = model(batch, targets=batch)
    if zero_grad:
        recorder.stage = "zero_grad"
        opt.zero_grad()
    recorder.stage = "backward"
    # The strategy knows from Trainer(gradient_clip_val) that a clip will come: norms on the device.
    with engine.backward(accumulate=mode == "accumulate", clip=norms):
        loss.backward()
    recorder.stage = "optimizer"
    if clip is not None:
        engine.clip_grad_norm_(clip)
    return loss


def record_steps(
    config: LlamaConfig,
    tokens: int,
    clip: float | None = None,
    steps: int = 3,
    num_slots: int | str = 2,
    offload_inputs: bool = False,
    tile: int | None = None,
    profile: Profile | None = None,
    launch_s: float = LAUNCH_S,
    device_memory: tuple[int, int] | None = None,
    micro_batches: int = 1,
    data_parallel: DataParallel | None = None,
    recompute: bool | str = "auto",
    grad_sums: int | str = 0,
    batch_size: int = 1,
    row_chunk: int | None = None,
    speculative_step: bool = False,
    fusion: Fusion | None = None,
    keep_attention: bool = False,
) -> Trace:
    """The trace of `steps` bf16-mixed training steps of `config`, each of `micro_batches` micro-batches of
    `batch_size` x `tokens`, on fake tensors (measure.py's way: the engine and model run for real, the tensors have
    shapes but no memory). `tile` and `offload_inputs` are fixed: their "auto" choices read the free memory
    of a device there is not. With a
    `profile` the engine's timing decisions (prefetch a block whose step is done) get that device's answers
    (a live replay, see Recorder). `device_memory` = (capacity, transient bytes): the profile's GPU memory
    less the CUDA context, of which the engine finds free what the recording's live device bytes leave
    (Recorder.probes; read by ``num_slots="auto"`` after the first step and by ``recompute="auto"`` at each
    pass's first block), and what the first step needed beyond the persistent buffers (the planner's figure:
    there is no device to measure). `recompute`: the engine's option (True: every block is recomputed in
    backward; False or "auto": kept graphs stay in device memory and their blocks' forward is recorded once;
    without `device_memory` "auto" keeps none, as on a device with no memory measure). `row_chunk`: the engine's
    option (layer-major calls of that many rows at a time); `speculative_step` too (a fake norm has no value: the
    recording takes it as not clipped, so every speculation is kept), and `keep_attention`. `data_parallel`: record one rank of that many GPUs instead (ranks.py), replayed live on
    the rank's profile. `fusion`: model ``compile_blocks=True`` (fusion.py: each block's memory-bound bytes scaled
    as inductor fuses them; the engine itself runs eagerly on the fake tensors)."""
    config = dataclasses.replace(config, token_chunk_size=tile)
    if data_parallel is None:
        recorder = Recorder(profile, launch_s, fusion)
    else:
        recorder = RankRecorder(data_parallel, profile, launch_s, fusion)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = LlamaForCausalLM(config)  # built before recording: host memory the engine takes over
        batch = torch.zeros(batch_size, tokens, dtype=torch.int64)
        with recorder.recording():
            options = EngineConfig(
                device="cpu",
                precision="bf16-mixed",
                num_slots=num_slots,
                offload_inputs=offload_inputs,
                pin_memory=False,
                clipping=clip is not None,
                accumulating=micro_batches > 1,
                recompute=recompute,
                device_grad_sums=grad_sums,
                row_chunk=row_chunk,
                speculative_step=speculative_step,
                keep_attention=keep_attention,
            )
            engine = Engine(model, options, recorder.probes(device_memory))
            recorder.attach(engine)
            try:
                train_steps(engine, model, batch, recorder, steps, clip, micro_batches=micro_batches)
                recorder.trace.slots = engine.pool.num_slots
                recorder.trace.grad_sums = 0 if engine.host.sums is None else engine.host.sums.count
                recorder.trace.speculative = (engine.stats["speculative_kept"], engine.stats["speculative_discarded"])
            finally:
                recorder.detach()
                release_quietly(engine)
    return recorder.trace
