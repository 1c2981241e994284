"""Callbacks: live throughput and memory figures, and a fit-end Hugging Face export with a sample.

:class:`MegatrainMonitor` measures over windows of training batches (synchronizing the device only at a
window's ends, so it adds no sync per step):

- ``perf/tokens_per_sec``: tokens of the window's batches / its wall time (validation time excluded);
- ``perf/model_tflops``: model FLOPs per second, as :mod:`megatrain_lightning.planning.flops` defines them (6·N per
  token plus causal attention; the engine's recompute not counted), with the sequence length read off
  each batch's shape: :func:`~megatrain_lightning.planning.flops.model_flops` for this project's model (a
  ``LlamaConfig`` on ``pl_module.model.config``), :func:`~megatrain_lightning.planning.flops.hf_model_flops` for a
  Hugging Face one; absent for a model neither describes (no number rather than a wrong one);
- ``perf/mfu``: those FLOPs / the GPU's dense bf16 peak (:func:`~megatrain_lightning.planning.flops.peak_bf16_flops`);
  absent on the CPU, an unknown GPU or where model FLOPs are;
- ``mem/host_rss_gib`` and ``mem/gpu_peak_gib`` (``torch.cuda.max_memory_allocated`` in the window);
- from ``trainer.strategy.engine.stats`` (``strategy="megatrain"`` only): ``engine/h2d_gbps`` and
  ``engine/d2h_gbps`` (weights up, gradients down), and the share of wall time the host worker spent
  stepping Adam (``engine/host_step_frac``) and landing gradients (``engine/host_land_frac``), which
  overlap device compute, and the share the compute thread was blocked waiting for the host
  (``engine/host_wait_frac``): a stall where the GPU may starve.

All figures go to every logger; tokens/s, MFU and the host-wait share also go to the progress bar.
"""

from __future__ import annotations

import os
import resource
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from megatrain_lightning.models.config import LlamaConfig
from megatrain_lightning.planning import flops

