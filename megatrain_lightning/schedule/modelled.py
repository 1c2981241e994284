"""One training step of strategy="megatrain" modelled on a device profile, end to end: what ``megatrain
schedule`` and ``bench/schedule.py`` print.

:func:`modelled_step` takes the planner's choices for the profile's GPU memory (token tiles, input offload,
the free and transient memory that ``num_slots="auto"`` reads), records a few bf16-mixed optimizer steps on
fake tensors (``steps.py``), replays them on the profile (``replay.py``) and measures the last one
(``report.py``). :class:`ModelledStep` holds the figures and prints them: what was modelled, the lanes'
table and, as the last line, one machine-readable summary.

With ``gpus`` > 1 it models one rank of the data-parallel mode (``ranks.py``; engine/ranks.py): the rank's share of
the step's tokens is what it records (``micro_batches`` of its own), its profile has 1/gpus of the host's
DRAM bandwidth, and the planner's choices leave the GPU memory of the collective library's buffers free.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from megatrain_lightning.engine import check_row_chunk
from megatrain_lightning.engine.config import check_num_slots
from megatrain_lightning.engine.device.recompute import check_recompute
from megatrain_lightning.models import LlamaConfig
from megatrain_lightning.planning import planner
from megatrain_lightning.planning.flops import attention_flops, model_flops
from megatrain_lightning.schedule.fusion import Fusion, block_fusion
from megatrain_lightning.schedule.profiles import PEER_EFFICIENCY, Profile
from megatrain_lightning.schedule.ranks import DataParallel
from megatrain_lightning.schedule.replay import LAUNCH_S, Timeline, replay
from megatrain_lightning.schedule.report import Summary, summarize, table
from megatrain_lightning.schedule.steps import record_steps
from megatrain_lightning.schedule.trace import Trace

PRECISION = "bf16-mixed"  # what the recording trains in (steps.record_steps)
FIRST_SLOTS = 2  # what num_slots="auto" starts with: the planner's figures for the first step use it


@dataclass(frozen=True)
class ModelledStep:
    """The last of `steps` recorded optimizer steps of `name`, each `micro_batches` micro-batches of
    `batch_size` x `seq_len` tokens, replayed on `profile`."""

    name: str
    config: LlamaConfig
    profile: Profile
    seq_len: int
    micro_batches: int
    clip: float | None
    num_slots: int | str  # as asked; trace.slots is what the engine ended with
    steps: int
    launch_s: float
    adam_source: str  # where the host Adam rate comes from
    tile: int | None
    offload_inputs: bool
    record_s: float  # seconds the recording took here
    trace: Trace
    timeline: Timeline
    summary: Summary
    data_parallel: DataParallel = DataParallel()
    recompute: bool | str = "auto"  # as asked; trace.kept_calls is what the engine kept
    batch_size: int = 1  # rows (sequences) per micro-batch
    row_chunk: int | None = None  # rows a block call computes at a time (layer-major; None: the micro-batch's)
    fusion: Fusion | None = None  # compile_blocks modelled: inductor's fusion of a block (fusion.py)

    @property
    def step_tokens(self) -> int:
        """Tokens per step of this rank (of the only GPU with gpus=1)."""
        return self.micro_batches * self.batch_size * self.seq_len

    @property
    def gpus(self) -> int:
        return self.data_parallel.gpus

    @property
    def global_tokens(self) -> int:
        """Tokens per step of all ranks together."""
        return self.gpus * self.step_tokens

    @property
    def tokens_per_s(self) -> float:
        return self.global_tokens / self.summary.step_s

    def describe(self) -> list[str]:
        """What was modelled: the model, the engine's decisions, the profile's rates and the FLOPs counted."""
        c, p = self.config, self.profile
        clip = "none" if self.clip is None else self.clip
        inputs = "offloaded to host memory" if self.offload_inputs else "kept on the GPU"
        slots = f"{self.trace.slots} weight slots" + (
            " (auto: 2 in the first step)" if self.num_slots == "auto" else ""
        )
        if self.micro_batches > 1:
            slots += f", {self.trace.grad_sums} blocks sum their gradients on the GPU"
        flops, attention = self.summary.model_flops, attention_flops(c, self.step_tokens, self.seq_len)
        micro = f"{self.micro_batches} micro-batches of " if self.micro_batches > 1 else ""
        if self.row_chunk is not None and self.row_chunk < self.batch_size:
            slots += f", layer-major: block calls of {self.row_chunk} rows"
        kept, discarded = self.trace.speculative
        if kept or discarded:  # (a fake norm is taken as not clipped: every one is kept)
            slots += f", speculative steps: {kept} kept, {discarded} discarded (taken as not clipped)"
        return [
            f"schedule model: {self.name} ({c.num_parameters() / 1e9:.2f}B params, {c.num_hidden_layers} blocks), "
            f"{micro}{self.batch_size} x {self.seq_len} tokens/step, {PRECISION}, clip {clip}, modelled {p.name}",
            f"engine decisions: token tiles {self.tile or 'none'}, block inputs {inputs} (planner, "
            f"{p.gpu_mem_gib:g} GiB), {slots}, {self.kept_text()}; {self.steps} steps recorded on fake tensors in {self.record_s:.1f} s "
            f"({len(self.trace.issue)} issued items, {len(self.trace.jobs)} host jobs)",
            f"rates: matmul {p.matmul_tflops:g} TFLOP/s, attention {p.attention_tflops:g} (peak {p.bf16_peak_tflops:g}), "
            f"HBM {p.hbm_bytes() / 1e9:.0f} GB/s, link {p.link_bytes() / 1e9:.1f} GB/s each way, "
            f"host {p.host_bytes() / 1e9:.0f} GB/s{' (given)' if p.host_given else ''}, Adam {p.adam_params() / 1e9:.3g} Gparams/s "
            f"({self.adam_source}), launch {self.launch_s * 1e6:g} us",
            f"model FLOPs/step {flops:.4g} = 6·N·tokens (N: weight matrices and head) + causal attention forward and "
            f"backward {attention:.3g}; no recompute",
            *self._ranks_line(),
            *([self.fusion.describe()] if self.fusion is not None else []),
        ]

    @property
    def kept_blocks(self) -> float:
        """Blocks per micro-batch that kept their graph in the measured (last) step."""
        return self.trace.kept_calls[-1] / self.micro_batches if self.trace.kept_calls else 0

    def kept_text(self) -> str:
        """``recompute auto: 30 of 32 blocks keep their graph (...)`` for the description."""
        kept = f"{self.kept_blocks:g} of {self.config.num_hidden_layers} blocks keep their graph"
        why = " (the first step recomputes all and measures)" if self.recompute == "auto" else ""
        return f"recompute {str(self.recompute).lower()}: {kept}{why}"

    def _ranks_line(self) -> list[str]:
        """Data parallel: what one rank of how many was modelled (ranks.py)."""
        dp, p = self.data_parallel, self.profile
        if dp.gpus == 1:
            return []
        link = f"NVLink {p.peer_gbps:g} GB/s each way x {PEER_EFFICIENCY:g}" if dp.link == "nvlink" else "PCIe"
        return [
            f"data parallel (modelled; the strategy trains on one GPU today): one rank of {dp.gpus} GPUs of one node, "
            f"peers over {link}; shard copies 1/{dp.gpus} of each unit, all-gather ({dp.gather_lane} lane) and "
            f"reduce-scatter ({dp.scatter_lane} lane) of {dp.gpus - 1}/{dp.gpus}; host work on 1/{dp.gpus} of the parameters at "
            f"1/{dp.gpus} of the node's DRAM bandwidth (shown above); {self.global_tokens} tokens per step in all"
        ]

    def summary_line(self) -> str:
        """``schedule: model=... tokens_per_step=... clip=... step_s=... bound_s=... ratio=... bound=... mfu=...``"""
        s = self.summary
        clip = "none" if self.clip is None else f"{self.clip:g}"
        return (
            f"schedule: model={self.name} tokens_per_step={self.step_tokens} clip={clip} step_s={s.step_s:.4g} "
            f"bound_s={s.bound_s:.4g} ratio={s.ratio:.4g} bound={s.bound} mfu={s.mfu:.3g}"
            + (
                f" gpus={self.gpus} link={self.data_parallel.link} tokens_per_s={self.tokens_per_s:.5g}"
                if self.gpus > 1
                else ""
            )
        )

    def report(self) -> list[str]:
        """Everything printed: the description, the lanes' table, then the summary line."""
        return [*self.describe(), table(self.summary), self.summary_line()]


