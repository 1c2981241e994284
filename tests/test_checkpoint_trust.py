"""A checkpoint from anywhere is safe to open: nothing stored is unpickled unrestricted, every damage is one
line naming the file and the intact earlier checkpoints, and storage_options carry credentials unwritten."""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
import time
import zlib
from fractions import Fraction
from pathlib import Path

import fsspec
import pytest
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping

from megatrain_lightning import Engine, EngineConfig, MegatrainStrategy, load_from_checkpoint
from megatrain_lightning.checkpoint import CheckpointError, ModelCheckpoint, store, trust, versions
from megatrain_lightning.cli.main import run
from megatrain_lightning.lightning.data import TextDataModule
from megatrain_lightning.lightning.module import CausalLMModule
from megatrain_lightning.models import LlamaConfig, LlamaForCausalLM
from ray_jobs.trial import run_trial
from tests.helpers import quiet, trainer

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=64, loss_chunk_size=32)
MODEL = {"model": "tiny", "overrides": TINY, "max_steps": 8}
DATA = {"path": "builtin:python-docs", "seq_len": 16, "batch_size": 2}
STEP1, STEP2 = "epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """Checkpoints after steps 1 and 2 of one tiny CausalLMModule fit with ModelCheckpoint, EarlyStopping and
    its LR scheduler (and the strategy's RNG state), written once for the whole file."""
    root = tmp_path_factory.mktemp("source")
    torch.manual_seed(0)
    callbacks = [
        ModelCheckpoint(dirpath=str(root), save_top_k=-1, every_n_train_steps=1),
        EarlyStopping(monitor="train_loss", check_on_train_epoch_end=True),
    ]
    with quiet():
        trainer(max_steps=2, callbacks=callbacks, enable_checkpointing=True, limit_val_batches=0).fit(
            CausalLMModule(**MODEL), TextDataModule(**DATA)
        )
    return root


# -- editing a copied checkpoint as an attacker or a failing disk would ------------------------------------
def copy_to(source: Path, name: str, dest: Path, as_name: str | None = None) -> Path:
    """Copy the checkpoint `name` (marker and data) into `dest`, as `as_name` if given."""
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / (as_name or name)
    shutil.copy(source / name, target)
    shutil.copytree(source / f"{name}.d", f"{target}.d")
    return target


def vdir(marker: Path) -> Path:
    (version,) = list(Path(f"{marker}.d").iterdir())
    return version


def set_index(marker: Path, index: dict | bytes) -> None:
    """Write index.json and re-seal the marker with its checksum (what a deliberate editor would do)."""
    raw = index if isinstance(index, bytes) else json.dumps(index).encode()
    (vdir(marker) / "index.json").write_bytes(raw)
    pointer = store.parse_marker(marker.read_bytes())
    marker.write_bytes(store.marker_bytes({**pointer, "index_crc32": zlib.crc32(raw)}))


def index_of(marker: Path) -> dict:
    return json.loads((vdir(marker) / "index.json").read_bytes())


def reseal(marker: Path, name: str) -> None:
    """Record the file's present size and checksum in the index, and the index's in the marker."""
    raw = (vdir(marker) / name).read_bytes()
    index = index_of(marker)
    records = {"trainer.pt": index["trainer"], "buffers.safetensors": index["buffers"]}
    records.update({u["file"]: u for u in index["units"]})
    records[name].update(bytes=len(raw), crc32=zlib.crc32(raw))
    set_index(marker, index)


class Plant:
    """Unpickling this creates the directory `sentinel`: proof that stored bytes ran code."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = str(sentinel)

    def __reduce__(self):
        return (os.makedirs, (self.sentinel,))


def plant(marker: Path, target: str, sentinel: Path) -> None:
    """Replace `target` ("marker", "index.json", "units", "buffers.safetensors", "trainer.pt") with a pickle
    that runs code; every checksum that guards it is recomputed, so only what reads it stands in the way."""
    evil = pickle.dumps({"state": Plant(sentinel)})
    if target == "marker":
        marker.write_bytes(evil)
    elif target == "index.json":
        set_index(marker, evil)
    elif target == "trainer.pt":
        raw = Path(vdir(marker) / "trainer.pt")
        torch.save({"epoch": 0, "hyper_parameters": {"x": Plant(sentinel)}}, raw)
        reseal(marker, "trainer.pt")
    else:
        files = [u["file"] for u in index_of(marker)["units"]] if target == "units" else [target]
        for name in files:
            (vdir(marker) / name).write_bytes(evil)
            reseal(marker, name)


def test_the_planted_pickle_runs_code_when_unpickled_plainly(tmp_path):
    """The attack below is real: an ordinary unpickler would create the sentinel."""
    pickle.loads(pickle.dumps(Plant(tmp_path / "ran")))
    assert (tmp_path / "ran").is_dir()


# -- every way a checkpoint is opened -----------------------------------------------------------------------
CLI_ARGS = (
    "--data.path=builtin:python-docs --data.seq_len=16 --data.batch_size=2 --trainer.max_steps=3 "
    "--trainer.accelerator=cpu --trainer.logger=false --trainer.enable_progress_bar=false "
    "--trainer.enable_checkpointing=false --trainer.enable_model_summary=false --trainer.num_sanity_val_steps=0 "
    "--trainer.limit_val_batches=1"
).split()


def raised(fn) -> str:
    with pytest.raises(CheckpointError) as err, quiet():
        fn()
    return str(err.value)


def exited(argv: list[str], capsys) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as err, quiet():
        run(argv)
    assert err.value.code == 2
    return capsys.readouterr().err


def by_fit(url: str, tmp: Path, capsys) -> str:
    return raised(lambda: trainer(max_steps=3).fit(CausalLMModule(**MODEL), TextDataModule(**DATA), ckpt_path=url))


def by_validate(url: str, tmp: Path, capsys) -> str:
    return raised(lambda: trainer().validate(CausalLMModule(**MODEL), TextDataModule(**DATA), ckpt_path=url))


def by_cli(sub: str):
    def go(url: str, tmp: Path, capsys) -> str:
        return exited([sub, f"--ckpt_path={url}", f"--trainer.default_root_dir={tmp / 'cli'}", *CLI_ARGS], capsys)

    go.__name__ = f"cli_{sub}"
    return go


def by_convert_torch(url: str, tmp: Path, capsys) -> str:
    return exited(["convert", url, "--to", "torch", str(tmp / "out.ckpt")], capsys)


def by_convert_hf(url: str, tmp: Path, capsys) -> str:
    return exited(["convert", url, "--to", "hf", str(tmp / "hf")], capsys)


def by_load_from_checkpoint(url: str, tmp: Path, capsys) -> str:
    return raised(lambda: load_from_checkpoint(CausalLMModule, url))


def by_trial(url: str, tmp: Path, capsys) -> str:
    """The sweep's trial resuming from its own last.ckpt (run_trial, without Ray)."""
    trial = tmp / "trial"
    copy_to(Path(url).parent, Path(url).name, trial / "checkpoints")
    settings = {"max_steps": 3, "accelerator": "cpu", "limit_val_batches": 1, "num_sanity_val_steps": 0}
    return raised(lambda: run_trial({"model": MODEL, "data": DATA, "trainer": settings}, str(trial), 100))


PATHS = [
    by_fit,
    by_validate,
    by_cli("fit"),
    by_cli("validate"),
    by_convert_torch,
    by_convert_hf,
    by_load_from_checkpoint,
    by_trial,
]
PLANTED = {  # the file each planted pickle is in: what the message must name
    "marker": "last.ckpt: its commit marker is damaged",
    "index.json": "index.json is not JSON",
    "units": "units/00000.safetensors",
    "buffers.safetensors": "buffers.safetensors",
    "trainer.pt": "trainer.pt: the trainer state needs os.makedirs",
}


def one_line(message: str) -> str:
    lines = message.strip().splitlines()
    assert len(lines) == 1, message
    return lines[0]


# Every path meets every planted file; `megatrain validate` (a second LightningCLI, 1-2 s each) only the two
# files read at different moments (the trainer state before anything is built, the shards while restoring),
# and `convert --to hf` also without the index's export entry (it then reads the hyper-parameters).
CASES = [(path, target, True) for path in PATHS for target in PLANTED if path.__name__ != "cli_validate"]
CASES += [(PATHS[3], target, True) for target in ("trainer.pt", "units")]
CASES += [(by_convert_hf, target, False) for target in PLANTED]


@pytest.mark.parametrize(
    "path, target, export", CASES, ids=[f"{p.__name__}-{t}{'' if e else '-no_export'}" for p, t, e in CASES]
)
def test_a_planted_pickle_never_runs(source, tmp_path, capsys, path, target, export):
    marker = copy_to(source, STEP2, tmp_path / "ckpts", "last.ckpt")
    if not export:
        set_index(marker, {k: v for k, v in index_of(marker).items() if k != "export"})
    sentinel = tmp_path / "PWNED"
    plant(marker, target, sentinel)
    # (`convert --to hf` reads the trainer state even with the index's export entry: the run's tokenizer is
    # named in its data module's hyper-parameters)
    line = one_line(path(str(marker), tmp_path, capsys))
    assert PLANTED[target] in line
    assert not sentinel.exists()


# -- every damage explained ---------------------------------------------------------------------------------
def truncate(path: Path, size: int) -> None:
    path.write_bytes(path.read_bytes()[:size])


def flip(path: Path, at: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0xFF
    path.write_bytes(bytes(raw))


def overwrite(path: Path, at: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[at : at + len(data)] = data
    path.write_bytes(bytes(raw))


SHARD = "units/00000.safetensors"


def shard(m: Path) -> Path:
    return vdir(m) / SHARD


def other_format(m: Path) -> None:
    m.write_bytes(store.marker_bytes({**store.parse_marker(m.read_bytes()), "format": "other-ckpt", "version": 7}))


def missing_version(m: Path) -> None:
    m.write_bytes(store.marker_bytes({**store.parse_marker(m.read_bytes()), "data": "v0-deadbeef"}))


def refused_class(m: Path) -> None:
    """A trainer state holding a class that is not allowed (the checksums made to match)."""
    state = torch.load(vdir(m) / "trainer.pt", weights_only=True)
    torch.save({**state, "extra": Fraction(1, 3)}, vdir(m) / "trainer.pt")
    reseal(m, "trainer.pt")


def lacking_units(m: Path) -> None:
    set_index(m, {k: v for k, v in index_of(m).items() if k != "units"})


def garbage_trainer(m: Path) -> None:
    (vdir(m) / "trainer.pt").write_bytes(b"not a torch file" * 8)
    reseal(m, "trainer.pt")


DAMAGE = {  # kind: (damage the newer checkpoint, what the message says, the file it names)
    "shard header damaged": (lambda m: overwrite(shard(m), 8, b"\xff" * 16), "header is damaged", SHARD),
    "shard header truncated": (
        lambda m: truncate(shard(m), 40),
        "ends inside its .*header: the file is truncated",
        SHARD,
    ),
    "shard length truncated": (lambda m: truncate(shard(m), 5), "shorter than a safetensors header", SHARD),
    "shard data truncated": (lambda m: truncate(shard(m), shard(m).stat().st_size - 9), "ends early", SHARD),
    "shard missing": (lambda m: shard(m).unlink(), "is missing", SHARD),
    "shard byte flipped": (lambda m: flip(shard(m), -3), "checksum .* the file is damaged", SHARD),
    "shard length field": (lambda m: overwrite(shard(m), 0, b"\xff" * 8), "claim a .*header", SHARD),
    "buffers missing": (lambda m: (vdir(m) / "buffers.safetensors").unlink(), "is missing", "buffers.safetensors"),
    "buffers damaged": (
        lambda m: overwrite(vdir(m) / "buffers.safetensors", 8, b"\x00" * 8),
        "header is damaged",
        "buffers.safetensors",
    ),
    "trainer missing": (lambda m: (vdir(m) / "trainer.pt").unlink(), "the trainer state, is missing", "trainer.pt"),
    "trainer truncated": (lambda m: truncate(vdir(m) / "trainer.pt", 300), "truncated or altered", "trainer.pt"),
    "trainer byte flipped": (lambda m: flip(vdir(m) / "trainer.pt", 700), "truncated or altered", "trainer.pt"),
    "trainer garbage": (garbage_trainer, "is not a readable torch.save file", "trainer.pt"),
    "trainer refused class": (refused_class, r"needs fractions\.Fraction.*add_safe_globals", "trainer.pt"),
    "marker garbage": (lambda m: m.write_bytes(b"\x00garbage" * 9), "commit marker is damaged", STEP2),
    "marker truncated": (lambda m: truncate(m, 120), r"commit marker is damaged \(.*truncated", STEP2),
    "marker frame truncated": (lambda m: truncate(m, len(m.read_bytes()) - 2), "truncated or altered", STEP2),
    "marker empty": (lambda m: m.write_bytes(b""), "commit marker is empty", STEP2),
    "marker missing": (lambda m: m.unlink(), "commit marker is missing .*never committed", STEP2),
    "marker names a missing version": (missing_version, "names version v0-deadbeef", STEP2),
    "marker of another format": (other_format, "unsupported checkpoint format other-ckpt v7", STEP2),
    "index missing": (lambda m: (vdir(m) / "index.json").unlink(), "the index .* is missing", "index.json"),
    "index garbage": (lambda m: (vdir(m) / "index.json").write_bytes(b"\x89\xff"), "does not match", "index.json"),
    "index garbage resealed": (lambda m: set_index(m, b"\x89\xff{"), "is not JSON", "index.json"),
    "index edited": (lambda m: overwrite(vdir(m) / "index.json", 20, b"9"), "does not match", "index.json"),
    "index lacks keys": (lacking_units, "lacks key 'units'", "index.json"),
    "data directory missing": (lambda m: shutil.rmtree(f"{m}.d"), "data directory, is missing", f"{STEP2}.d"),
}


@pytest.fixture
def two(source, tmp_path) -> Path:
    """Both checkpoints copied; returns the newer's marker."""
    copy_to(source, STEP1, tmp_path / "ckpts")
    return copy_to(source, STEP2, tmp_path / "ckpts")


def assert_explained(line: str, says: str, names: str, intact: str = STEP1) -> None:
    assert re.search(says, line), line
    assert names in line
    assert line.rsplit("; intact earlier checkpoints in ", 1)[1].endswith(f"ckpts: {intact}"), line


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_every_damage_is_one_line_naming_the_file_and_the_intact_checkpoints(kind, two, tmp_path, capsys):
    damage, says, names = DAMAGE[kind]
    damage(two)
    assert_explained(one_line(by_load_from_checkpoint(str(two), tmp_path, capsys)), says, names)
    line = one_line(by_convert_torch(str(two), tmp_path, capsys))
    assert line.startswith("megatrain convert: error: ")
    assert_explained(line, says, names)
    assert not (tmp_path / "out.ckpt").exists()


@pytest.mark.parametrize("kind", ["shard byte flipped", "marker garbage", "marker missing"])
def test_damage_through_trainer_fit_and_the_cli(kind, two, tmp_path, capsys):
    damage, says, names = DAMAGE[kind]
    damage(two)
    assert_explained(one_line(by_fit(str(two), tmp_path, capsys)), says, names)
    line = one_line(by_cli("fit")(str(two), tmp_path, capsys))
    assert line.startswith("megatrain: error: ")
    assert_explained(line, says, names)


def test_the_earliest_checkpoint_damaged_has_none_intact_before_it(source, tmp_path, capsys):
    first = copy_to(source, STEP1, tmp_path / "ckpts")
    copy_to(source, STEP2, tmp_path / "ckpts")
    flip(vdir(first) / SHARD, -1)
    assert_explained(one_line(by_load_from_checkpoint(str(first), tmp_path, capsys)), "checksum", SHARD, "none")


@pytest.mark.parametrize(
    "kind, model",
    [
        ("another shape", {**MODEL, "overrides": {**TINY, "intermediate_size": 96}}),
        ("another number of units", {**MODEL, "overrides": {**TINY, "num_hidden_layers": 3}}),
        ("other parameter names", MODEL),
    ],
)
def test_a_checkpoint_of_another_model_is_one_line(kind, model, two, tmp_path):
    if kind == "other parameter names":
        index = index_of(two)
        index["units"][0]["params"][0]["name"] = "model.renamed.weight"
        set_index(two, index)
    line = one_line(
        raised(lambda: trainer(max_steps=3).fit(CausalLMModule(**model), TextDataModule(**DATA), ckpt_path=str(two)))
    )
    assert re.search("another shape|parameter units", line) and STEP2 in line
    assert line.endswith(f"ckpts: {STEP1}")


def test_every_byte_of_the_trainer_state_is_under_the_checksum(source):
    """A flipped byte anywhere in trainer.pt (every 7th position, the first and last 64 all) is caught before
    it is unpickled; the checkpoint is served from memory:// to keep the thousands of reads quick."""
    local = source / STEP2
    url = f"memory://trust-{os.getpid()}/{STEP2}"
    fs, path = fsspec.core.url_to_fs(url)
    for file in [local, *Path(f"{local}.d").rglob("*")]:
        if file.is_file():
            fs.pipe_file(f"{path}{str(file)[len(str(local)) :]}", file.read_bytes())
    fs, version, index = store.read_index(url)
    raw = fs.cat_file(f"{version}/trainer.pt")
    positions = sorted({*range(64), *range(0, len(raw), 7), *range(len(raw) - 64, len(raw))})
    refused = 0
    for at in positions:
        flipped = bytearray(raw)
        flipped[at] ^= 0x01
        fs.pipe_file(f"{version}/trainer.pt", bytes(flipped))
        with pytest.raises(CheckpointError) as err:
            store.read_trainer_state(fs, version, index)
        refused += "truncated or altered" in str(err.value)
    assert refused == len(positions) > len(raw) // 7
    fs.rm(path.rsplit("/", 1)[0], recursive=True)


def test_allowing_a_class_deliberately_loads_it(two, tmp_path, capsys):
    refused_class(two)
    with torch.serialization.safe_globals([Fraction]):
        module = load_from_checkpoint(CausalLMModule, str(two))
    assert module.config.num_hidden_layers == 2


def test_typical_hyper_parameter_types_load_restricted():
    """What save_hyperparameters commonly holds besides builtins (the classes of trust.TRAINER_GLOBALS)."""
    import argparse
    import datetime
    import io

    state = {
        "path": Path("/data/x"),
        "config": LlamaConfig(97, 32, 64, 2, 4),
        "args": argparse.Namespace(lr=0.1),
        "budget": datetime.timedelta(hours=2),
        "rng": __import__("random").getstate(),
    }
    raw = io.BytesIO()
    torch.save(state, raw)
    assert trust.load_restricted(raw.getvalue()) == state


def test_torch_format_resume_refuses_arbitrary_objects_unless_told(tmp_path, capsys):
    """checkpoint_format="torch": Lightning's single file, read restricted unless weights_only=False."""
    path = tmp_path / "single.ckpt"
    sentinel = tmp_path / "PWNED"
    torch.save({"epoch": 0, "global_step": 0, "state_dict": {}, "x": Plant(sentinel)}, path)
    strategy = MegatrainStrategy(checkpoint_format="torch")
    line = one_line(raised(lambda: strategy.load_checkpoint(path)))
    assert "single.ckpt: the checkpoint needs os.makedirs" in line and "weights_only=False" in line
    assert not sentinel.exists()
    strategy.load_checkpoint(path, weights_only=False)  # the user's explicit trust
    assert sentinel.exists()


# -- storage_options ----------------------------------------------------------------------------------------
class SaveAtEnd(Callback):
    def __init__(self, url: str, **kwargs) -> None:
        self.url, self.kwargs = url, kwargs

    def on_train_end(self, trainer, pl_module) -> None:
        trainer.save_checkpoint(self.url, **self.kwargs)


def _credentials_only_in_options(s3_env: dict, monkeypatch) -> dict:
    """The test server's credentials as storage options, and none in the environment (nor cached by s3fs)."""
    import s3fs

    from tests.s3_server import OPTIONS_KEY, OPTIONS_SECRET

    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    s3fs.S3FileSystem.clear_instance_cache()
    return {"key": OPTIONS_KEY, "secret": OPTIONS_SECRET, "endpoint_url": s3_env["AWS_ENDPOINT_URL"]}


def test_storage_options_carry_the_credentials_and_are_written_nowhere(s3_env, monkeypatch, caplog, recwarn):
    from tests.s3_server import OPTIONS_SECRET

    options = _credentials_only_in_options(s3_env, monkeypatch)
    root = f"s3://megatrain/options-{os.getpid()}"
    caplog.set_level(logging.INFO)
    strategy = MegatrainStrategy(storage_options=options)
    callbacks = [SaveAtEnd(f"{root}/a.ckpt"), SaveAtEnd(f"{root}/b.ckpt", storage_options=options)]
    torch.manual_seed(0)
    with quiet():
        trainer(strategy, max_steps=2, callbacks=callbacks).fit(CausalLMModule(**MODEL), TextDataModule(**DATA))
        resumed = trainer(MegatrainStrategy(storage_options=options), max_steps=3, max_epochs=-1)
        resumed.fit(CausalLMModule(**MODEL), TextDataModule(**DATA), ckpt_path=f"{root}/b.ckpt")
    assert resumed.global_step == 3
    module = load_from_checkpoint(CausalLMModule, f"{root}/a.ckpt", storage_options=options)
    assert module.config.num_hidden_layers == 2
    fs = fsspec.filesystem("s3", **options)
    written = fs.find(root.removeprefix("s3://"))
    assert any(p.endswith("trainer.pt") for p in written) and any(p.endswith("b.ckpt") for p in written)
    for p in written:
        assert OPTIONS_SECRET.encode() not in fs.cat_file(p)
    assert OPTIONS_SECRET not in caplog.text
    assert not [w for w in recwarn if OPTIONS_SECRET in str(w.message)]


def test_saves_after_fit_use_the_strategy_storage_options(s3_env, monkeypatch, recwarn):
    """trainer.save_checkpoint after fit, credentials given only to the strategy: over the sharded checkpoint
    saved during fit a sharded one again, elsewhere Lightning's single file; both written with the strategy's
    options, and both resume with them."""
    options = _credentials_only_in_options(s3_env, monkeypatch)
    root = f"s3://megatrain/after-fit-{os.getpid()}"
    torch.manual_seed(0)
    with quiet():
        fitted = trainer(
            MegatrainStrategy(storage_options=options), max_steps=2, callbacks=[SaveAtEnd(f"{root}/a.ckpt")]
        )
        fitted.fit(CausalLMModule(**MODEL), TextDataModule(**DATA))
    fs = fsspec.filesystem("s3", **options)
    during_fit = store.parse_marker(fs.cat_file(f"{root}/a.ckpt".removeprefix("s3://")))["data"]
    fitted.save_checkpoint(f"{root}/a.ckpt")
    fitted.save_checkpoint(f"{root}/single.ckpt")
    assert store.parse_marker(fs.cat_file(f"{root}/a.ckpt".removeprefix("s3://")))["data"] != during_fit
    assert fs.cat_file(f"{root}/single.ckpt".removeprefix("s3://"))[:2] == b"PK"  # torch.save's zip
    for name in ("a.ckpt", "single.ckpt"):
        resumed = trainer(MegatrainStrategy(storage_options=options), max_steps=3, max_epochs=-1)
        with quiet():
            resumed.fit(CausalLMModule(**MODEL), TextDataModule(**DATA), ckpt_path=f"{root}/{name}")
        assert resumed.global_step == 3, name


def test_what_counts_as_a_sharded_checkpoint(source, tmp_path):
    """Ours even when its marker is cut short or lost beside its data; a trial resumes only from a marker."""
    from ray_jobs.trial import resume_from

    marker = copy_to(source, STEP2, tmp_path)
    assert store.is_checkpoint(str(marker)) and resume_from(str(marker)) == str(marker)
    shutil.rmtree(f"{marker}.d")
    truncate(marker, 20)  # the start of the marker's frame, nothing else
    assert store.is_checkpoint(str(marker))
    lightning_file = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {}}, lightning_file)
    assert not store.is_checkpoint(str(lightning_file))
    lost = copy_to(source, STEP1, tmp_path)
    lost.unlink()  # a first save that never committed: its data alone
    assert store.is_checkpoint(str(lost)) and resume_from(str(lost)) is None


# -- the checkpoint directory is a boundary -----------------------------------------------------------------
def tiny_engine(seed: int = 0) -> Engine:
    """A two-block engine with Adam state (a checkpoint of it takes milliseconds, no Trainer)."""
    torch.manual_seed(seed)
    config = LlamaConfig.from_preset("tiny")
    config.num_hidden_layers = 2
    engine = Engine(LlamaForCausalLM(config), EngineConfig(device="cpu", precision="32-true"))
    for unit in engine.all_units():
        unit.alloc_optimizer_state()
        unit.m.normal_()
        unit.v.uniform_()
        unit.steps = [3] * len(unit.entries)
    return engine


@pytest.fixture
def saved(tmp_path) -> tuple[Engine, Path]:
    """A tiny engine and the marker of its checkpoint ``run/last.ckpt`` under tmp_path."""
    engine = tiny_engine()
    marker = tmp_path / "run" / "last.ckpt"
    store.save(engine, str(marker), {"epoch": 0}, param_groups=[{"lr": 1e-3, "weight_decay": 0.0}])
    return engine, marker


def tree(root: Path) -> dict[str, object]:
    """Every entry under `root` (links not followed): a file's bytes, a link's target, or "dir"."""
    found: dict[str, object] = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder, name)
            rel = str(path.relative_to(root))
            if path.is_symlink():
                found[rel] = f"-> {os.readlink(path)}"
            elif path.is_dir():
                found[rel] = "dir"
            else:
                found[rel] = path.read_bytes()
    return found


