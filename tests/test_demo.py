"""The README's first command, shortened: the embedded demo trains, the loss falls, artifacts exist."""

from __future__ import annotations

import json

import pytest

from megatrain_lightning.demo import embedded_corpus, main


def test_corpus_is_embedded_english_text():
    tokens = embedded_corpus()
    assert len(tokens) > 300_000
    assert b"statement" in bytes(tokens[:20_000].tolist())


@pytest.mark.slow
def test_demo_trains_and_writes_artifacts(tmp_path):
    result = main(["--max-steps", "25", "--batch-size", "8", "--seq-len", "64", "--out", str(tmp_path)])
    assert result["val_loss_after"] < result["val_loss_before"] - 1.0
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_hidden_layers"] == 4
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_demo_rejects_bad_step_count(capsys):
    with pytest.raises(SystemExit):
        main(["--max-steps", "0"])
    assert "--max-steps=0" in capsys.readouterr().err
