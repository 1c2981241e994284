"""Pictures: the loss curves the demo draws and `megatrain plan --png`, valid PNG files; without matplotlib
one line says how to install it."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from lightning.pytorch.loggers import CSVLogger

from megatrain_lightning.cli.main import run
from megatrain_lightning.lightning import plots
from megatrain_lightning.lightning.callbacks import ExportAndSample


def assert_png(path: Path) -> None:
    """A PNG file matplotlib reads back as a picture of some size (not an empty canvas)."""
    image = pytest.importorskip("matplotlib.image")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = image.imread(path)
    assert pixels.shape[0] >= 200 and pixels.shape[1] >= 300 and pixels.std() > 0.05


def test_loss_curves_are_drawn_from_the_csv_loggers_metrics(tmp_path):
    pytest.importorskip("matplotlib")
    logger = CSVLogger(tmp_path)
    for step in range(0, 40, 10):  # as Lightning logs: train_loss every few steps, val_loss apart, other columns
        logger.log_metrics({"train_loss": 5.0 - step / 10, "perf/tokens_per_sec": 100.0}, step=step)
        if step % 20 == 0:
            logger.log_metrics({"val_loss": 5.5 - step / 10, "epoch": 0}, step=step)
    logger.save()
    series = plots.read_series(logger.experiment.metrics_file_path, "train_loss", "val_loss")
    assert series == {"train_loss": [(0, 5.0), (10, 4.0), (20, 3.0), (30, 2.0)], "val_loss": [(0, 5.5), (20, 3.5)]}
    assert plots.loss_png(logger.experiment.metrics_file_path, tmp_path / "loss.png") == tmp_path / "loss.png"
    assert_png(tmp_path / "loss.png")


def test_a_csv_without_losses_is_refused_by_name(tmp_path):
    (tmp_path / "metrics.csv").write_text("step,lr\n0,0.1\n")
    with pytest.raises(ValueError, match="metrics.csv holds no train_loss or val_loss"):
        plots.loss_png(tmp_path / "metrics.csv", tmp_path / "loss.png")


def test_plan_png_draws_the_host_and_gpu_breakdown(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plots" / "plan.png"
    plan = run(["plan", "--model", "tiny", "--gpu-mem", "2GiB", "--no-measure", "--png", str(out)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2:] == [f"memory breakdown drawn: {out}", plan.host_plan_line()]  # the summary stays last
    assert_png(out)
    assert sum(v for _, v in plan.gpu_peak_items()) == plan.gpu_peak  # what the GPU bar stacks is the peak
    assert [label for label, _ in plan.host_items()][0] == "fp32 master weights"


def test_without_matplotlib_one_line_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(SystemExit) as exit:
        run(["plan", "--model", "tiny", "--no-measure", "--png", str(tmp_path / "plan.png")])
    captured = capsys.readouterr()
    assert exit.value.code == 2 and captured.out == ""  # refused before any planning
    assert captured.err == f"megatrain plan: error: {plots.MISSING}\n"
    assert "pip install 'megatrain_lightning[plot]'" in plots.MISSING
    (tmp_path / "metrics.csv").write_text("step,train_loss\n0,1.0\n")
    with pytest.raises(ImportError) as err:
        plots.loss_png(tmp_path / "metrics.csv", tmp_path / "loss.png")
    assert str(err.value) == plots.MISSING and "\n" not in str(err.value) and err.value.__cause__ is None
    assert not (tmp_path / "plan.png").exists() and not (tmp_path / "loss.png").exists()


def test_the_demos_callback_says_in_one_line_why_it_drew_nothing(tmp_path, monkeypatch):
    """ExportAndSample at the end of fit: a missing matplotlib or CSV logger is a line, never a failed fit."""
    logger = CSVLogger(tmp_path)
    logger.log_metrics({"train_loss": 1.0}, step=0)
    fit_end = SimpleNamespace(loggers=[logger])
    assert ExportAndSample._plot(SimpleNamespace(loggers=[]), tmp_path / "loss.png") == (
        "not drawn: no CSVLogger among the trainer's loggers"
    )
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert ExportAndSample._plot(fit_end, tmp_path / "loss.png") == f"not drawn: {plots.MISSING}"
    assert Path(logger.experiment.metrics_file_path).is_file()  # the logger's rows were flushed first


def test_the_architecture_diagram_is_a_committed_picture_the_docs_show():
    """docs/img/make_architecture.py draws it from the schedule model (minutes: not run here); the PNG it
    wrote is committed and architecture.md shows it."""
    docs = Path(__file__).resolve().parents[1] / "docs"
    assert "](img/architecture.png)" in (docs / "architecture.md").read_text()
    assert (docs / "img" / "make_architecture.py").is_file()
    assert_png(docs / "img" / "architecture.png")