def restores(engine: Engine, marker: Path) -> bool:
    """Whether the checkpoint at `marker` restores `engine`'s masters, moments and steps into a fresh engine."""
    fresh = tiny_engine(seed=1)
    store.restore(fresh, str(marker), optimizer=True)
    return all(
        torch.equal(a.master, b.master) and torch.equal(a.m, b.m) and torch.equal(a.v, b.v) and a.steps == b.steps
        for a, b in zip(engine.all_units(), fresh.all_units())
    )


def user_files(folder: Path) -> None:
    """Folders of a user's that no save wrote (no lease, as every save's cleanup once saw them)."""
    (folder / "photos").mkdir(parents=True)
    (folder / "photos" / "a.jpg").write_bytes(b"jpeg")
    (folder / "thesis" / "units").mkdir(parents=True)
    (folder / "thesis" / "units" / "chapter1.tex").write_text("text")


def refused_save(engine: Engine, marker: Path) -> str:
    with pytest.raises(CheckpointError) as err:
        store.save(engine, str(marker), {"epoch": 1})
    return one_line(str(err.value))


def test_a_data_directory_moved_behind_a_link_is_refused_and_still_restores(saved, tmp_path):
    """`last.ckpt.d` moved to another disk and linked back: a save refuses in one line before touching anything
    (its cleanup would delete through the link), and the checkpoint there still restores."""
    engine, marker = saved
    disk = tmp_path / "disk"
    user_files(disk)
    shutil.move(f"{marker}.d", disk / "last.ckpt.d")
    os.symlink(disk / "last.ckpt.d", f"{marker}.d")
    before = tree(tmp_path)
    line = refused_save(engine, marker)
    assert f"saving {marker}: {marker}.d is a symbolic link (to {disk / 'last.ckpt.d'})" in line
    assert "save to another path" in line
    assert tree(tmp_path) == before
    assert restores(engine, marker)


