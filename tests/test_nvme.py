"""nvme_dir: the Adam moments in files on a local drive, read ahead and written behind per unit.

The tier changes where m and v wait between steps, never their values: training with it equals training
without it bit for bit (fp32 and bf16-mixed, with accumulation and clipping, stepping during backward or
after it) and, in fp32 with the torch-op optimizer, ordinary Lightning training too. A resume from a
checkpoint writes the saved moments into fresh files and goes on exactly; the run directory is gone
after fit; host memory holds only the tier's few working buffers; a bad directory fails at construction.
"""

from __future__ import annotations

import os
import random
import threading
from dataclasses import dataclass

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from megatrain_lightning import Engine, EngineConfig, MegatrainStrategy
from megatrain_lightning.engine.host import nvme
from megatrain_lightning.engine.host.nvme import BUFFERS, PREFIX, NvmeTier, NvmeTierError
from megatrain_lightning.engine.optimizer import HostAdamW
from tests import async_streams
from tests.helpers import (
    CausalLM,
    assert_same,
    assert_same_params,
    fit,
    hf_llama,
    loader,
    own_llama,
    own_loop,
    params_of,
    quiet,
    token_batches,
    trainer,
)
from tests.streamed import precision_of

STEPS = 8  # each step reads and writes every unit's moments: more steps repeat the same cycle


pytestmark = pytest.mark.usefixtures("torch_adam")  # bitwise comparisons need torch's own AdamW arithmetic


class TierProbe(L.Callback):
    """What the engine's tier did, and where its run directory was, seen before teardown releases it."""

    def on_train_end(self, trainer, pl_module):
        engine = trainer.strategy.engine
        engine.flush()
        if engine.tier is not None:
            engine.tier.drain()  # the last step's writes behind, into the counts
        self.path = engine.tier.path if engine.tier is not None else None
        self.stats = dict(engine.tier.stats) if engine.tier is not None else {}
        self.nvme_bytes, self.n = engine.nvme_bytes(), engine.num_parameters()


def train(precision: str, nvme_dir=None, layout: str = "default", batches: int = STEPS, callbacks=(), **trainer_kwargs):
    torch.manual_seed(0)
    module = CausalLM(hf_llama(layers=3), split_decay=True, schedule=batches)
    strategy = "auto" if nvme_dir == "ordinary" else MegatrainStrategy(nvme_dir=nvme_dir, host_layout=layout)
    torch.manual_seed(5)
    fit(
        module,
        token_batches(batches),
        strategy=strategy,
        precision=precision,
        callbacks=list(callbacks),
        **trainer_kwargs,
    )
    return module


TRAIN = {
    "accumulate+clip": {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5},  # steps after backward
    "plain": {},  # each unit steps as its gradient lands, during backward
}


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("kind", list(TRAIN))
def test_trains_exactly_with_moments_on_nvme(precision, kind, tmp_path):
    """STEPS steps with nvme_dir equal STEPS steps without it bit for bit; every moment went through the files
    (one read and one write per unit and step), and the run directory is gone after fit."""
    probe = TierProbe()
    kwargs = TRAIN[kind]
    batches = STEPS * kwargs.get("accumulate_grad_batches", 1)
    on_nvme = train(precision, str(tmp_path), batches=batches, callbacks=[probe], **kwargs)
    assert_same(on_nvme, train(precision, batches=batches, **kwargs))
    if precision == "32-true":
        assert_same(on_nvme, train(precision, "ordinary", batches=batches, **kwargs))
    assert probe.path is not None and os.path.basename(probe.path).startswith(PREFIX)
    assert probe.stats["write_bytes"] >= STEPS * probe.nvme_bytes and probe.stats["read_bytes"] > 0
    assert probe.nvme_bytes == 8 * probe.n
    assert not os.path.exists(probe.path) and list(tmp_path.iterdir()) == []


def test_nvme_under_asynchronous_copy_streams(tmp_path, monkeypatch):
    """Copy streams that run late (tests/async_streams.py) change nothing: the tier only sees the worker."""
    async_streams.install(monkeypatch, seed=0)
    on_nvme = train("bf16-mixed", str(tmp_path), batches=12, **TRAIN["accumulate+clip"])
    monkeypatch.undo()
    monkeypatch.setenv("MEGATRAIN_CPU_ADAM", "torch")
    assert_same(on_nvme, train("bf16-mixed", batches=12, **TRAIN["accumulate+clip"]))


