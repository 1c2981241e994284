"""Data parallel in the engine (engine/ranks.py): W ranks, each holding 1/W of every unit's host state,
train as ordinary training does what W DDP ranks do.

Each rank is a process (gloo on the CPU). The oracle is ordinary training of the same model with
torch.optim.AdamW in one process, whose gradient per micro-batch is what DDP's is: each rank's gradient of
its rows, divided by W, summed in rank order (the engine sums the W parts of each chunk in rank order, so
the collective library's own order does not enter), then summed over micro-batches.

- Without clipping that is the same arithmetic: equal bit for bit.
- With clipping the coefficient comes from each parameter's norm assembled from its pieces' norms (no rank
  holds a whole gradient), which can differ from the whole tensor's norm in the last bit. Adam turns such
  a difference into a larger one for elements whose gradient is near eps, so one clipped step is compared,
  within 1e-6 of each tensor's largest value.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from megatrain_lightning.engine.config import EngineConfig
from megatrain_lightning.engine.device.streams import Streams
from megatrain_lightning.engine.engine import Engine
from megatrain_lightning.engine.ranks import OneRank, ranks_of
from megatrain_lightning.optim.threads import rank_cpus, usable_cpus
from tests.helpers import gloo_rank, own_llama, own_loss

ROWS, SEQ = 6, 16  # ROWS: the global batch, divisible by 2 and 3
# optimizer steps, micro-batches per step, clip; "twice": each micro-batch's loss takes two forwards (the
# rows, then reversed) before its one backward
# "tied": the head is the embedding (one outer parameter) and one block's MLP is frozen.
RUNS = {"plain": (3, 2, None), "clipped": (1, 2, 1.0), "twice": (1, 1, None), "tied": (2, 2, None)}
# Relative to each tensor's largest value. "twice": each call's gradient is exchanged before the calls are
# summed (ordinary training sums them first), and a block's two calls can nearly cancel, so the sum keeps
# fewer correct bits: measured up to 1.0e-6 with W=3.
BOUND = {"clipped": 1e-6, "twice": 1e-5}
# The plain run, stored otherwise, or with its gradient shards summed on the device across micro-batches
# ("nvme" last: the checkpoint read back below is its).
LAYOUTS = {"lean": {"host_layout": "lean"}, "sums": {"device_grad_sums": 3}, "nvme": {"nvme_dir": "NVME"}}


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (ROWS, SEQ), generator=g) for _ in range(n)]


def _optimizer(model: torch.nn.Module, eps: float = 1e-8) -> torch.optim.AdamW:
    """Two param groups (no decay for the norms), with a schedule: both must reach every rank's shards alike."""
    decay = [p for n, p in model.named_parameters() if "norm" not in n]
    rest = [p for n, p in model.named_parameters() if "norm" in n]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=eps,
    )