def test_a_link_to_the_folder_above_deletes_nothing(saved, tmp_path):
    """A downloaded checkpoint holding `last.ckpt.d -> ..`: the user's folders beside it survive a save (refused in
    one line), a removal of the checkpoint and its versions' cleanup, none of which follow the link."""
    engine, marker = saved
    user_files(tmp_path)  # beside the folder `run` that holds the checkpoint
    shutil.rmtree(f"{marker}.d")
    os.symlink("..", f"{marker}.d")
    before = tree(tmp_path)
    assert "last.ckpt.d is a symbolic link (to ..)" in refused_save(engine, marker)
    assert tree(tmp_path) == before
    fs = fsspec.filesystem("file")
    versions.remove_unused(fs, str(marker), keep=set)
    store.remove(str(marker))  # the marker goes; what the link points to stays
    del before["run/last.ckpt"]
    assert tree(tmp_path) == before


@pytest.mark.parametrize("kind", ["file", "folder", "version-named link", "file for .d"])
def test_what_no_save_wrote_in_the_data_directory_is_refused_and_kept(kind, saved, tmp_path):
    """A plain file or a folder inside `last.ckpt.d`, a link named like a version, or `last.ckpt.d` a file: the save
    is one line naming it, nothing anywhere changes, and (where its data is there) the checkpoint restores."""
    engine, marker = saved
    user_files(tmp_path / "home")
    data = Path(f"{marker}.d")
    stranger, says = {
        "file": ("notes.txt", "holds 'notes.txt', which no save of this format wrote"),
        "folder": ("backup", "holds 'backup', which no save of this format wrote"),
        "version-named link": ("v1-00000000", "holds 'v1-00000000', which no save of this format wrote"),
        "file for .d": ("", "is a file, not a checkpoint's data directory"),
    }[kind]
    if kind == "file":
        (data / stranger).write_text("mine")
    elif kind == "folder":
        (data / stranger / "units").mkdir(parents=True)
        (data / stranger / "units" / "keep.bin").write_bytes(b"mine")
    elif kind == "version-named link":
        os.symlink(tmp_path / "home" / "photos", data / stranger)
    else:
        shutil.rmtree(data)
        data.write_text("mine")
    before = tree(tmp_path)
    line = refused_save(engine, marker)
    assert line.startswith(f"saving {marker}: {data} {says}; ") and "move what is not a save's out" in line, line
    assert tree(tmp_path) == before
    if kind != "file for .d":
        assert restores(engine, marker)


