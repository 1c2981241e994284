"""The streaming engine on its own: memory accounting, upload schedule, saved tensors, RNG replay."""

from __future__ import annotations

import copy
import gc
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

from megatrain_lightning import Engine, EngineConfig
from megatrain_lightning.engine import Probes
from megatrain_lightning.engine.build import worker_init
from megatrain_lightning.engine.host.units import HostUnit
from megatrain_lightning.engine.optimizer import HostAdamW
from megatrain_lightning.planning.device_memory import SLOT_RESERVE_BYTES
from tests.helpers import CausalLM, fit, hf_llama, own_llama, own_loop, params_of, token_batches, twin
from tests.streamed import precision_of


def train_steps(engine: Engine, model: nn.Module, steps: int) -> list[float]:
    return own_loop(model, engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3)), token_batches(steps))


def test_device_bytes_do_not_grow_with_depth():
    """Weight slots, gradient slots and the outer parameters are the same for 4 and 16 blocks."""
    shallow, deep = (Engine(own_llama(n), EngineConfig(device="cpu", precision="bf16-true")) for n in (4, 16))
    assert shallow.device_bytes() == deep.device_bytes()
    assert deep.host_bytes()["master"] > 3 * shallow.host_bytes()["master"]  # the host holds the depth


@pytest.mark.parametrize(("dtype", "per_param"), [(torch.bfloat16, 16), (torch.float32, 16)])
def test_host_bytes_per_parameter(dtype, per_param):
    """After a step: fp32 master 4 + Adam m, v 8 + bf16 copy 2 + bf16 slab 2 = 16 bytes/param;
    in fp32 the master is the transfer copy itself, and the slab is fp32: 4 + 8 + 4 = 16."""
    model = own_llama(4)
    engine = Engine(model, EngineConfig(device="cpu", precision=precision_of(dtype)))
    train_steps(engine, model, 1)
    assert sum(engine.host_bytes().values()) == per_param * engine.num_parameters()
    assert engine.host_bytes()["acc"] == 0  # the fp32 accumulator only exists while accumulating


@pytest.mark.parametrize("slots", [2, 3])
def test_backward_does_not_reupload_resident_blocks(slots):
    """Each training step uploads every block for forward, then only the blocks forward evicted. The
    optimizer step already issues block 0 for the next forward (and the blocks after it whose steps are
    done), so the forward after the last step uploads the rest: every block once."""
    layers = 6
    model = own_llama(layers)
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true", num_slots=slots))
    train_steps(engine, model, 3)
    assert engine.pool.slot_of(0) is not None
    assert 1 <= engine.pool.uploads - 3 * (layers + layers - slots) <= slots - 1
    with torch.no_grad():
        model(token_batches(1)[0])
    assert engine.pool.uploads == 3 * (layers + layers - slots) + layers


def count_saved(model: nn.Module, batch: torch.Tensor) -> int:
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        model(batch, targets=batch)
    return len(saved)


def test_each_block_saves_only_its_input():
    """Going from 2 to 6 blocks adds exactly 4 saved tensors (one block input each) to the graph."""
    batch = token_batches(1)[0]
    counts = []
    for layers in (2, 6):
        model = own_llama(layers)
        Engine(model, EngineConfig(device="cpu", precision="32-true"))
        counts.append(count_saved(model, batch))
    assert counts[1] - counts[0] == 4


def test_evaluation_builds_no_graph():
    model = own_llama(3)
    Engine(model, EngineConfig(device="cpu", precision="bf16-true"))
    batch = token_batches(1)[0]
    with torch.no_grad():
        out = model(batch)
    assert out.grad_fn is None
    saved = []
    with torch.no_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        model(batch)
    assert saved == []


def test_release_returns_an_ordinary_model():
    model = own_llama(3)
    reference = copy.deepcopy(model)
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true"))
    engine.close()
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)
    batch = token_batches(1)[0]
    assert torch.equal(model(batch), reference(batch))


