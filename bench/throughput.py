"""Training throughput of strategy="megatrain" on one GPU, each resource timed alone, and the peers.

    python bench/throughput.py --all --out bench/out      # the GPU run: one H100, within --budget-s 500
    python bench/throughput.py --dry                      # the same harness on the CPU, tiny shape (CI)

Trains a decoder of a named shape (default: the Llama-3.1-8B block shape, with as many layers as the
memory planner says fit in host memory; the name then says so, e.g. ``llama-3.1-8b[15 of 32 layers]``)
with ``Trainer(strategy="megatrain", precision="bf16-mixed", accumulate_grad_batches=k)`` on random
tokens at each tokens-per-step point (default 128k and 32k), each point twice: with
``gradient_clip_val`` as the shipped configs set it (configs/*.yaml: 1.0) and without, since clipping
makes every step wait for the global norm before the first unit is stepped. Every training run is a
subprocess of its own, so a crash or an OOM is a table cell, not the end of the run. DeepSpeed ZeRO-3
offload and FSDP CPU offload train the same model at the comparison point, clipping included
(bench/peers.py; GPU only).

What the columns count (bench/report.py):

- model FLOPs (megatrain_lightning/planning/flops.py) = 6·N·tokens + causal attention forward and backward,
  N = the weights of the matmuls (head included, input embedding not); no recompute counted.
- MFU = model FLOP/s over the GPU's dense bf16 peak from its datasheet (flops.PEAK_BF16_FLOPS, or
  --peak-tflops); "na" for a device not in the table. The matmul-relative utilization divides by a bf16
  matmul measured in the same run instead: printed beside MFU, it is not MFU.
- H2D/D2H GB/s = the engine's bytes moved in the timed window over its wall time, next to a pinned-copy
  peak measured in the same run; CPU opt = the host worker's Adam seconds per step (engine.stats).
- overlap = step time / max(GPU compute alone, transfer alone, CPU worker alone), each measured by
  itself in this run (bench/alone.py): 1.0 is perfect overlap (the step lasts as long as its slowest
  resource), and sum/max is what running the three one after another would give.

``--recompute auto,true`` trains each point once per ``MegatrainStrategy(recompute=)`` value (default: auto,
the strategy's); each row shows the pool's slots, the blocks per forward pass that kept their graph and that
offloaded their input, and the planner's GPU peak for that run. ``--compile`` runs each block through
``torch.compile`` (``compile_blocks=True``). One ``run: key=value ...`` line per run precedes the summary.

``--dry`` runs all of it on the CPU with the tiny preset: the CPU stands in for the GPU (a fp32 matmul
for the matmul figure, memcpy for the copy peak, peak RSS for device memory), MFU is "na" unless
--peak-tflops names a peak, and the peers are marked "skipped: needs CUDA". The last line is
machine-readable (megatrain's figures at the peers' point: tokens per step and clipping):

    gpu_summary: device=<name> shape=<name>x<layers> tokens_per_step=<n> megatrain/deepspeed=<x>
    megatrain/fsdp=<y> mfu=<z> overlap=<w>        (one line; ratios and figures 'na' when not run)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as L

# bench/ is a folder of scripts (run as `python bench/throughput.py`): its modules import by their names.
import peers
import torch
import yaml
from alone import compute_alone, copy_peak, cpu_worker_alone, matmul_peak, transfer_alone, uploaded_blocks
from report import PRECISION, clip_text, depth_name, recompute_text, render
from timeline import OneStepTrace
from torch import nn
from torch.utils.data import DataLoader, Dataset

from megatrain_lightning.cli.commands import add_engine_flags, int_or_auto
from megatrain_lightning.engine.host.host_memory import available_host_bytes
from megatrain_lightning.lightning.strategy import MegatrainStrategy
from megatrain_lightning.models import LlamaConfig, LlamaForCausalLM
from megatrain_lightning.optim import kernels
from megatrain_lightning.planning import flops
from megatrain_lightning.planning.planner import format_size, host_breakdown, parse_size

PARTS = ("megatrain", "compare", "timeline", "depth")
CLIP_ROWS = ("both", "on", "off")
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
GPU_DEFAULTS = dict(
    shape="llama-3.1-8b",
    seq_len=4096,
    micro_batch=8,
    tokens_per_step="128k,32k",
    warmup=1,
    steps=2,
    depth_layers="8,16",
    timeout=300,
    budget_s=500,
)
DRY_DEFAULTS = dict(
    shape="tiny",
    seq_len=64,
    micro_batch=2,
    tokens_per_step="256,128",
    warmup=1,
    steps=2,
    depth_layers="2,4",
    timeout=180,
    budget_s=0,
)
LR, BETAS, WEIGHT_DECAY = 1e-5, (0.9, 0.95), 0.1
COMPILE_NOTE = (
    "--compile: each block's forward and recompute run through torch.compile (MegatrainStrategy("
    "compile_blocks=True)); compiling happens in the warm-up steps, outside the timed window"
)
SUMS_NOTE = (
    "--device-grad-sums {}: that many blocks keep their fp32 gradient sums on the GPU across a step's "
    "micro-batches (MegatrainStrategy(device_grad_sums=)); the others, and every run without it, land each "
    "micro-batch's gradient on the host"
)
ROWS_NOTE = (
    "--row-chunk {}: each block's training call runs in chunks of that many rows, every chunk through the block "
    "before the next block (MegatrainStrategy(row_chunk=): layer-major)"
)
SPECULATIVE_NOTE = (
    "--speculative-step: each unit's Adam step is taken as its last gradient lands, before the clip's norm is "
    "known, into a spare compute copy (MegatrainStrategy(speculative_step=True))"
)
RECOMPUTE_CHOICES = {"true": True, "false": False, "auto": "auto"}


# -- the run's settings ------------------------------------------------------------------------------
def parse_tokens(text: str) -> list[int]:
    """'128k,32k' -> [131072, 32768] (k = 1024)."""
    parts = [p.strip().lower() for p in text.split(",")]
    return [int(p[:-1]) * 1024 if p.endswith("k") else int(p) for p in parts]


def accumulation(tokens_per_step: int, micro_batch: int, seq_len: int) -> int:
    """Micro-batches per optimizer step; tokens per step must be a whole number of micro-batches."""
    per = micro_batch * seq_len
    if tokens_per_step <= 0 or tokens_per_step % per:
        raise ValueError(
            f"--tokens-per-step {tokens_per_step} is not a positive multiple of micro-batch "
            f"{micro_batch} x seq-len {seq_len} = {per} tokens; use a multiple of {per}"
        )
    return tokens_per_step // per


def layers_for_host(config: LlamaConfig, host_bytes: int, accumulate: int, fraction: float) -> int:
    """The most layers (up to the preset's own) whose planned host state fits `fraction` of `host_bytes`."""

    def need(layers: int) -> int:
        shape = dataclasses.replace(config, num_hidden_layers=layers)
        return sum(host_breakdown(shape, PRECISION, accumulate).values())

    budget = fraction * host_bytes
    if need(2) > budget:
        raise ValueError(
            f"even 2 layers of this shape need {format_size(need(2))} of host memory, more than "
            f"{fraction:.0%} of {format_size(host_bytes)}; pass --layers, --host-mem or a smaller "
            "--shape"
        )
    layers = 2
    while layers < config.num_hidden_layers and need(layers + 1) <= budget:
        layers += 1
    return layers


def shipped_clip(shape: str, configs: Path = CONFIGS) -> tuple[float, str]:
    """(gradient_clip_val, where it comes from): what the shipped configs training `shape` set (0: none);
    for a shape no config trains, the value every config sets. Configs that disagree are an error."""
    found = {}
    for path in sorted(configs.glob("*.yaml")):
        text = yaml.safe_load(path.read_text()) or {}
        clip = (text.get("trainer") or {}).get("gradient_clip_val") or 0
        found[path] = ((text.get("model") or {}).get("model"), float(clip))
    mine = {p: clip for p, (model, clip) in found.items() if model == shape}
    pool = mine or {p: clip for p, (_, clip) in found.items()}
    if len(set(pool.values())) != 1:
        raise ValueError(
            f"the configs in {configs} set gradient_clip_val {sorted(set(pool.values()))} for --shape "
            f"{shape}; pass --clip-val to choose one"
        )
    names = ", ".join(p.name for p in mine) if mine else f"every config in {configs.name}/"
    return next(iter(pool.values())), names


def parse_recompute(text: str) -> list[bool | str]:
    """'true,auto' -> [True, 'auto']: the MegatrainStrategy(recompute=) of each row, in order, once each."""
    names = [p.strip().lower() for p in text.split(",")]
    bad = [n for n in names if n not in RECOMPUTE_CHOICES]
    if bad or not names:
        raise ValueError(f"--recompute {text!r}: a comma list of {', '.join(RECOMPUTE_CHOICES)}")
    return list(dict.fromkeys(RECOMPUTE_CHOICES[n] for n in names))


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


# -- the model and its data --------------------------------------------------------------------------
def build_model(
    config: LlamaConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> nn.Module:
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


class BenchLM(L.LightningModule):
    """This project's Llama on random tokens: logs nothing (no per-step sync), AdamW with a no-decay group.
    The peers recompute every layer in backward as megatrain does (bench/peers.py)."""

    def __init__(self, config: LlamaConfig, kind: str) -> None:
        super().__init__()
        self.model, self.kind = build_model(config), kind
        self.optimizer_note = "torch.optim.AdamW, stepped on the host by HostAdamW"
        peers.prepare(kind, self.model)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return self.model(inputs, targets=targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = list(self.model.parameters())
        groups = [
            {"params": [p for p in params if p.ndim >= 2]},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
        hp = dict(lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
        if self.kind == "megatrain":
            return torch.optim.AdamW(groups, **hp)
        opt, self.optimizer_note = peers.optimizer(self.kind, groups, hp)
        return opt


class FsdpBenchLM(BenchLM):
    """Lightning's FSDP precision refuses to clip by norm; the root FSDP module clips the global norm
    across its shards itself, as Trainer(gradient_clip_val=) asks."""

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None
    ) -> None:
        if gradient_clip_val:
            self.trainer.strategy.model.clip_grad_norm_(gradient_clip_val)


# -- one training run (a subprocess) -----------------------------------------------------------------
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

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.first:
            self._sync(trainer)
            self._t0, self._stats0 = time.perf_counter(), self._stats(trainer)
        if self.trace is not None:
            self.trace.begin(batch_idx)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
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
        per_pass = self.result.get("per_step", {})
        self.result["engine"] = {
            "layers": layers,
            "slots": slots,
            # blocks per forward pass (one pass per micro-batch) that kept their graph / saved their input on
            # the host, in the timed window (an offloading pass offloads the input of every block it runs)
            "kept_blocks": per_pass.get("kept_calls", 0) / k,
            "offloaded_blocks": layers * per_pass.get("offloaded_passes", 0) / k,
            "num_parameters": engine.num_parameters(),
            "host_bytes": engine.host_bytes(),
            "pinned": engine.pinned_bytes(),
            "allocator": allocator_pinned_bytes(),
            "formula_h2d_bytes": sum(engine.units[i].copy.nbytes for i in uploaded_blocks(layers, slots, k))
            + sum(u.copy.nbytes for u in engine.outer_units),
            "formula_d2h_bytes": k * engine.num_parameters() * elt,
            "transfer_alone": transfer_alone(engine, k),
            "cpu_alone": cpu_worker_alone(engine, k, clip=bool(self.spec["clip"])),
            "cpu_backend": cpu_backend(),
        }


def cpu_backend() -> str:
    name = kernels.backend()
    if name == "native":
        from megatrain_lightning.optim import native

        name = f"{native.backend()} kernel, {native.get_num_threads()} threads"
    return f"{name}; torch {torch.get_num_threads()} threads"


def run(spec: dict) -> dict:
    """Train as `spec` says; returns the measurements (what a child process writes to spec['result'])."""
    device = torch.device("cpu") if spec["dry"] else torch.device("cuda", 0)
    kind = spec["kind"]
    if spec.get("threads") and kind == "megatrain":
        torch.set_num_threads(spec["threads"])
        if kernels.backend() == "native":
            from megatrain_lightning.optim import native

            native.set_num_threads(spec["threads"])
    config = dataclasses.replace(LlamaConfig.from_preset(spec["shape"]), num_hidden_layers=spec["layers"])
    k, steps = spec["accumulate"], spec["warmup"] + spec["steps"] + (1 if spec.get("timeline") else 0)
    module, window = (FsdpBenchLM if kind == "fsdp" else BenchLM)(config, kind), Window(spec, device)
    strategy = megatrain_strategy(spec) if kind == "megatrain" else peers.make_strategy(kind)
    trainer = L.Trainer(
        accelerator="cpu" if spec["dry"] else "gpu",
        devices=1,
        strategy=strategy,
        precision=PRECISION,
        accumulate_grad_batches=k,
        gradient_clip_val=spec["clip"] or None,
        max_steps=steps,
        callbacks=[window],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    rows = RandomTokens(steps * k * spec["micro_batch"], spec["seq_len"], config.vocab_size)
    data = DataLoader(rows, batch_size=spec["micro_batch"], pin_memory=device.type == "cuda")
    if device.type == "cuda":
        torch.cuda.init()  # before any allocation the allocator has no device: resetting it would fail
        torch.cuda.reset_peak_memory_stats(device)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(module, train_dataloaders=data)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        **window.result,
        "num_parameters": config.num_parameters(),
        "rss_peak_bytes": rss,
        "optimizer": module.optimizer_note,
        "gradient_clip_val": trainer.gradient_clip_val,
    }


PLANNED = ("device_grad_sums", "row_chunk", "speculative_step")  # strategy options the planner's GPU figure counts


def option_notes(args: argparse.Namespace) -> list[str]:
    """A note for each strategy option the megatrain runs were given beyond the strategy's defaults."""
    return (
        ([SUMS_NOTE.format(args.device_grad_sums)] if args.device_grad_sums else [])
        + ([ROWS_NOTE.format(args.row_chunk)] if args.row_chunk is not None else [])
        + ([SPECULATIVE_NOTE] if args.speculative_step else [])
    )


def megatrain_strategy(spec: dict) -> MegatrainStrategy:
    """The strategy of a megatrain run: the spec's options, the strategy's defaults for the rest."""
    return MegatrainStrategy(
        num_slots=spec["num_slots"],
        recompute=spec.get("recompute", "auto"),
        compile_blocks=bool(spec.get("compile")),
        device_grad_sums=spec.get("device_grad_sums", 0),
        row_chunk=spec.get("row_chunk"),
        speculative_step=bool(spec.get("speculative_step")),
    )


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


# -- main --------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = ap.add_argument
    add("--dry", action="store_true", help="run on the CPU with a tiny shape (what CI runs)")
    add("--all", action="store_true", help="every part: " + ", ".join(PARTS))
    add(
        "--parts",
        default="megatrain,compare,timeline",
        help=f"comma list of {', '.join(PARTS)}: the training "
        "points, DeepSpeed and FSDP at --compare-at, one profiled step, peak memory at --depth-layers",
    )
    add("--out", default="bench/out", help="folder for throughput.md, results.json, runs.log, the trace and plot")
    add("--shape", help="model preset (default llama-3.1-8b; dry: tiny)")
    add(
        "--layers",
        type=int,
        help="decoder layers (default: as many as host memory allows); another depth than "
        "the preset's shows in the name, e.g. llama-3.1-8b[16 of 32 layers]",
    )
    add("--host-mem", help="host memory to size --layers against, e.g. 120GiB (default: what is available)")
    add(
        "--host-fraction",
        type=float,
        default=0.7,
        help="share of host memory the planned state may take (default "
        "0.7: DeepSpeed needs about 10%% more per parameter at the same depth, and the model is built in fp32 first)",
    )
    add("--tokens-per-step", help="comma list of points, k = 1024 (default 128k,32k; dry: 256,128)")
    add("--seq-len", type=int, help="tokens per row (default 4096; dry: 64)")
    add("--micro-batch", type=int, help="rows per micro-batch (default 8; dry: 2)")
    add("--compare-at", help="the point DeepSpeed and FSDP run at (default: the smallest)")
    add(
        "--clip",
        choices=CLIP_ROWS,
        default="both",
        help="megatrain rows with gradient clipping as the configs set "
        "it, without, or both (default); the peers clip unless 'off'",
    )
    add("--clip-val", type=float, help="gradient_clip_val of the clipped rows (default: what configs/*.yaml set)")
    add("--peak-tflops", type=float, help="dense bf16 peak for MFU (default: the datasheet's, by device name)")
    add("--steps", type=int, help="timed optimizer steps (default 2)")
    add("--warmup", type=int, help="untimed optimizer steps first (default 1)")
    add("--depth-layers", help="layer counts of the peak-memory-vs-depth runs (default 8,16; dry: 2,4)")
    add(
        "--num-slots",
        type=int_or_auto("a number of slots"),
        default="auto",
        help="device weight slots, or auto (MegatrainStrategy(num_slots=); default auto, the strategy's)",
    )
    add("--threads", type=int, help="CPU optimizer threads (torch's and the native kernel's; default: all)")
    add(
        "--recompute",
        default="auto",
        help="comma list of MegatrainStrategy(recompute=) values, a row each: true (every block recomputed), "
        "false (every graph kept), auto (the last blocks keep theirs while they fit; default, the strategy's)",
    )
    add("--compile", action="store_true", help="torch.compile each block (MegatrainStrategy(compile_blocks=True))")
    add(
        "--device-grad-sums",
        type=int_or_auto("a number of blocks"),
        default=0,
        help="blocks whose gradient sums stay on the GPU across a step's micro-batches, or auto "
        "(MegatrainStrategy(device_grad_sums=); default 0, the strategy's: every gradient lands on the host)",
    )
    add_engine_flags(ap, ("row_chunk", "speculative_step"), {"row_chunk": None, "speculative_step": False})
    add("--timeout", type=float, help="seconds a training run may take before it is killed (default 300)")
    add(
        "--budget-s",
        type=float,
        help="wall-clock budget of the whole command: runs that would start with under "
        "30 s left are skipped (default 500 on a GPU, to fit one 10-minute call with its installs; dry: none)",
    )
    add("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for key, value in (DRY_DEFAULTS if args.dry else GPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.parts = set(PARTS) if args.all else set(args.parts.split(","))
    try:
        args.recompute = parse_recompute(args.recompute)
    except ValueError as err:
        ap.error(str(err))
    if args.parts - set(PARTS):
        ap.error(f"--parts {sorted(args.parts - set(PARTS))}: choose among {', '.join(PARTS)}")
    return args


def layer_choice(args: argparse.Namespace, base: LlamaConfig, accumulate: int) -> tuple[int, str]:
    """(layers, how they were chosen): --layers, or the most the host memory holds."""
    preset = base.num_hidden_layers
    if args.layers:
        return args.layers, f"{args.layers} of the preset's {preset} (--layers)"
    have = parse_size(args.host_mem) if args.host_mem else available_host_bytes()
    layers = layers_for_host(base, have, accumulate, args.host_fraction)
    per = sum(host_breakdown(base, PRECISION, accumulate).values()) / base.num_parameters()
    return layers, (
        f"{layers} of the preset's {preset} = the most whose host state ({per:.0f} B/param by the "
        f"planner, accumulate {accumulate}) fits {args.host_fraction:.0%} of {format_size(have)} "
        f"{'given' if args.host_mem else 'available'}"
    )


def peak_choice(args: argparse.Namespace, device: torch.device, device_name: str) -> dict[str, Any]:
    """MFU's denominator: --peak-tflops, else the datasheet's dense bf16 peak of this GPU (None: unknown)."""
    if args.peak_tflops:
        return {"flops": args.peak_tflops * 1e12, "what": f"{args.peak_tflops:g} TFLOP/s (--peak-tflops)"}
    peak = flops.peak_bf16_flops(device_name) if device.type == "cuda" else None
    if peak is None:
        return {
            "flops": None,
            "what": f"no dense bf16 peak known for {device_name} (megatrain_lightning/planning/flops.py "
            "PEAK_BF16_FLOPS); pass --peak-tflops",
        }
    return {"flops": peak, "what": f"{peak / 1e12:g} TFLOP/s, the dense bf16 peak of {device_name} (datasheet)"}


def setup_state(args: argparse.Namespace, device: torch.device) -> dict:
    base = LlamaConfig.from_preset(args.shape)
    points = parse_tokens(args.tokens_per_step)
    compare_at = parse_tokens(args.compare_at)[0] if args.compare_at else min(points)
    ks = {t: accumulation(t, args.micro_batch, args.seq_len) for t in {*points, compare_at}}
    layers, layer_note = layer_choice(args, base, max(ks.values()))
    clip_val, source = (args.clip_val, "--clip-val") if args.clip_val is not None else shipped_clip(args.shape)
    clips = {"both": [clip_val, 0.0], "on": [clip_val], "off": [0.0]}[args.clip]
    clips = list(dict.fromkeys(clips))  # a config without clipping gives one row, not two equal ones
    notes = [COMPILE_NOTE] if args.compile else []
    notes += option_notes(args)
    notes.append(peers.NOTE)
    if args.dry:
        notes.append(
            "dry: the CPU stands in for the GPU (no copy engines, no concurrent streams); 'peak GPU' is "
            "the run's peak RSS and the matmul figure is a fp32 CPU matmul: these numbers check the harness"
        )
    name = "cpu-dry" if args.dry else torch.cuda.get_device_name(device)
    return {
        "device": name.replace(" ", "-"),
        "shape": args.shape,
        "layers": layers,
        "preset_layers": base.num_hidden_layers,
        "name": depth_name(args.shape, layers, base.num_hidden_layers),
        "layer_note": layer_note,
        "clips": clips,
        "peer_clip": clips[0],
        "clip_note": f"gradient_clip_val {clip_text(clip_val)} (norm) as {source} sets it, rows "
        f"{' and '.join(clip_text(c) for c in clips)}; the peers at {clip_text(clips[0])}",
        "peak": peak_choice(args, device, name),
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "num_slots": args.num_slots,
        "recompute": args.recompute,
        "gpu_mem": None if args.dry else torch.cuda.get_device_properties(device).total_memory,
        "steps": args.steps,
        "warmup": args.warmup,
        "config": dataclasses.replace(base, num_hidden_layers=layers),
        "points": points,
        "ks": ks,
        "compare_at": compare_at,
        "notes": notes,
        "runs": [],
        "competitors": [],
        "depth": [],
    }


def jobs(state: dict, args: argparse.Namespace, trace: str) -> list[tuple[str, dict, str]]:
    """(label, spec, list in `state`) in the order they run: megatrain at the peers' point (clipped as they
    are first, with the first --recompute value: it carries the timeline and the ratios), the peers,
    megatrain's other points, the depth runs. Each megatrain point runs once per --recompute value."""
    at, clips, name, modes = state["compare_at"], state["clips"], state["name"], state["recompute"]
    mine = (
        []
        if "megatrain" not in args.parts
        else [
            (tokens, clip, mode)
            for tokens in sorted(state["points"], key=lambda t: t != at)
            for clip in clips
            for mode in modes
        ]
    )

    def megatrain(tokens: int, clip: float, mode: bool | str) -> tuple[str, dict, str]:
        main = (tokens, clip, mode) == (at, state["peer_clip"], modes[0])
        timeline = trace if "timeline" in args.parts and main else None
        spec = {"kind": "megatrain", "tokens": tokens, "clip": clip, "recompute": mode, "timeline": timeline}
        return f"megatrain {name} {tokens} tokens/step clip {clip_text(clip)}{recompute_text(mode)}", spec, "runs"

    out = [megatrain(*job) for job in mine if job[0] == at]
    if "compare" in args.parts:
        out += [
            (
                f"{label} {name} {at} tokens/step clip {clip_text(state['peer_clip'])}",
                {"kind": kind, "tokens": at, "clip": state["peer_clip"]},
                "competitors",
            )
            for kind, label in peers.COMPETITORS.items()
        ]
    out += [megatrain(*job) for job in mine if job[0] != at]
    if "depth" in args.parts:
        for layers in (int(x) for x in args.depth_layers.split(",")):
            spec = {
                "kind": "megatrain",
                "tokens": at,
                "clip": state["peer_clip"],
                "recompute": modes[0],
                "layers": layers,
                "warmup": 1,
                "steps": 1,
            }
            out.append((f"depth {depth_name(args.shape, layers, state['preset_layers'])}", spec, "depth"))
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
    for note in option_notes(args):
        log_line(note)
    state["peaks"] = {"matmul": matmul_peak(device), "copy": copy_peak(device)}
    if "megatrain" in args.parts:
        one_layer = build_model(dataclasses.replace(state["config"], num_hidden_layers=1), device, torch.bfloat16)
        state["compute"] = compute_alone(one_layer, state["layers"], args.micro_batch, args.seq_len, device, reps=3)
        del one_layer
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the one-layer model is gone: hand its memory back before the runs
    mm, cp = state["peaks"]["matmul"], state["peaks"]["copy"]
    log_line(
        f"{state['name']}: layers {state['layer_note']}; clip {state['clip_note']}; matmul "
        f"{mm['flops'] / 1e12:.4g} TFLOP/s, copy H2D {cp['h2d'] / 1e9:.3g} GB/s, "
        f"D2H {cp['d2h'] / 1e9:.3g} GB/s"
    )
    base = {
        "shape": args.shape,
        "layers": state["layers"],
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "warmup": args.warmup,
        "steps": args.steps,
        "num_slots": args.num_slots,
        "compile": args.compile,
        "device_grad_sums": args.device_grad_sums,
        "row_chunk": args.row_chunk,
        "speculative_step": args.speculative_step,
        "threads": args.threads,
        "dry": args.dry,
    }
    for label, job, where in jobs(state, args, str((out / "timeline.trace.json.gz").resolve())):
        spec = {**base, **job, "accumulate": state["ks"][job["tokens"]]}
        left = min(args.timeout, deadline - time.perf_counter())
        blocker = peers.blocker(spec["kind"], device) if where == "competitors" else None
        if blocker is None and left < 30:
            blocker = f"skipped: out of time (--budget-s {args.budget_s:.0f})"
        if blocker:
            log_line(f"{label}: {blocker}")
        result = {"error": blocker} if blocker else spawn(spec, out, label, left)
        kept = {k: spec.get(k) for k in ("kind", "tokens", "accumulate", "layers", "clip", "recompute", *PLANNED)}
        state[where].append({**kept, "label": label, "result": result})
        save(state, out)
    print(save(state, out), end="")
    failed = [e for e in state["runs"] if not e["result"].get("error", "skipped:").startswith("skipped:")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