def test_a_version_named_folder_without_a_lease_is_deleted_only_if_a_save_could_have_written_it(saved, recwarn):
    """An old lease-less version directory is an interrupted save's only when it holds what saves write."""
    engine, marker = saved
    old = [f"v{time.time_ns() - int(2e12) + i:x}-00000000" for i in range(2)]
    ours, theirs = (Path(f"{marker}.d") / name for name in old)
    (ours / "units").mkdir(parents=True)
    (ours / "units" / "00000.safetensors").write_bytes(b"partial")
    (theirs / "units").mkdir(parents=True)
    (theirs / "thesis.tex").write_text("mine")
    store.save(engine, str(marker), {"epoch": 1})
    assert not ours.exists() and (theirs / "thesis.tex").read_text() == "mine"
    assert restores(engine, marker)


# -- every name in an index stays inside its version directory; every size is checked before it is used ------
def convert_line(marker: Path, to: str, tmp_path: Path, capsys) -> str:
    """`megatrain convert` of `marker`: its one error line (after the prefix); nothing may be written."""
    out = tmp_path / ("hf" if to == "hf" else "out.ckpt")
    line = one_line(exited(["convert", str(marker), "--to", to, str(out)], capsys))
    assert line.startswith("megatrain convert: error: ") and not out.exists()
    return line