def test_three_slots_equal_ordinary_training(monkeypatch):
    monkeypatch.setenv("MEGATRAIN_CPU_ADAM", "torch")
    from megatrain_lightning import MegatrainStrategy

    a, b = twin(hf_llama)
    ref, mt = CausalLM(a), CausalLM(b)
    batches = token_batches(8)
    fit(ref, batches, strategy="auto")
    fit(mt, batches, strategy=MegatrainStrategy(num_slots=3))
    assert mt.losses == ref.losses
    assert all(torch.equal(x, y) for x, y in zip(params_of(mt.model).values(), params_of(ref.model).values()))


def test_dropout_is_replayed_in_the_recompute(monkeypatch):
    """With attention dropout the recompute must draw the same masks as the forward: bitwise equal training."""
    monkeypatch.setenv("MEGATRAIN_CPU_ADAM", "torch")
    a, b = twin(lambda: hf_llama(attention_dropout=0.3))
    ref, mt = CausalLM(a), CausalLM(b)
    batches = token_batches(6)
    torch.manual_seed(123)
    fit(ref, batches, strategy="auto")
    torch.manual_seed(123)
    fit(mt, batches, strategy="megatrain")
    assert mt.losses == ref.losses
    assert all(torch.equal(x, y) for x, y in zip(params_of(mt.model).values(), params_of(ref.model).values()))


def test_frozen_embedding_still_trains_blocks(monkeypatch):
    """A frozen embedding feeds the first block an input without grad; the blocks must train anyway."""
    monkeypatch.setenv("MEGATRAIN_CPU_ADAM", "torch")

    class Frozen(CausalLM):
        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-2)

    a, b = twin(hf_llama)
    for m in (a, b):
        m.model.embed_tokens.weight.requires_grad_(False)
    ref, mt = Frozen(a), Frozen(b)
    start = params_of(b)
    batches = token_batches(6)
    fit(ref, batches, strategy="auto")
    fit(mt, batches, strategy="megatrain")
    end = params_of(mt.model)
    assert torch.equal(end["model.embed_tokens.weight"], start["model.embed_tokens.weight"])
    assert not torch.equal(end["model.layers.0.mlp.up_proj.weight"], start["model.layers.0.mlp.up_proj.weight"])
    assert mt.losses == ref.losses


@pytest.mark.parametrize("clip", [None, 1.0])
def test_blocks_step_during_backward_unless_clipping(clip):
    """Without clipping every block is stepped by the time backward returns (the host step overlaps the
    rest of backward); with clipping nothing steps before the global norm is known."""
    model = own_llama(4)
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true"))
    opt = engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    batch = token_batches(1)[0]
    with engine.backward(clip=clip is not None):
        model(batch, targets=batch).backward()
    engine.flush()
    assert [u.steps for u in engine.units] == [[0 if clip else 1] * len(u.entries) for u in engine.units]
    if clip:
        engine.clip_grad_norm_(clip)
    opt.step()
    engine.flush()
    assert all(u.steps == [1] * len(u.entries) for u in engine.all_units())


def test_stats_count_transfers():
    """Byte counters follow the upload schedule: per step L + (L - S) block uploads plus the outer copies
    (the last step has already issued block 0 for the forward after it)."""
    layers = 4
    model = own_llama(layers)
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true"))
    start = dict(engine.stats)
    train_steps(engine, model, 2)
    block = engine.units[0].numel * 4
    outer = sum(u.numel for u in engine.outer_units) * 4
    assert engine.stats["h2d_bytes"] - start["h2d_bytes"] == 2 * ((2 * layers - 2) * block + outer) + block
    assert engine.stats["d2h_bytes"] - start["d2h_bytes"] == 2 * (layers * block + outer)
    assert engine.stats["host_step_seconds"] > 0


