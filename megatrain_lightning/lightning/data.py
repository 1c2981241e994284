"""Local training data for causal LMs: text, JSONL or pre-tokenized files, packed into full windows.

Documents are concatenated with an end-of-text token between them and the stream is cut into windows
of ``seq_len + 1`` tokens (input = window[:-1], target = window[1:]; consecutive windows share one
token, so every token is a target exactly once). Nothing is padded, so no compute goes to padding.
With ``document_positions`` each window also carries position ids that restart after every end-of-text
token, for training long windows of packed documents (see :class:`TextDataModule`).

| format  | files                          | tokens                                                    |
|---------|--------------------------------|-----------------------------------------------------------|
| text    | ``*.txt``, ``*.md``            | one document per file                                     |
| jsonl   | ``*.jsonl``                    | one document per line, from its ``text`` field            |
| tokens  | ``*.bin`` (raw uint16/uint32), | memory-mapped, never read whole; write them with          |
|         | ``*.npy``                      | :func:`write_tokens` (documents already separated by EOS) |

Text is tokenized by a local Hugging Face ``tokenizer.json`` (the optional ``tokenizers`` package), or
by default into bytes (vocabulary 256, byte 0 as end-of-text), which needs no download at all.
``builtin:python-docs`` is a corpus that ships with Python (the embedded demo's).

The training loader is resumable mid-epoch: Lightning saves and restores the state of any train loader
exposing ``state_dict``/``load_state_dict``, and :class:`ResumableLoader` records how many batches the
training loop has taken, so a run resumed from a checkpoint continues with the very next batch; with several
ranks each takes its share of the epoch's order, and the position resumes on another number of ranks that
divides it.

Why one file of about 500 lines: it is the path from files to batches (formats, tokenizing, packing, the
validation split, the resumable order, the data module), each step a short function or class the next one
calls; split, a reader would follow one batch through several modules.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

Format = Literal["auto", "text", "jsonl", "tokens"]
TokenDtype = Literal["uint16", "uint32"]
BUILTIN = "builtin:"
_EXTENSIONS = {".txt": "text", ".md": "text", ".text": "text", ".jsonl": "jsonl", ".bin": "tokens", ".npy": "tokens"}
_EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")


# -- tokenizers ------------------------------------------------------------------------------------
class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, byte 0 (never in text) ends a document."""

    vocab_size = 256

    def __init__(self, eos_token_id: int | None = None) -> None:
        self.eos_id = 0 if eos_token_id is None else eos_token_id

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).copy() for t in texts]  # writable, for torch

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    @property
    def token_ids(self) -> dict[str, int | None]:
        """The ids a Hugging Face config.json gives generation (bytes have no begin-of-text token)."""
        return {"bos_token_id": None, "eos_token_id": self.eos_id}

    def save_pretrained(self, directory: str | Path) -> None:
        """Write these byte tokens in the Hugging Face format, for ``AutoTokenizer.from_pretrained``."""
        from megatrain_lightning.models.hf_tokenizer import save_byte_tokenizer

        save_byte_tokenizer(directory, self.eos_id)


class HFTokenizer:
    """A local Hugging Face ``tokenizer.json`` through the ``tokenizers`` package."""

    def __init__(self, path: str, eos_token_id: int | None = None) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as err:
            raise ImportError(f"tokenizer={path!r} needs the tokenizers package: pip install tokenizers") from err
        file = Path(path).expanduser()
        file = file / "tokenizer.json" if file.is_dir() else file
        check_exists(str(file), "a Hugging Face tokenizer.json (or a checkpoint directory holding one)")
        self.file = file
        self.tokenizer = Tokenizer.from_file(str(file))
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = eos_token_id if eos_token_id is not None else self._find_eos(file)

    def _find_eos(self, file: Path) -> int:
        for name in _EOS_NAMES:
            if (token_id := self.tokenizer.token_to_id(name)) is not None:
                return token_id
        raise ValueError(f"{file} has none of the usual end-of-text tokens {list(_EOS_NAMES)}; set data eos_token_id=")

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int64) for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids])

    @property
    def token_ids(self) -> dict[str, int | None]:
        """The ids a Hugging Face config.json gives generation."""
        return {"eos_token_id": self.eos_id}

    def save_pretrained(self, directory: str | Path) -> None:
        """Copy this tokenizer.json and the files that configure it into `directory`."""
        from megatrain_lightning.models.hf_tokenizer import copy_tokenizer

        copy_tokenizer(self.file, directory, self.tokenizer.id_to_token(self.eos_id))