def restore_line(marker: Path) -> str:
    with pytest.raises(CheckpointError) as err:
        store.restore(tiny_engine(seed=1), str(marker), optimizer=True)
    return one_line(str(err.value))


def test_an_index_naming_a_file_outside_its_version_is_refused(saved, tmp_path, capsys):
    _, marker = saved
    outside = tmp_path / "outside.safetensors"
    shutil.copy(vdir(marker) / SHARD, outside)  # a valid shard, checksum and all: only its place is wrong
    index = index_of(marker)
    index["units"][0]["file"] = "../../outside.safetensors"
    set_index(marker, index)
    says = "units[0].file is '../../outside.safetensors', not a unit shard of this version directory"
    for line in (convert_line(marker, "hf", tmp_path, capsys), restore_line(marker)):
        assert f"index.json: {says}: the index is damaged or altered; intact earlier checkpoints in" in line, line


def test_a_marker_naming_a_version_outside_the_data_directory_is_refused(saved, tmp_path, capsys):
    _, marker = saved
    marker.write_bytes(store.marker_bytes({**store.parse_marker(marker.read_bytes()), "data": ".."}))
    line = convert_line(marker, "torch", tmp_path, capsys)
    assert "last.ckpt: its commit marker names '..', not a version directory" in line


def bomb_buffers(marker: Path, entries: dict, data: bytes, claimed: int | None = None) -> None:
    """buffers.safetensors replaced by a header of `entries` and `data`; the index records the real file's
    checksum and its size (or `claimed`, the size its header pretends)."""
    head = json.dumps(entries).encode()
    raw = len(head).to_bytes(8, "little") + head + data
    (vdir(marker) / "buffers.safetensors").write_bytes(raw)
    index = index_of(marker)
    index["buffers"] = {"bytes": claimed or len(raw), "crc32": zlib.crc32(raw)}
    set_index(marker, index)