def _train(
    run: str, world: int, rank: int | None = None, group=None, save: str | None = None, **options
) -> tuple[dict, dict]:
    """Train `run` on rank `rank`'s rows of each global batch with the engine (`rank` None: ordinary training
    doing what `world` DDP ranks do, in one process); the final parameters, and the engine's counters.
    `save`: the engine's checkpoint goes there at the end."""
    steps, micro, clip = RUNS[run]
    model = own_llama(layers=3) if run != "tied" else _tied_llama()
    # "twice": where a block's two calls nearly cancel, their sum rounds differently when each call is
    # exchanged first; a first Adam step with eps 1e-8 turns that into lr-sized differences of tiny
    # gradients. A larger eps keeps the comparison about the gradients.
    opt = _optimizer(model, eps=1e-4 if run == "twice" else 1e-8)
    engine = None
    if rank is not None:
        config = EngineConfig(
            **{"device": "cpu", "precision": "32-true", "group": group, "accumulating": True, **options}
        )
        engine = Engine(model, config)
    step = opt if engine is None else engine.optimizer(opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    batches, per = _batches(steps * micro), ROWS // world
    params = [p for g in opt.param_groups for p in g["params"]]
    trained = [p for p in params if p.requires_grad]
    for s in range(steps):
        for k in range(micro):
            batch, last = batches[s * micro + k], k == micro - 1
            if engine is not None:
                with engine.backward(accumulate=not last, clip=bool(clip) and last):
                    (_loss(run, model, batch[rank * per : (rank + 1) * per]) / micro).backward()
                continue
            mean = None  # the micro-batch's gradient: the ranks' parts, each divided by W, summed in rank order
            for r in range(world):
                grads = torch.autograd.grad(_loss(run, model, batch[r * per : (r + 1) * per]) / micro, trained)
                mean = [g / world for g in grads] if mean is None else [m + g / world for m, g in zip(mean, grads)]
            for p, g in zip(trained, mean):  # then summed over micro-batches, as the engine's accumulator does
                p.grad = g if p.grad is None else p.grad + g
        if clip and engine is None:
            torch.nn.utils.clip_grad_norm_(params, clip)  # (in the optimizer's order, as the engine takes it)
        elif clip:
            engine.clip_grad_norm_(clip)
        step.step()
        step.zero_grad()
        sched.step()
    stats = {}
    if engine is not None:
        if save:
            engine.save(save)
        engine.flush()
        stats = {**engine.stats, **engine.host_bytes(), "host_cpus": engine.host_cpus}
        engine.close()  # each rank gets the whole trained model back
    return {n: p.detach().clone() for n, p in model.named_parameters()}, stats


def _tied_llama() -> torch.nn.Module:
    from megatrain_lightning.models import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.from_preset("tiny", num_hidden_layers=3, tie_word_embeddings=True))
    model.model.layers[1].mlp.requires_grad_(False)
    return model