def tokenizer_of(hparams: dict[str, Any]) -> ByteTokenizer | HFTokenizer | None:
    """The tokenizer a :class:`TextDataModule` with these hyper-parameters (a checkpoint's
    ``datamodule_hyper_parameters``) read its text with, for an export made after the run; None for other
    data modules, and for token files read without a tokenizer (their ids are nobody's we know). A
    tokenizer.json that is gone since raises FileNotFoundError."""
    if not {"path", "tokenizer", "eos_token_id", "format"} <= set(hparams):
        return None
    if hparams["tokenizer"]:
        return HFTokenizer(hparams["tokenizer"], hparams["eos_token_id"])
    path, fmt = str(hparams["path"]), hparams["format"]
    if fmt == "auto" and not path.startswith(BUILTIN):
        fmt = _files(path, fmt)[1] if Path(path).expanduser().exists() else _EXTENSIONS.get(Path(path).suffix)
    return None if fmt in ("tokens", None) else ByteTokenizer(hparams["eos_token_id"])


# -- files -----------------------------------------------------------------------------------------
def check_exists(path: str, expected: str) -> None:
    """Refuse a path that does not exist, saying what should be there."""
    if not path.startswith(BUILTIN) and not Path(path).expanduser().exists():
        raise FileNotFoundError(f"data path {path!r} does not exist; expected {expected}")


def _files(path: str, fmt: str) -> tuple[list[Path], str]:
    """The files under `path` (a file or a directory) and their format."""
    root = Path(path).expanduser()
    files = sorted(p for p in root.rglob("*") if p.suffix in _EXTENSIONS) if root.is_dir() else [root]
    formats = {_EXTENSIONS.get(p.suffix) for p in files}
    if fmt == "auto":
        if len(formats) != 1 or None in formats:
            found = sorted({p.suffix or "(none)" for p in files}) or "no data files"
            raise ValueError(
                f"cannot tell the format of {path!r} (extensions: {found}); "
                f"name files {', '.join(_EXTENSIONS)} or set format= text, jsonl or tokens"
            )
        fmt = formats.pop()
    if root.is_dir():
        files = [p for p in files if _EXTENSIONS[p.suffix] == fmt]
    if not files:
        raise ValueError(f"{path!r} holds no {fmt} files ({', '.join(k for k, v in _EXTENSIONS.items() if v == fmt)})")
    return files, fmt


def _documents(files: list[Path], fmt: str, text_field: str) -> Iterator[str]:
    for file in files:
        try:
            if fmt == "text":
                yield file.read_text(encoding="utf-8")
                continue
            with open(file, encoding="utf-8") as f:
                for n, line in enumerate(f, start=1):
                    if line.strip():
                        yield _jsonl_text(line, text_field, file, n)
        except UnicodeDecodeError as err:
            raise ValueError(
                f"{file} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}); convert it, "
                f"e.g. iconv -f latin1 -t utf-8 {file.name} > {file.stem}.utf8{file.suffix}"
            ) from None


def _jsonl_text(line: str, field: str, file: Path, n: int) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{file}:{n} is not JSON ({err.msg} at column {err.colno}); each line of a .jsonl file is one "
            f'object such as {{"{field}": "..."}}'
        ) from None
    if not isinstance(record, dict) or not isinstance(record.get(field), str):
        raise ValueError(
            f"{file}:{n} has no string field {field!r}; set data text_field= to the field holding the text"
        )
    return record[field]