HUGE = 2**40


@pytest.mark.parametrize(
    "kind, says",
    [
        ("shape beyond its bytes", rf"tensor 'x' is F32\[{HUGE}\] in 4 bytes: the header is damaged"),
        ("bytes beyond the file", r"buffers.safetensors ends early: its header describes \d+ bytes, the file has \d+"),
        ("overlapping tensors", r"byte ranges overlap or leave gaps: the header is damaged"),
        ("numel beyond the params", rf"units\[0\]: its parameters hold \d+ values, the unit {HUGE}"),
        (
            "numel beyond the file",
            rf"units/00000.safetensors: its header describes \d+ bytes, the index recorded {12 * HUGE + 4096}",
        ),
    ],
)
def test_sizes_in_a_header_or_index_are_checked_before_memory_is_spent(kind, says, saved, tmp_path, capsys):
    """Each would allocate terabytes (or read one tensor's bytes as another's); each is one line, and nothing
    large is allocated (the allocator's error would be a traceback)."""
    _, marker = saved
    x = {"dtype": "F32", "shape": [HUGE], "data_offsets": [0, 4 * HUGE]}
    if kind == "shape beyond its bytes":
        bomb_buffers(marker, {"x": {**x, "data_offsets": [0, 4]}}, b"\0" * 4)
    elif kind == "bytes beyond the file":
        head = len(json.dumps({"x": x}).encode())
        bomb_buffers(marker, {"x": x}, b"\0" * 4, claimed=8 + head + 4 * HUGE)
    elif kind == "overlapping tensors":
        y = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
        bomb_buffers(marker, {"x": y, "y": y}, b"\0" * 8)
    else:
        index = index_of(marker)
        unit = index["units"][0]
        unit["numel"] = HUGE
        if kind == "numel beyond the file":  # the index made consistent with itself, not with the file
            unit["bytes"] = 12 * HUGE + 4096
            last = unit["params"][-1]
            last["shape"] = [HUGE - last["offset"]]
        set_index(marker, index)
    assert re.search(says, convert_line(marker, "torch", tmp_path, capsys))


