"""The data module: packing, formats, tokenizers, the validation split and mid-epoch resume."""

from __future__ import annotations

import json
import pickle
import warnings

import lightning.pytorch as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from megatrain_lightning.data import ResumableLoader, TextDataModule, TokenFile, write_tokens

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
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
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
    trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=bool(every), callbacks=callbacks,
                        num_sanity_val_steps=0, limit_val_batches=0)  # fmt: skip
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


def test_loader_refuses_a_state_from_different_data(tmp_path):
    write_tokens(np.arange(200), tmp_path / "t.bin")
    dm = TextDataModule(str(tmp_path / "t.bin"), seq_len=8, batch_size=2, val_fraction=0)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert isinstance(loader, ResumableLoader)
    with pytest.raises(ValueError, match="resume with the same data, seq_len and batch_size"):
        loader.load_state_dict({"epoch": 0, "batches": 3, "batch_size": 4, "num_samples": 24})