def pack(documents: list[np.ndarray], eos_id: int, vocab_size: int) -> np.ndarray:
    """One token stream: each document followed by the end-of-text token."""
    eos = np.array([eos_id])
    parts = [p for doc in documents for p in (doc, eos)]
    dtype = np.uint16 if vocab_size <= 2**16 else np.uint32
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)


class TokenFile:
    """A memory-mapped token file, opened lazily so that loader worker processes map it themselves."""

    def __init__(self, path: Path, dtype: str) -> None:
        self.path, self.dtype = path, dtype
        self._map: np.ndarray | None = None
        self._range: tuple[int, int] | None = None  # (smallest, largest) id, once asked for (id_range)
        self.length = len(self.array())

    def array(self) -> np.ndarray:
        if self._map is None:
            self._map = self._open()
            if self._map.ndim != 1 or self._map.dtype.kind not in "iu":
                raise ValueError(
                    f"{self.path} holds {self._map.dtype} of shape {self._map.shape}; expected 1-D token ids"
                )
        return self._map

    def _open(self) -> np.ndarray:
        """The file mapped (never unpickled: np.load refuses object arrays), or a ValueError naming the file."""
        if self.path.suffix == ".npy":
            try:
                return np.load(self.path, mmap_mode="r")
            except (ValueError, OSError, EOFError) as err:
                raise ValueError(
                    f"{self.path} is not a .npy array of token ids ({' '.join(str(err).split())[:120]}); "
                    "write token files with megatrain_lightning.lightning.data.write_tokens or numpy.save"
                ) from None
        size, itemsize = self.path.stat().st_size, np.dtype(self.dtype).itemsize
        if size == 0 or size % itemsize:
            raise ValueError(
                f"{self.path} holds {size} bytes, which is not a whole number of {self.dtype} token ids "
                f"({itemsize} bytes each); set data token_dtype= to the type it was written with, or rewrite it "
                "(it may be truncated)"
            )
        return np.memmap(self.path, dtype=self.dtype, mode="r")

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: slice) -> np.ndarray:
        return self.array()[index]

    def id_range(self) -> tuple[int, int]:
        """The smallest and the largest id in the file: one pass over it, the first time it is asked."""
        if self._range is None:
            ids = self.array()
            self._range = (int(ids.min()), int(ids.max())) if len(ids) else (0, 0)
        return self._range

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_map": None}  # a pickled memmap would copy the whole file


def write_tokens(tokens: np.ndarray | torch.Tensor, path: str | Path, dtype: TokenDtype = "uint16") -> None:
    """Write token ids as a raw ``.bin`` file that :class:`TextDataModule` memory-maps."""
    array = np.asarray(tokens.numpy() if isinstance(tokens, torch.Tensor) else tokens)
    if array.size and (array.min() < 0 or array.max() >= np.iinfo(dtype).max + 1):
        raise ValueError(f"token ids span {array.min()}..{array.max()}, which {dtype} cannot hold; use dtype='uint32'")
    array.astype(dtype).tofile(path)


# -- windows, sampler, loader ----------------------------------------------------------------------
IGNORE_INDEX = -100  # the loss skips targets holding this (see models.loss.chunked_cross_entropy)