def test_saved_block_inputs_are_freed_after_backward():
    """A loss the user keeps (plain loops, manual optimization) keeps autograd's nodes alive; the input each
    block saved for its recompute must still be freed by backward (one hidden state per block otherwise:
    8 GiB at 32k tokens for an 8B model)."""
    model = own_llama(3)
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true"))
    engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    saved = []
    for blk in engine.blocks:
        blk.register_forward_pre_hook(lambda module, args: saved.append(weakref.ref(args[0])))
    batch = token_batches(1)[0]
    loss = model(batch, targets=batch)
    gc.collect()
    assert len(saved) == 3 and all(ref() is not None for ref in saved)  # held for the recompute
    loss.backward()
    gc.collect()
    assert loss.grad_fn is not None  # the graph object is still referenced ...
    assert all(ref() is None for ref in saved)  # ... but no block input is


class SpyEvent:
    """A copy event that records whether the host waited for it."""

    def __init__(self) -> None:
        self.waited = False

    def synchronize(self) -> None:
        self.waited = True

    def query(self) -> bool:
        return self.waited


def test_compute_copies_are_rewritten_only_after_their_uploads(monkeypatch):
    """Loading weights rewrites every pinned compute copy; an upload still reading one must finish first."""
    engine = Engine(own_llama(2), EngineConfig(device="cpu", precision="bf16-true"))
    events = {unit.name: SpyEvent() for unit in engine.all_units()}
    for unit in engine.all_units():
        unit.upload_done = events[unit.name]
    rewrites = []
    refresh = HostUnit.refresh_copy

    def checked(unit: HostUnit) -> None:
        rewrites.append(events[unit.name].waited)
        refresh(unit)

    monkeypatch.setattr(HostUnit, "refresh_copy", checked)
    engine.refresh_from_masters()
    assert len(rewrites) == len(engine.all_units()) and all(rewrites)


def test_release_waits_for_the_copy_streams_before_freeing_device_buffers(monkeypatch):
    engine = Engine(own_llama(2), EngineConfig(device="cpu", precision="bf16-true"))
    slots, seen = engine.pool.num_slots, []
    monkeypatch.setattr(engine.streams, "synchronize", lambda: seen.append(len(engine.pool.buffers)))
    engine.close()
    assert seen == [slots] and engine.pool.buffers == []


