"""The data module: packing, formats, tokenizers, the validation split and mid-epoch resume."""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path

import lightning.pytorch as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from megatrain_lightning.cli.main import run
from megatrain_lightning.lightning.data import (
    PackedWindows,
    ResumableLoader,
    ResumableSampler,
    TextDataModule,
    TokenFile,
    write_tokens,
)
from megatrain_lightning.lightning.module import CausalLMModule

DEMO = str(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml")
DOCS = ["the cat sat on the mat", "a dog barked", "hello world, once more"]


def windows(dm: TextDataModule, split: str = "train") -> list[tuple[torch.Tensor, torch.Tensor]]:
    dm.setup("fit")
    data = dm.train_set if split == "train" else dm.val_set
    return [data[i] for i in range(len(data))]


def stream_of(ws: list[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
    """Undo the packing: window i is stream[i*T : i*T + T + 1], so consecutive windows share one token."""
    out = []
    for x, y in ws:
        assert torch.equal(x[1:], y[:-1])  # the target is the input shifted by one
        out += x.tolist()
    return out + [ws[-1][1][-1].item()]


def test_packing_has_no_padding_and_eos_between_documents(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    dm = TextDataModule(str(path), seq_len=8, val_fraction=0)
    ws = windows(dm)
    assert all(x.shape == (8,) and y.shape == (8,) for x, y in ws)
    packed = b"".join(d.encode() + b"\0" for d in DOCS)
    assert len(ws) == (len(packed) - 1) // 8
    assert stream_of(ws) == list(packed[: len(ws) * 8 + 1])  # contiguous, in order, nothing inserted


def test_text_files_are_documents(tmp_path):
    for i, doc in enumerate(DOCS):
        (tmp_path / f"{i}.txt").write_text(doc)
    dm = TextDataModule(str(tmp_path), seq_len=4, val_fraction=0)
    assert dm.format == "text" and dm.vocab_size == 256
    assert bytes(stream_of(windows(dm))) == b"".join(d.encode() + b"\0" for d in DOCS)[: len(windows(dm)) * 4 + 1]


@pytest.mark.parametrize(("dtype", "suffix"), [("uint16", ".bin"), ("uint32", ".bin"), ("uint32", ".npy")])
def test_token_files_are_memory_mapped(tmp_path, dtype, suffix):
    tokens = np.random.default_rng(0).integers(0, 70_000 if dtype == "uint32" else 60_000, 1001)
    path = tmp_path / f"tokens{suffix}"
    if suffix == ".bin":
        write_tokens(tokens, path, dtype=dtype)
    else:
        np.save(path, tokens.astype(dtype))
    dm = TextDataModule(str(path), seq_len=10, token_dtype=dtype, val_fraction=0.1)
    ws, val = windows(dm), windows(dm, "val")
    assert isinstance(dm.train_set.streams[0], TokenFile) and isinstance(dm.train_set.streams[0].array(), np.memmap)
    assert stream_of(ws + val) == tokens.tolist()  # round trip: 1001 tokens = 100 windows of 10 + 1
    assert len(val) == 10 and dm.vocab_size is None  # the last 10% of windows; vocabulary unknown


def test_token_file_pickles_without_its_data(tmp_path):
    """Loader workers get the path and map the file themselves (a pickled memmap would copy it)."""
    path = tmp_path / "t.bin"
    write_tokens(np.arange(100_000), path, dtype="uint32")
    file = TokenFile(path, "uint32")
    file.array()
    blob = pickle.dumps(file)
    assert len(blob) < 1000 and pickle.loads(blob)[5:8].tolist() == [5, 6, 7]


def test_write_tokens_refuses_ids_too_large_for_the_dtype(tmp_path):
    with pytest.raises(ValueError, match="use dtype='uint32'"):
        write_tokens(np.array([1, 70_000]), tmp_path / "t.bin", dtype="uint16")


def test_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(DOCS * 20, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    dm = TextDataModule(str(tmp_path / "train.jsonl"), seq_len=4, tokenizer=str(tmp_path), val_fraction=0)
    eos = tok.token_to_id("<|endoftext|>")
    expected = [i for d in DOCS for i in [*tok.encode(d, add_special_tokens=False).ids, eos]]
    ws = windows(dm)
    assert dm.vocab_size == tok.get_vocab_size() and dm.tokenizer.eos_id == eos
    assert stream_of(ws) == expected[: len(ws) * 4 + 1]
    assert dm.tokenizer.decode(expected[:5]).startswith("the cat")


def test_jsonl_field_errors_name_the_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "ok"}\n{"body": "no text here"}\n')
    dm = TextDataModule(str(path), seq_len=4)
    with pytest.raises(ValueError, match=r"d.jsonl:2 has no string field 'text'.*text_field"):
        dm.setup("fit")
    dm = TextDataModule(str(path), seq_len=2, text_field="body", val_fraction=0)
    with pytest.raises(ValueError, match=r"d.jsonl:1 has no string field 'body'"):
        dm.setup("fit")


def test_missing_and_unusable_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data path '/data/nope.jsonl' does not exist; expected a file or dir"):
        TextDataModule("/data/nope.jsonl")
    with pytest.raises(FileNotFoundError, match=r"tokenizer.json"):
        TextDataModule("builtin:python-docs", tokenizer=str(tmp_path / "missing"))
    (tmp_path / "data.parquet").write_text("x")
    with pytest.raises(ValueError, match=r"cannot tell the format.*format="):
        TextDataModule(str(tmp_path / "data.parquet"))
    (tmp_path / "short.txt").write_text("tiny")
    dm = TextDataModule(str(tmp_path / "short.txt"), seq_len=64, val_fraction=0)
    with pytest.raises(ValueError, match="fewer than one batch"):
        dm.setup("fit")


def test_validation_split_and_separate_validation_file(tmp_path):
    dm = TextDataModule("builtin:python-docs", seq_len=128, val_fraction=0.05)
    dm.setup("fit")
    total = len(dm.train_set) + len(dm.val_set)
    assert dm.val_set.start == len(dm.train_set) and len(dm.val_set) == round(0.05 * total)
    (tmp_path / "val.txt").write_text("x" * 1000)
    dm = TextDataModule("builtin:python-docs", seq_len=99, val_path=str(tmp_path / "val.txt"))
    assert len(windows(dm, "val")) == 1000 // 99  # 1000 bytes + EOS
    assert dm.train_set.stop == dm.train_set.offsets[-1]  # nothing split off the training data


# -- resume mid-epoch through a Lightning checkpoint -------------------------------------------------
class Recorder(L.LightningModule):
    """Records the first token of every sequence it trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch[0][:, 0].tolist())
        return (self.w * batch[0].float().mean()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(dm: TextDataModule, max_steps: int, tmp_path, ckpt_path=None, every: int | None = None) -> Recorder:
    module = Recorder()
    callbacks = [ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=every, save_top_k=-1)] if every else []
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(every),
        callbacks=callbacks,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    return module


def test_resume_mid_epoch_continues_with_the_next_batch(tmp_path):
    """A run stopped at step 7 and resumed from its checkpoint sees exactly the batches an uninterrupted
    run sees, through the rest of the epoch and into the next one (a new shuffle)."""
    tokens = np.arange(40 * 8 + 1) % 60_000
    write_tokens(tokens, tmp_path / "t.bin")

    def data() -> TextDataModule:
        return TextDataModule(str(tmp_path / "t.bin"), seq_len=8, batch_size=2, val_fraction=0, seed=3)

    whole = fit(data(), 26, tmp_path / "a")  # 20 batches per epoch
    first = fit(data(), 7, tmp_path / "b", every=7)
    rest = fit(data(), 26, tmp_path / "c", ckpt_path=str(tmp_path / "b" / "epoch=0-step=7.ckpt"))
    assert first.seen + rest.seen == whole.seen
    assert sorted(sum(whole.seen[:20], [])) == [8 * i for i in range(40)]  # an epoch visits every window once
    assert whole.seen[20:] != whole.seen[:6]  # the second epoch is shuffled anew


def test_ranks_share_the_epoch_and_resume_with_another_number_of_ranks():
    """W ranks take disjoint strided shares of the one-rank order (cut to a multiple of W, equal counts); a
    position saved by 2 ranks resumes on 1 or 4 ranks at the same place of the order, and one that does not
    split into whole batches is refused."""
    dataset = list(range(21))

    def loader(ranks: int, rank: int) -> ResumableLoader:
        return ResumableLoader(dataset, 2, ResumableSampler(21, shuffle=True, seed=5, num_replicas=ranks, rank=rank))

    order = [int(i) for b in loader(1, 0) for i in b]
    shares = [[int(i) for b in loader(2, r) for i in b] for r in range(2)]
    assert shares == [order[0:20:2], order[1:20:2]] and len(loader(2, 1)) == 5
    saved = loader(2, 1)
    it = iter(saved)
    next(it), next(it)  # two batches of 2 on each of 2 ranks: 8 positions of the order seen
    state = saved.state_dict()
    one, four = loader(1, 0), loader(4, 3)
    one.load_state_dict(state)
    four.load_state_dict(state)
    assert [int(i) for b in one for i in b] == order[8:20]
    assert [int(i) for b in four for i in b] == order[8:20][3::4][:2] and four.state_dict()["batches"] == 2
    three = loader(3, 0)
    with pytest.raises(ValueError, match="resume with 2 ranks"):
        three.load_state_dict(state)


def test_loader_refuses_a_state_from_different_data(tmp_path):
    write_tokens(np.arange(200), tmp_path / "t.bin")
    dm = TextDataModule(str(tmp_path / "t.bin"), seq_len=8, batch_size=2, val_fraction=0)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert isinstance(loader, ResumableLoader)
    with pytest.raises(ValueError, match="resume with the same data, seq_len and batch_size"):
        loader.load_state_dict({"epoch": 0, "batches": 3, "batch_size": 4, "num_samples": 24})


# -- document positions: packed documents for long-context training -----------------------------------
def reference_positions(tokens: list[int], eos: int) -> list[int]:
    """Position of each token in its document, one token at a time: 0 at the start and after every EOS."""
    out, pos = [], 0
    for token in tokens:
        out.append(pos)
        pos = 0 if token == eos else pos + 1
    return out


def test_document_positions_restart_after_eos_and_eos_targets_are_ignored(tmp_path):
    #         doc 1   | doc 2       | doc 3 | doc 4
    stream = [1, 2, 9, 3, 4, 5, 9, 6, 9, 7, 8]  # 9 ends each document
    write_tokens(np.array(stream), tmp_path / "t.bin")
    dm = TextDataModule(str(tmp_path / "t.bin"), seq_len=5, val_fraction=0, eos_token_id=9, document_positions=True)
    (x0, y0, p0), (x1, y1, p1) = windows(dm)
    assert x0.tolist() == [1, 2, 9, 3, 4] and y0.tolist() == [2, 9, -100, 4, 5] and p0.tolist() == [0, 1, 2, 0, 1]
    # The second window starts inside doc 2, at position 0 (the window cannot see the document's start).
    assert x1.tolist() == [5, 9, 6, 9, 7] and y1.tolist() == [9, -100, 9, -100, 8] and p1.tolist() == [0, 1, 0, 1, 0]
    assert all(t.dtype == torch.int64 for t in (x0, y0, p0))


def test_default_windows_are_unchanged_by_the_option(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    plain = windows(TextDataModule(str(path), seq_len=8, val_fraction=0))
    with_docs = windows(TextDataModule(str(path), seq_len=8, val_fraction=0, document_positions=True))
    assert all(len(w) == 2 for w in plain) and len(plain) == len(with_docs)
    for (x, y), (dx, dy, dp) in zip(plain, with_docs):
        eos = x == 0  # byte tokens end documents with byte 0
        assert torch.equal(x, dx) and torch.equal(dy, torch.where(eos, -100, y))
        assert dp.tolist() == reference_positions(x.tolist(), 0)


def test_loader_batches_hold_inputs_targets_and_positions(tmp_path):
    write_tokens(np.arange(200) % 7, tmp_path / "t.bin")  # documents 0..6, each ended by 6
    dm = TextDataModule(
        str(tmp_path / "t.bin"), seq_len=16, batch_size=2, eos_token_id=6, val_fraction=0.2, document_positions=True
    )
    dm.setup("fit")
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        inputs, targets, positions = next(iter(loader))
        assert inputs.shape == targets.shape == positions.shape == (2, 16) and positions.dtype == torch.int64
        assert (targets == -100).sum() == (inputs == 6).sum()


def test_positions_of_a_262144_token_window_from_a_token_file(tmp_path):
    """A long-context window straight from a memory-mapped file, documents of random lengths."""
    rng = np.random.default_rng(0)
    seq_len, eos = 262_144, 50_000
    lengths = rng.integers(1, 5_000, size=300)  # ~750k tokens: at least two windows
    stream = np.concatenate([np.append(rng.integers(0, 32_000, n), eos) for n in lengths])
    write_tokens(stream, tmp_path / "t.bin", dtype="uint32")
    dm = TextDataModule(
        str(tmp_path / "t.bin"),
        seq_len=seq_len,
        token_dtype="uint32",
        eos_token_id=eos,
        val_fraction=0,
        shuffle=False,
        document_positions=True,
    )
    dm.setup("fit")
    assert isinstance(dm.train_set.streams[0], TokenFile) and len(dm.train_set) >= 2
    inputs, targets, positions = dm.train_set[1]  # starts inside a document
    assert inputs.tolist() == stream[seq_len : 2 * seq_len].tolist()
    part = slice(0, 40_000)  # the reference is a Python loop: a slice keeps the test light
    assert positions[part].tolist() == reference_positions(inputs[part].tolist(), eos)
    ends = np.flatnonzero(inputs.numpy() == eos)
    assert (positions[ends[1:]] == np.diff(ends) - 1).all()  # every whole document counts 0..length
    assert torch.equal(targets == -100, inputs == eos)


def test_document_positions_refuse_to_guess_the_eos_of_token_files(tmp_path):
    write_tokens(np.arange(100), tmp_path / "t.bin")
    with pytest.raises(ValueError, match=r"document_positions=true .* set data eos_token_id="):
        TextDataModule(str(tmp_path / "t.bin"), seq_len=8, document_positions=True)
    with pytest.raises(ValueError, match=r"eos_token_id=-1 must be a token id"):
        TextDataModule(str(tmp_path / "t.bin"), seq_len=8, eos_token_id=-1, document_positions=True)
    with pytest.raises(ValueError, match=r"needs eos_id="):
        PackedWindows([np.arange(100)], 8, document_positions=True)
    TextDataModule(str(tmp_path / "t.bin"), seq_len=8)  # without the option the EOS is not needed


def test_cli_names_the_missing_eos_of_token_files_in_one_line(tmp_path, capsys):
    write_tokens(np.arange(1000) % 50, tmp_path / "t.bin")
    with pytest.raises(SystemExit) as exit_info:
        run(["fit", "--config", DEMO, f"--data.path={tmp_path / 't.bin'}", "--data.document_positions=true"])
    assert exit_info.value.code == 2
    assert "cannot tell their end-of-text id: set data eos_token_id=" in capsys.readouterr().err


def test_module_passes_position_ids_to_the_model(tmp_path, monkeypatch):
    module = CausalLMModule("tiny")
    calls = []
    forward = module.model.forward
    monkeypatch.setattr(module.model, "forward", lambda *a, **kw: calls.append(kw) or forward(*a, **kw))
    write_tokens(np.arange(200) % 7, tmp_path / "t.bin")
    dm = TextDataModule(str(tmp_path / "t.bin"), seq_len=16, batch_size=2, eos_token_id=6, document_positions=True)
    dm.setup("fit")
    inputs, targets, positions = next(iter(dm.train_dataloader()))
    loss = module.training_step((inputs, targets, positions), 0)
    assert calls[-1]["position_ids"] is positions and torch.equal(calls[-1]["targets"], targets)
    assert torch.equal(loss, forward(inputs, targets=targets, position_ids=positions))
    module.training_step((inputs, targets), 0)
    assert calls[-1]["position_ids"] is None  # two tensors: the model's own positions 0..T-1
    with pytest.raises(ValueError, match=r"got 1 items"):
        module.training_step((inputs,), 0)


def test_document_positions_from_a_yaml_config_through_the_cli(tmp_path):
    """`data.document_positions: true` in a YAML config trains the demo with (inputs, targets, positions)."""
    config = tmp_path / "run.yaml"
    config.write_text("data:\n  document_positions: true\n")
    cli = run(
        [
            "fit",
            "--config",
            DEMO,
            "--config",
            str(config),
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.max_steps=2",
            "--trainer.num_sanity_val_steps=0",
            "--trainer.limit_val_batches=1",
            "--trainer.val_check_interval=2",
            "--trainer.enable_progress_bar=false",
            "--data.seq_len=32",
            "--data.batch_size=2",
            "--trainer.callbacks.max_new_tokens=4",
        ]
    )
    assert cli.datamodule.hparams.document_positions and cli.trainer.global_step == 2
    assert len(cli.datamodule.train_set[0]) == 3 and torch.isfinite(cli.trainer.callback_metrics["val_loss"])


def _fit_refused(dm: TextDataModule, tmp_path: Path, **overrides) -> str:
    """Trainer.fit of the tiny Llama on `dm`: the one-line ValueError it stops with, before any step."""
    module = CausalLMModule("tiny", overrides={"num_hidden_layers": 1, **overrides})
    trainer = L.Trainer(
        max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path
    )
    with pytest.raises(ValueError) as refused:
        trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 0
    assert "\n" not in str(refused.value)
    return str(refused.value)


def test_seq_len_above_the_models_positions_is_refused_through_the_api(tmp_path):
    """The command checks seq_len against the model before building anything; Trainer.fit with the data
    module refuses it too (the model would run positions it was not built for)."""
    (tmp_path / "t.txt").write_text("the cat sat on the mat. " * 200)
    dm = TextDataModule(str(tmp_path / "t.txt"), seq_len=64, batch_size=2, val_fraction=0)
    said = _fit_refused(dm, tmp_path, max_position_embeddings=32)
    assert said.startswith("data seq_len=64 is above the model's max_position_embeddings=32: give a seq_len from 1")


@pytest.mark.parametrize(
    ("name", "bad"), [("above.bin", 256), ("above.npy", 70000), ("negative.npy", -1), ("huge.npy", 2**62)]
)
def test_token_ids_outside_the_vocabulary_are_refused_naming_the_file(tmp_path, name, bad):
    """Token ids the model has no embedding for (above its vocabulary, negative, or 2^62 in an int64 .npy)
    are found where the data is loaded, by each file's smallest and largest id, not at the first batch
    that holds one (an IndexError, or silently wrong training on a device that does not check)."""
    ids = np.concatenate([np.arange(500) % 256, [bad], np.arange(500) % 256])
    path = tmp_path / name
    if name.endswith(".bin"):
        write_tokens(ids, path, "uint16")
    else:
        np.save(path, ids)
    (tmp_path / "ok.bin").write_bytes((np.arange(1000) % 256).astype(np.uint16).tobytes())
    dm = TextDataModule(str(tmp_path / "ok.bin"), seq_len=16, batch_size=2, val_path=str(path))
    said = _fit_refused(dm, tmp_path)
    assert said.startswith(f"{path} holds token id {bad}, outside the model's vocabulary of 256 ids (0..255)")
    assert TokenFile(tmp_path / "ok.bin", "uint16").id_range() == (0, 255)