def _loss(run: str, model: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
    if run == "twice":  # every block is called twice before the backward: its calls' gradients are summed
        return own_loss(model, rows) + own_loss(model, rows.flip(1))
    return own_loss(model, rows)


def _rank(rank: int, world: int, out: str) -> None:
    with gloo_rank(rank, world, out):
        if world == 2:
            with open(f"{out}/refusals{rank}.json", "w") as f:
                json.dump(_refusals(dist.group.WORLD), f)
        if world == 2:
            _late_streams(rank, world, out)
            for name, options in LAYOUTS.items():
                options = {k: f"{out}/nvme{rank}" if v == "NVME" else v for k, v in options.items()}
                os.makedirs(options.get("nvme_dir", out), exist_ok=True)
                params, _ = _train("plain", world, rank, dist.group.WORLD, save=f"{out}/{name}.ckpt", **options)
                if rank == world - 1:
                    save_file(params, f"{out}/{name}.safetensors")
            # Speculative steps (bf16: they write a spare compute copy; steps waiting for opt.step()): each rank
            # speculates on its shards, and the run is the one without them.
            for name, speculative in (("bf16", False), ("speculative", True)):
                bf16 = dict(precision="bf16-true", overlap_optimizer=False, speculative_step=speculative)
                params, stats = _train("plain", world, rank, dist.group.WORLD, **bf16)
                if rank == world - 1:
                    save_file(params, f"{out}/{name}.safetensors")
                    with open(f"{out}/{name}.json", "w") as f:
                        json.dump([stats["speculative_kept"], stats["speculative_discarded"]], f)
            # A checkpoint read back into the moments' files, and written again from them.
            model = own_llama(layers=3)
            engine = Engine(model, EngineConfig(device="cpu", precision="32-true", group=dist.group.WORLD, **options))
            engine.optimizer(_optimizer(model))
            engine.load(f"{out}/nvme.ckpt")
            engine.save(f"{out}/again.ckpt")
            engine.close()
        for run in RUNS:
            params, stats = _train(run, world, rank, dist.group.WORLD, save=f"{out}/{run}.ckpt" if world == 2 else None)
            with open(f"{out}/{run}{rank}.json", "w") as f:
                json.dump(stats, f)
            if rank == world - 1:  # (the last rank: its shards are the short ones)
                save_file(params, f"{out}/{run}.safetensors")


def _late_streams(rank: int, world: int, out: str) -> None:
    """The plain run on copy streams that run late (tests/async_streams.py, everything held until waited
    for), as issued, and with each all-gather run at once instead of on the H2D stream after the upload of
    its rank's shard (skipped): that one reads shards not uploaded yet."""
    from megatrain_lightning.engine import build as build_module
    from tests.async_streams import AsyncStreams

    for name, skip in (("late", ()), ("skipped", (("collective", "run"),))):
        made: list[AsyncStreams] = []

        def late(device, skip=skip, made=made):
            made.append(AsyncStreams(device, hold=1.0, skip=skip))
            return made[-1]

        build_module.Streams = late
        try:
            params, _ = _train("plain", world, rank, dist.group.WORLD)
        except RuntimeError as error:  # the engine's self-check: a recompute saw other weights than its forward
            if name != "skipped":
                raise
            params = {"stopped": torch.tensor([1.0])}
            with open(f"{out}/{name}{rank}.stopped", "w") as f:
                f.write(str(error))
        finally:
            build_module.Streams = Streams
        if rank == world - 1:
            save_file(params, f"{out}/{name}.safetensors")
        with open(f"{out}/{name}{rank}.json", "w") as f:
            json.dump(sum(s.skipped[("collective", "run")] for s in made), f)


def _refusals(group) -> list[str]:
    """What a partitioned engine refuses, in one line each: the calls that need every parameter whole in
    one process."""
    said = []
    model = own_llama(layers=2)
    engine = Engine(model, EngineConfig(device="cpu", group=group))
    opt = engine.optimizer(torch.optim.AdamW(model.parameters()))
    for call in (
        engine.master_state_dict,
        engine.host_view().__enter__,
        opt.state_dict,
        model.model.layers[0].state_dict,
    ):
        try:
            call()
        except RuntimeError as err:
            said.append(str(err))
    said.append(str(float(model.model.layers[0].mlp.up_proj.weight.detach().sum())))  # no rank holds it whole: NaN
    engine.close()
    return said


def _read_back(url: str) -> dict:
    """A checkpoint's weights and optimizer state, as an unpartitioned engine in this process reads them."""
    model = own_llama(layers=3)
    with Engine(model, EngineConfig(device="cpu", precision="32-true")) as engine:
        opt = engine.optimizer(_optimizer(model))
        engine.load(url)
        return {k: v.clone() for k, v in engine.master_state_dict().items()} | {"opt": opt.state_dict()["state"]}


def _tensors(state: dict) -> list[torch.Tensor]:
    return [v for k, v in state.items() if k != "opt"] + [
        t for s in state["opt"].values() for t in (s["step"], s["exp_avg"], s["exp_avg_sq"])
    ]


@pytest.mark.usefixtures("torch_adam")
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_train_as_ordinary_training_does_what_ddp_does(world, tmp_path):
    mp.spawn(_rank, args=(world, str(tmp_path)), nprocs=world, join=True)
    for run in RUNS:
        params, reference = load_file(f"{tmp_path}/{run}.safetensors"), _train(run, world)[0]
        start = (own_llama(layers=3) if run != "tied" else _tied_llama()).state_dict()
        assert params.keys() == reference.keys()
        for name, ref in reference.items():
            # (every trained tensor moved, the frozen ones did not: the comparison is not vacuous)
            assert torch.equal(ref, start[name]) == (".layers.1.mlp." in name and run == "tied"), name
            if run in ("plain", "tied"):
                assert torch.equal(params[name], ref), name
            else:  # clipped, or two calls' gradients each exchanged before they are summed (one sum, ordinarily)
                err = ((params[name] - ref).abs().max() / ref.abs().max()).item()
                assert err < BOUND[run], f"{name}: {err:.2e} relative"
    if world == 2:
        # Late copy streams change nothing, nor the lean layout, the sums on the device or the NVMe tier; the
        # all-gather issued off the stream does.
        plain = load_file(f"{tmp_path}/plain.safetensors")
        for name in ("late", *LAYOUTS):
            assert all(torch.equal(t, plain[n]) for n, t in load_file(f"{tmp_path}/{name}.safetensors").items()), name
        # Their checkpoints hold the same state, as one process reads it; and so does the NVMe tier's, read
        # back into its files and written again.
        states = [_read_back(f"{tmp_path}/{name}.ckpt") for name in ("plain", *LAYOUTS, "again")]
        for state in states[1:]:
            assert all(torch.equal(a, b) for a, b in zip(_tensors(state), _tensors(states[0]), strict=True))
        assert torch.equal(states[0]["lm_head.weight"], plain["lm_head.weight"])
        bf16, speculated = (load_file(f"{tmp_path}/{name}.safetensors") for name in ("bf16", "speculative"))
        assert all(torch.equal(t, bf16[n]) for n, t in speculated.items())
        steps, units = RUNS["plain"][0], 3 + 3  # blocks, and the embedding, final norm and head
        assert [json.loads((tmp_path / f"{n}.json").read_text()) for n in ("bf16", "speculative")] == [
            [0, 0],
            [steps * units, 0],
        ]
        # Reading shards not uploaded yet changes the training: the recompute self-check stops it (on a rank
        # that saw other weights in the recompute than in the forward), or the weights come out different.
        skipped = load_file(f"{tmp_path}/skipped.safetensors")
        stopped = [p.read_text() for p in tmp_path.glob("skipped*.stopped")]
        assert all("recompute in backward did not reproduce its forward" in s for s in stopped), stopped
        assert stopped or any(not torch.equal(t, plain[n]) for n, t in skipped.items())
        with open(f"{tmp_path}/skipped0.json") as f:
            assert json.load(f) > 0
        with open(f"{tmp_path}/refusals0.json") as f:
            said = json.load(f)
        assert len(said) == 5
        assert all("each data-parallel rank holds 1/W" in s or "ranks holds 1/W" in s for s in said[:4]), said
        assert said[4] == "nan"
    # Each rank holds and moves about 1/W of what one process does (a unit's shards are equal up to rounding).
    whole = _train("plain", 1, 0)[1]
    assert whole["allgather_bytes"] == whole["reduce_scatter_bytes"] == 0
    ranks = []
    for r in range(world):
        with open(f"{tmp_path}/plain{r}.json") as f:
            ranks.append(json.load(f))
    for stats in ranks:
        for key in ("master", "adam", "acc", "h2d_bytes", "d2h_bytes"):
            assert stats[key] == pytest.approx(whole[key] / world, rel=0.03), key
        assert stats["allgather_bytes"] >= whole["h2d_bytes"]  # the device gathers the whole of each upload
        assert stats["reduce_scatter_bytes"] >= whole["d2h_bytes"]
    assert sum(s["master"] for s in ranks) == whole["master"]  # one copy of the state between the ranks
    # The ranks on this machine split its CPUs for their host threads (one each, shared, when there are fewer).
    cpus = sorted(usable_cpus())
    assert [s["host_cpus"] for s in ranks] == [rank_cpus(r, world, set(cpus), {}) for r in range(world)]
    if len(cpus) >= world:
        assert sorted(c for s in ranks for c in s["host_cpus"]) == cpus
    assert whole["host_cpus"] is None


def test_ranks_split_a_machines_cpus_node_by_node():
    nodes = {0: list(range(8)), 1: list(range(8, 16))}
    everything = set(range(16))
    assert [rank_cpus(r, 4, everything, nodes) for r in range(4)] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 10, 11],
        [12, 13, 14, 15],
    ]
    # Interleaved node numbering: each rank's share still lies on one node.
    odd_even = {0: list(range(0, 16, 2)), 1: list(range(1, 16, 2))}
    assert rank_cpus(1, 2, everything, odd_even) == list(range(1, 16, 2))
    assert [len(rank_cpus(r, 4, set(range(6)), {})) for r in range(4)] == [2, 2, 1, 1]
    assert [rank_cpus(r, 3, {0, 1}, {}) for r in range(3)] == [[0], [1], [0]]