def test_a_unit_is_allocated_only_once_its_shard_header_vouches_for_its_size(saved):
    """Behind the index's own checks: a record claiming more values than its shard's header holds is refused
    before its tensors are allocated."""
    _, marker = saved
    fs, version, index = store.read_index(str(marker))
    with pytest.raises(CheckpointError, match=rf"tensor 'master' is F32\[\d+\], this model needs F32\[{HUGE}\]"):
        store.read_unit(fs, version, {**index["units"][0], "numel": HUGE}, adam=True)


DEEP = 100_000


@pytest.mark.parametrize("where", ["index", "marker", "header", "lease"])
def test_json_nested_100k_deep_is_one_line(where, saved, tmp_path, capsys):
    engine, marker = saved
    deep = b"[" * DEEP + b"]" * DEEP
    if where == "index":
        set_index(marker, b'{"units": ' + deep + b"}")
        says = "index.json: its JSON nests deeper than 64 levels"
    elif where == "marker":
        marker.write_bytes(b'{"format": "megatrain-checkpoint", "x": ' + deep + b"}")
        says = "last.ckpt: its commit marker is damaged (its JSON nests deeper than 64 levels)"
    elif where == "header":
        bomb_buffers(marker, {}, b"")
        raw = len(deep).to_bytes(8, "little") + deep
        (vdir(marker) / "buffers.safetensors").write_bytes(raw)
        reseal(marker, "buffers.safetensors")
        says = "buffers.safetensors: its header is not safetensors JSON: the header is damaged"
    else:  # another writer's lease: the save reads it to decide what to delete
        lapsed = Path(f"{marker}.d") / versions.new_version()
        lapsed.mkdir()
        (lapsed / "lease.json").write_bytes(deep)
        store.save(engine, str(marker), {"epoch": 1})  # (young by its name: kept as a live writer's)
        assert lapsed.exists() and restores(engine, marker)
        return
    assert says in convert_line(marker, "torch", tmp_path, capsys)


