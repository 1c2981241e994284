"""Gradient sums kept on the device across micro-batches (engine/device/grad_sums.py): bit for bit the results of the
host path (every micro-batch's gradient landing on the host) and of ordinary training, in a plain loop, the
Trainer and Fabric, with every way a sum goes to the host early; and the downloads they save."""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch
from lightning.fabric import Fabric

from megatrain_lightning import Engine, EngineConfig
from megatrain_lightning.engine.device.grad_sums import auto_sum_count
from megatrain_lightning.engine.host.host_steps import HostSide
from megatrain_lightning.lightning.fabric import MegatrainFabricStrategy
from megatrain_lightning.lightning.strategy import MegatrainStrategy
from tests.helpers import ZOO, CausalLM, assert_same, fit, hf_llama, hf_loss, token_batches, trainer, twin
from tests.test_zoo import ACCUMULATE, MODULE_KWARGS, OPT_STEPS, TRAIN_KWARGS, assert_bitwise, ordinary_fit, seeded_fit

pytestmark = pytest.mark.usefixtures("torch_adam")  # bitwise comparisons need torch's own AdamW arithmetic

LAYERS, MICRO, STEPS = 3, 3, 2
BATCHES = token_batches(MICRO * STEPS)


def loop(model, sums: int | None, clip: str | None = None, between=None, precision="32-true", calls_twice=False):
    """A plain accumulation loop: MICRO micro-batches per step, with the engine (`sums`: its device_grad_sums)
    or without it (None). `between(model, engine, step, micro)` runs after each accumulating backward.
    Returns (losses, total norms, engine stats or None)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    engine = None
    if sums is not None:
        engine = Engine(model, EngineConfig(device="cpu", precision=precision, device_grad_sums=sums))
        opt = engine.optimizer(opt)
    losses, norms = [], []
    for step in range(STEPS):
        for micro in range(MICRO):
            batch = BATCHES[step * MICRO + micro]
            last = micro == MICRO - 1
            loss = hf_loss(model, batch)
            if calls_twice and last:  # the last block called again in one loss: its calls are summed on the host
                hidden = model.model.embed_tokens(batch)
                positions = model.model.rotary_emb(hidden, torch.arange(batch.shape[1])[None])
                loss = loss + model.model.layers[-1](hidden, position_embeddings=positions).square().mean()
            context = nullcontext() if engine is None else engine.backward(accumulate=not last, clip=clip or False)
            with context:
                (loss / MICRO).backward()
            losses.append(loss.item())
            if between is not None and not last:
                between(model, engine, step, micro)
        if clip == "norm":
            if engine is None:
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            else:
                norms.append(engine.grad_norm())
                engine.clip_grad_norm_(1.0)
        elif clip == "value":
            if engine is None:
                torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
            else:
                engine.clip_grad_value_(0.01)
        opt.step()
        opt.zero_grad()
    stats = None
    if engine is not None:
        engine.flush()
        stats = dict(engine.stats, grad_sums=engine.device_bytes()["grad_sums"])
        engine.close()
    return losses, norms, stats


def same_state(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name, t in sa.items():
        assert torch.equal(sb[name], t), name


@pytest.mark.parametrize("clip", [None, "norm", "value"])
def test_device_sums_train_as_the_host_path_and_ordinary_training_bit_for_bit(clip):
    """All blocks, one, none: the same losses, norms and weights as ordinary training; each unit given a sum
    sends one gradient down per step (fp32) instead of one per micro-batch."""
    models = [hf_llama(layers=LAYERS) for _ in range(4)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    ref = loop(models[0], None, clip)
    runs = {n: loop(model, n, clip) for n, model in zip((0, 1, LAYERS), models[1:])}
    for n, (losses, norms, _) in runs.items():
        assert losses == ref[0] and [float(x) for x in norms] == [float(x) for x in ref[1]], n
    for model in models[1:]:
        same_state(model, models[0])
    # Downloads: a unit with a sum (the blocks given one, and then the embedding, norm and head) sends 4
    # bytes/param once per step instead of 4 bytes/param per micro-batch.
    block = sum(p.numel() for p in models[0].model.layers[0].parameters())
    outer = sum(p.numel() for p in models[0].parameters()) - LAYERS * block
    per_step = STEPS * (MICRO - 1) * 4
    assert runs[0][2]["d2h_bytes"] - runs[LAYERS][2]["d2h_bytes"] == per_step * (LAYERS * block + outer)
    assert runs[0][2]["d2h_bytes"] - runs[1][2]["d2h_bytes"] == per_step * (block + outer)
    assert runs[LAYERS][2]["grad_sums"] == 4 * (LAYERS * block + outer) and runs[0][2]["grad_sums"] == 0


def test_clipping_takes_the_norms_of_device_sums_on_the_device(monkeypatch):
    """With every unit summed on the device, the clip's per-parameter norms are taken from each sum before it goes
    down (as from a single micro-batch's gradient): no pass over the landed gradients on the host, whose result
    the clip would otherwise wait for. Without sums, the host takes them. Equal norms either way (the test
    above: bit for bit on the CPU)."""
    taken = []
    host_norms = HostSide._norms
    monkeypatch.setattr(HostSide, "_norms", lambda self, unit: taken.append(unit) or host_norms(self, unit))
    for sums in (LAYERS, 0):
        taken.clear()
        model = hf_llama(layers=LAYERS)
        loop(model, sums, "norm")
        outer = [n for n, _ in model.named_parameters() if not n.startswith("model.layers.")]  # a unit each
        assert len(taken) == (0 if sums else STEPS * (LAYERS + len(outer))), sums


def test_in_bf16_device_sums_add_the_same_fp32_numbers_as_the_host():
    """bf16 gradients, fp32 sums: casting then adding on the device rounds exactly as the host's accumulation."""
    a, b = twin(lambda: hf_llama(layers=LAYERS))
    assert loop(a, 0, precision="bf16-true")[0] == loop(b, LAYERS, precision="bf16-true")[0]
    same_state(a, b)


def _hook_reads_grads(model, engine, step, micro):
    """Gradients shown to hooks between micro-batches: the device sums come down first."""
    if engine is None:
        grads = [p.grad.clone() for p in model.model.layers.parameters()]
    else:
        with engine.gradients_visible():
            grads = [p.grad.clone() for p in model.model.layers.parameters()]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)


