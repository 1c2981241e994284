"""Checkpoints of the partitioned engine (checkpoint/ranks.py): every rank writes its share of files that do
not depend on the number of ranks W, so a run saved with 2 ranks resumes with 1, and one saved with 1 resumes
with 3, each continuing bit for bit as the same run would have without the save (the torch Adam backend, no
clipping).

The oracle is test_partition.py's: ordinary training with torch.optim.AdamW in one process, whose gradient
is what DDP's is over the ranks of that step (each rank's gradient of its rows divided by W, summed in rank
order), here with W changing where the run was resumed. One spawn of 3 processes: ranks 0 and 1 first run
as a group of 2 (which also fails a save on purpose on rank 1), then all 3 resume.
"""

from __future__ import annotations

import fsspec
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from megatrain_lightning.checkpoint import ranks, store, stream
from megatrain_lightning.engine.config import EngineConfig
from megatrain_lightning.engine.engine import Engine
from tests.helpers import gloo_rank, own_llama, own_loss
from tests.test_partition import ROWS, _batches, _optimizer

STEPS, SAVED = 4, 2  # optimizer steps of a run; the run is saved after the first SAVED of them


def _engine(group=None):
    model = own_llama(layers=3)
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true", group=group))
    return model, engine, engine.optimizer(_optimizer(model))


def _train(model, engine, opt, steps: range, world: int, rank: int = 0) -> None:
    """Steps `steps` of the run on this rank's rows of each global batch."""
    batches, per = _batches(STEPS), ROWS // world
    for s in steps:
        with engine.backward():
            own_loss(model, batches[s][rank * per : (rank + 1) * per]).backward()
        opt.step()
        opt.zero_grad()


def _oracle(worlds: list[int]) -> dict[str, torch.Tensor]:
    """Ordinary training that never saved, step s doing what worlds[s] DDP ranks do."""
    model = own_llama(layers=3)
    opt = _optimizer(model)
    params = [p for g in opt.param_groups for p in g["params"]]
    for batch, world in zip(_batches(STEPS), worlds):
        per, mean = ROWS // world, None
        for r in range(world):
            grads = torch.autograd.grad(own_loss(model, batch[r * per : (r + 1) * per]), params)
            mean = [g / world for g in grads] if mean is None else [m + g / world for m, g in zip(mean, grads)]
        for p, g in zip(params, mean):
            p.grad = g
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _saves_with_two(rank: int, out: str, group) -> None:
    model, engine, opt = _engine(group)
    _train(model, engine, opt, range(SAVED), 2, rank)
    url = f"{out}/two.ckpt"
    engine.save(url, {"step": SAVED})
    with open(url, "rb") as f:
        marker = f.read()
    # A save whose first unit file fails on rank 1: nothing committed, and every rank raises.
    write = stream.write
    if rank == 1:
        stream.write = lambda *a, **k: (_ for _ in ()).throw(OSError("disk full (injected)"))
    try:
        engine.save(url, {"step": -1})
        failure = "none"
    except Exception as err:
        failure = f"{type(err).__name__}: {err}"
    finally:
        stream.write = write
    with open(f"{out}/failure{rank}.txt", "w") as f:
        f.write(failure)
    if rank == 0:
        with open(f"{out}/marker.bin", "wb") as f:
            f.write(marker)
    engine.close()


def _resumes_with_three(rank: int, out: str) -> None:
    model, engine, opt = _engine(dist.group.WORLD)
    extras = engine.load(f"{out}/one.ckpt")
    engine.save(f"{out}/three.ckpt", extras)  # the state just restored, written by 3 ranks
    _train(model, engine, opt, range(SAVED, STEPS), 3, rank)
    engine.close()  # each rank gets the whole model back
    if rank == 2:
        save_file({n: p.detach().clone() for n, p in model.named_parameters()}, f"{out}/three.safetensors")


def _rank(rank: int, out: str) -> None:
    with gloo_rank(rank, 3, out):
        two = dist.new_group([0, 1])  # (collective: every process creates it)
        if rank < 2:
            _saves_with_two(rank, out, two)
        dist.barrier()
        _resumes_with_three(rank, out)


def _assert_equal(params: dict, reference: dict) -> None:
    start = own_llama(layers=3).state_dict()
    assert params.keys() == reference.keys()
    for name, ref in reference.items():
        assert not torch.equal(ref, start[name]), name  # (every tensor moved: the comparison is not vacuous)
        assert torch.equal(params[name], ref), name


def _assert_same_units(url: str, other: str) -> None:
    """The unit files byte for byte, and the index (parameters, steps, checksums) but for the version name."""
    (fs, vdir, index), (_, other_vdir, other_index) = store.read_index(url), store.read_index(other)
    for rec in index["units"]:
        assert fs.cat_file(f"{vdir}/{rec['file']}") == fs.cat_file(f"{other_vdir}/{rec['file']}"), rec["file"]
    assert {k: v for k, v in index.items() if k != "data"} == {k: v for k, v in other_index.items() if k != "data"}
    assert {p["step"] for rec in index["units"] for p in rec["params"]} == {SAVED}


