"""MegatrainMonitor's live figures on the CPU, its model FLOPs and MFU (checked against hand counts) and peaks."""

from __future__ import annotations

import csv
import math
import warnings

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from megatrain_lightning.lightning import callbacks
from megatrain_lightning.lightning.callbacks import MegatrainMonitor, model_flops_of, peak_flops
from megatrain_lightning.lightning.data import TextDataModule
from megatrain_lightning.lightning.module import CausalLMModule
from tests import helpers

ENGINE_FIELDS = (
    "engine/h2d_gbps",
    "engine/d2h_gbps",
    "engine/host_step_frac",
    "engine/host_land_frac",
    "engine/host_wait_frac",
)


def fit(tmp_path, strategy: str) -> tuple[L.Trainer, MegatrainMonitor]:
    monitor = MegatrainMonitor(every_n_batches=2)
    trainer = L.Trainer(
        accelerator="cpu",
        strategy=strategy,
        max_steps=6,
        logger=CSVLogger(tmp_path, name="m"),
        callbacks=[monitor],
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
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


def pretend_a_peak(monkeypatch) -> None:
    """The CPU has no bf16 peak, so no MFU: pretend it has 1 TFLOP/s to get one to check."""
    monkeypatch.setattr(callbacks, "peak_flops", lambda device: 1e12)


def test_monitor_mfu_is_model_flops_over_the_peak(tmp_path, monkeypatch):
    pretend_a_peak(monkeypatch)
    trainer, monitor = fit(tmp_path, "auto")
    c = trainer.lightning_module.config
    assert (
        c.vocab_size,
        c.hidden_size,
        c.intermediate_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
    ) == (256, 64, 128, 4, 4, 2, 16)
    # The "tiny" preset by hand, rows of 32 tokens. N: q, k, v, o and gate, up, down of 4 blocks, and the
    # head. Attention: QK^T and scores x V, 2 x 16 FLOPs per query-key pair and head, x3 for backward, over
    # the 33/2 pairs per token of a causal row of 32.
    n = 4 * (64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 128) + 256 * 64
    per_token = 6 * n + 4 * 4 * (3 * 2 * 2 * 16) * 33 // 2
    figures = monitor.last
    tflops = per_token * figures["perf/tokens_per_sec"] / 1e12
    assert figures["perf/model_tflops"] == pytest.approx(tflops, rel=1e-9)
    assert figures["perf/mfu"] == pytest.approx(tflops, rel=1e-9)  # over 1 TFLOP/s
    assert "mfu" in trainer.progress_bar_metrics


def test_monitor_counts_a_hugging_face_model(monkeypatch):
    pytest.importorskip("transformers")
    pretend_a_peak(monkeypatch)
    monitor = MegatrainMonitor(every_n_batches=2)
    helpers.fit(helpers.CausalLM(helpers.hf_llama()), helpers.token_batches(4), callbacks=[monitor])
    # hf_llama by hand: vocabulary 97, width 32, MLP 64, 3 blocks of 4 query heads and 2 key/value heads of
    # width 8, an untied head; rows of 16 tokens.
    n = 3 * (32 * 32 + 32 * 16 + 32 * 16 + 32 * 32 + 3 * 32 * 64) + 97 * 32
    per_token = 6 * n + 3 * 4 * (3 * 2 * 2 * 8) * 17 // 2
    figures = monitor.last
    assert figures["perf/mfu"] == pytest.approx(per_token * figures["perf/tokens_per_sec"] / 1e12, rel=1e-9)


def test_monitor_gives_no_flops_for_a_model_it_cannot_describe(monkeypatch):
    pytest.importorskip("transformers")
    pretend_a_peak(monkeypatch)
    model = helpers.hf_llama()
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)  # no weight gradient: 6 x N is wrong
    monitor = MegatrainMonitor(every_n_batches=2)
    helpers.fit(helpers.CausalLM(model), helpers.token_batches(4), strategy="auto", callbacks=[monitor])
    assert monitor.last["perf/tokens_per_sec"] > 0
    assert "perf/model_tflops" not in monitor.last and "perf/mfu" not in monitor.last
    no_config = helpers.CausalLM(torch.nn.Sequential(torch.nn.Embedding(97, 32), torch.nn.Linear(32, 97)))
    assert model_flops_of(no_config) is None


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA L40", 181e12),
        ("NVIDIA GeForce GTX 1080", None),
    ],
)
def test_peak_flops_by_device_name(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops(torch.device("cuda", 0)) == peak
    assert peak_flops(torch.device("cpu")) is None


def test_monitor_refuses_an_empty_window():
    with pytest.raises(ValueError, match="every_n_batches=0"):
        MegatrainMonitor(every_n_batches=0)