def test_host_worker_thread_uses_the_engines_gpu(monkeypatch):
    """The worker waits on CUDA events; without set_device it would create a context on GPU 0. The current
    device is per thread: it is set on the worker's own thread, for a CUDA engine only. That the engine's
    worker runs worker_init with its settings: tests/test_threads.py (the engine's worker runs on its budget)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append((threading.get_ident(), device)))
    with ThreadPoolExecutor(max_workers=1) as thread:  # worker_init sets the calling thread's torch threads
        worker = thread.submit(threading.get_ident).result()
        thread.submit(worker_init, torch.device("cuda", 1)).result()
        thread.submit(worker_init, torch.device("cpu")).result()
    assert calls == [(worker, torch.device("cuda", 1))]


@pytest.mark.parametrize("clip", [None, 0.5])
def test_outer_parameters_are_current_when_the_optimizer_step_returns(clip):
    """What a callback (an EMA of the weights, a norm logger) reads right after a step is the stepped
    weights: every outer parameter's device copy equals its master once optimizer_step returns, with the
    optimizer overlapping backward or (clipping) stepping after it."""
    model = own_llama(3)
    engine = Engine(model, EngineConfig(device="cpu", precision="bf16-true", clipping=clip is not None))
    opt = engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    for batch in token_batches(3):
        with engine.backward(clip=clip is not None):
            model(batch, targets=batch).backward()
        if clip is not None:
            engine.clip_grad_norm_(clip)
        opt.step()
        for unit in engine.outer_units:
            (entry,) = unit.entries
            assert torch.equal(entry.param.detach().reshape(-1), unit.master.to(torch.bfloat16)), unit.name
        opt.zero_grad()
    engine.close()


# -- num_slots="auto" -------------------------------------------------------------------------------------
def auto_slots_engine(model: nn.Module, extra_slots: int, transient: int = 10**6) -> Engine:
    """An engine with num_slots="auto" whose device reports, after the first step, room for `extra_slots`
    more slots (and half of one) beyond four times a `transient` step and the reserve
    (device_memory.auto_slot_count)."""
    free: list[int] = []  # filled once the engine knows its slot size
    probes = Probes(device_free_bytes=lambda: free[0], step_transient_bytes=lambda: transient)
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true", num_slots="auto"), probes)
    free.append(4 * transient + SLOT_RESERVE_BYTES + extra_slots * engine.pool.slot_bytes + engine.pool.slot_bytes // 2)
    return engine


def traced_steps(engine: Engine, model: nn.Module, steps: int) -> tuple[list[float], list[int], int]:
    """own_loop's steps, then a forward without grad: the losses, the slots each step started with and the
    blocks uploaded in all (an optimizer step issues some of the next forward's, as many as are stepped)."""
    opt = engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    losses, slots = [], []
    for batch in token_batches(steps):
        slots.append(engine.pool.num_slots)
        loss = model(batch, targets=batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    engine.flush()
    with torch.no_grad():
        model(token_batches(1)[0])
    return losses, slots, engine.pool.uploads


def test_auto_slots_grow_after_the_first_step_and_train_the_same():
    """num_slots="auto" streams through 2 slots in the first step, then adds what the memory that step left
    free allows (here 3 more of a block's size): 6 blocks then upload 6 + 1 times a step, not 6 + 4, and
    training is bit for bit that of 2 fixed slots."""
    layers = 6
    ref_model, model = own_llama(layers), own_llama(layers)
    ref = Engine(ref_model, EngineConfig(device="cpu", precision="32-true", num_slots=2))
    engine = auto_slots_engine(model, extra_slots=3)
    losses, slots, uploads = traced_steps(engine, model, 4)
    ref_losses, ref_slots, ref_uploads = traced_steps(ref, ref_model, 4)
    assert slots == [2, 5, 5, 5] and ref_slots == [2] * 4
    assert uploads == (layers + layers - 2) + 3 * (layers + layers - 5) + layers  # the last forward: every block
    assert ref_uploads == 4 * (layers + layers - 2) + layers
    assert losses == ref_losses
    mine, theirs = params_of(model), params_of(ref_model)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


def test_auto_slots_stop_at_one_per_block_and_keep_them_all_resident():
    """With room for more, "auto" takes one slot per block and no more; then a step uploads each block once
    (for its forward, after its weights changed): a backward, and every micro-batch of an accumulation
    after the first, find every block resident."""
    layers = 4
    model = own_llama(layers)
    engine = auto_slots_engine(model, extra_slots=50)
    opt = engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    marks = []
    for batches in [token_batches(2), token_batches(2)]:
        for micro, batch in enumerate(batches):
            loss = model(batch, targets=batch)
            marks.append(engine.pool.uploads)  # after the forward
            with engine.backward(accumulate=micro == 0):
                loss.backward()
            marks.append(engine.pool.uploads)  # after the backward
        opt.step()
        opt.zero_grad()
        marks.append(engine.pool.uploads)
    engine.flush()
    with torch.no_grad():
        model(token_batches(1)[0])
    assert engine.pool.num_slots == layers
    second = marks[5:]  # the step after the pool grew: forward, backward, forward, backward, optimizer
    assert second[1] == second[2] == second[3]  # nothing goes up after the first forward of the step
    # From the first step's last backward on, the weights of step 2 and those after it go up once each
    # (some of them already in the optimizer step before the forward that reads them).
    assert engine.pool.uploads - marks[3] == 2 * layers


def test_auto_slots_need_a_measure_of_device_memory():
    """On the CPU (no free or transient figure) "auto" keeps its 2 slots."""
    model = own_llama(3)
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true", num_slots="auto"))
    assert traced_steps(engine, model, 2)[1] == [2, 2] and engine.pool.num_slots == 2


@pytest.mark.parametrize("bad", [1, 0, True, "many", 2.0, None])
def test_num_slots_is_checked_where_it_enters(bad):
    with pytest.raises(ValueError, match=f"num_slots={bad!r}: give at least 2 slots .* or 'auto'"):
        Engine(own_llama(2), EngineConfig(device="cpu", precision="bf16-true", num_slots=bad))


# -- what a step waits for --------------------------------------------------------------------------------
HOLD_LIMIT_S = 60.0  # a held step runs after this long anyway: a regression fails instead of hanging


def held_step(engine: Engine, block: int) -> tuple[threading.Event, threading.Event]:
    """Hold block `block`'s next Adam step on the worker until the test sets the returned gate; the second
    event is set once that step has run."""
    gate, stepped, step = threading.Event(), threading.Event(), engine.host._step_unit

    def held(unit: HostUnit, *args, **kwargs):
        if unit is not engine.units[block]:
            return step(unit, *args, **kwargs)
        gate.wait(HOLD_LIMIT_S)
        try:
            return step(unit, *args, **kwargs)
        finally:
            stepped.set()

    engine.host._step_unit = held
    return gate, stepped


def clipped_backward(layers: int, num_slots: int = 2) -> tuple[nn.Module, Engine, HostAdamW]:
    """A model after one backward with clipping requested: its steps all wait for the optimizer step."""
    model = own_llama(layers)
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true", num_slots=num_slots, clipping=True))
    opt = engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    batch = token_batches(1)[0]
    with engine.backward(clip=True):
        model(batch, targets=batch).backward()
    engine.clip_grad_norm_(1.0)
    return model, engine, opt


def test_optimizer_step_waits_for_block_0_alone_with_more_slots():
    """With 4 slots the optimizer step issues block 0 for the next forward (waiting for its step) and the
    blocks after it only if their steps are done already: it returns while block 1 is still being stepped."""
    model, engine, opt = clipped_backward(4, num_slots=4)
    gate, stepped = held_step(engine, block=1)
    opt.step()  # had it waited for block 1, it would return only after HOLD_LIMIT_S, the step run
    assert not stepped.is_set()  # returned before block 1's step could run
    assert engine.pool.slot_of(0) is not None and engine.pool.slot_of(1) is None
    gate.set()
    assert stepped.wait(HOLD_LIMIT_S)
    engine.close()


def test_state_dict_waits_for_the_blocks_steps():
    """A block's parameters are views of its master, stepped in the background after the optimizer step
    returns; the model's state_dict() waits for each block's step before reading it."""
    model, engine, opt = clipped_backward(3)
    gate, stepped = held_step(engine, block=2)
    opt.step()
    assert not stepped.is_set()  # block 2's step is still held when state_dict() starts
    asked, wait = [], HostUnit.wait

    def open_when_waited_for(unit: HostUnit) -> None:
        if unit is engine.units[2] and not gate.is_set():
            asked.append(stepped.is_set())
            gate.set()  # the step runs only once state_dict() waits for it: reading earlier sees old weights
        wait(unit)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(HostUnit, "wait", open_when_waited_for)
        state = {k: v.clone() for k, v in model.state_dict().items()}
    assert asked == [False] and stepped.is_set()
    engine.flush()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    engine.close()


class _OddBlock(nn.Module):
    """Parameters of odd sizes: packed back to back, every one after the first would start off a 16-byte
    boundary (a 7x7 weight is 49 elements)."""

    def __init__(self, width: int = 7) -> None:
        super().__init__()
        self.up = nn.Linear(width, width)
        self.gain = nn.Parameter(torch.ones(width))
        self.down = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.tanh(self.up(h)) * self.gain)


class _OddLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 7)
        self.layers = nn.ModuleList(_OddBlock() for _ in range(3))
        self.head = nn.Linear(7, 11)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _odd_run(precision: str, layout: str, ids: torch.Tensor) -> tuple[nn.Module, list[int], list[int]]:
    """Train an _OddLM with the engine; the model, where each block parameter started in each call, and
    the packed host offsets of block 0."""
    torch.manual_seed(0)
    model = _OddLM()
    engine = Engine(model, EngineConfig(device="cpu", precision=precision, host_layout=layout, piece=30))
    opt = engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    starts: list[int] = []
    for block in model.layers:  # where each parameter the block computes with starts (inside the call)
        block.down.register_forward_pre_hook(lambda *_, b=block: starts.extend(p.data_ptr() for p in b.parameters()))
    for batch in ids:
        with engine.backward():
            _odd_loss(model, batch).backward()
        opt.step()
        opt.zero_grad()
    engine.close()
    return model, starts, [e.offset for e in engine.units[0].layout]