@pytest.mark.usefixtures("torch_adam")
def test_a_checkpoint_moves_between_world_sizes_and_a_failed_save_keeps_the_last(tmp_path):
    out = str(tmp_path)
    model, engine, opt = _engine()  # the 1 -> 3 run, saved by one process
    _train(model, engine, opt, range(SAVED), 1)
    engine.save(f"{out}/one.ckpt", {"step": SAVED})
    engine.close()
    mp.spawn(_rank, args=(out,), nprocs=3, join=True)

    # The failed save: rank 1 raised its own error, rank 0 one naming rank 1; the marker and the data it
    # names are as the save before left them (the resume below reads and checksums them).
    failures = [(tmp_path / f"failure{r}.txt").read_text() for r in range(2)]
    assert failures[0].startswith("CheckpointError: saving") and "rank 1 failed" in failures[0], failures[0]
    assert "the previous checkpoint stands" in failures[0]
    assert failures[1] == "OSError: disk full (injected)"
    assert (tmp_path / "two.ckpt").read_bytes() == (tmp_path / "marker.bin").read_bytes()
    assert len(list((tmp_path / "two.ckpt.d").iterdir())) == 1  # the failed save's data went

    model, engine, opt = _engine()  # the 2 -> 1 run, resumed in this process
    assert engine.load(f"{out}/two.ckpt") == {"step": SAVED}
    engine.save(f"{out}/again.ckpt", {"step": SAVED})  # what one process writes for that state
    _train(model, engine, opt, range(SAVED, STEPS), 1)
    engine.close()
    _assert_equal(dict(model.named_parameters()), _oracle([2] * SAVED + [1] * (STEPS - SAVED)))
    _assert_equal(load_file(f"{out}/three.safetensors"), _oracle([1] * SAVED + [3] * (STEPS - SAVED)))

    # The files do not depend on W: what 2 and 3 ranks wrote is what one process writes for the same state.
    _assert_same_units(f"{out}/two.ckpt", f"{out}/again.ckpt")
    _assert_same_units(f"{out}/one.ckpt", f"{out}/three.ckpt")


def test_a_rank_reads_its_shard_through_a_small_scratch_buffer(tmp_path):
    """Each rank keeps the elements lo..hi of a unit file's tensors and passes the rest through the scratch
    buffer, many pieces of it here; every byte is checksummed. A tensor the rank does not keep (the moments
    when only weights are restored) passes through whole."""
    fs, numel = fsspec.filesystem("file"), 23
    master, m = torch.randn(numel), torch.randn(numel)
    info = stream.write(fs, f"{tmp_path}/unit.safetensors", [("master", master), ("exp_avg", m)])
    for lo, hi in [(0, 8), (8, 16), (16, 23), (23, 23)]:
        unit = type("Shard", (), {"lo": lo, "hi": hi, "full_numel": numel})()
        mine = {"master": torch.full((hi - lo,), float("nan"))}
        targets = ranks.shard_targets(unit, ["master", "exp_avg"], mine, torch.empty(3))
        stream.read_into(fs, f"{tmp_path}/unit.safetensors", targets, info)
        assert torch.equal(mine["master"], master[lo:hi]), (lo, hi)
    with pytest.raises(stream.ShardError, match="checksum"):  # (the whole file is still checked)
        stream.read_into(fs, f"{tmp_path}/unit.safetensors", targets, {**info, "crc32": info["crc32"] ^ 1})


def test_one_rank_writes_each_unit_whole_from_its_buffers_and_reads_it_back_in_place(tmp_path, monkeypatch):
    """The one save and restore path with one rank: each unit's file straight from its buffers (no shard
    swapped, no scratch buffer), its weights taken as the file is written, the NVMe moments read ahead."""
    monkeypatch.setattr(ranks, "_Round", None)  # (a swap would call it)
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    model = own_llama(layers=2)
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true", nvme_dir=str(nvme)))
    opt = engine.optimizer(_optimizer(model))
    _train(model, engine, opt, range(1), 1)
    units, order, plans = engine.all_units(), [], []
    plan = engine.tier.plan
    monkeypatch.setattr(engine.tier, "plan", lambda pieces: (plans.append(len(pieces)), plan(pieces))[1])

    def weights(unit):
        order.append(("weights", units.index(unit)))
        return unit.master * 2  # (a weight average's stand-in)

    url = f"{tmp_path}/one.ckpt"
    store.save(engine, url, {}, weights=weights, after_unit=lambda i: order.append(("written", i)))
    assert order == [(what, i) for i in range(len(units)) for what in ("weights", "written")]
    assert plans == [2 * sum(len(engine.tier.pieces(u)) for u in units)]  # m's pass, then v's, of every unit
    fs, vdir, index = store.read_index(url)
    for unit, rec in zip(units, index["units"]):
        saved = load_file(f"{vdir}/{rec['file']}")
        pieces = [(m.clone(), v.clone()) for _, _, m, v in unit.moment_pieces(write=False)]
        m, v = (torch.cat([p[k] for p in pieces]) for k in (0, 1))
        assert saved.keys() == {"master", "exp_avg", "exp_avg_sq"}
        assert torch.equal(saved["master"], unit.master * 2)
        assert torch.equal(saved["exp_avg"], m) and torch.equal(saved["exp_avg_sq"], v)
    for unit in units:
        unit.master.zero_()
    store.restore(engine, url, optimizer=True)
    assert all(torch.equal(u.master, load_file(f"{vdir}/{r['file']}")["master"]) for u, r in zip(units, index["units"]))
    engine.close()