def _norm_between(model, engine, step, micro):
    """A gradient norm asked for mid-accumulation (a logger's): the sums come down for it."""
    if engine is None:
        torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    else:
        engine.grad_norm()


def _drop_then_go_on(model, engine, step, micro):
    """zero_grad after the first micro-batch of the first step: that micro-batch's sum is discarded."""
    if step == 0 and micro == 0:
        if engine is None:
            model.zero_grad()
        else:
            engine.zero_grad()


@pytest.mark.parametrize("between", [_hook_reads_grads, _norm_between, _drop_then_go_on], ids=lambda f: f.__name__)
def test_a_sum_wanted_on_the_host_mid_step_comes_down_and_the_host_goes_on_adding(between):
    a, b = twin(lambda: hf_llama(layers=LAYERS))
    assert loop(a, None, between=between)[0] == loop(b, LAYERS, between=between)[0]
    same_state(a, b)


def test_a_block_called_twice_in_one_loss_is_summed_on_the_host_after_its_device_sum():
    """The step's last micro-batch calls a block twice: its device sum of the earlier ones comes down first."""
    a, b = twin(lambda: hf_llama(layers=LAYERS))
    assert loop(a, None, calls_twice=True)[0] == loop(b, LAYERS, calls_twice=True)[0]
    same_state(a, b)


def test_lightning_accumulation_with_device_sums_is_ordinary_training():
    base = CausalLM(hf_llama(layers=LAYERS), schedule=STEPS)
    ref = CausalLM(hf_llama(layers=LAYERS), schedule=STEPS)
    ref.load_state_dict(base.state_dict())
    fit(ref, BATCHES, strategy="auto", accumulate_grad_batches=MICRO, gradient_clip_val=1.0)
    fit(
        base,
        BATCHES,
        strategy=MegatrainStrategy(device_grad_sums=2),
        accumulate_grad_batches=MICRO,
        gradient_clip_val=1.0,
    )
    assert_same(base, ref)


def test_fabric_no_backward_sync_with_device_sums_is_ordinary_fabric():
    def run(strategy) -> tuple[list[float], dict]:
        torch.manual_seed(0)
        raw = hf_llama(layers=LAYERS)
        fabric = Fabric(accelerator="cpu", devices=1, precision="32-true", strategy=strategy)
        model, opt = fabric.setup(raw, torch.optim.AdamW(raw.parameters(), lr=1e-2, weight_decay=0.1))
        losses = []
        for step in range(STEPS):
            for micro in range(MICRO):
                batch = BATCHES[step * MICRO + micro]
                with fabric.no_backward_sync(model, enabled=micro < MICRO - 1):
                    loss = model(input_ids=batch, labels=batch).loss
                    fabric.backward(loss / MICRO)
                losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        if isinstance(fabric.strategy, MegatrainFabricStrategy):
            fabric.strategy.teardown()
        return losses, {k: v.detach().clone() for k, v in raw.state_dict().items()}

    ref, got = run("auto"), run(MegatrainFabricStrategy(device_grad_sums=LAYERS))
    assert got[0] == ref[0]
    for name, t in ref[1].items():
        assert torch.equal(got[1][name], t), name


