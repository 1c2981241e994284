"""Training throughput of strategy="megatrain" on one GPU, each resource timed alone, and the competitors.

    python bench/throughput.py --all --out bench/out      # the GPU run: one H100, within --budget-s 500
    python bench/throughput.py --dry                      # the same harness on the CPU, tiny shape (CI)

Trains a decoder of a named shape (default: the Llama-3.1-8B block shape, with as many layers as the
memory planner says fit in host memory) with ``Trainer(strategy="megatrain", precision="bf16-mixed",
accumulate_grad_batches=k)`` on random tokens at each tokens-per-step point (default 128k and 32k) and
prints one markdown table. Every training run is a subprocess of its own, so a crash or an OOM is a
table cell, not the end of the run. The same model, batch and sequence length also train under
Lightning's DeepSpeed ZeRO-3 offload and FSDP CPU offload strategies (GPU only).

What the columns count:

- model FLOPs per step = sequences x (6·N·seq + 12·layers·heads·head_dim·seq²), N = every parameter but
  the input embedding (the head counted, tied or not). The second term is attention's QKᵀ and AV,
  forward and backward, counted in full (no causal discount: PaLM's convention). Not counted: the
  engine's recompute of every block (another 2·N per token) and padding (there is none: random
  full-length rows). MFU = model FLOP/s over a bf16 matmul's FLOP/s measured in the same run.
- H2D/D2H GB/s = the engine's bytes moved in the timed window over its wall time, next to a pinned-copy
  peak measured in the same run; CPU opt = the host worker's Adam seconds per step (engine.stats).
- overlap = step time / max(GPU compute alone, transfer alone, CPU worker alone), each measured by
  itself in this run: 1.0 is perfect overlap (the step lasts as long as its slowest resource), and
  sum/max is what running the three one after another would give.

``--dry`` runs all of it on the CPU with the tiny preset: the CPU stands in for the GPU (a fp32 matmul
for the peak, memcpy for the copy peak, peak RSS for device memory) and the competitors are marked
"skipped: needs CUDA". The last line is machine-readable:

    gpu_summary: device=<name> shape=<preset>x<layers> tokens_per_step=<n> megatrain/deepspeed=<x>
    megatrain/fsdp=<y> mfu=<z> overlap=<w>        (one line; ratios and figures 'na' when not run)
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from megatrain_lightning.engine.host import available_host_bytes
from megatrain_lightning.models import LlamaConfig, LlamaForCausalLM
from megatrain_lightning.models.llama import DecoderLayer
from megatrain_lightning.optim import kernels
from megatrain_lightning.planner import format_size, host_breakdown, parse_size, plan
from megatrain_lightning.strategy import MegatrainStrategy
from timeline import OneStepTrace  # bench/ is a folder of scripts: run as `python bench/throughput.py`

GiB = 2**30
PRECISION = "bf16-mixed"
PARTS = ("megatrain", "compare", "timeline", "depth")
COMPETITORS = {"deepspeed": "DeepSpeed ZeRO-3 offload", "fsdp": "FSDP CPU offload"}
GPU_DEFAULTS = dict(shape="llama-3.1-8b", seq_len=4096, micro_batch=8, tokens_per_step="128k,32k", warmup=1,
                    steps=2, depth_layers="8,16", timeout=300, budget_s=500)  # fmt: skip
DRY_DEFAULTS = dict(shape="tiny", seq_len=64, micro_batch=2, tokens_per_step="256,128", warmup=1, steps=2,
                    depth_layers="2,4", timeout=180, budget_s=0)  # fmt: skip
LR, BETAS, WEIGHT_DECAY = 1e-5, (0.9, 0.95), 0.1
COMPILE_NOTE = ("--compile: not implemented: the engine has no hook to compile a block (it runs each block "
                "with torch.func.functional_call on a meta skeleton), so nothing was compiled")  # fmt: skip


# -- pure helpers ------------------------------------------------------------------------------------
def parse_tokens(text: str) -> list[int]:
    """'128k,32k' -> [131072, 32768] (k = 1024)."""
    parts = [p.strip().lower() for p in text.split(",")]
    return [int(p[:-1]) * 1024 if p.endswith("k") else int(p) for p in parts]


def accumulation(tokens_per_step: int, micro_batch: int, seq_len: int) -> int:
    """Micro-batches per optimizer step; tokens per step must be a whole number of micro-batches."""
    per = micro_batch * seq_len
    if tokens_per_step <= 0 or tokens_per_step % per:
        raise ValueError(f"--tokens-per-step {tokens_per_step} is not a positive multiple of micro-batch "
                         f"{micro_batch} x seq-len {seq_len} = {per} tokens; use a multiple of {per}")  # fmt: skip
    return tokens_per_step // per


def flop_params(config: LlamaConfig) -> int:
    """N of 6N: every parameter but the input embedding; the head counted (its matmul runs either way)."""
    embedding = config.vocab_size * config.hidden_size
    return config.num_parameters() - (0 if config.tie_word_embeddings else embedding)


def model_flops(config: LlamaConfig, seq_len: int, sequences: int) -> int:
    """Model FLOPs of training on `sequences` rows of `seq_len` tokens (see the module docstring)."""
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * seq_len**2
    return sequences * (6 * flop_params(config) * seq_len + attention)


def layers_for_host(config: LlamaConfig, host_bytes: int, accumulate: int, fraction: float) -> int:
    """The most layers (up to the preset's own) whose planned host state fits `fraction` of `host_bytes`."""

    def need(layers: int) -> int:
        shape = dataclasses.replace(config, num_hidden_layers=layers)
        return sum(host_breakdown(shape, PRECISION, accumulate).values())

    budget = fraction * host_bytes
    if need(2) > budget:
        raise ValueError(f"even 2 layers of this shape need {format_size(need(2))} of host memory, more than "
                         f"{fraction:.0%} of {format_size(host_bytes)}; pass --layers, --host-mem or a smaller "
                         "--shape")  # fmt: skip
    layers = 2
    while layers < config.num_hidden_layers and need(layers + 1) <= budget:
        layers += 1
    return layers


def uploaded_blocks(layers: int, slots: int, accumulate: int) -> list[int]:
    """Block indices one optimizer step uploads. After a step every block is stale: the first forward
    uploads all L, its backward skips the S still resident from forward's end. A later micro-batch's
    forward also finds blocks 0..S-1 resident from the previous backward: 2·(L - S) each."""
    kept = min(slots, layers)
    first = list(range(layers)) + list(range(layers - kept))
    later = list(range(kept, layers)) + list(range(layers - kept))
    return first + later * (accumulate - 1)


def overlap_figure(step_s: float, alone: dict[str, float]) -> float:
    """Step time over the slowest resource's time alone: 1.0 = perfect overlap."""
    slowest = max(alone.values())
    if not slowest > 0:
        raise ValueError(f"alone-times {alone} have no positive entry; nothing to compare the step with")
    return step_s / slowest


def failure_summary(returncode: int | None, log: str) -> str:
    """What a failed run's table cell says: OOM, a timeout, or the error's last line."""
    if returncode is None:
        return "timeout"
    if "OutOfMemoryError" in log or "out of memory" in log.lower():
        return "OOM"
    if returncode == -9:
        return "OOM (killed, likely host memory)"
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    return lines[-1][:160].replace("|", "/") if lines else f"exit code {returncode}"  # it goes in a table cell


def fmt(x: float | str | None, digits: int = 3) -> str:
    """`digits` significant digits as plain decimals (no exponent, no separators); None -> 'na'."""
    if x is None or isinstance(x, str):
        return x or "na"
    if x == 0 or not math.isfinite(x):
        return str(x)
    return f"{x:.{max(0, digits - 1 - math.floor(math.log10(abs(x))))}f}"


# -- timing on a device ------------------------------------------------------------------------------
class Clock:
    """CUDA events on a GPU (no host sync inside a timed region), perf_counter on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self, stream: Any = None) -> Any:
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream if stream is not None else torch.cuda.current_stream())
        return ev

    def seconds(self, start: Any, end: Any) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def time(self, fn: Callable[[], Any], reps: int, warmup: int = 1) -> float:
        """Best of `reps` runs of `fn`."""
        for _ in range(warmup):
            fn()
        best = math.inf
        for _ in range(reps):
            start = self.mark()
            fn()
            best = min(best, self.seconds(start, self.mark()))
        return best

    def on_streams(self, work: list[tuple[Any, Callable[[], None]]]) -> float:
        """Seconds until every (stream, fn)'s work is done, the streams running concurrently from one start."""
        if self.cuda:
            torch.cuda.synchronize()
        start, ends = self.mark(), []
        for stream, fn in work:
            if self.cuda:
                stream.wait_event(start)
            with torch.cuda.stream(stream) if self.cuda else nullcontext():
                fn()
            ends.append(self.mark(stream))
        return max(self.seconds(start, end) for end in ends)


def matmul_peak(device: torch.device) -> dict[str, Any]:
    """FLOP/s of a large matmul: bf16 8192³ on a GPU; fp32 512³ on the CPU (dry)."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    t = Clock(device).time(lambda: a @ b, reps=10, warmup=3)
    return {"flops": 2 * n**3 / t, "what": f"{str(dtype)[6:]} {n}x{n}x{n} matmul, best of 10"}


def copy_peak(device: torch.device) -> dict[str, Any]:
    """Bytes/s of one large copy each way: pinned host <-> GPU; on the CPU (dry) plain memcpy."""
    cuda = device.type == "cuda"
    n = GiB if cuda else 16 * 2**20
    host = torch.ones(n, dtype=torch.uint8, pin_memory=cuda)
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    clock = Clock(device)
    h2d = clock.time(lambda: dev.copy_(host, non_blocking=True), reps=5)
    d2h = clock.time(lambda: host.copy_(dev, non_blocking=True), reps=5)
    what = "pinned" if cuda else "memcpy (dry)"
    return {"h2d": n / h2d, "d2h": n / d2h, "what": f"{what}, {n / 2**20:.0f} MiB, best of 5"}


# -- the model and its data --------------------------------------------------------------------------
def build_model(config: LlamaConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model without its normal init (serial, minutes at 8B): every matrix tiles one N(0, std) pattern,
    norms are 1, biases 0. Values change the speed of no kernel measured here."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()
    g = torch.Generator().manual_seed(0)
    pattern = (torch.randn(2**20 + 7, generator=g) * config.initializer_range).to(device, dtype)  # odd: rows differ
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.fill_(0.0 if name.endswith("bias") else 1.0)
                continue
            flat = p.view(-1)
            for start in range(0, flat.numel(), pattern.numel()):
                chunk = flat[start : start + pattern.numel()]
                chunk.copy_(pattern[: chunk.numel()])
    return model


class RandomTokens(Dataset):
    """Rows of random token ids (inputs and the next-token targets), reproducible by index."""

    def __init__(self, rows: int, seq_len: int, vocab: int) -> None:
        self.rows, self.seq_len, self.vocab = rows, seq_len, vocab

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(self.vocab, (self.seq_len + 1,), generator=torch.Generator().manual_seed(i))
        return ids[:-1], ids[1:]


class _Checkpointed(nn.Module):
    """A decoder layer whose activations are recomputed in backward. It is called through the module, so
    DeepSpeed's parameter-fetching hooks run for the recompute too."""

    def __init__(self, layer: nn.Module, checkpoint: Callable) -> None:
        super().__init__()
        self.layer, self._checkpoint = layer, checkpoint

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self._checkpoint(self.layer, *args)


class BenchLM(L.LightningModule):
    """This project's Llama on random tokens: logs nothing (no per-step sync), AdamW with a no-decay group.

    The competitors recompute every layer in backward as megatrain does (FSDP through Lightning's
    activation_checkpointing_policy, DeepSpeed through deepspeed.checkpointing): all three do the same math.
    """

    def __init__(self, config: LlamaConfig, kind: str) -> None:
        super().__init__()
        self.model, self.kind = build_model(config), kind
        self.optimizer_note = "torch.optim.AdamW, stepped on the host by HostAdamW"
        if kind == "deepspeed":
            import deepspeed

            layers = self.model.model.layers
            for i, layer in enumerate(layers):
                layers[i] = _Checkpointed(layer, deepspeed.checkpointing.checkpoint)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return self.model(inputs, targets=targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = list(self.model.parameters())
        groups = [{"params": [p for p in params if p.ndim >= 2]},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]  # fmt: skip
        hp = dict(lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
        if self.kind == "deepspeed":
            return self._deepspeed_adam(groups, hp)
        if self.kind == "fsdp":
            self.optimizer_note = "torch.optim.AdamW(fused=True) on the CPU"
            return torch.optim.AdamW(groups, fused=True, **hp)
        return torch.optim.AdamW(groups, **hp)

    def _deepspeed_adam(self, groups: list[dict], hp: dict) -> torch.optim.Optimizer:
        """DeepSpeedCPUAdam, what ZeRO-Offload is built around; its C++ op is compiled on first use."""
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            opt = DeepSpeedCPUAdam(groups, adamw_mode=True, **hp)
        except (ImportError, RuntimeError) as err:  # the JIT build needs a compiler and CUDA headers
            self.optimizer_note = f"torch.optim.AdamW: DeepSpeedCPUAdam did not build ({str(err)[:80]})"
            return torch.optim.AdamW(groups, **hp)
        self.optimizer_note = "DeepSpeedCPUAdam"
        return opt


# -- each resource alone -----------------------------------------------------------------------------
def compute_alone(config: LlamaConfig, micro_batch: int, seq_len: int, device: torch.device, reps: int) -> dict:
    """Device seconds of one micro-batch with nothing streaming: one bf16 block resident, its forward,
    recompute-forward and backward (as the engine runs them, under autocast), times the layers, plus
    embedding, final norm, head and loss forward and backward. Packing gradients is not counted."""
    out = _time_pieces(dataclasses.replace(config, num_hidden_layers=1), micro_batch, seq_len, device, reps)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the one-layer model is gone: hand its memory back before the runs
    per_block = out["block_forward_s"] + out["block_recompute_backward_s"]
    out["micro_batch_s"] = config.num_hidden_layers * per_block + out["outer_s"]
    out["timer"] = "CUDA events" if device.type == "cuda" else "perf_counter"
    return out


def _time_pieces(config: LlamaConfig, micro_batch: int, seq_len: int, device: torch.device, reps: int) -> dict:
    model = build_model(config, device, torch.bfloat16)
    block, trunk, clock = model.model.layers[0], model.model, Clock(device)
    ids = torch.randint(config.vocab_size, (micro_batch, seq_len), device=device)
    params = list(block.parameters())
    with torch.autocast(device.type, dtype=torch.bfloat16):
        x = trunk.embed_tokens(ids).detach()
        cos, sin = trunk.position_embeddings(ids, None, x.dtype)
        grad_out = torch.randn_like(x)

        def forward() -> None:
            with torch.no_grad():
                block(x, cos, sin)

        def recompute_backward() -> None:
            xx = x.detach().requires_grad_(True)
            torch.autograd.grad(block(xx, cos, sin), [xx, *params], grad_out)

        def outer() -> None:
            model.loss_from_hidden(trunk.norm(trunk.embed_tokens(ids)), ids).backward()
            model.zero_grad(set_to_none=True)

        pieces = (("block_forward_s", forward), ("block_recompute_backward_s", recompute_backward), ("outer_s", outer))
        return {name: clock.time(fn, reps) for name, fn in pieces}


def transfer_alone(engine: Any, accumulate: int) -> dict[str, float]:
    """One step's copies with nothing else running, through the engine's own pinned buffers, slots and
    copy streams: H2D of the blocks :func:`uploaded_blocks` lists and of every outer copy, D2H of every
    gradient once per micro-batch. Each direction alone, then both at once (as the pipeline runs them)."""
    units, slots = engine.units, engine.pool.buffers
    biggest = max(u.numel for u in engine.all_units())
    up_dst = torch.empty(biggest, dtype=engine.compute_dtype, device=engine.device)
    down_src = torch.zeros(biggest, dtype=engine.compute_dtype, device=engine.device)  # contents are irrelevant
    order = uploaded_blocks(len(units), len(slots), accumulate)
    grads = [u.slab for u in engine.all_units() if u.slab is not None]

    def up() -> None:
        for n, i in enumerate(order):
            slots[n % len(slots)][: units[i].numel].copy_(units[i].copy, non_blocking=True)
        for u in engine.outer_units:
            up_dst[: u.numel].copy_(u.copy, non_blocking=True)

    def down() -> None:
        for _ in range(accumulate):
            for slab in grads:
                slab.copy_(down_src[: slab.numel()], non_blocking=True)

    clock, h2d, d2h = Clock(engine.device), engine.streams.h2d, engine.streams.d2h
    return {
        "h2d_s": clock.on_streams([(h2d, up)]), "d2h_s": clock.on_streams([(d2h, down)]),
        "both_s": clock.on_streams([(h2d, up), (d2h, down)]),
        "h2d_bytes": sum(units[i].copy.nbytes for i in order) + sum(u.copy.nbytes for u in engine.outer_units),
        "d2h_bytes": accumulate * sum(slab.nbytes for slab in grads),
    }  # fmt: skip


def cpu_worker_alone(engine: Any, accumulate: int) -> dict[str, float]:
    """The host worker's arithmetic for one step with nothing else running, on this thread: landing each
    unit's gradient (k fp32 accumulations when k > 1; nothing to do when k = 1), then its AdamW step with
    the active backend (kernels.adam_step_ over the unit's flat buffers, one call per param-group run)."""
    hyper, land, step = engine.hyper(), 0.0, 0.0
    for unit in engine.all_units():
        if unit.slab is None or unit.m is None:
            continue
        grad, t0 = unit.slab, time.perf_counter()
        if accumulate > 1:
            if unit.acc is None:
                unit.acc = torch.empty(unit.numel, dtype=torch.float32)
            for i in range(accumulate):
                kernels.accumulate_(unit.acc, unit.slab, i == 0)
            grad = unit.acc
        t1 = time.perf_counter()
        copy = None if unit.copy is unit.master else unit.copy
        saved, unit.has_grad = unit.has_grad, [True] * len(unit.entries)  # time every parameter's step
        runs, unit.has_grad = unit.segments(), saved
        for group, done, a, b in runs:
            kernels.adam_step_(unit.master[a:b], unit.m[a:b], unit.v[a:b], grad[a:b],
                               None if copy is None else copy[a:b], hyper[group], done + 1)  # fmt: skip
        land, step = land + t1 - t0, step + time.perf_counter() - t1
    return {"land_s": land, "adam_s": step, "total_s": land + step}


def allocator_pinned_bytes() -> int | None:
    """Bytes torch's caching host allocator holds now (None where it keeps no statistics)."""
    if not (torch.cuda.is_available() and hasattr(torch.cuda, "host_memory_stats")):
        return None
    stats = torch.cuda.host_memory_stats()
    key = next((k for k in ("reserved_bytes.current", "allocated_bytes.current") if k in stats), None)
    return None if key is None else int(stats[key])


def device_peak_bytes(device: torch.device) -> int:
    """torch.cuda.max_memory_allocated on a GPU; on the CPU (dry) this process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# -- one training run (a subprocess) -----------------------------------------------------------------
def _engine(trainer: L.Trainer) -> Any:
    return trainer.strategy.engine if isinstance(trainer.strategy, MegatrainStrategy) else None


class Window(L.Callback):
    """Times optimizer steps [warmup, warmup + steps) between two full syncs, optionally profiles the step
    after them, and measures the engine's resources alone once training has ended (before teardown)."""

    def __init__(self, spec: dict, device: torch.device) -> None:
        k = spec["accumulate"]
        self.first, self.last = spec["warmup"] * k, (spec["warmup"] + spec["steps"]) * k - 1
        self.spec, self.device, self.result = spec, device, {}
        self.trace: OneStepTrace | None = None
        self._t0, self._stats0 = 0.0, {}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.spec.get("timeline"):
            step, path = self.spec["warmup"] + self.spec["steps"], Path(self.spec["timeline"])
            self.trace = OneStepTrace(step, self.spec["accumulate"], path, self.device, lambda: self._sync(trainer))

    def _sync(self, trainer: L.Trainer) -> None:
        """Nothing in flight: no queued device work, no pending host job (megatrain's worker)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if _engine(trainer) is not None:
            _engine(trainer).flush()

    def _stats(self, trainer: L.Trainer) -> dict[str, float]:
        return dict(_engine(trainer).stats) if _engine(trainer) is not None else {}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.first:
            self._sync(trainer)
            self._t0, self._stats0 = time.perf_counter(), self._stats(trainer)
        if self.trace is not None:
            self.trace.begin(batch_idx)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        if batch_idx == self.last:
            self._sync(trainer)
            steps, now = self.spec["steps"], self._stats(trainer)
            self.result["step_s"] = (time.perf_counter() - self._t0) / steps
            self.result["per_step"] = {k: (now[k] - self._stats0[k]) / steps for k in now}
            self.result["peak_device_bytes"] = device_peak_bytes(self.device)
        if self.trace is not None:
            self.trace.end(batch_idx)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.trace is not None:
            self.result["timeline"] = self.trace.summary
        engine = _engine(trainer)
        if engine is None:
            return
        engine.flush()
        k, layers, slots = self.spec["accumulate"], len(engine.units), engine.pool.num_slots
        elt = torch.finfo(engine.compute_dtype).bits // 8
        self.result["engine"] = {
            "layers": layers, "slots": slots, "num_parameters": engine.num_parameters(),
            "host_bytes": engine.host_bytes(), "pinned": engine.pinned_bytes(), "allocator": allocator_pinned_bytes(),
            "formula_h2d_bytes": sum(engine.units[i].copy.nbytes for i in uploaded_blocks(layers, slots, k))
            + sum(u.copy.nbytes for u in engine.outer_units),
            "formula_d2h_bytes": k * engine.num_parameters() * elt,
            "transfer_alone": transfer_alone(engine, k), "cpu_alone": cpu_worker_alone(engine, k),
            "cpu_backend": cpu_backend(),
        }  # fmt: skip


def cpu_backend() -> str:
    name = kernels.backend()
    if name == "native":
        from megatrain_lightning.optim import native

        name = f"{native.backend()} kernel, {native.get_num_threads()} threads"
    return f"{name}; torch {torch.get_num_threads()} threads"


def make_strategy(spec: dict) -> Any:
    if spec["kind"] == "megatrain":
        return MegatrainStrategy(num_slots=spec["num_slots"])
    if spec["kind"] == "deepspeed":
        from lightning.pytorch.strategies import DeepSpeedStrategy, StrategyRegistry

        # Lightning's registered "deepspeed_stage_3_offload", with the pinned buffers DeepSpeed recommends.
        strategy = DeepSpeedStrategy(**StrategyRegistry["deepspeed_stage_3_offload"]["init_params"], pin_memory=True)
        strategy.config["zero_force_ds_cpu_optimizer"] = False  # lets the torch AdamW fallback run
        return strategy
    from lightning.pytorch.strategies import FSDPStrategy

    layers = {DecoderLayer}
    return FSDPStrategy(cpu_offload=True, auto_wrap_policy=layers, activation_checkpointing_policy=layers)


def run(spec: dict) -> dict:
    """Train as `spec` says; returns the measurements (what a child process writes to spec['result'])."""
    device = torch.device("cpu") if spec["dry"] else torch.device("cuda", 0)
    if spec.get("threads") and spec["kind"] == "megatrain":
        torch.set_num_threads(spec["threads"])
        if kernels.backend() == "native":
            from megatrain_lightning.optim import native

            native.set_num_threads(spec["threads"])
    config = dataclasses.replace(LlamaConfig.from_preset(spec["shape"]), num_hidden_layers=spec["layers"])
    k, steps = spec["accumulate"], spec["warmup"] + spec["steps"] + (1 if spec.get("timeline") else 0)
    module, window = BenchLM(config, spec["kind"]), Window(spec, device)
    trainer = L.Trainer(accelerator="cpu" if spec["dry"] else "gpu", devices=1, strategy=make_strategy(spec),
                        precision=PRECISION, accumulate_grad_batches=k, max_steps=steps, callbacks=[window],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)  # fmt: skip
    rows = RandomTokens(steps * k * spec["micro_batch"], spec["seq_len"], config.vocab_size)
    data = DataLoader(rows, batch_size=spec["micro_batch"], pin_memory=device.type == "cuda")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(module, train_dataloaders=data)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {**window.result, "num_parameters": config.num_parameters(), "rss_peak_bytes": rss,
            "optimizer": module.optimizer_note}  # fmt: skip


# -- the parent: spawning runs -----------------------------------------------------------------------
_T0 = time.perf_counter()


def log_line(text: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.0f} s] {text}", file=sys.stderr, flush=True)


def spawn(spec: dict, out: Path, label: str, timeout: float) -> dict:
    """Run `spec` in a fresh Python process; a crash, OOM or timeout comes back as {'error': ...}.
    Its output is appended to out/runs.log."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, log_path = Path(tmp) / "spec.json", Path(tmp) / "log"
        spec = {**spec, "result": str(Path(tmp) / "result.json")}
        spec_path.write_text(json.dumps(spec))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)]
        t0, rc = time.perf_counter(), None
        with open(log_path, "w") as log:
            try:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                pass  # subprocess.run has killed it
        text, seconds = log_path.read_text(errors="replace"), time.perf_counter() - t0
        with open(out / "runs.log", "a") as f:
            f.write(f"\n===== {label} (exit {rc}, {seconds:.0f} s): {json.dumps(spec)}\n{text}")
        if rc == 0 and Path(spec["result"]).exists():
            result = json.loads(Path(spec["result"]).read_text())
        else:
            result = {"error": f"timeout after {timeout:.0f} s" if rc is None else failure_summary(rc, text)}
    log_line(f"{label}: {result.get('error') or 'done'} ({seconds:.0f} s)")
    return {**result, "wall_s": seconds}


def competitor_blocker(kind: str, device: torch.device) -> str | None:
    """Why a competitor cannot run here (None: it can)."""
    if device.type != "cuda":
        return "skipped: needs CUDA"
    if kind == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        return ("missing: DeepSpeed is not installed (bench-only: pip install deepspeed; without network, "
                "carry the wheel: docs/benchmarks.md, GPU)")  # fmt: skip
    return None


# -- the report --------------------------------------------------------------------------------------
MAIN_COLUMNS = ("run", "tokens/step", "step s", "tokens/s", "model TFLOPS", "MFU", "H2D GB/s", "H2D % peak",
                "D2H GB/s", "D2H % peak", "CPU opt s/step", "peak GPU GiB", "host B/param", "overlap")  # fmt: skip
_KEYS = ("step_s", "tokens_per_s", "tflops", "mfu", "h2d_gbps", "h2d_pct", "d2h_gbps", "d2h_pct", "cpu_opt_s",
         "peak_gib", "host_bpp", "overlap")  # fmt: skip


def figures(state: dict, entry: dict) -> dict[str, Any] | None:
    """The table's numbers for one run (None when it failed or did not run)."""
    r = entry["result"]
    if "step_s" not in r:
        return None
    config = dataclasses.replace(state["config"], num_hidden_layers=entry["layers"])
    step, rate = r["step_s"], model_flops(config, state["seq_len"], entry["tokens"] // state["seq_len"]) / r["step_s"]
    f: dict[str, Any] = {"step_s": step, "tokens_per_s": entry["tokens"] / step, "tflops": rate / 1e12,
                         "mfu": rate / state["peaks"]["matmul"]["flops"], "peak_gib": r["peak_device_bytes"] / GiB,
                         "host_bpp": r["rss_peak_bytes"] / r["num_parameters"]}  # fmt: skip
    engine, per, copy = r.get("engine"), r.get("per_step", {}), state["peaks"]["copy"]
    if engine is None:
        return f
    up, down = per["h2d_bytes"] / step, per["d2h_bytes"] / step
    f.update(h2d_gbps=up / 1e9, d2h_gbps=down / 1e9, h2d_pct=100 * up / copy["h2d"], d2h_pct=100 * down / copy["d2h"],
             cpu_opt_s=per["host_step_seconds"], host_bpp=sum(engine["host_bytes"].values()) / engine["num_parameters"])
    if "compute" in state:
        alone = {"GPU compute": entry["accumulate"] * state["compute"]["micro_batch_s"],
                 "transfer": engine["transfer_alone"]["both_s"], "CPU worker": engine["cpu_alone"]["total_s"]}
        f.update(alone=alone, overlap=overlap_figure(step, alone), bound=max(alone, key=alone.get),
                 serial=sum(alone.values()) / max(alone.values()))  # fmt: skip
    return f


def by_tokens(entries: list[dict]) -> list[dict]:
    return sorted(entries, key=lambda e: -e["tokens"])


def _row(cells: list[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    return [_row(header), _row(["---"] * len(header)), *(_row(r) for r in rows)]


def main_table(state: dict) -> list[str]:
    rows = []
    for entry in by_tokens(state["runs"]) + state["competitors"]:
        f = figures(state, entry)
        cells = [fmt(f.get(key)) for key in _KEYS] if f else [entry["result"].get("error", "not run")] + ["na"] * 11
        rows.append([COMPETITORS.get(entry["kind"], entry["kind"]), entry["tokens"], *cells])
    notes = [f"- optimizer of {COMPETITORS.get(e['kind'], e['kind'])}: {e['result']['optimizer']}"
             for e in state["runs"][:1] + state["competitors"] if "optimizer" in e["result"]]  # fmt: skip
    return _table(list(MAIN_COLUMNS), rows) + ([""] + notes if notes else [])


def alone_section(state: dict) -> list[str]:
    rows, details, c = [], [], state.get("compute")
    if c:
        details.append(f"- GPU compute alone, one micro-batch: {fmt(c['micro_batch_s'])} s = {state['layers']} "
                       f"layers x ({fmt(c['block_forward_s'])} s forward + {fmt(c['block_recompute_backward_s'])} s "
                       f"recompute and backward) + {fmt(c['outer_s'])} s embedding, norm, head and loss; one bf16 "
                       f"block resident, best of 3 ({c['timer']}); times k per step; gradient packing not counted.")
    for entry in by_tokens(state["runs"]):
        f, r = figures(state, entry), entry["result"]
        if f is None or "alone" not in f:
            continue
        a, e, per = f["alone"], r["engine"], r["per_step"]
        times = [fmt(x) for x in (f["step_s"], a["GPU compute"], a["transfer"], a["CPU worker"])]
        rows.append([entry["tokens"], entry["accumulate"], *times, f["bound"], fmt(f["overlap"]), fmt(f["serial"])])
        t, cpu = e["transfer_alone"], e["cpu_alone"]
        details.append(
            f"- {entry['tokens']} tokens/step: transfer alone H2D {t['h2d_bytes'] / 1e9:.3g} GB in {fmt(t['h2d_s'])} s,"
            " "
            f"D2H {t['d2h_bytes'] / 1e9:.3g} GB in {fmt(t['d2h_s'])} s, both at once {fmt(t['both_s'])} s; per-step "
            f"bytes, formula vs engine.stats: H2D {e['formula_h2d_bytes']} vs {per['h2d_bytes']:.0f}, D2H "
            f"{e['formula_d2h_bytes']} vs {per['d2h_bytes']:.0f}. CPU worker alone: {fmt(cpu['land_s'])} s landing + "
            f"{fmt(cpu['adam_s'])} s Adam ({e['cpu_backend']}); in the run the worker spent "
            f"{fmt(per['host_land_seconds'])} s landing and {fmt(per['host_step_seconds'])} s stepping per step, and "
            f"the compute thread waited {fmt(per['host_wait_seconds'])} s on it.")  # fmt: skip
    header = ["tokens/step", "k", "step s", "GPU compute alone s", "transfer alone s", "CPU worker alone s", "bound",
              "overlap = step/max", "serial = sum/max"]  # fmt: skip
    return _table(header, rows) + [""] + details


def memory_table(state: dict) -> list[str]:
    rows = []
    for entry in by_tokens(state["runs"]) + state["depth"]:
        r, name = entry["result"], entry["label"] if entry["label"].startswith("depth") else entry["kind"]
        if "step_s" not in r:
            rows.append([name, entry["tokens"], entry["layers"], r.get("error", "not run"), *["na"] * 6])
            continue
        e, n = r.get("engine", {}), r["num_parameters"]
        shape = dataclasses.replace(state["config"], num_hidden_layers=entry["layers"])
        planned = plan(shape, state["seq_len"], state["micro_batch"], PRECISION, entry["accumulate"], state["num_slots"])
        # Pinned buffers are registered at their exact size (engine/pinned.py); the caching host allocator's
        # figure beside it shows that nothing else pins (it rounded each buffer to a power of two).
        host = [sum(e["host_bytes"].values()), e["pinned"], e["allocator"]] if e else []
        per_param = [fmt(None if b is None else b / n) for b in host or [None] * 3]
        gib = [fmt(r["peak_device_bytes"] / GiB), fmt(planned.gpu_peak / GiB)]
        rows.append([name, entry["tokens"], entry["layers"], *gib, *per_param, fmt(r["rss_peak_bytes"] / n)])
    header = ["run", "tokens/step", "layers", "peak GPU GiB", "planner GPU GiB", "host B/param (accounting)",
              "pinned B/param", "pinned by allocator B/param", "peak RSS B/param"]  # fmt: skip
    return _table(header, rows)


def timeline_section(state: dict) -> list[str]:
    for entry in state["runs"]:
        tl = entry["result"].get("timeline")
        if not tl:
            continue
        rows = [[lane, fmt(v["busy_ms"]), v["events"], "na" if v["under_compute"] is None else
                 f"{100 * v['under_compute']:.0f}%"] for lane, v in tl["lanes"].items()]  # fmt: skip
        return [f"One optimizer step at {entry['tokens']} tokens/step, profiled after the timed window (span "
                f"{fmt(tl['span_ms'])} ms with the profiler on): trace `{tl['trace']}`; {tl['plot']}.", "",
                *_table(["lane", "busy ms", "events", "share under compute"], rows)]  # fmt: skip
    return ["Not profiled (--parts without timeline, or the run failed)."]


def summary_line(state: dict) -> str:
    at = [figures(state, e) for e in state["runs"] if e["tokens"] == state["compare_at"]]
    f = at[0] if at else None
    ratios = {}
    for kind in COMPETITORS:
        rival = [figures(state, e) for e in state["competitors"] if e["kind"] == kind]
        ratios[kind] = fmt(f["tokens_per_s"] / rival[0]["tokens_per_s"]) if f and rival and rival[0] else "na"
    return (f"gpu_summary: device={state['device']} shape={state['shape']}x{state['layers']} "
            f"tokens_per_step={state['compare_at']} megatrain/deepspeed={ratios['deepspeed']} "
            f"megatrain/fsdp={ratios['fsdp']} mfu={fmt(f['mfu']) if f else 'na'} "
            f"overlap={fmt(f.get('overlap')) if f else 'na'}")  # fmt: skip


def render(state: dict) -> str:
    s, mm, cp = state, state["peaks"]["matmul"], state["peaks"]["copy"]
    n = s["config"].num_parameters()
    count = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
    head = [
        f"# Throughput: {s['shape']} x {s['layers']} layers ({count} parameters), seq {s['seq_len']}, "
        f"micro-batch {s['micro_batch']}, {PRECISION}, {s['num_slots']} slots, on {s['device']}", "",
        f"- layers: {s['layer_note']}",
        f"- model FLOPs per step = sequences x (6·N·seq + 12·layers·heads·head_dim·seq²), N = "
        f"{flop_params(s['config']):,} (all parameters but the input embedding, head counted); attention in full, no "
        "causal discount (PaLM); the recompute (2·N·seq more) and padding (none) are not counted",
        f"- peaks measured in this run: matmul {mm['flops'] / 1e12:.4g} TFLOP/s ({mm['what']}); copy H2D "
        f"{cp['h2d'] / 1e9:.3g} GB/s, D2H {cp['d2h'] / 1e9:.3g} GB/s ({cp['what']})",
        f"- timed: {s['steps']} optimizer steps after {s['warmup']} warm-up; k = micro-batches per step; host "
        "B/param: megatrain = engine.host_bytes() / params, competitors = peak RSS / params",
        *[f"- {note}" for note in s["notes"]], "",
    ]  # fmt: skip
    at = [figures(s, e) for e in s["runs"] if e["tokens"] == s["compare_at"]]
    bound = [f"The {s['compare_at']}-token run is bound by: {at[0]['bound']} (the largest alone-time)."] \
        if at and at[0] and "bound" in at[0] else []  # fmt: skip
    body = [*main_table(s), "", "## Each resource alone, per optimizer step", "", *alone_section(s), "",
            "## Memory", "", *memory_table(s), "", "## Timeline", "", *timeline_section(s), "", *bound,
            f"Ratios: megatrain tokens/s over the competitor's at {s['compare_at']} tokens/step; the summary's mfu "
            "and overlap are megatrain's at that point.", ""]  # fmt: skip
    return "\n".join(head + body + [summary_line(s)]) + "\n"


# -- main --------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = ap.add_argument
    add("--dry", action="store_true", help="run on the CPU with a tiny shape (what CI runs)")
    add("--all", action="store_true", help="every part: " + ", ".join(PARTS))
    add("--parts", default="megatrain,compare,timeline", help=f"comma list of {', '.join(PARTS)}: the training "
        "points, DeepSpeed and FSDP at --compare-at, one profiled step, peak memory at --depth-layers")
    add("--out", default="bench/out", help="folder for throughput.md, results.json, runs.log, the trace and plot")
    add("--shape", help="model preset (default llama-3.1-8b; dry: tiny)")
    add("--layers", type=int, help="decoder layers (default: as many as host memory allows)")
    add("--host-mem", help="host memory to size --layers against, e.g. 120GiB (default: what is available)")
    add("--host-fraction", type=float, default=0.7, help="share of host memory the planned state may take (default "
        "0.7: DeepSpeed needs about 10%% more per parameter at the same depth, and the model is built in fp32 first)")
    add("--tokens-per-step", help="comma list of points, k = 1024 (default 128k,32k; dry: 256,128)")
    add("--seq-len", type=int, help="tokens per row (default 4096; dry: 64)")
    add("--micro-batch", type=int, help="rows per micro-batch (default 8; dry: 2)")
    add("--compare-at", help="the point DeepSpeed and FSDP run at (default: the smallest)")
    add("--steps", type=int, help="timed optimizer steps (default 2)")
    add("--warmup", type=int, help="untimed optimizer steps first (default 1)")
    add("--depth-layers", help="layer counts of the peak-memory-vs-depth runs (default 8,16; dry: 2,4)")
    add("--num-slots", type=int, default=2, help="device weight slots (MegatrainStrategy(num_slots=))")
    add("--threads", type=int, help="CPU optimizer threads (torch's and the native kernel's; default: all)")
    add("--compile", action="store_true", help="torch.compile the block (not implemented: the output says so)")
    add("--timeout", type=float, help="seconds a training run may take before it is killed (default 300)")
    add("--budget-s", type=float, help="wall-clock budget of the whole command: runs that would start with under "
        "30 s left are skipped (default 500 on a GPU, to fit one 10-minute call with its installs; dry: none)")
    add("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for key, value in (DRY_DEFAULTS if args.dry else GPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.parts = set(PARTS) if args.all else set(args.parts.split(","))
    if args.parts - set(PARTS):
        ap.error(f"--parts {sorted(args.parts - set(PARTS))}: choose among {', '.join(PARTS)}")
    return args


def setup_state(args: argparse.Namespace, device: torch.device) -> dict:
    base = LlamaConfig.from_preset(args.shape)
    points = parse_tokens(args.tokens_per_step)
    compare_at = parse_tokens(args.compare_at)[0] if args.compare_at else min(points)
    ks = {t: accumulation(t, args.micro_batch, args.seq_len) for t in {*points, compare_at}}
    if args.layers:
        layers, note = args.layers, f"{args.layers} (--layers)"
    else:
        have, k = parse_size(args.host_mem) if args.host_mem else available_host_bytes(), max(ks.values())
        layers = layers_for_host(base, have, k, args.host_fraction)
        per = sum(host_breakdown(base, PRECISION, k).values()) / base.num_parameters()
        note = (f"{layers} = the most whose host state ({per:.0f} B/param by the planner, accumulate {k}) fits "
                f"{args.host_fraction:.0%} of {format_size(have)} {'given' if args.host_mem else 'available'} "
                f"(capped at the preset's {base.num_hidden_layers})")  # fmt: skip
    notes = [COMPILE_NOTE] if args.compile else []
    notes.append(f"{COMPETITORS['deepspeed']}: Lightning's deepspeed_stage_3_offload with pin_memory=True, "
                 f"deepspeed.checkpointing per layer; {COMPETITORS['fsdp']}: FSDPStrategy(cpu_offload=True), "
                 "decoder layers as auto_wrap_policy and activation_checkpointing_policy")  # fmt: skip
    if args.dry:
        notes.append("dry: the CPU stands in for the GPU (no copy engines, no concurrent streams); 'peak GPU' is "
                     "the run's peak RSS and MFU is against a fp32 CPU matmul: these numbers check the harness only")
    return {"device": "cpu-dry" if args.dry else torch.cuda.get_device_name(device).replace(" ", "-"),
            "shape": args.shape, "layers": layers, "layer_note": note, "seq_len": args.seq_len,
            "micro_batch": args.micro_batch, "num_slots": args.num_slots, "steps": args.steps, "warmup": args.warmup,
            "config": dataclasses.replace(base, num_hidden_layers=layers), "points": points, "ks": ks,
            "compare_at": compare_at, "notes": notes, "runs": [], "competitors": [], "depth": []}  # fmt: skip


def jobs(state: dict, args: argparse.Namespace, trace: str) -> list[tuple[str, dict, str]]:
    """(label, spec, list in `state`) in the order they run: the competitors' point first (it carries the
    timeline and the ratios), then the other points, the competitors, the depth runs."""
    out, at = [], state["compare_at"]
    if "megatrain" in args.parts:
        for tokens in sorted(state["points"], key=lambda t: t != at):
            timeline = trace if "timeline" in args.parts and tokens == at else None
            spec = {"kind": "megatrain", "tokens": tokens, "timeline": timeline}
            out.append((f"megatrain {tokens} tokens/step", spec, "runs"))
    if "compare" in args.parts:
        out += [(COMPETITORS[kind], {"kind": kind, "tokens": at}, "competitors") for kind in COMPETITORS]
    if "depth" in args.parts:
        for layers in (int(x) for x in args.depth_layers.split(",")):
            spec = {"kind": "megatrain", "tokens": at, "layers": layers, "warmup": 1, "steps": 1}
            out.append((f"depth {layers}", spec, "depth"))
    return out


def save(state: dict, out: Path) -> str:
    text = render(state)
    (out / "throughput.md").write_text(text)
    plain = {k: (dataclasses.asdict(v) if k == "config" else v) for k, v in state.items()}
    (out / "results.json").write_text(json.dumps(plain, indent=1, default=str))
    return text


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        spec = json.loads(Path(args.child).read_text())
        Path(spec["result"]).write_text(json.dumps(run(spec)))
        return 0
    if not args.dry and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here: run with --dry for the CPU dry mode")
    device = torch.device("cpu") if args.dry else torch.device("cuda", 0)
    deadline = time.perf_counter() + args.budget_s if args.budget_s else math.inf
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "runs.log").write_text("")
    state = setup_state(args, device)
    if args.compile:
        log_line(COMPILE_NOTE)
    state["peaks"] = {"matmul": matmul_peak(device), "copy": copy_peak(device)}
    if "megatrain" in args.parts:
        state["compute"] = compute_alone(state["config"], args.micro_batch, args.seq_len, device, reps=3)
    mm, cp = state["peaks"]["matmul"], state["peaks"]["copy"]
    log_line(f"layers: {state['layer_note']}; matmul {mm['flops'] / 1e12:.4g} TFLOP/s, copy H2D "
             f"{cp['h2d'] / 1e9:.3g} GB/s, D2H {cp['d2h'] / 1e9:.3g} GB/s")  # fmt: skip
    base = {"shape": args.shape, "layers": state["layers"], "seq_len": args.seq_len, "micro_batch": args.micro_batch,
            "warmup": args.warmup, "steps": args.steps, "num_slots": args.num_slots, "threads": args.threads,
            "dry": args.dry}  # fmt: skip
    for label, job, where in jobs(state, args, str((out / "timeline.trace.json.gz").resolve())):
        spec = {**base, **job, "accumulate": state["ks"][job["tokens"]]}
        left = min(args.timeout, deadline - time.perf_counter())
        blocker = competitor_blocker(spec["kind"], device) if where == "competitors" else None
        if blocker is None and left < 30:
            blocker = f"skipped: out of time (--budget-s {args.budget_s:.0f})"
        if blocker:
            log_line(f"{label}: {blocker}")
        result = {"error": blocker} if blocker else spawn(spec, out, label, left)
        state[where].append({**{k: spec[k] for k in ("kind", "tokens", "accumulate", "layers")}, "label": label,
                             "result": result})  # fmt: skip
        save(state, out)
    print(save(state, out), end="")
    failed = [e for e in state["runs"] if not e["result"].get("error", "skipped:").startswith("skipped:")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