def test_lean_layout_with_nvme_trains_exactly(tmp_path):
    """The two ways of saving host memory combine: lean layout + NVMe tier == the default layout."""
    kwargs = TRAIN["accumulate+clip"]
    lean = train("bf16-mixed", str(tmp_path), layout="lean", batches=12, **kwargs)
    assert_same(lean, train("bf16-mixed", batches=12, **kwargs))


@pytest.mark.parametrize("fmt", ["sharded", "torch"])
@pytest.mark.parametrize("first_on_nvme", [True, False])
def test_resume_with_nvme_is_exact(fmt, first_on_nvme, tmp_path):
    """2 epochs straight == 1 epoch, last.ckpt, then a resume on the NVMe tier for epoch 2: the moments
    of the checkpoint (sharded: streamed per unit; torch: the optimizer state dict) go into fresh files.
    The first run may have had its moments in host memory or on the tier."""
    batches = token_batches(10)
    kwargs = dict(gradient_clip_val=1.0, accumulate_grad_batches=2)
    drive = tmp_path / "nvme"
    drive.mkdir()

    def module() -> CausalLM:
        torch.manual_seed(0)
        return CausalLM(hf_llama(layers=3), split_decay=True, schedule=10)

    def strategy(on_nvme: bool) -> MegatrainStrategy:
        return MegatrainStrategy(checkpoint_format=fmt, nvme_dir=str(drive) if on_nvme else None)

    straight = module()
    fit(straight, batches, max_epochs=2, **kwargs)
    cb = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_epochs=1)
    fit(
        module(),
        batches,
        strategy=strategy(first_on_nvme),
        max_epochs=1,
        enable_checkpointing=True,
        callbacks=[cb],
        **kwargs,
    )
    resumed = module()
    t = trainer(strategy=strategy(True), max_epochs=2, **kwargs)
    with quiet():
        t.fit(resumed, loader(batches), ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert resumed.losses == straight.losses[10:]
    assert_same_params(resumed, straight)
    assert list(drive.iterdir()) == []


def test_a_sharded_save_never_gathers_the_moments(tmp_path, monkeypatch):
    """Lightning asks the strategy for the optimizer state at every save; for a sharded checkpoint that is
    the param groups alone (the moments stream from the tier into the shards unit by unit), so saving a
    100B+ model on the tier never holds all its moments in host memory."""
    drive = tmp_path / "nvme"
    drive.mkdir()
    monkeypatch.setattr(HostAdamW, "_stepped_moments", lambda self: pytest.fail("moments gathered for a sharded save"))
    cb = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=2)
    fit(
        CausalLM(hf_llama(layers=2)),
        token_batches(4),
        strategy=MegatrainStrategy(nvme_dir=str(drive)),
        enable_checkpointing=True,
        callbacks=[cb],
    )
    assert (tmp_path / "ckpt" / "last.ckpt").exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_bytes_drop_by_8_per_param(dtype, tmp_path):
    """The same 12-block model and step with and without the tier: every kind of host buffer is the same
    but "adam", which holds only the tier's working buffers (at most BUFFERS, each the m and v of the
    largest unit) instead of 8 bytes/param; the files hold the 8 bytes/param."""
    held = {}
    for nvme_dir in (None, str(tmp_path)):
        model = own_llama(12)
        engine = Engine(model, EngineConfig(device="cpu", precision=precision_of(dtype), nvme_dir=nvme_dir))
        own_loop(model, engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3)), token_batches(2))
        engine.flush()
        held[nvme_dir], n = engine.host_bytes(), engine.num_parameters()
        largest = max(u.numel for u in engine.all_units())
        if nvme_dir is not None:
            files = [os.path.join(engine.tier.path, f) for f in os.listdir(engine.tier.path)]
            assert sum(os.path.getsize(f) for f in files) == engine.nvme_bytes() == 8 * n
            assert 0 < held[nvme_dir]["adam"] == engine.tier.buffer_bytes() <= BUFFERS * 8 * (largest + 16)
        else:
            assert engine.nvme_bytes() == 0 and held[None]["adam"] == 8 * n
        engine.close()
    on_nvme, in_memory = held[str(tmp_path)], held[None]
    assert {k: v for k, v in on_nvme.items() if k != "adam"} == {k: v for k, v in in_memory.items() if k != "adam"}
    assert in_memory["adam"] - on_nvme["adam"] > 0.5 * 8 * n  # 12 blocks: the buffers are a third of the moments
    assert list(tmp_path.iterdir()) == []


