"""Checkpoints under concurrency and crashes: writers and readers on one checkpoint cannot hurt each other,
a killed save leaves a checkpoint that resumes exactly, and commits are fsynced in order."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
import torch

from megatrain_lightning import Engine, EngineConfig
from megatrain_lightning.checkpoint import CheckpointError, restore, save, store, stream, versions
from megatrain_lightning.models import LlamaConfig, LlamaForCausalLM
from tests.helpers import token_batches

REPO = str(Path(__file__).parents[1])


def url_for(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if kind == "local":
        return str(tmp_path / "c.ckpt")
    request.getfixturevalue("s3_env")
    return f"s3://megatrain/writers-{uuid.uuid4().hex[:8]}/c.ckpt"


def tiny(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig.from_preset("tiny")
    cfg.num_hidden_layers = 2
    return LlamaForCausalLM(cfg)


def engine_of(seed: int) -> Engine:
    """A tiny engine whose masters and Adam state depend on `seed` (checkpoints of two of them differ)."""
    engine = Engine(tiny(seed), EngineConfig(device="cpu", precision="32-true"))
    for unit in engine.all_units():
        unit.alloc_optimizer_state()
        unit.m.normal_()
        unit.v.uniform_()
        unit.steps = [seed] * len(unit.entries)
    return engine


def same_state(a: Engine, b: Engine) -> bool:
    return all(
        torch.equal(u.master, v.master) and torch.equal(u.m, v.m) and torch.equal(u.v, v.v) and u.steps == v.steps
        for u, v in zip(a.all_units(), b.all_units())
    )


def version_names(url: str) -> set[str]:
    fs, path = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    return {p[len(path) + 3 :].split("/", 1)[0] for p in fs.find(f"{path}.d")}


def marker_of(url: str) -> dict:
    fs, path = fsspec.core.url_to_fs(url)
    return store.parse_marker(fs.cat_file(path))


def during_first_shard_read(monkeypatch, action):
    """Run `action` once, when a reader is about to open its first shard (after it read marker and index)."""
    real, done = stream.read_into, []

    def read_into(*args, **kwargs):
        if not done:
            done.append(True)
            action()
        return real(*args, **kwargs)

    monkeypatch.setattr(stream, "read_into", read_into)


# -- readers during saves ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_read_outliving_one_commit_finishes_on_its_version_and_two_start_it_over(
    kind, tmp_path, request, monkeypatch
):
    """A save keeps the checkpoint it replaced: a restore that read the old marker just before a commit
    reads the old version to the end. After a second commit that version is gone: the restore sees the
    marker moved and starts over on the newest checkpoint, never calling the race damage."""
    url = url_for(kind, tmp_path, request)
    a, b, reader = engine_of(1), engine_of(2), engine_of(3)
    save(a, url, {"by": "a"})
    during_first_shard_read(monkeypatch, lambda: save(b, url, {"by": "b"}))
    restore(reader, url, optimizer=True)
    assert same_state(reader, a)

    during_first_shard_read(monkeypatch, lambda: [save(a, url, {"by": "a"}) for _ in range(2)])
    restore(reader, url, optimizer=True)  # began on b's version, deleted by the second save
    assert same_state(reader, a)
    assert len(version_names(url)) == 2  # the current checkpoint and the one it replaced


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_resume_takes_the_weights_of_the_trainer_state_it_read(kind, tmp_path, request):
    """Resuming reads the trainer state, then streams the weights: a save between the two must not mix
    checkpoints. The weights come from the version the state came from (kept one save back); two saves
    later that version is gone and the resume says so."""
    url = url_for(kind, tmp_path, request)
    a, b, reader = engine_of(1), engine_of(2), engine_of(3)
    save(a, url, {"by": "a"})
    state, index = store.read_checkpoint(url)
    save(b, url, {"by": "b"})
    restore(reader, url, optimizer=True, pinned=index)
    assert state == {"by": "a"} and same_state(reader, a)
    save(b, url, {"by": "b"})
    with pytest.raises(CheckpointError, match="replaced twice by newer saves.*resume again"):
        restore(reader, url, optimizer=True, pinned=index)


def test_a_missing_file_is_damage_only_under_an_unchanged_marker(tmp_path):
    """A unit read (as `megatrain convert` does, after the index) whose version two saves replaced says so;
    a shard missing from the version the marker still names is damage."""
    url, engine = str(tmp_path / "c.ckpt"), engine_of(1)
    save(engine, url, {})
    fs, vdir, index = store.read_index(url)
    save(engine, url, {})
    save(engine, url, {})
    with pytest.raises(CheckpointError, match="replaced by a newer save while being read .* read it again"):
        store.read_unit(fs, vdir, index["units"][1])
    fs, vdir, index = store.read_index(url)
    Path(vdir, "units", "00001.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"00001.safetensors is missing; intact earlier checkpoints in .*: none"):
        store.read_unit(fs, vdir, index["units"][1])
    with pytest.raises(CheckpointError, match=r"00001.safetensors is missing; intact earlier checkpoints"):
        restore(engine_of(2), url, optimizer=True)


# -- which versions a save deletes -------------------------------------------------------------------
def plant(url: str, name: str, lease: dict | None) -> str:
    """A version directory with one shard-like file and `lease` (None: no lease file)."""
    fs, path = fsspec.core.url_to_fs(url)
    fs.makedirs(f"{path}.d/{name}/units", exist_ok=True)
    fs.pipe_file(f"{path}.d/{name}/units/00000.safetensors", b"partial")
    if lease is not None:
        fs.pipe_file(f"{path}.d/{name}/lease.json", json.dumps({"token": "t", **lease}).encode())
    return name


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_save_deletes_only_versions_proven_abandoned(kind, tmp_path, request):
    """Kept: another writer's version with a fresh heartbeat (any machine), a young directory without its
    lease yet, the checkpoint replaced. Deleted with a warning: a lease that lapsed, a writer on this
    machine whose process is gone; silently: older committed versions."""
    url = url_for(kind, tmp_path, request)
    now, here, old = time.time(), versions._machine(), f"v{time.time_ns() - int(2e12):x}-00000000"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    engine = engine_of(1)
    save(engine, url, {})
    first = marker_of(url)["data"]
    live = {
        plant(url, versions.new_version(), {"state": "writing", "machine": "elsewhere", "pid": 1, "heartbeat": now}),
        plant(url, versions.new_version(), {"state": "writing", "machine": here, "pid": os.getpid(), "heartbeat": now}),
        plant(url, versions.new_version(), None),
    }
    abandoned = {
        plant(url, versions.new_version(), {"state": "writing", "machine": "elsewhere", "pid": 1, "heartbeat": 0}),
        plant(url, versions.new_version(), {"state": "writing", "machine": here, "pid": gone.pid, "heartbeat": now}),
        plant(url, old, None),
    }
    with pytest.warns(UserWarning, match="interrupted save") as caught:
        save(engine, url, {})
    assert {n for n in abandoned if any(n in str(w.message) for w in caught)} == abandoned
    second = marker_of(url)
    assert second["previous"] == first and version_names(url) == live | {first, second["data"]}
    save(engine, url, {})
    assert version_names(url) == live | {second["data"], marker_of(url)["data"]}  # `first` went silently
    store.remove(url)
    assert version_names(url) == live  # remove() spares live writers too


# -- concurrent writers ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["local", "s3"])
def test_two_writers_and_a_reader_on_one_checkpoint(kind, tmp_path, request):
    """Two writers save to one path in a loop while a reader reads trainer state and weights: nothing
    fails (a writer whose version another deleted would fail: its files or its lease vanish), every read
    pairs a state with the weights of the same save, and the last marker names a complete version."""
    url = url_for(kind, tmp_path, request)
    writers, reader = {1: engine_of(1), 2: engine_of(2)}, engine_of(3)
    save(writers[1], url, {"by": 1})
    errors, reads, done = [], [], threading.Event()

    def write(tag: int) -> None:
        try:
            for i in range(4):
                save(writers[tag], url, {"by": tag, "i": i})
                time.sleep(0.01)
        except BaseException as err:
            errors.append(err)

    def read_pair() -> int:
        state, index = store.read_checkpoint(url)
        restore(reader, url, optimizer=True, pinned=index)
        return state["by"]

    def read() -> None:
        try:
            while not done.is_set() or len(reads) < 3:
                by = store.reread_if_replaced(url, read_pair)
                reads.append(same_state(reader, writers[by]))
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=write, args=(t,)) for t in writers] + [threading.Thread(target=read)]
    for t in threads:
        t.start()
    for t in threads[:2]:
        t.join()
    done.set()
    threads[2].join()
    assert errors == [] and all(reads), (errors, reads)
    state, index = store.read_checkpoint(url)
    restore(reader, url, optimizer=True)  # every shard checksummed
    assert state["i"] == 3 and same_state(reader, writers[state["by"]])


WRITER = textwrap.dedent(
    """
    import sys, time, warnings
    from pathlib import Path
    sys.path.insert(0, {repo!r})
    warnings.simplefilter("always")
    from megatrain_lightning.checkpoint import ModelCheckpoint
    from tests.helpers import CausalLM, fit, own_llama, own_loss, token_batches

    me, other = Path({flag!r} + sys.argv[1]), Path({flag!r} + ("1" if sys.argv[1] == "2" else "2"))
    me.touch()
    while not other.exists():  # start the two runs together
        time.sleep(0.01)
    for url in sys.argv[2:]:
        cb = ModelCheckpoint(dirpath=url, save_last=True, every_n_train_steps=1, save_top_k=1)
        fit(CausalLM(own_llama(2), own_loss), token_batches(3), enable_checkpointing=True, callbacks=[cb])
    """
)


def test_two_trainers_checkpointing_to_one_directory(tmp_path, request):
    """Two real Lightning ModelCheckpoints, in two processes, save `last.ckpt` and the same step names to
    one directory (and delete them: save_top_k=1), locally and on S3: both runs finish, no save is taken
    for abandoned, and the last checkpoint is complete."""
    request.getfixturevalue("s3_env")
    urls = [str(tmp_path / "local"), f"s3://megatrain/trainers-{uuid.uuid4().hex[:8]}"]
    script = WRITER.format(repo=REPO, flag=str(tmp_path / "ready"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, "-c", script, n, *urls], stderr=subprocess.PIPE, text=True, env=env)
        for n in "12"
    ]
    outputs = [p.communicate(timeout=600)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert not [line for out in outputs for line in out.splitlines() if "interrupted save" in line]
    for url in urls:
        state, index = store.read_checkpoint(f"{url}/last.ckpt")
        fs, vdir, index = store.read_index(f"{url}/last.ckpt")
        assert state["global_step"] == 3 and len(index["units"]) == 5  # embeddings, 2 blocks, norm, head
        for rec in index["units"]:  # complete: every shard there and checksummed
            store.read_unit(fs, vdir, rec, adam=True)
        store.read_buffers(fs, vdir, index)


# -- kill -9 inside saves ----------------------------------------------------------------------------
BATCHES = token_batches(4, seed=3)


@contextlib.contextmanager
def run_from(url: str, start: int) -> Iterator[tuple[torch.nn.Module, Engine, torch.optim.Optimizer]]:
    """A fixed run of a tiny model at step `start` (resumed from `url` unless 0): model, engine, optimizer.
    One host thread: the killed runs fork, and a thread pool does not survive a fork."""
    model = tiny(0)
    with Engine(model, EngineConfig(device="cpu", precision="32-true", host_threads=1)) as engine:
        opt = engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
        if start:
            assert engine.load(url)["step"] == start
        yield model, engine, opt


def step(run: tuple, i: int, save_to: str | None = None) -> dict[str, torch.Tensor]:
    """Optimizer step `i` of the run (saved to `save_to`, as step i + 1); returns the weights."""
    model, engine, opt = run
    loss = model(BATCHES[i], targets=BATCHES[i])
    with engine.backward():
        loss.backward()
    opt.step()
    opt.zero_grad()
    if save_to:
        engine.save(save_to, state={"step": i + 1})
    engine.flush()
    return {k: v.clone() for k, v in engine.master_state_dict().items()}


KILLER = textwrap.dedent(
    """
    import json, os, shutil, signal, sys
    sys.path.insert(0, {repo!r})
    import torch
    torch.set_num_threads(1)  # no thread pool, before the forks or in them
    from megatrain_lightning.checkpoint import store, stream, versions
    from tests.test_checkpoint_writers import run_from, step

    root, kills = sys.argv[1], int(sys.argv[2])
    WATCHED = [(stream, "write"), (versions, "write_bytes"), (versions, "sync_dirs"), (os, "replace"),
               (store, "_commit"), (versions.Lease, "committed"), (versions, "remove_unused")]
    seen = {{"saving": False, "events": 0}}

    def watch(owner, name, kill_at):
        real = getattr(owner, name)
        def tick():
            if seen["saving"]:
                seen["events"] += 1
                if seen["events"] == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
        def wrapped(*args, **kwargs):
            tick()
            out = real(*args, **kwargs)
            tick()
            return out
        setattr(owner, name, wrapped)

    def third_save(url, kill_at):  # in a forked child: resume at step 2, take step 3, save it (to be killed)
        real_save = store.save
        def save(*args, **kwargs):
            seen["saving"] = True
            return real_save(*args, **kwargs)
        store.save = save
        for owner, name in WATCHED:
            watch(owner, name, kill_at)
        with run_from(url, 2) as run:
            step(run, 2, save_to=url)
        return seen["events"]

    def forked(name, kill_at):
        shutil.copytree(f"{{root}}/base", f"{{root}}/{{name}}")
        url = f"{{root}}/{{name}}/c.ckpt"
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            events = third_save(url, kill_at)
            with open(f"{{root}}/events", "w") as f:
                f.write(str(events))
            os._exit(0)
        return url, os.waitpid(pid, 0)[1]

    with run_from("", 0) as run:  # two steps, each saved
        for i in range(2):
            step(run, i, save_to=f"{{root}}/base/c.ckpt")
    assert forked("probe", -1)[1] == 0  # a third save not killed: how many events it has
    events = int(open(f"{{root}}/events").read())
    for k in sorted({{1 + round(i * (events - 1) / (kills - 1)) for i in range(kills)}}):
        print(json.dumps([*forked(f"kill-{{k}}", k), k, events]), flush=True)
    """
)


@pytest.fixture
def one_thread():
    """As in the killed runs: the same reduction order, so that their steps and these agree bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_kill_9_anywhere_in_a_save_leaves_a_checkpoint_that_resumes_exactly(tmp_path, torch_adam, one_thread):
    """A run saving after every step is killed (SIGKILL) at 12 points spread over its third save: before
    and after each shard, the buffers, trainer state, index, directory fsyncs, lease renewals, the marker's
    replace, the clean-up. Each time the checkpoint left resumes to the weights of the run never killed, bit
    for bit (from step 2, or 3 when the kill came after the commit), and the resumed run's saves remove
    the killed save's data."""
    kills = 12
    proc = subprocess.run(
        [sys.executable, "-c", KILLER.format(repo=REPO), str(tmp_path), str(kills)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(runs) == kills and runs[0][3] > 2 * kills  # distinct points, among many more events
    with run_from("", 0) as run:
        straight = [step(run, i) for i in range(4)][-1]
    resumed_from = []
    for url, status, kill_at, _ in runs:
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (kill_at, status)
        start = store.read_checkpoint(url)[0]["step"]
        resumed_from.append(start)
        with warnings.catch_warnings(record=True), run_from(url, start) as run:
            warnings.simplefilter("always")
            got = [step(run, i, save_to=url) for i in range(start, 4)][-1]
        assert all(torch.equal(got[k], v) for k, v in straight.items()), (kill_at, start)
        # What is left is committed, or empty: killed before its lease, it wrote nothing (and is removed
        # once LEASE_TIMEOUT_S passes, as a writer between creating it and its lease could own it).
        left = [sorted(f.name for f in v.rglob("*") if f.is_file()) for v in Path(url + ".d").iterdir()]
        assert all("index.json" in files or files == [] for files in left), (kill_at, left)
    assert resumed_from[0] == 2 and resumed_from[-1] == 3, resumed_from  # killed before, and after, the commit


# -- durable commits ---------------------------------------------------------------------------------
def test_everything_is_fsynced_before_the_marker_and_the_marker_last(tmp_path, monkeypatch):
    """On a local disk a power loss keeps only what was fsynced: every file of the version, and the new
    directory entries, reach the disk before the marker's temp file is fsynced and renamed; the last fsync
    is the marker's directory (its rename). The first save's new directories are fsynced too."""
    url = str(tmp_path / "run" / "c.ckpt")
    synced, real = [], os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    save(engine_of(1), url, {})
    vdir = str(next((tmp_path / "run" / "c.ckpt.d").iterdir()))
    marker = synced.index(next(p for p in synced if p.startswith(url + ".tmp-")))
    files = [str(p) for p in Path(vdir).rglob("*") if p.is_file() and p.name != "lease.json"]
    assert len(files) == len(store.read_index(url)[2]["units"]) + 3  # the unit shards, buffers, trainer state, index
    for p in [*files, f"{vdir}/units", vdir, f"{url}.d", str(tmp_path / "run")]:
        assert p in synced[:marker], p
    assert synced.index(f"{url}.d") < synced.index(f"{vdir}/units/00000.safetensors")  # created, then written
    assert synced[marker + 1 :] == [str(tmp_path / "run")]  # the rename itself, last