def _cuda_paths(rank: int, world: int, out: str) -> None:
    """Decisions of a partitioned engine that only show on GPUs, taken with stand-ins on the CPU: the slot
    count after ``num_slots="auto"`` when one rank's allocation fails midway, the blocks whose steps a forward
    waits for before each block runs, and what stays page-locked after close in fp32."""
    from megatrain_lightning.engine import Probes
    from megatrain_lightning.engine.host import pinned

    said: dict = {}
    with gloo_rank(rank, world, out):
        model = own_llama(layers=4)
        probes = Probes(device_free_bytes=lambda: 2**40, step_transient_bytes=lambda: 0)  # room for a slot per block
        config = EngineConfig(device="cpu", precision="32-true", group=dist.group.WORLD, num_slots="auto")
        engine = Engine(model, config, probes=probes)
        if rank == 1:  # this rank's device runs out after one more slot (fragmentation)
            grow = engine.pool.grow

            def short(n: int) -> None:
                grow(1)
                raise torch.OutOfMemoryError("out of memory (stand-in)")

            engine.pool.grow = short
        opt = engine.optimizer(_optimizer(model))
        order: list[tuple[str, int]] = []
        index = {id(u): i for i, u in enumerate(engine.units)}
        wait = engine.host.wait
        engine.host.wait = lambda unit: (order.append(("wait", index.get(id(unit), -1))), wait(unit))[1]
        for i, blk in enumerate(model.model.layers):
            blk.register_forward_pre_hook(lambda *_, i=i: order.append(("forward", i)))
        batches = _batches(2)
        for s, batch in enumerate(batches):
            with engine.backward():
                own_loss(model, batch[rank * 3 : rank * 3 + 3]).backward()
            if s == 1:
                break
            order.clear()  # from the first step's optimizer step through the second forward
            opt.step()
            opt.zero_grad()
        said["slots"] = engine.pool.num_slots
        said["order"] = order
        engine.close()
        # fp32 (the master is the pinned DMA source) with page-locking recorded instead of done
        registered: dict[int, int] = {}
        pinned_fakes = {
            "_host_register": lambda ptr, nbytes, flags: registered.setdefault(ptr, nbytes) and 0,
            "_host_unregister": lambda ptr: 0 if registered.pop(ptr, None) is not None else 713,
        }
        for name, fake in pinned_fakes.items():
            setattr(pinned, name, fake)
        model = own_llama(layers=2)
        engine = Engine(model, EngineConfig(device="cpu", precision="32-true", group=dist.group.WORLD, pin_memory=True))
        said["pinned_while_open"] = pinned.registered_bytes()
        engine.close()
        said["pinned_after_close"] = pinned.registered_bytes()
        with open(f"{out}/cuda_paths{rank}.json", "w") as f:
            json.dump(said, f)