@pytest.mark.parametrize("where", ["param", "unit"])
def test_a_negative_step_is_refused_before_training_divides_by_it(where, saved):
    """Adam's bias correction divides by 1 - beta**step: a step of -1 would reach it as a ZeroDivisionError."""
    _, marker = saved
    index = index_of(marker)
    unit = index["units"][0]
    if where == "param":
        unit["params"][0]["step"] = -1
        says = f"units[0]: parameter {unit['params'][0]['name']} has step -1, not a step count"
    else:  # indexes of the first format kept one step per unit
        for p in unit["params"]:
            del p["step"]
        unit["step"] = -1
        says = "units[0].step is -1, not a step count"
    set_index(marker, index)
    assert says in restore_line(marker)


def export_config_with(marker: Path, edit) -> None:
    index = index_of(marker)
    edit(index)
    set_index(marker, index)


def unknown_key(index: dict) -> None:
    index["export"]["llama_config"]["attention_sinks"] = 4


def overlapping(index: dict) -> None:
    index["units"][3]["params"][1]["offset"] = 0  # the second tensor's bytes would be the first's


def out_of_range(index: dict) -> None:
    index["units"][3]["params"][-1]["offset"] += 10**9


@pytest.mark.parametrize(
    "edit, says",
    [
        (unknown_key, r"export.llama_config has keys \['attention_sinks'\] that LlamaConfig does not have"),
        (overlapping, r"units\[3\]: parameter .* starts at offset 0, where the parameters before it end at \d+"),
        (out_of_range, r"units\[3\]: parameter .* starts at offset \d+, where the parameters before it end at \d+"),
    ],
    ids=["unknown config key", "overlapping offsets", "offset out of range"],
)
def test_convert_checks_the_config_keys_and_that_params_tile_their_unit(edit, says, saved, tmp_path, capsys):
    _, marker = saved
    export_config_with(marker, edit)
    assert re.search(says, convert_line(marker, "hf", tmp_path, capsys))
