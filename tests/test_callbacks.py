"""MegatrainMonitor's live figures on the CPU, its FLOP count and peak table."""

from __future__ import annotations

import csv
import math
import warnings

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from megatrain_lightning.callbacks import MegatrainMonitor, flop_params, peak_flops
from megatrain_lightning.data import TextDataModule
from megatrain_lightning.models import LlamaConfig, LlamaForCausalLM
from megatrain_lightning.module import CausalLMModule

ENGINE_FIELDS = ("engine/h2d_gbps", "engine/d2h_gbps", "engine/host_step_frac", "engine/host_land_frac",
                 "engine/host_wait_frac")  # fmt: skip


def fit(tmp_path, strategy: str) -> tuple[L.Trainer, MegatrainMonitor]:
    monitor = MegatrainMonitor(every_n_batches=2)
    trainer = L.Trainer(accelerator="cpu", strategy=strategy, max_steps=6, logger=CSVLogger(tmp_path, name="m"),
                        callbacks=[monitor], enable_checkpointing=False, enable_model_summary=False,
                        enable_progress_bar=False, limit_val_batches=0, num_sanity_val_steps=0)  # fmt: skip
    data = TextDataModule("builtin:python-docs", seq_len=32, batch_size=4)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(CausalLMModule("tiny"), datamodule=data)
    return trainer, monitor


def test_monitor_logs_throughput_memory_and_engine_figures(tmp_path):
    trainer, monitor = fit(tmp_path, "megatrain")
    figures = monitor.last
    assert figures["perf/tokens_per_sec"] > 0 and figures["perf/model_tflops"] > 0 and figures["mem/host_rss_gib"] > 0
    assert all(math.isfinite(v) for v in figures.values())
    assert figures["engine/h2d_gbps"] > 0 and figures["engine/d2h_gbps"] > 0  # weights up, gradients down
    assert all(0 <= figures[k] < 1.5 for k in ENGINE_FIELDS[2:])  # shares of wall time (the worker overlaps)
    assert "perf/mfu" not in figures and "mem/gpu_peak_gib" not in figures  # CPU: no peak to compare with
    assert "tok/s" in trainer.progress_bar_metrics
    with open(trainer.logger.log_dir + "/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("perf/tokens_per_sec")]
    assert len(rows) == 3 and set(ENGINE_FIELDS) <= set(rows[0])  # every 2 of 6 batches, all figures


def test_monitor_without_the_engine_reports_throughput_only(tmp_path):
    _, monitor = fit(tmp_path, "auto")
    assert monitor.last["perf/tokens_per_sec"] > 0
    assert not any(k.startswith("engine/") for k in monitor.last)


@pytest.mark.parametrize(("preset", "tied"), [("tiny", False), ("tiny-qwen", True)])
def test_flop_params_exclude_the_embedding_but_keep_the_head(preset, tied):
    config = LlamaConfig.from_preset(preset)
    model = LlamaForCausalLM(config)
    total, vh = config.num_parameters(), config.vocab_size * config.hidden_size
    assert config.tie_word_embeddings == tied
    assert flop_params(model) == (total if tied else total - vh)  # a tied head still does its matmul


@pytest.mark.parametrize(("name", "peak"), [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                                            ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12),
                                            ("NVIDIA L40S", 362e12), ("NVIDIA L4", 121e12),
                                            ("NVIDIA GeForce GTX 1080", None)])  # fmt: skip
def test_peak_flops_by_device_name(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops(torch.device("cuda", 0)) == peak
    assert peak_flops(torch.device("cpu")) is None


def test_monitor_refuses_an_empty_window():
    with pytest.raises(ValueError, match="every_n_batches=0"):
        MegatrainMonitor(every_n_batches=0)