def test_ranks_agree_on_slots_prefetch_one_block_ahead_and_unlock_their_shards(tmp_path):
    mp.spawn(_cuda_paths, args=(2, str(tmp_path)), nprocs=2, join=True)
    said = []
    for r in range(2):
        with open(f"{tmp_path}/cuda_paths{r}.json") as f:
            said.append(json.load(f))
    # Rank 1 got one slot more than the pool's two, rank 0 one per block: both keep rank 1's three, so they
    # prefetch the same blocks and issue their all-gathers in the same order.
    assert [s["slots"] for s in said] == [3, 3]
    for s in said:
        # A prefetch is a collective, so it waits for its block's step: in the forward, never for a block
        # beyond the next one, so the host steps keep overlapping the compute (with a deeper prefetch the
        # first block would wait for the steps of as many blocks as there are slots).
        order = [tuple(e) for e in s["order"]]
        forwards = [i for i, (what, _) in enumerate(order) if what == "forward"]
        assert [order[i][1] for i in forwards] == [0, 1, 2, 3]
        for k, at in enumerate(forwards):
            waited = [b for what, b in order[:at] if what == "wait"]
            assert waited and max(waited) <= k, (k, order)
        # In fp32 the master shards were page-locked; none stays locked after close.
        assert s["pinned_while_open"] > 0 and s["pinned_after_close"] == 0


