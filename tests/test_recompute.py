"""Blocks that keep their graph from the forward instead of a recompute in backward (engine/device/recompute.py).

The oracle is ordinary training, bit for bit (fp32 on the CPU, the torch optimizer backend): a kept graph
is the graph ordinary training builds, differentiated once. What must not happen is a kept graph reading
weights an upload has since overwritten: its slot is pinned, and the copy-stream double shows the pin is
needed. "auto" is driven with a stand-in free-memory figure (the CPU has none).
"""

from __future__ import annotations

import copy
import gc
import weakref

import lightning.pytorch as L
import pytest
import torch

from megatrain_lightning import Engine, EngineConfig, MegatrainStrategy
from megatrain_lightning.engine.device.recompute import KEEP_SHARE
from megatrain_lightning.engine.device.streams import SlotPool
from megatrain_lightning.engine.probes import Probes
from tests.async_streams import install
from tests.helpers import ZOO, Zoo, hf_llama, hf_loss, params_of, token_batches, trainer
from tests.test_zoo import ACCUMULATE, MODULE_KWARGS, TRAIN_KWARGS, assert_bitwise, seeded_fit

pytestmark = pytest.mark.usefixtures("torch_adam")

LAYERS = 4


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return hf_llama(layers=LAYERS, attention_dropout=0.1)  # dropout on: nothing may draw twice


def train(net: torch.nn.Module, config: EngineConfig | None = None, probes=None, steps=3, forwards=1):
    """AdamW steps with norm clipping, each on `forwards` forwards summed before one backward: ordinary
    training when `config` is None, else through an Engine. Returns (losses, weights, engine stats)."""
    torch.manual_seed(1)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    engine = None if config is None else Engine(net, config, probes)
    opt = opt if engine is None else engine.optimizer(opt)
    losses = []
    for batch in token_batches(steps, batch=2 * forwards):
        loss = sum(hf_loss(net, b) for b in batch.chunk(forwards))
        if engine is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        else:
            with engine.backward(clip=True):
                loss.backward()
            engine.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    stats = {}
    if engine is not None:
        stats = dict(engine.stats, num_slots=engine.pool.num_slots)
        engine.close()
    return losses, params_of(net), stats


def assert_equal(a, b) -> None:
    assert a[0] == b[0]
    assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1]), [
        k for k in a[1] if not torch.equal(a[1][k], b[1][k])
    ]


def cfg(**kw) -> EngineConfig:
    return EngineConfig(device="cpu", precision="32-true", offload_inputs=False, **kw)


@pytest.mark.parametrize("forwards", [1, 2], ids=["one-forward", "two-forwards-one-backward"])
def test_keeping_every_graph_trains_like_ordinary_training(forwards):
    """recompute=False: every call keeps its graph and pins its slot; the pool grows to hold them."""
    ref = train(model(), forwards=forwards)
    ours = train(model(), cfg(recompute=False, num_slots=2), forwards=forwards)
    assert_equal(ours, ref)
    assert ours[2]["kept_calls"] == 3 * LAYERS * forwards  # every call of every step
    assert ours[2]["num_slots"] == LAYERS  # one per block (a prefetch never takes a pinned slot: it waits)


def test_auto_keeps_the_last_blocks_that_fit():
    """From the second step on (the first measures what each block saves), the last blocks keep their graphs
    while their activations fit in KEEP_SHARE of the free memory and two slots stay unpinned."""
    big = Probes(device_free_bytes=lambda: 10**15)
    assert train(model(), cfg(recompute="auto", num_slots=LAYERS + 2), big)[2]["kept_calls"] == 2 * LAYERS
    assert train(model(), cfg(recompute="auto", num_slots=3), big)[2]["kept_calls"] == 2 * 1  # one slot to pin
    assert train(model(), cfg(recompute="auto", num_slots=LAYERS + 2))[2]["kept_calls"] == 0  # no memory figure
    assert train(model(), cfg(recompute=True, num_slots=LAYERS + 2), big)[2]["kept_calls"] == 0

    # Room for two blocks' activations, measured from outside: what an ordinary block call saves for backward.
    saved = block_saved_bytes()
    room = Probes(device_free_bytes=lambda: int(2.5 * saved / KEEP_SHARE))
    ref = train(model())
    ours = train(model(), cfg(recompute="auto", num_slots=LAYERS + 2), room)
    assert ours[2]["kept_calls"] == 2 * 2
    assert_equal(ours, ref)


def block_saved_bytes() -> int:
    """Bytes one ordinary (unstreamed) decoder layer call saves for backward, its weights not counted: each
    storage once."""
    net = model()
    weights = {p.untyped_storage().data_ptr() for p in net.parameters()}
    seen: dict[int, int] = {}
    calls = []

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    layer = net.model.layers[1]
    layer.register_forward_pre_hook(lambda *_: calls.append(len(seen)))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer.register_forward_hook(lambda *_: calls.append(len(seen)))
        hf_loss(net, token_batches(1)[0])
    keys = list(seen)
    return sum(seen[k] for k in keys[calls[0] : calls[1]])