def document_position_ids(tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """int64 position of each token within its document; 0 on the first token and after every ``eos_id``.

    The EOS token closes its own document (it takes that document's next position). Vectorized over the
    given tokens only: a 512k-token window costs a few array passes, whatever the size of the file.
    """
    after_eos = np.flatnonzero(tokens[:-1] == eos_id) + 1
    starts = np.zeros(len(tokens), dtype=np.int64)
    starts[after_eos] = after_eos
    np.maximum.accumulate(starts, out=starts)  # each token's latest document start
    return np.arange(len(tokens), dtype=np.int64) - starts


class PackedWindows(Dataset):
    """Windows ``start..stop`` of ``seq_len + 1`` tokens over one or more token streams (never across two).

    Items are ``(inputs, targets)``; with ``document_positions`` they are ``(inputs, targets, position_ids)``
    as described in :class:`TextDataModule` (``eos_id`` then says where documents end).
    """

    def __init__(
        self,
        streams: list[Any],
        seq_len: int,
        start: int = 0,
        stop: int | None = None,
        document_positions: bool = False,
        eos_id: int | None = None,
    ) -> None:
        if document_positions and eos_id is None:
            raise ValueError("PackedWindows(document_positions=True) needs eos_id=, the token ending each document")
        self.streams, self.seq_len = streams, seq_len
        self.document_positions, self.eos_id = document_positions, eos_id
        self.offsets = np.cumsum([0] + [max(0, (len(s) - 1) // seq_len) for s in streams]).tolist()
        self.start, self.stop = start, self.offsets[-1] if stop is None else stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        g = self.start + i
        s = bisect.bisect_right(self.offsets, g) - 1
        begin = (g - self.offsets[s]) * self.seq_len
        window = np.asarray(self.streams[s][begin : begin + self.seq_len + 1], dtype=np.int64)
        if self.document_positions:
            return self._with_positions(window)
        window = torch.from_numpy(window)
        return window[:-1], window[1:]

    def _with_positions(self, window: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        inputs = window[:-1]
        # A copy: inputs and targets share the window, and only the targets are masked.
        targets = window[1:].copy()
        targets[inputs == self.eos_id] = IGNORE_INDEX  # the next document's first token is unpredictable
        positions = document_position_ids(inputs, self.eos_id)
        return torch.from_numpy(inputs), torch.from_numpy(targets), torch.from_numpy(positions)


class ResumableSampler(DistributedSampler):
    """This rank's indices of a per-epoch seeded order; after a resume, the first pass skips what was already seen.

    With W ranks (``num_replicas``) the epoch's order is cut to a multiple of W and rank r takes every W-th index
    of it from position r, so every rank runs as many batches (the engine's ranks run each forward in lockstep).
    With one rank that is the whole order. ``skip`` counts positions of the whole order (all ranks together), so a
    position saved with W ranks resumes with any number of ranks that divides it. It is a ``DistributedSampler``
    so that Lightning keeps it: the sampler Lightning would put in its place knows nothing of the resume offset.
    """

    def __init__(self, num_samples: int, shuffle: bool, seed: int, num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__(range(num_samples), num_replicas, rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.windows = num_samples  # (the base class's num_samples is this rank's count)
        self.epoch = 0
        self.skip = 0  # positions of the whole order to skip at the start of the next pass (set by a resume)

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning at each epoch start; a resume offset only holds for its own epoch."""
        if epoch != self.epoch:
            self.skip = 0
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            order = torch.randperm(self.windows, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        else:
            order = torch.arange(self.windows)
        skip, self.skip = self.skip, 0
        return iter(order[skip : self.total_size][self.rank :: self.num_replicas].tolist())

    def __len__(self) -> int:
        return self.num_samples


class ResumableLoader(DataLoader):
    """A DataLoader whose position within the epoch survives a checkpoint.

    The count is kept where the training loop takes batches (not in the sampler), so batches that loader
    workers prefetched but the loop never used are not counted as seen. The state names the batches one rank
    took and the number of ranks (every rank takes as many), so it resumes with another number of ranks when
    the samples seen split into whole batches among them.
    """

    def __init__(self, dataset: Dataset, batch_size: int, sampler: ResumableSampler, **kwargs: Any) -> None:
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, drop_last=True, **kwargs)
        self.batches_taken = 0

    def __iter__(self) -> Iterator[Any]:
        self.batches_taken = self.sampler.skip // (self.batch_size * self.sampler.num_replicas)
        for batch in super().__iter__():
            self.batches_taken += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.sampler.epoch,
            "batches": self.batches_taken,
            "batch_size": self.batch_size,
            "num_samples": self.sampler.windows,
            "ranks": self.sampler.num_replicas,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        mine = (self.batch_size, self.sampler.windows)
        if (state["batch_size"], state["num_samples"]) != mine:
            raise ValueError(
                f"the checkpoint's data position is for batch_size={state['batch_size']} over {state['num_samples']} "
                f"windows, but the data now has batch_size={mine[0]} over {mine[1]}: resume with the same data, "
                "seq_len and batch_size"
            )
        seen, ranks = state["batches"] * self.batch_size * state.get("ranks", 1), self.sampler.num_replicas
        if seen % (self.batch_size * ranks):
            raise ValueError(
                f"the checkpoint stopped after {seen} samples of its epoch ({state.get('ranks', 1)} ranks), which "
                f"do not split into whole batches of {self.batch_size} over {ranks} ranks: resume with "
                f"{state.get('ranks', 1)} ranks (or a number of ranks that divides {seen // self.batch_size} batches)"
            )
        self.sampler.epoch, self.sampler.skip = state["epoch"], seen


def id_range(stream: Any) -> tuple[int, int]:
    """A token stream's smallest and largest id (a token file's is read once and kept)."""
    if isinstance(stream, TokenFile):
        return stream.id_range()
    return (int(stream.min()), int(stream.max())) if len(stream) else (0, 0)


def model_limits(module: Any) -> tuple[int | None, int | None]:
    """The vocabulary size and the positions (``max_position_embeddings``) of the model a LightningModule
    trains, from the config of the module or of one of its direct children (a Hugging Face model's, this
    project's Llama's); None for what no config says."""
    owners = [module, *module.children()] if isinstance(module, torch.nn.Module) else [module]
    for owner in owners:
        config = getattr(owner, "config", None)
        if getattr(config, "vocab_size", None) is not None:
            return config.vocab_size, getattr(config, "max_position_embeddings", None)
    return None, None


def _val_windows(total: int, fraction: float) -> int:
    """Windows kept for validation: at least one when asked for any, never all of them."""
    if fraction == 0 or total < 2:
        return 0
    return min(total - 1, max(1, round(total * fraction)))


# -- the data module -------------------------------------------------------------------------------
def check_data_args(
    seq_len: Any = 2048, batch_size: Any = 1, val_fraction: Any = 0.01, num_workers: Any = 0, eos_token_id: Any = None
) -> None:
    """The data module's numbers, each refused out of range naming the value and the valid range (the sweep
    driver checks a sweep's data section with them too, without its paths, which trials read on their nodes)."""
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"data {name}={value!r} must be an integer >= 1")
    if not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
        raise ValueError(f"data val_fraction={val_fraction!r} must be in [0, 1)")
    if not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"data num_workers={num_workers!r} must be an integer >= 0 (0: load in the training process)")
    if eos_token_id is not None and (not isinstance(eos_token_id, int) or eos_token_id < 0):
        raise ValueError(f"data eos_token_id={eos_token_id!r} must be a token id (>= 0), or null for the tokenizer's")


def _builtin_documents(name: str) -> list[str]:
    from megatrain_lightning.lightning.demo import python_docs

    corpora = {"python-docs": python_docs}
    if name not in corpora:
        available = ", ".join(BUILTIN + k for k in corpora)
        raise ValueError(f"unknown built-in corpus {BUILTIN}{name}; available: {available}")
    return corpora[name]()


class TextDataModule(L.LightningDataModule):
    """Packed next-token windows from local text, JSONL or token files, with a validation split.

    Args:
        path: a file or directory of .txt/.md, .jsonl, or .bin/.npy token files, or builtin:python-docs.
        seq_len: tokens per training sequence (windows hold seq_len + 1 tokens).
        batch_size: sequences per micro-batch.
        format: file format; auto tells it from the file extensions.
        tokenizer: a Hugging Face tokenizer.json (or a checkpoint directory holding one); None: UTF-8 bytes.
        eos_token_id: end-of-text token put between documents; None: the tokenizer's (byte 0 for bytes).
        token_dtype: element type of raw .bin token files.
        text_field: the JSONL field holding each document's text.
        val_path: separate validation data (same formats); None: split val_fraction off the end of path.
        val_fraction: share of windows, taken from the end, kept for validation when val_path is None.
        shuffle: visit training windows in a seeded random order, new each epoch.
        seed: seed of that order.
        num_workers: DataLoader worker processes.
        document_positions: items become ``(inputs, targets, position_ids)`` for training on packed documents
            without letting them see each other (long-context training): see below.

    With ``document_positions`` the int64 ``position_ids`` restart at 0 on the token after each end-of-text
    token (which itself ends its document, so it takes that document's next position), and the target of
    every end-of-text input (the first token of the next, unrelated document) is -100, which the loss
    ignores. A window always starts at position 0, also when it starts inside a document: the window cannot
    attend to that document's earlier tokens anyway, and it is what Hugging Face's packed-sequence
    (flash-attention) path does. Positions are computed over the window alone, so token files stay
    memory-mapped at any ``seq_len``. Keeping documents apart in attention is the model's part: it reads a
    position that restarts as a document start. Off (the default), items are ``(inputs, targets)`` and
    positions are left to the model (0..seq_len-1).
    """

    def __init__(
        self,
        path: str,
        seq_len: int = 2048,
        batch_size: int = 1,
        format: Format = "auto",
        tokenizer: str | None = None,
        eos_token_id: int | None = None,
        token_dtype: TokenDtype = "uint16",
        text_field: str = "text",
        val_path: str | None = None,
        val_fraction: float = 0.01,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        document_positions: bool = False,
    ) -> None:
        super().__init__()
        check_data_args(seq_len, batch_size, val_fraction, num_workers, eos_token_id)
        expected = "a file or directory of .txt/.md, .jsonl or .bin/.npy token files (or builtin:python-docs)"
        for p in (path, val_path):
            if p is not None:
                check_exists(p, expected)
        self.save_hyperparameters()
        self.format = "text" if path.startswith(BUILTIN) else _files(path, format)[1]
        self.tokenizer = HFTokenizer(tokenizer, eos_token_id) if tokenizer else ByteTokenizer(eos_token_id)
        if self.format != "tokens" and self.tokenizer.eos_id >= self.tokenizer.vocab_size:
            raise ValueError(
                f"data eos_token_id={self.tokenizer.eos_id} is not a token of the tokenizer (ids 0.."
                f"{self.tokenizer.vocab_size - 1}); leave it null for the tokenizer's own end-of-text token"
            )
        if document_positions:
            self._check_document_eos()
        self.train_set: PackedWindows | None = None
        self.val_set: PackedWindows | None = None

    def _check_document_eos(self) -> None:
        """Refuse to guess where the documents of token files end: byte 0 is right only for byte tokens."""
        hp = self.hparams
        formats = {self.format}  # the training files' format, found once in __init__
        if hp.val_path is not None and not hp.val_path.startswith(BUILTIN):
            formats.add(_files(hp.val_path, hp.format)[1])
        if "tokens" in formats and hp.tokenizer is None and hp.eos_token_id is None:
            raise ValueError(
                f"data document_positions=true reads the token files of {hp.path!r} but cannot tell their "
                "end-of-text id: set data eos_token_id= (e.g. 128001 for Llama 3, 151643 for Qwen2.5; 0 for byte "
                "tokens) or tokenizer= the tokenizer that wrote them"
            )

    @property
    def vocab_size(self) -> int | None:
        """Token ids the data can hold; None for token files read without a tokenizer (unknown)."""
        if self.format == "tokens" and self.hparams.tokenizer is None:
            return None
        return self.tokenizer.vocab_size

    def streams(self, path: str) -> list[Any]:
        """The token streams of `path`: memory-mapped token files, or tokenized and packed documents."""
        hp = self.hparams
        if path.startswith(BUILTIN):
            docs, fmt = _builtin_documents(path[len(BUILTIN) :]), "text"
        else:
            files, fmt = _files(path, hp.format)
            if fmt == "tokens":
                return [TokenFile(f, hp.token_dtype) for f in files]
            docs = list(_documents(files, fmt, hp.text_field))
        return [pack(self.tokenizer.encode(docs), self.tokenizer.eos_id, self.tokenizer.vocab_size)]

    def setup(self, stage: str | None = None) -> None:
        """Read the data (once), then, once a Trainer has brought the model, check the data against it."""
        self._read()
        module = self.trainer.lightning_module if self.trainer is not None else None
        if module is not None:
            self.check_model(*model_limits(module))

    def check_model(self, vocab_size: int | None, max_positions: int | None) -> None:
        """Refuse data the model cannot read, in one line: windows longer than its positions, or a token id
        outside its vocabulary (each file's smallest and largest id, read once; never per batch)."""
        hp = self.hparams
        if max_positions is not None and hp.seq_len > max_positions:
            raise ValueError(
                f"data seq_len={hp.seq_len} is above the model's max_position_embeddings={max_positions}: give a "
                f"seq_len from 1 to {max_positions}, or a model with more positions"
            )
        if vocab_size is None or self.train_set is None:
            return
        sources = [(self.train_set, hp.path), (self.val_set, hp.val_path or hp.path)]
        for stream, path in {id(s): (s, p) for data, p in sources if data is not None for s in data.streams}.values():
            lo, hi = id_range(stream)
            if lo < 0 or hi >= vocab_size:
                raise ValueError(
                    f"{getattr(stream, 'path', path)} holds token id {lo if lo < 0 else hi}, outside the model's "
                    f"vocabulary of {vocab_size} ids (0..{vocab_size - 1}): tokenize the data with the model's "
                    "tokenizer (for .bin files, token_dtype= must be the type they were written with)"
                )

    def _read(self) -> None:
        if self.train_set is not None:
            return
        hp = self.hparams
        windows = {"document_positions": hp.document_positions, "eos_id": self.tokenizer.eos_id}
        data = PackedWindows(self.streams(hp.path), hp.seq_len, **windows)
        if hp.val_path is not None:
            self.train_set, self.val_set = data, PackedWindows(self.streams(hp.val_path), hp.seq_len, **windows)
        else:
            cut = len(data) - _val_windows(len(data), hp.val_fraction)
            self.train_set = PackedWindows(data.streams, hp.seq_len, 0, cut, **windows)
            self.val_set = PackedWindows(data.streams, hp.seq_len, cut, **windows)
        if len(self.train_set) < hp.batch_size:
            raise ValueError(
                f"{hp.path!r} gives {len(self.train_set)} training windows of seq_len+1={hp.seq_len + 1} tokens, "
                f"fewer than one batch of {hp.batch_size}: add data or lower seq_len/batch_size"
            )

    def train_dataloader(self) -> ResumableLoader:
        hp = self.hparams
        trainer = self.trainer  # ranks of a data-parallel run share the windows (none attached: one rank)
        ranks, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        sampler = ResumableSampler(len(self.train_set), hp.shuffle, hp.seed, ranks, rank)
        return ResumableLoader(
            self.train_set, hp.batch_size, sampler, num_workers=hp.num_workers, pin_memory=torch.cuda.is_available()
        )

    def val_dataloader(self) -> DataLoader | list:
        if not self.val_set:
            return []  # no validation data: Lightning skips validation
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, num_workers=self.hparams.num_workers)