GiB = 2**30
_STATS = ("h2d_bytes", "d2h_bytes", "host_step_seconds", "host_land_seconds", "host_wait_seconds")


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak (flops.peak_bf16_flops), or None on the CPU and on GPUs it does not know."""
    return flops.peak_bf16_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def model_flops_of(pl_module: L.LightningModule) -> Callable[[int, int], int | None] | None:
    """Model FLOPs of (tokens, seq_len) for the module's ``model`` (the module itself if it has none): this
    project's LlamaConfig through flops.model_flops, a Hugging Face model (one with a ``config``) through
    flops.hf_model_flops (None where that cannot describe it), None for a model without a config."""
    model = getattr(pl_module, "model", None)
    model = model if isinstance(model, nn.Module) else pl_module
    config = getattr(model, "config", None)
    if isinstance(config, LlamaConfig):
        return partial(flops.model_flops, config)
    if config is None:
        return None
    return partial(flops.hf_model_flops, model)


def rss_bytes() -> int:
    """Resident memory of this process now (peak resident memory where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def batch_ids(batch: Any) -> torch.Tensor | None:
    """A batch's token ids: an id tensor, a tuple starting with one, or a dict with ``input_ids``."""
    if isinstance(batch, dict):
        batch = batch["input_ids"]
    if isinstance(batch, (tuple, list)):
        batch = batch[0]
    return batch if isinstance(batch, torch.Tensor) else None


class MegatrainMonitor(L.Callback):
    """Tokens/s, model TFLOPS, MFU, memory and where step time goes, every few training batches.

    Args:
        every_n_batches: batches per measurement window; None: the trainer's ``log_every_n_steps``.
    """

    def __init__(self, every_n_batches: int | None = None) -> None:
        if every_n_batches is not None and every_n_batches < 1:
            raise ValueError(f"every_n_batches={every_n_batches} must be at least 1")
        self.every_n_batches = every_n_batches
        self.last: dict[str, float] = {}
        """The latest window's figures (also what the loggers got)."""
        self._start: float | None = None
        self._paused: float | None = None
        self._tokens = self._batches = 0
        self._rows: Counter[int] = Counter()  # the window's tokens by sequence length
        self._stats: dict[str, float] = {}
        self._flops_of: Callable[[int, int], int | None] | None = None
        self._peak: float | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._flops_of = model_flops_of(pl_module)
        self._peak = peak_flops(trainer.strategy.root_device)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._start is None:
            self._sync(trainer)
            self._start, self._tokens, self._batches = time.perf_counter(), 0, 0
            self._rows.clear()
            self._stats = self._engine_stats(trainer)
            if trainer.strategy.root_device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        ids = batch_ids(batch)
        if ids is not None and ids.ndim:  # rows of ids.shape[-1] tokens: the sequence length model FLOPs need
            self._tokens += ids.numel()
            self._rows[ids.shape[-1]] += ids.numel()
        self._batches += 1
        if self._batches >= (self.every_n_batches or trainer.log_every_n_steps):
            self._sync(trainer)
            self._emit(trainer, pl_module, time.perf_counter() - self._start)
            self._start = None

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._paused = time.perf_counter() if self._start is not None and not trainer.sanity_checking else None

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._paused is not None and self._start is not None:
            self._start += time.perf_counter() - self._paused  # validation is not training time
        self._paused = None

    def _emit(self, trainer: L.Trainer, pl_module: L.LightningModule, seconds: float) -> None:
        figures = self._figures(trainer, seconds)
        self.last = figures
        for logger in trainer.loggers:
            logger.log_metrics(figures, step=trainer.global_step)
        for key, short in (
            ("perf/tokens_per_sec", "tok/s"),
            ("perf/mfu", "mfu"),
            ("engine/host_wait_frac", "host_wait"),
        ):
            if key in figures:
                pl_module.log(short, figures[key], prog_bar=True, logger=False, on_step=True, on_epoch=False)

    def _figures(self, trainer: L.Trainer, seconds: float) -> dict[str, float]:
        out = {"perf/tokens_per_sec": self._tokens / seconds, "mem/host_rss_gib": rss_bytes() / GiB}
        work = self._window_flops()
        if work is not None:
            out["perf/model_tflops"] = work / seconds / 1e12
            if self._peak is not None:
                out["perf/mfu"] = flops.mfu(work, seconds, self._peak)
        if trainer.strategy.root_device.type == "cuda":
            out["mem/gpu_peak_gib"] = torch.cuda.max_memory_allocated(trainer.strategy.root_device) / GiB
        now = self._engine_stats(trainer)
        if now and self._stats:
            delta = {k: now[k] - self._stats[k] for k in _STATS}
            out["engine/h2d_gbps"] = delta["h2d_bytes"] / seconds / 1e9
            out["engine/d2h_gbps"] = delta["d2h_bytes"] / seconds / 1e9
            for part in ("step", "land", "wait"):
                out[f"engine/host_{part}_frac"] = delta[f"host_{part}_seconds"] / seconds
        return out

    def _window_flops(self) -> int | None:
        """Model FLOPs of the window's batches; None if any of them is of a shape flops.py cannot describe."""
        if self._flops_of is None:
            return None
        total = 0
        for seq_len, tokens in self._rows.items():
            work = self._flops_of(tokens, seq_len)
            if work is None:
                return None
            total += work
        return total

    @staticmethod
    def _engine_stats(trainer: L.Trainer) -> dict[str, float]:
        engine = getattr(trainer.strategy, "engine", None)  # set by strategy="megatrain" during fit
        return dict(engine.stats) if engine is not None else {}

    @staticmethod
    def _sync(trainer: L.Trainer) -> None:
        # Time is measured on the host: wait for queued device work at the window's ends only.
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)


