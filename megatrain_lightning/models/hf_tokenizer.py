"""Write a run's tokenizer beside its Hugging Face export, so that ``AutoTokenizer.from_pretrained(dir)``
reads the very tokenizer the model was trained with, without ``transformers`` or ``tokenizers`` here.

Byte tokens (the data module's default) become a ``tokenizers`` byte-level BPE with no merges: each UTF-8
byte of the text is one token whose id is the byte's value, as :class:`~megatrain_lightning.lightning.data.ByteTokenizer`
encodes; decoding joins the bytes and reads them as UTF-8, invalid sequences replaced, as it decodes. The
end-of-text byte is a special token, so ``generate`` stops on it and ``skip_special_tokens`` drops it.

A Hugging Face ``tokenizer.json`` is copied with the files that configure it where they lie beside it
(special tokens, chat template), so the export carries what the run read.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
# Files beside a tokenizer.json that configure it for transformers, copied with it when present.
_COMPANIONS = (TOKENIZER_CONFIG, "special_tokens_map.json", "added_tokens.json", "chat_template.jinja")
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}


def byte_level_chars() -> list[str]:
    """The character byte-level BPE shows for each byte value: printable Latin-1 bytes are themselves, the
    others (controls, space, soft hyphen) are moved to U+0100 onwards, in byte order, so that no token
    string holds whitespace or control characters. ``tokenizers``' ByteLevel pre-tokenizer and decoder use
    this very table, which is why the vocabulary must be written in it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, moved = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + moved))
            moved += 1
    return chars


def byte_tokenizer_json(eos_id: int) -> dict:
    """``tokenizer.json`` of byte tokens with `eos_id` as end of text. An ASCII end-of-text byte is the
    special token of its own character: it is matched in the raw text before the byte-level split (a NUL
    in text encodes as `eos_id`, as with the project's tokenizer) and, not being in the byte-level table,
    decodes to itself. A byte >= 128 cannot stand alone in UTF-8 text, so it stays an ordinary byte."""
    chars = byte_level_chars()
    added = []
    if eos_id < 128:
        chars[eos_id] = chr(eos_id)
        added.append(
            {"id": eos_id, "content": chr(eos_id), "single_word": False, "lstrip": False, "rstrip": False}
            | {"normalized": False, "special": True}
        )
    model = {
        "type": "BPE",
        "dropout": None,
        "unk_token": None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        "byte_fallback": False,
        "ignore_merges": False,
        "vocab": {c: i for i, c in enumerate(chars)},
        "merges": [],  # no merges: every byte stays its own token
    }
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": _BYTE_LEVEL,
        "post_processor": None,
        "decoder": _BYTE_LEVEL,
        "model": model,
    }


def save_byte_tokenizer(directory: str | os.PathLike, eos_id: int, max_length: int | None = None) -> None:
    """Write byte tokens (ids 0..255, `eos_id` ends a document) as ``tokenizer.json`` +
    ``tokenizer_config.json`` into `directory`, for ``AutoTokenizer``."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        # transformers' default clean-up rewrites " ." and " n't"; bytes decode exactly as they are.
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
    }
    if eos_id < 128:
        config["eos_token"] = chr(eos_id)
    if max_length is not None:
        config["model_max_length"] = max_length
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _write_json(byte_tokenizer_json(eos_id), directory / TOKENIZER_FILE)
    _write_json(config, directory / TOKENIZER_CONFIG)


def copy_tokenizer(source: str | os.PathLike, directory: str | os.PathLike, eos_token: str | None = None) -> None:
    """Copy the Hugging Face ``tokenizer.json`` `source` and the files that configure it beside it into
    `directory`; without a ``tokenizer_config.json`` there, write one naming `eos_token`."""
    source, directory = Path(source), Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _copy(source, directory / TOKENIZER_FILE)
    for name in _COMPANIONS:
        if (source.parent / name).is_file():
            _copy(source.parent / name, directory / name)
    if not (source.parent / TOKENIZER_CONFIG).is_file():
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
        _write_json(config | ({"eos_token": eos_token} if eos_token is not None else {}), directory / TOKENIZER_CONFIG)


def _write_json(obj: dict, final: Path) -> None:
    tmp = final.with_name(f".{final.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
    os.replace(tmp, final)  # a reader never sees half a file


def _copy(source: Path, final: Path) -> None:
    if source.resolve() == final.resolve():
        return  # exporting into the directory the tokenizer came from
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.copyfile(source, tmp)
    os.replace(tmp, final)