def modelled_step(
    config: LlamaConfig,
    profile: Profile,
    seq_len: int,
    micro_batches: int = 1,
    clip: float | None = None,
    num_slots: int | str = "auto",
    steps: int = 3,
    launch_s: float = LAUNCH_S,
    name: str = "model",
    adam_source: str | None = None,
    gpus: int = 1,
    link: str = "nvlink",
    recompute: bool | str = "auto",
    grad_sums: int | str = 0,
    batch_size: int = 1,
    row_chunk: int | str | None = None,
    speculative_step: bool = False,
    compile_blocks: bool = False,
    keep_attention: bool = False,
) -> ModelledStep:
    """Record `steps` optimizer steps of `config` as the strategy runs them and replay them on `profile`
    (module docstring); with `gpus` > 1, one rank of that many joined by `link`, each step `micro_batches`
    of the rank's own. `row_chunk`: layer-major block calls of that many rows (engine/device/rows.py; "auto": as
    many as the planner picks), the tile and the memory figures those of one chunk. `compile_blocks`: the engine's option,
    modelled from inductor's fusion of one block on the CPU (fusion.py; untiled blocks only); `keep_attention` the
    engine's option. A ValueError names a bad option."""
    check_options(seq_len, micro_batches, clip, num_slots, steps, batch_size)
    check_recompute(recompute)
    check_row_chunk(row_chunk)
    dp = DataParallel(gpus, link)
    base, profile = profile, dp.rank_profile(profile)
    gpu_mem = int(profile.gpu_mem_gib * planner.GiB) - planner.collective_bytes(config, PRECISION, gpus)
    elt = planner.compute_bytes(PRECISION)
    # "auto": the planner's rows (the most that fit; the engine, measuring, takes at most as many)
    row_chunk = planner.auto_row_chunk(config, seq_len, batch_size, PRECISION, FIRST_SLOTS, gpu_mem, "auto", row_chunk)
    tile = planner.planned_tile(config, seq_len, planner.call_rows(batch_size, row_chunk), elt, gpu_mem)
    offload = planner.auto_offloads_inputs(config, seq_len, batch_size, PRECISION, FIRST_SLOTS, gpu_mem, row_chunk)
    transient = planner.free_and_transient(config, seq_len, batch_size, PRECISION, offload, gpu_mem, row_chunk)[1]
    memory = (gpu_mem - planner.CUDA_CONTEXT_BYTES, transient)  # free = this less what is live (Recorder.probes)
    if compile_blocks and tile is not None:
        raise ValueError(
            f"compile_blocks=True with token tiles of {tile} is not modelled (fusion.py measures an untiled block): "
            "fewer tokens per block call (--row-chunk, --seq-len) leave the block untiled"
        )
    fusion = block_fusion(config, PRECISION) if compile_blocks else None
    t0 = time.perf_counter()
    trace = record_steps(
        config,
        seq_len,
        clip,
        steps,
        num_slots,
        offload,
        tile,
        base,
        launch_s,
        memory,
        micro_batches,
        dp if gpus > 1 else None,
        recompute,
        grad_sums,
        batch_size,
        row_chunk=row_chunk,
        speculative_step=speculative_step,
        fusion=fusion,
        keep_attention=keep_attention,
    )
    record_s = time.perf_counter() - t0
    timeline = replay(trace, profile, launch_s)
    flops = model_flops(config, micro_batches * batch_size * seq_len, seq_len)
    summary = summarize(timeline, profile, flops, steps, clip is not None, micro_batches, trace.speculative[0] > 0)
    if adam_source is None:
        adam_source = "28 B/param over host bandwidth" if profile.host_adam_gparams is None else "given"
    return ModelledStep(
        name=name,
        config=config,
        profile=profile,
        seq_len=seq_len,
        micro_batches=micro_batches,
        clip=clip,
        num_slots=num_slots,
        steps=steps,
        launch_s=launch_s,
        adam_source=adam_source,
        tile=tile,
        offload_inputs=offload,
        record_s=record_s,
        trace=trace,
        timeline=timeline,
        summary=summary,
        data_parallel=dp,
        recompute=recompute,
        batch_size=batch_size,
        row_chunk=row_chunk,
        fusion=fusion,
    )


def check_options(
    seq_len: int, micro_batches: int, clip: float | None, num_slots: int | str, steps: int, batch_size: int = 1
) -> None:
    """One-line ValueErrors for options the recording cannot take."""
    for key, value in (("seq_len", seq_len), ("micro_batches", micro_batches), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}={value!r} must be an integer >= 1")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(f"steps={steps!r}: the last step is measured from the step before, so at least 2")
    if clip is not None and not clip > 0:
        raise ValueError(f"clip={clip!r} must be > 0 (None: no clipping)")
    check_num_slots(num_slots)