class ExportAndSample(L.Callback):
    """At the end of fit: print the validation loss before and after, write a Hugging Face export, sample,
    and draw the loss curves.

    Needs a LightningModule whose ``model`` is this project's ``LlamaForCausalLM`` (``CausalLMModule``);
    prompts are encoded with the datamodule's ``tokenizer`` when it has one, else as bytes. The export
    holds that tokenizer too (anything with ``save_pretrained``), so ``AutoTokenizer`` reads it from there.

    Args:
        dirpath: where ``hf/``, ``sample.txt`` and ``loss.png`` go; None: the trainer's ``default_root_dir``.
        export: write a ``transformers``-loadable Hugging Face checkpoint.
        dtype: tensor type of the export; None: the masters' (fp32), as ``megatrain convert --to hf`` writes
            (bf16 halves the files).
        prompt: text the sample continues.
        max_new_tokens: sample length in tokens (0: no sample).
        temperature: sampling temperature.
        top_k: sample among the k most likely tokens.
        plot: draw ``loss.png`` (train and validation loss) from the ``CSVLogger``'s metrics.csv; needs
            matplotlib (``pip install 'megatrain_lightning[plot]'``), else one line says it is skipped.
    """

    def __init__(
        self,
        dirpath: str | None = None,
        export: bool = True,
        dtype: Literal["float32", "bfloat16"] | None = None,
        prompt: str = "The ",
        max_new_tokens: int = 120,
        temperature: float = 0.8,
        top_k: int = 20,
        plot: bool = True,
    ) -> None:
        self.dirpath, self.export, self.prompt = dirpath, export, prompt
        self.dtype = getattr(torch, dtype) if dtype is not None else None
        self.max_new_tokens, self.temperature, self.top_k, self.plot = max_new_tokens, temperature, top_k, plot
        self.plotted: str | None = None
        """What ``loss.png`` became: the path written, or why it was not drawn."""
        self.val_losses: list[float] = []
        """``val_loss`` after each validation run, the sanity check's first."""
        self.sample: str | None = None

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if "val_loss" in trainer.callback_metrics:
            self.val_losses.append(float(trainer.callback_metrics["val_loss"]))

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from megatrain_lightning.models import LlamaForCausalLM

        model = getattr(pl_module, "model", None)
        if not isinstance(model, LlamaForCausalLM):
            rank_zero_warn(
                f"ExportAndSample needs pl_module.model to be a LlamaForCausalLM, not {type(model).__name__}"
            )
            return
        out = Path(self.dirpath or trainer.default_root_dir)
        if self.export:
            self._export(trainer, model, out / "hf")
        if self.max_new_tokens > 0:
            self.sample = self._generate(trainer, model)
            (out / "sample.txt").write_text(self.sample, encoding="utf-8")
        if self.plot:
            self.plotted = self._plot(trainer, out / "loss.png")
        self._report(trainer, out)

    def _export(self, trainer: L.Trainer, model: nn.Module, directory: Path) -> None:
        from megatrain_lightning.checkpoint import export_hf
        from megatrain_lightning.models import save_pretrained

        tokenizer = getattr(trainer.datamodule, "tokenizer", None)
        tokenizer = tokenizer if hasattr(tokenizer, "save_pretrained") else None
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:  # stream from the fp32 host masters (the module's tensors may be device copies)
            export_hf(engine, model, directory, dtype=self.dtype, tokenizer=tokenizer)
        else:
            save_pretrained(model, directory, dtype=self.dtype, tokenizer=tokenizer)

    @staticmethod
    def _plot(trainer: L.Trainer, out: Path) -> str:
        """Draw the CSV logger's losses into `out`; returns the path, or why nothing was drawn."""
        from lightning.pytorch.loggers import CSVLogger

        from megatrain_lightning.lightning import plots

        logger = next((lg for lg in trainer.loggers if isinstance(lg, CSVLogger)), None)
        if logger is None:
            return "not drawn: no CSVLogger among the trainer's loggers"
        logger.save()  # Lightning writes the file only every flush_logs_every_n_steps and at the very end
        try:
            return str(plots.loss_png(logger.experiment.metrics_file_path, out))
        except (ImportError, ValueError, OSError) as err:  # a missing extra or file must not fail the fit
            return f"not drawn: {err}"

    def _generate(self, trainer: L.Trainer, model: nn.Module) -> str:
        from megatrain_lightning.lightning.data import ByteTokenizer

        tokenizer = getattr(trainer.datamodule, "tokenizer", None) or ByteTokenizer()
        prompt = torch.as_tensor(tokenizer.encode([self.prompt])[0], dtype=torch.long)[None]
        # Where the weights are after fit, not the strategy's root device: megatrain's teardown leaves them
        # on the host (a model larger than the GPU could not go there), ordinary strategies on the device.
        device = next(model.parameters()).device
        ids = model.generate(
            prompt.to(device),
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
        )[0].tolist()
        eos = getattr(tokenizer, "eos_id", None)
        new = ids[prompt.shape[1] :]
        return self.prompt + tokenizer.decode(new[: new.index(eos)] if eos in new else new)

    def _report(self, trainer: L.Trainer, out: Path) -> None:
        if len(self.val_losses) >= 2:
            print(f"\nvalidation loss: {self.val_losses[0]:.3f} -> {self.val_losses[-1]:.3f} (nats/token)")
        ckpt = getattr(trainer.checkpoint_callback, "last_model_path", "") or "(none)"
        print(f"checkpoint: {ckpt}")
        if self.export:
            print(f"Hugging Face export: {out / 'hf'}")
        if self.plotted is not None:
            print(f"loss curves: {self.plotted}")
        if self.sample is not None:
            print(f"sample: {self.sample!r}")