def _odd_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch)
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten())


@pytest.mark.parametrize("layout", ["default", "lean"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_odd_sized_parameters_start_aligned_in_their_slot_and_train_exactly(monkeypatch, precision, layout):
    """In a weight slot every parameter starts on a 16-byte boundary (engine/host/units.py, slot_layout), though the
    host buffers stay packed: the upload copies each stretch the padding separates to its place (the lean
    layout's staging pieces cut here across parameters too). Training is bit for bit the packed slot's, and
    in fp32 ordinary training's."""
    from megatrain_lightning.engine.host import units as host_module

    monkeypatch.setenv("MEGATRAIN_CPU_ADAM", "torch")
    ids = torch.randint(0, 11, (4, 2, 6), generator=torch.Generator().manual_seed(3))
    model, starts, packed = _odd_run(precision, layout, ids)
    assert len(starts) == 3 * 5 * 2 * len(ids)  # every parameter, in the forward and the recompute
    assert all(p % 16 == 0 for p in starts)
    assert any(o * (4 if precision == "32-true" else 2) % 16 for o in packed)  # the host layout is packed
    monkeypatch.setattr(host_module, "SLOT_ALIGN_BYTES", 1)  # the slot packed like the host buffers
    unpadded, starts, _ = _odd_run(precision, layout, ids)
    assert any(p % 16 for p in starts)  # (so the padding above did something)
    for (name, a), b in zip(unpadded.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name
    if precision == "32-true":
        torch.manual_seed(0)
        ref = _OddLM()
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for batch in ids:
            _odd_loss(ref, batch).backward()
            opt.step()
            opt.zero_grad()
        for (name, a), b in zip(ref.named_parameters(), model.parameters()):
            assert torch.equal(a, b), name


class BlocksOnly(nn.Module):
    """A model that is nothing but its blocks: no embedding, norm or head outside them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return x


def test_a_model_with_nothing_outside_its_blocks_trains_as_ordinary_training(tmp_path, monkeypatch):
    """An empty set of outer parameters is a model like any other: clipped steps equal torch's AdamW bit for
    bit, and its checkpoint reads back into a fresh engine."""
    monkeypatch.setenv("MEGATRAIN_CPU_ADAM", "torch")
    model, reference = twin(BlocksOnly)
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true"))
    assert engine.outer_units == []
    opt = engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    start = params_of(reference)
    for x in torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(1)):
        with engine.backward(clip=True):
            model(x).square().mean().backward()
        engine.clip_grad_norm_(0.05)
        opt.step()
        opt.zero_grad()
        reference(x).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        ref_opt.step()
        ref_opt.zero_grad()
    engine.save(str(tmp_path / "ckpt"))
    engine.close()
    trained = params_of(model)
    assert all(not torch.equal(trained[n], start[n]) for n in start)  # (not vacuous: every tensor moved)
    assert all(torch.equal(trained[n], p) for n, p in params_of(reference).items())
    again = BlocksOnly()
    with Engine(again, EngineConfig(device="cpu", precision="32-true")) as fresh:
        fresh.load(str(tmp_path / "ckpt"), optimizer=False)
        assert all(torch.equal(trained[n], p) for n, p in fresh.master_state_dict().items())
