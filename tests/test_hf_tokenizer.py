"""The run's tokenizer in the Hugging Face format: transformers' AutoTokenizer reads it back and encodes and
decodes exactly as the project's own tokenizer does."""

from __future__ import annotations

import json

import pytest

from megatrain_lightning.lightning.data import ByteTokenizer, HFTokenizer, tokenizer_of
from megatrain_lightning.models.hf_tokenizer import byte_level_chars

transformers = pytest.importorskip("transformers")

SAMPLES = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, tabs\tand\nnew lines\r\n",
    "héllo wörld — ñ, 日本語, Ελληνικά, emoji 🙂👍🏽",
    "a\x00b",  # the end-of-text byte inside text
    "<|endoftext|> </s> Ā Ċ",  # other tokenizers' specials and byte-level's own characters, as plain text
    "don't , . ? !",  # what transformers' clean-up of spaces would rewrite
    "",
]


def test_byte_level_table_is_a_permutation_of_256_printable_characters():
    chars = byte_level_chars()
    assert len(set(chars)) == 256
    assert chars[ord("A")] == "A" and chars[ord(" ")] == "Ġ" and chars[0] == "Ā" and chars[ord("\n")] == "Ċ"
    assert all(c.isprintable() and not c.isspace() for c in chars)


@pytest.mark.parametrize("eos", [0, 10])
def test_bytes_round_trip_through_auto_tokenizer(tmp_path, eos):
    ours = ByteTokenizer(eos)
    ours.save_pretrained(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert len(theirs) == 256 and theirs.eos_token_id == eos
    for text in SAMPLES:
        ids = theirs(text)["input_ids"]
        assert ids == ours.encode([text])[0].tolist() == list(text.encode("utf-8")), text
        assert theirs.decode(ids) == ours.decode(ids) == text
    invalid = [0xE6, 0x97, 65, 0xFF, 66]  # a truncated character and a byte no UTF-8 text holds
    assert theirs.decode(invalid) == ours.decode(invalid) == "\ufffdA\ufffdB"
    assert theirs.decode([72, 105, eos], skip_special_tokens=True) == "Hi"  # generate's output, end dropped


def test_an_hf_tokenizer_is_copied_with_what_configures_it(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    source = tmp_path / "source"
    source.mkdir()
    vocab = {"<unk>": 0, "</s>": 1, "hello": 2, "world": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(source / "tokenizer.json"))
    HFTokenizer(str(source)).save_pretrained(tmp_path / "out")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert theirs("hello world")["input_ids"] == [2, 3] and theirs.eos_token == "</s>"
    (source / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "model_max_length": 77}))
    HFTokenizer(str(source)).save_pretrained(tmp_path / "out2")
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out2").model_max_length == 77


def test_a_runs_tokenizer_is_found_from_its_data_modules_hyper_parameters(tmp_path):
    base = {"format": "auto", "tokenizer": None, "eos_token_id": None}
    assert isinstance(tokenizer_of({**base, "path": "builtin:python-docs"}), ByteTokenizer)
    assert tokenizer_of({**base, "path": str(tmp_path / "gone.txt"), "eos_token_id": 3}).eos_id == 3
    assert tokenizer_of({**base, "path": str(tmp_path / "tokens.bin")}) is None  # ids of an unknown tokenizer
    assert tokenizer_of({"batch_size": 4}) is None  # not a TextDataModule's
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        tokenizer_of({**base, "path": "builtin:python-docs", "tokenizer": str(tmp_path / "gone")})