def test_a_kept_graph_pins_its_slot_against_uploads(monkeypatch):
    """With copies that really run late, the pinned slots keep every kept graph's weights; without the pin
    an upload overwrites a slot a graph still reads (an error or a different training). Two forwards before
    one backward: with one, least-recently-used eviction happens to bring each block back into the slot its
    graph reads before its backward, and the missing pin would go unseen."""
    ref = train(model(), forwards=2)
    install(monkeypatch, seed=3, hold=0.3, max_delay=1e-3)
    assert_equal(train(model(), cfg(recompute=False, num_slots=2), forwards=2), ref)

    monkeypatch.setattr(SlotPool, "pin", lambda self, s: None)
    monkeypatch.setattr(SlotPool, "unpin", lambda self, s: None)
    try:
        unpinned = train(model(), cfg(recompute=False, num_slots=2), forwards=2)
    except RuntimeError as e:  # autograd sees the slot rewritten under a saved weight
        assert "modified by an inplace operation" in str(e)
    else:
        assert unpinned[0] != ref[0] or any(not torch.equal(unpinned[1][k], ref[1][k]) for k in ref[1])


class KeptCalls(L.Callback):
    def on_train_end(self, trainer, module):
        self.kept = trainer.strategy.engine.stats["kept_calls"]


def tied_llama() -> torch.nn.Module:
    net = hf_llama(layers=3)
    net.model.layers[2].mlp.up_proj.weight = net.model.layers[0].mlp.up_proj.weight  # shared by two blocks
    return net


@pytest.mark.parametrize("name", ["mixtral-aux", "llama-frozen", "tied"])
def test_kept_graphs_in_lightning_equal_ordinary_training(name):
    """Router aux losses (side outputs), frozen parameters and a parameter shared between blocks, with
    accumulation, clipping and two param groups."""
    entry = {**ZOO, "tied": Zoo(tied_llama)}[name]
    net = entry.make()
    kwargs = dict(MODULE_KWARGS, schedule=2)
    ref = entry.module(copy.deepcopy(net), loss_fn=entry.loss_fn, **kwargs)
    mt = entry.module(net, loss_fn=entry.loss_fn, **kwargs)
    batches = token_batches(2 * ACCUMULATE)
    seeded_fit(trainer("auto", **TRAIN_KWARGS), ref, batches)
    kept = KeptCalls()
    seeded_fit(trainer(MegatrainStrategy(recompute=False), callbacks=[kept], **TRAIN_KWARGS), mt, batches)
    assert_bitwise(ref, mt)
    assert kept.kept > 0


@pytest.mark.parametrize("bad", ["always", 1, None])
@pytest.mark.parametrize("build", [MegatrainStrategy, EngineConfig])
def test_bad_recompute_is_refused_in_one_line(build, bad):
    with pytest.raises(ValueError, match=r"^recompute=.*: choose True .*False .*'auto'") as err:
        build(recompute=bad)
    assert "\n" not in str(err.value)


def test_a_dropped_graph_gives_back_its_slots_and_activations():
    """A forward under grad whose loss is dropped (an evaluation under grad): its kept graphs go with it,
    their slots unpinned and their activations freed, and the next step trains as ordinary training."""
    net = model()
    engine = Engine(net, cfg(recompute=False, num_slots=2))
    kept = []
    net.model.layers[1].mlp.register_forward_pre_hook(lambda m, a: kept.append(weakref.ref(a[0])))  # saved by it
    hf_loss(net, token_batches(1)[0])  # dropped
    gc.collect()
    assert engine.stats["kept_calls"] == LAYERS and engine.pool.num_slots == LAYERS
    assert engine.pool.pinned() == 0 and not any(engine.streamer.open_calls) and kept[0]() is None
    engine.close()


@pytest.mark.parametrize("options", [dict(precision="bf16-mixed"), dict(host_layout="lean", offload_inputs=True)])
def test_a_kept_graph_gives_what_the_recompute_gives(options):
    """In bf16-mixed (where ordinary training's fp32 weights differ from the streamed bf16 copies) the
    oracle is the recompute itself: the kept graph is the graph the recompute would build, bit for bit."""
    base = dict(cfg().__dict__, num_slots=2, **options)
    recomputed = train(model(), EngineConfig(**{**base, "recompute": True}))
    kept = train(model(), EngineConfig(**{**base, "recompute": False}))
    assert kept[2]["kept_calls"] == 3 * LAYERS and recomputed[2]["kept_calls"] == 0
    assert_equal(kept, recomputed)