def test_device_grad_sums_is_checked_with_the_fix_in_one_line():
    for bad in (-1, 1.5, True, "all"):
        with pytest.raises(ValueError, match=r"^device_grad_sums=.*: give a number of blocks") as err:
            EngineConfig(device_grad_sums=bad)
        assert "\n" not in str(err.value)


def test_auto_takes_the_blocks_that_fit_beyond_the_slot_margin_in_order():
    gib = 1 << 30
    # 10 GiB free, 1 GiB transient (4 GiB kept for it), 1 GiB reserve: 5 GiB for sums of 4 bytes/param.
    assert auto_sum_count(10 * gib, gib, [gib // 4] * 8, 0) == 5
    assert auto_sum_count(10 * gib, gib, [gib // 4] * 3, 0) == 3  # at most one per block
    assert auto_sum_count(5 * gib, gib, [gib // 4] * 3, 1) == 1  # none fits: what it had
    assert auto_sum_count(10 * gib, gib, [gib // 4] * 8, 0, outer_numel=gib // 2) == 3  # outer units first
    assert auto_sum_count(10 * gib, gib, [gib // 4] * 8, 0, outer_numel=2 * gib) == 0
    # On the CPU "auto" measures nothing: every gradient lands on the host, as before.
    assert loop(hf_llama(layers=LAYERS), "auto")[2]["grad_sums"] == 0


@pytest.mark.parametrize("name", ["mixtral-aux", "user-encoder", "llama-frozen", "gemma2"])
def test_zoo_models_with_device_sums_train_as_ordinary_lightning_bit_for_bit(name):
    """The zoo's Lightning runs (accumulation, clipping, two groups, a schedule; dropout on) with the first
    two blocks' and the outer parameters' sums on the device: an MoE whose router has an auxiliary loss, a
    user's encoder, frozen parts, a family with its own norms; the ordinary reference is the zoo's own."""
    entry = ZOO[name]
    batches = token_batches(OPT_STEPS * ACCUMULATE)
    model, ref, _ = ordinary_fit(entry, batches, OPT_STEPS, **TRAIN_KWARGS)
    mt = entry.module(copy.deepcopy(model), loss_fn=entry.loss_fn, **dict(MODULE_KWARGS, schedule=OPT_STEPS))
    seeded_fit(trainer(MegatrainStrategy(device_grad_sums=2), **TRAIN_KWARGS), mt, batches)
    assert_bitwise(ref, mt)


def test_sums_granted_after_the_first_step_are_allocated_then_and_train_as_the_host_path(monkeypatch):
    """``device_grad_sums="auto"`` grants its sums after the first optimizer step; their buffers are allocated
    then, between steps, not inside the next backward (on a GPU the accumulators a sum comes down into are
    pinned there too, which took seconds in a step: tests/test_cuda.py). The CPU has no memory measure, so the
    measure is stood in for with one that has room for every block; the sums then add what the host adds."""
    from megatrain_lightning.engine.device.streamer import BlockStreamer

    monkeypatch.setattr(BlockStreamer, "_memory_after_step", lambda self: (1 << 40, 0))
    model = hf_llama(layers=LAYERS)
    ref_model = copy.deepcopy(model)
    reference = loop(ref_model, 0)
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true", device_grad_sums="auto"))
    opt = engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    losses, reserved = [], []
    for step in range(STEPS):
        for micro in range(MICRO):
            loss = hf_loss(model, BATCHES[step * MICRO + micro])
            with engine.backward(accumulate=micro < MICRO - 1):
                (loss / MICRO).backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        reserved.append(engine.device_bytes()["grad_sums"])
    granted = engine.host.sums.granted()
    engine.close()
    assert len(granted) > LAYERS  # every block, and the outer units
    assert reserved == [4 * sum(u.device_numel for u in granted)] * STEPS
    assert losses == reference[0]
    same_state(model, ref_model)
