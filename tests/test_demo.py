"""The README's first command, shortened: the embedded demo trains, the loss falls, artifacts exist."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from megatrain_lightning.cli.main import run
from megatrain_lightning.lightning.callbacks import ExportAndSample
from megatrain_lightning.lightning.data import ByteTokenizer
from megatrain_lightning.lightning.demo import python_docs
from megatrain_lightning.models import from_pretrained

DEMO = str(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml")


def test_corpus_is_embedded_english_text():
    docs = python_docs()
    assert len(docs) > 50 and sum(map(len, docs)) > 300_000
    assert any("statement" in d for d in docs[:20])


@pytest.mark.slow
def test_demo_trains_and_writes_artifacts(tmp_path, capsys):
    """`megatrain fit --config configs/demo.yaml` with fewer, smaller steps (validating at the last one)."""
    cli = run(
        [
            "fit",
            "--config",
            DEMO,
            "--trainer.max_steps=25",
            "--trainer.val_check_interval=25",
            "--data.batch_size=8",
            "--data.seq_len=64",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.enable_progress_bar=false",
            '--trainer.logger={"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "'
            + str(tmp_path)
            + '"}}',
        ]
    )
    [report] = [c for c in cli.trainer.callbacks if isinstance(c, ExportAndSample)]
    before, after = report.val_losses[0], report.val_losses[-1]
    assert after < before - 1.0, report.val_losses
    assert Path(cli.trainer.checkpoint_callback.last_model_path).is_file()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_hidden_layers"] == 4
    exported = from_pretrained(tmp_path / "hf").state_dict()
    trained = cli.model.model.state_dict()  # after fit: the fp32 masters, on the CPU
    assert all(torch.equal(exported[k], trained[k]) for k in exported)  # the masters' fp32, as convert writes
    if importlib.util.find_spec("transformers"):  # the test extra has it; the base install need not
        assert_generates_with_transformers_alone(tmp_path / "hf")
    assert (tmp_path / "sample.txt").read_text().startswith("The ")
    out = capsys.readouterr().out
    assert f"validation loss: {before:.3f} -> {after:.3f}" in out and "checkpoint:" in out and "sample:" in out
    if importlib.util.find_spec("matplotlib"):
        assert_png(tmp_path / "loss.png")
        assert f"loss curves: {tmp_path / 'loss.png'}" in out
    else:
        assert "loss curves: not drawn: drawing needs matplotlib" in out


def test_the_sample_is_drawn_where_the_weights_are_after_fit():
    """After a megatrain fit on a GPU the weights are back on the host while the strategy's root device is the
    GPU: the sample is drawn on the weights' device (a trainer standing in, its root device a GPU that the
    CPU-only test machine cannot reach and that a GPU machine holds no weights on)."""
    from types import SimpleNamespace

    from megatrain_lightning.models import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.from_preset("tiny"))
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0)), datamodule=None)
    sample = ExportAndSample(prompt="The ", max_new_tokens=4, temperature=0.0)._generate(trainer, model)
    assert sample.startswith("The ") and len(sample.encode()) > len("The ")


def assert_generates_with_transformers_alone(directory: Path) -> None:
    """The export's own tokenizer and weights, read by transformers, continue a prompt of the demo's bytes."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    prompt = tokenizer("The ", return_tensors="pt")
    assert prompt["input_ids"].tolist() == [ByteTokenizer().encode(["The "])[0].tolist()]
    out = model.generate(**prompt, max_new_tokens=20, do_sample=False)
    assert out.shape[1] > 4 and tokenizer.decode(out[0]).startswith("The ")


def assert_png(path: Path) -> None:
    """A PNG file matplotlib reads back as a picture of some size (not an empty canvas)."""
    from matplotlib import image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = image.imread(path)
    assert pixels.shape[0] >= 200 and pixels.shape[1] >= 300 and pixels.std() > 0.05


def quick_demo(root: Path) -> list[str]:
    """The demo config, a few tiny steps, with its progress bar on."""
    return [
        "fit",
        "--config",
        DEMO,
        f"--trainer.default_root_dir={root}",
        "--trainer.max_steps=2",
        "--trainer.val_check_interval=2",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.limit_val_batches=1",
        "--trainer.log_every_n_steps=1",
        "--data.seq_len=16",
        "--data.batch_size=2",
        "--trainer.callbacks.max_new_tokens=2",
    ]


def demo_with_extras(root: Path, installed: bool, monkeypatch) -> tuple[Any, set[str]]:
    """The quick demo as Lightning would run it with rich and tensorboard(X) installed, or with neither."""
    from lightning.pytorch.trainer.connectors import callback_connector
    from lightning.pytorch.trainer.connectors.logger_connector import logger_connector

    for module, flag in [
        (callback_connector, "_RICH_AVAILABLE"),
        (logger_connector, "_TENSORBOARD_AVAILABLE"),
        (logger_connector, "_TENSORBOARDX_AVAILABLE"),
    ]:
        monkeypatch.setattr(module, flag, installed)
    cli = run(quick_demo(root))
    files = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
    return cli, {re.sub(r"/v[0-9a-f]+-[0-9a-f]+/", "/VERSION/", f) for f in files}  # a checkpoint's random id


def test_the_demo_shows_and_writes_the_same_with_or_without_the_extras(tmp_path, monkeypatch, capsys, caplog, recwarn):
    """Lightning picks a rich bar and summary with `rich` installed and TensorBoard with tensorboard(X): the
    demo gets the tqdm bar, the plain summary and metrics.csv either way, and no notices."""
    from lightning.pytorch.callbacks import ModelSummary, RichModelSummary, TQDMProgressBar
    from lightning.pytorch.loggers import CSVLogger

    caplog.set_level("INFO")
    seen = {}
    for installed in (True, False):
        cli, files = demo_with_extras(tmp_path / str(installed), installed, monkeypatch)
        trainer = cli.trainer
        kinds = sorted(type(c).__name__ for c in trainer.callbacks)
        seen[installed] = (files, kinds, [type(x).__name__ for x in trainer.loggers])
        assert isinstance(trainer.progress_bar_callback, TQDMProgressBar)
        assert [type(x) for x in trainer.loggers] == [CSVLogger]
        summaries = [c for c in trainer.callbacks if isinstance(c, ModelSummary)]
        assert len(summaries) == 1 and not isinstance(summaries[0], RichModelSummary)
    assert seen[True] == seen[False]
    files = seen[True][0]
    assert {"lightning_logs/version_0/metrics.csv", "lightning_logs/version_0/checkpoints/last.ckpt"} <= files
    assert "sample.txt" in files and not any("tfevents" in f for f in files), files
    out = capsys.readouterr()
    shown = out.out + out.err + caplog.text
    assert "Epoch 0: 100%" in shown and "Total params" in shown  # the tqdm bar and the plain summary
    shown += "".join(str(w.message) for w in recwarn)
    for notice in ("💡 Tip", "LeafSpec", "tensorboardX", "Skipping setting a default"):
        assert notice not in shown, notice