# -- a bad nvme_dir fails at construction, naming the directory, the bytes and the fix ----------------


def engine_on(nvme_dir: str) -> Engine:
    return Engine(own_llama(2), EngineConfig(device="cpu", precision="32-true", nvme_dir=nvme_dir))


def test_missing_directory(tmp_path):
    missing = tmp_path / "no-such-drive"
    n = sum(p.numel() for p in own_llama(2).parameters())
    with pytest.raises(ValueError, match="does not exist") as err:
        engine_on(str(missing))
    assert str(missing) in str(err.value) and f"{8 * n} bytes" in str(err.value) and "mkdir -p" in str(err.value)
    (tmp_path / "file").write_text("")
    with pytest.raises(NvmeTierError, match="is not a directory"):
        engine_on(str(tmp_path / "file"))


def test_directory_too_small(tmp_path, monkeypatch):
    real = nvme.shutil.disk_usage
    monkeypatch.setattr(nvme.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(NvmeTierError, match="0.00 GiB free") as err:
        engine_on(str(tmp_path))
    assert str(tmp_path) in str(err.value) and "larger drive" in str(err.value)


def test_directory_not_writable(tmp_path, monkeypatch):
    """(Faked: root writes anywhere.) The model is left as it was: the check comes before the engine takes it."""

    def refuse(**kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(nvme.tempfile, "mkdtemp", refuse)
    model = own_llama(2)
    before = params_of(model)
    with pytest.raises(NvmeTierError, match="not writable") as err:
        Engine(model, EngineConfig(device="cpu", precision="32-true", nvme_dir=str(tmp_path)))
    assert str(tmp_path) in str(err.value) and "Permission denied" in str(err.value)
    assert all(torch.equal(p, before[n]) for n, p in params_of(model).items())


def test_strategy_refuses_a_missing_directory(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        train("32-true", str(tmp_path / "missing"), batches=2)


def test_evaluation_needs_no_tier(tmp_path):
    """Without training there are no moments: nvme_dir is not even looked at."""
    engine = Engine(
        own_llama(2),
        EngineConfig(device="cpu", precision="bf16-true", training=False, nvme_dir=str(tmp_path / "missing")),
    )
    assert engine.tier is None and engine.nvme_bytes() == 0


# -- the tier on its own: any order of use sees the last write ------------------------------------


@dataclass(eq=False)
class Unit:
    name: str
    numel: int


def test_random_use_always_sees_the_last_write(tmp_path):
    """Two buffers, six units cut into 2-3 pieces of up to 500 elements (the last one shorter), plans that
    are followed, broken or stale, reads with and without write back, fresh overwrites, from two threads:
    every piece always holds what was last written to it."""
    units = [Unit(f"u{i}", 1000 + 37 * i) for i in range(6)]
    tier = NvmeTier(str(tmp_path), sum(u.numel for u in units), 500, buffers=2)
    for u in units:
        tier.alloc(u)
    units = [p for u in units for p in tier.pieces(u)]  # the tier's keys from here on
    assert len(units) == 17 and [p.numel for p in units[:5]] == [500, 500, 500, 500, 37]
    truth = {u: (torch.zeros(u.numel), torch.zeros(u.numel)) for u in units}
    lock = threading.Lock()

    def use(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(300):
            if rng.random() < 0.2:
                tier.plan(rng.sample(units, rng.randint(0, 4)))
            u = rng.choice(units)
            with lock:  # one user per unit at a time, as the engine's worker and flush guarantee
                fresh, write = rng.random() < 0.2, rng.random() < 0.7
                with tier.resident(u, write=write, fresh=fresh) as (m, v):
                    if not fresh:
                        assert torch.equal(m, truth[u][0]) and torch.equal(v, truth[u][1]), u.name
                    if write or fresh:
                        m.copy_(torch.randn(u.numel))
                        v.copy_(torch.rand(u.numel))
                        truth[u] = (m.clone(), v.clone())

    threads = [threading.Thread(target=use, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tier.drain()  # from the files now
    for u in units:
        with tier.resident(u, write=False) as (m, v):
            assert torch.equal(m, truth[u][0]) and torch.equal(v, truth[u][1])
    assert len(tier._pool) == 2
    tier.close()
    assert list(tmp_path.iterdir()) == []


def test_an_error_inside_leaves_the_file_as_it_was(tmp_path):
    tier = NvmeTier(str(tmp_path), 100, 100)
    tier.alloc(unit := Unit("u", 100))
    (u,) = tier.pieces(unit)
    with pytest.raises(RuntimeError, match="boom"):
        with tier.resident(u) as (m, v):
            m.fill_(1.0)
            raise RuntimeError("boom")
    with tier.resident(u, write=False) as (m, v):
        assert not m.any() and not v.any()
    tier.close()
    with pytest.raises(RuntimeError, match="closed"):
        with tier.resident(u):
            pass


def test_a_failed_write_is_reported(tmp_path, monkeypatch):
    tier = NvmeTier(str(tmp_path), 100, 100)
    tier.alloc(unit := Unit("u", 100))
    (u,) = tier.pieces(unit)

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(nvme.os, "pwrite", full)
    with tier.resident(u):
        pass
    with pytest.raises(NvmeTierError, match="No space left"):
        with tier.resident(u):
            pass
    tier.close()


# -- a file changed under the run is caught by its checksum, before a step uses it --------------------------


@pytest.mark.parametrize("written", [True, False], ids=["after-a-write", "still-zeros"])
def test_a_piece_changed_in_its_file_is_refused_on_read(written, tmp_path):
    """Bytes of a piece changed in its file by another writer, after this tier wrote the piece or while it
    still holds the zeros it was reserved as: the next read raises one line naming the file and the piece,
    and the buffer is never handed out."""
    tier = NvmeTier(str(tmp_path), 300, 100)
    tier.alloc(unit := Unit("u", 300))
    first, second, _ = tier.pieces(unit)
    if written:
        with tier.resident(second) as (m, v):
            m.copy_(torch.randn(100))
            v.copy_(torch.rand(100))
    tier.drain()  # every buffer unbound: the next use reads the file
    (file,) = [str(p) for p in (tmp_path / os.listdir(tmp_path)[0]).iterdir()]
    with open(file, "r+b") as f:
        f.seek(second.lo * 8 + 4 * 100 + 12)  # one element of the piece's v
        f.write(b"\xff\xff\xff\xff")  # NaN
    with tier.resident(first, write=False) as (m, v):  # the pieces around it are intact
        assert not m.any() and not v.any()
    with pytest.raises(NvmeTierError, match="checksum mismatch") as err:
        with tier.resident(second, write=False):
            raise AssertionError("a changed piece was handed out")
    line = str(err.value)
    assert line.startswith(f"{file}: the Adam moments of u[100:200] (bytes 800 to 1600)") and "\n" not in line
    tier.close()


def test_training_stops_when_another_writer_changes_the_moments(tmp_path):
    """Another process overwrites a unit's moments file mid-training: fit stops with the file's one line at
    the next step that would read it, and no step used the bytes (every weight stays finite)."""

    class Overwrite(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx != 1:
                return
            tier = trainer.strategy.engine.tier
            trainer.strategy.engine.flush()
            tier.drain()
            self.file = tier._files[next(iter(tier._files))]
            with open(self.file, "r+b") as f:
                f.write(b"\xff" * 4096)  # NaN moments

    overwrite = Overwrite()
    module = CausalLM(hf_llama(layers=3))
    with pytest.raises(NvmeTierError, match="checksum mismatch") as err:
        fit(module, token_batches(4), strategy=MegatrainStrategy(nvme_dir=str(tmp_path)), callbacks=[overwrite])
    assert str(err.value).startswith(f"{overwrite.file}: the Adam moments of ") and "\n" not in str(err.value)
    assert all(torch.isfinite(p).all() for p in params_of(module.model).values())