# -- one rank: the ordinary case, every collective the identity ----------------------------------------------------
def test_one_rank_lays_out_whole_units_and_every_collective_is_the_identity():
    one = ranks_of(None)
    assert isinstance(one, OneRank)
    assert (one.rank, one.world, one.local_rank, one.local_world) == (0, 1, 0, 1)
    for n in (1, 7, 1000):
        assert one.chunk(n) == one.padded(n) == n and one.bounds(n) == one.bounds(n, 0) == (0, n)
    assert one.unit_shard(10) == (None, None)  # a HostUnit's defaults: the whole unit, aligned per parameter
    flat = torch.arange(12, dtype=torch.bfloat16)
    before = flat.clone()
    assert one.gather(flat) is None and torch.equal(flat, before)  # nothing gathered, nothing written
    # The gradient itself, not a copy: no fp32 round trip, no division by the one rank.
    assert one.reduce_scatter(flat, 12) is flat and flat.dtype == torch.bfloat16 and torch.equal(flat, before)
    flags = [True, False]
    assert one.any_rank(flags) is flags
    host = torch.ones(3)
    assert one.sum(host) is host and torch.equal(host, torch.ones(3))
    assert one.gather_host(host, 3) is host
    assert one.least(5) == 5
    measure = lambda: 123  # noqa: E731
    assert one.least_of(measure) is measure
    norms = {11: torch.tensor(2.0), 13: torch.tensor(3.0)}
    assert one.norms(norms, [13, 12, 11]) == [norms[13], norms[11]]  # the optimizer's order, as they are
    assert [one.prefetch_depth(k, forward) for k in (0, 1, 5) for forward in (True, False)] == [0, 0, 1, 1, 5, 5]
    assert one.host_cpus() is None and one.share_note() == ""
    assert one.whole_here and one.late_steps and one.stages_uploads and one.adds_stray_grads and not one.ships_absent


# torch.distributed's calls that need a process group: none may run with one rank, which needs none.
DIST_CALLS = (
    "get_rank",
    "get_world_size",
    "get_backend",
    "new_group",
    "all_gather",
    "all_gather_into_tensor",
    "all_to_all_single",
    "all_reduce",
    "reduce_scatter_tensor",
    "broadcast",
    "barrier",
)


def test_one_rank_engine_trains_saves_and_restores_with_no_distributed_call(monkeypatch, tmp_path):
    called: list[str] = []

    def refused(name: str):
        def call(*args, **kwargs):
            called.append(name)  # (and raised: a caller that catches errors does not hide it)
            raise AssertionError(f"torch.distributed.{name} called with one rank")

        return call

    for name in DIST_CALLS:
        monkeypatch.setattr(dist, name, refused(name))
    model = own_llama(layers=2)
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true", accumulating=True))
    assert isinstance(engine.ranks, OneRank) and engine.host_cpus is None
    opt = engine.optimizer(_optimizer(model))
    for last, batch in zip((False, True), _batches(2)):
        with engine.backward(accumulate=not last, clip=last):
            own_loss(model, batch).backward()
    engine.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
    engine.save(str(tmp_path / "one.ckpt"))
    engine.load(str(tmp_path / "one.ckpt"))
    engine.close()
    assert called == []


# Tests of the number of ranks: the rank code (engine/ranks.py) alone may take them; elsewhere the engine and
# the checkpoint store ask the rank object (its collectives, or a named decision such as ``whole_here``).
COUNT_TESTS = (
    r"\bpartition is (not )?None",
    r"\branks is (not )?None",
    r"getattr\([^)]*[\"'](partition|ranks)[\"']",
    r"\bworld\s*(==|!=|>=|<=|>|<)\s*\d",
    r"\d\s*(==|!=|>=|<=|>|<)\s*[\w.]*world\b",
    r"\bworld_size\(",
    r"isinstance\([^)]*\b(OneRank|Partition)\b",
)


def test_no_engine_module_counts_the_ranks():
    import re
    from pathlib import Path

    package = Path(__file__).resolve().parents[1] / "megatrain_lightning"
    files = [p for p in sorted((package / "engine").rglob("*.py")) if p != package / "engine" / "ranks.py"]
    files.append(package / "checkpoint" / "store.py")
    found = [
        f"{path.relative_to(package)}:{n}: {line.strip()}"
        for path in files
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if any(re.search(pattern, line) for pattern in COUNT_TESTS)
    ]
    assert not found, found
