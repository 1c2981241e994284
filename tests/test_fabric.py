"""``Fabric(strategy="megatrain")`` against ordinary Fabric on the CPU: the same loop (setup without ``launch()``,
accumulation with ``no_backward_sync``, clipping by norm or by value, an LR schedule) gives the same losses,
total norms and weights bit for bit, and checkpoints resume exactly in either direction.

The host AdamW runs on torch ops (``MEGATRAIN_CPU_ADAM=torch``), which are those of ``torch.optim.AdamW``."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision

import megatrain_lightning  # noqa: F401  (registers strategy="megatrain")
from megatrain_lightning.lightning.fabric import MegatrainFabricPrecision, MegatrainFabricStrategy
from tests.helpers import hf_llama, token_batches, warmup_cosine

STEPS, MICRO, CLIP, SAVE_AT = 6, 2, 0.5, 3
BATCHES = token_batches(STEPS * MICRO)


@pytest.fixture(autouse=True)
def torch_adam(monkeypatch):
    monkeypatch.setenv("MEGATRAIN_CPU_ADAM", "torch")


def make_fabric(strategy="auto", precision="32-true") -> Fabric:
    """One device, no ``fabric.launch()``: ordinary single-device Fabric needs none, and neither does this one.
    "megatrain": with ``overlap_optimizer=False``, since these loops call ``clip_gradients`` after backward."""
    if strategy == "megatrain":
        strategy = MegatrainFabricStrategy(overlap_optimizer=False)
    return Fabric(accelerator="cpu", devices=1, precision=precision, strategy=strategy)


def set_up(fabric: Fabric, separately: bool = False):
    """A fresh tiny Llama, AdamW with a warm-up + cosine schedule, set up by `fabric`; also the raw model."""
    raw = hf_llama(layers=2)
    optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(2, STEPS))
    if separately:
        model = fabric.setup_module(raw)
        optimizer = fabric.setup_optimizers(optimizer)
    else:
        model, optimizer = fabric.setup(raw, optimizer)
    return raw, model, optimizer, scheduler


def train(fabric, model, optimizer, scheduler, steps, clip=CLIP, save=None, on_last_backward=None, by="max_norm"):
    """Fabric's own loop; returns each micro-batch's loss and what clip_gradients returned (`by`: "max_norm" or
    "clip_val", clip_gradients' argument that `clip` goes to)."""
    losses, norms = [], []
    for step in steps:
        for micro in range(MICRO):
            batch = fabric.to_device(BATCHES[step * MICRO + micro])
            last = micro == MICRO - 1
            with fabric.no_backward_sync(model, enabled=not last):
                loss = model(input_ids=batch, labels=batch).loss
                fabric.backward(loss / MICRO)
            losses.append(loss.item())
        if on_last_backward is not None:
            on_last_backward(step)
        if clip is not None:
            norms.append(fabric.clip_gradients(model, optimizer, **{by: clip}))
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        if save is not None and step + 1 == SAVE_AT:
            fabric.save(save, {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": step + 1})
    return losses, norms


def weights(fabric: Fabric, raw: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trained weights as an ordinary model holds them (the megatrain run hands its model back first)."""
    if isinstance(fabric.strategy, MegatrainFabricStrategy):
        fabric.strategy.teardown()
    return {k: v.detach().clone() for k, v in raw.state_dict().items()}


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype == torch.float32, k
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both full runs, each saving a checkpoint after step SAVE_AT."""
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEGATRAIN_CPU_ADAM", "torch")
        for name, strategy in (("ordinary", "auto"), ("megatrain", "megatrain")):
            path = tmp_path_factory.mktemp(name) / "step.ckpt"
            fabric = make_fabric(strategy)
            raw, model, optimizer, scheduler = set_up(fabric)
            losses, norms = train(fabric, model, optimizer, scheduler, range(STEPS), save=path)
            out[name] = {"losses": losses, "norms": norms, "weights": weights(fabric, raw), "ckpt": path}
    return out


def test_matches_ordinary_fabric_bit_for_bit(runs):
    ordinary, megatrain = runs["ordinary"], runs["megatrain"]
    assert any(n > CLIP for n in ordinary["norms"])  # the clip does change the steps
    # clip_gradients returns the total norm before clipping, as ordinary Fabric does: the same fp32 scalar.
    assert len(megatrain["norms"]) == STEPS
    for mine, theirs in zip(megatrain["norms"], ordinary["norms"]):
        assert mine.shape == theirs.shape == () and mine.dtype == theirs.dtype == torch.float32
        assert torch.equal(mine, theirs)
    assert megatrain["losses"] == ordinary["losses"]
    assert len(set(ordinary["losses"])) > MICRO  # it trains
    assert_same_weights(megatrain["weights"], ordinary["weights"])


@pytest.mark.parametrize(
    "saved_by, loaded_by", [("megatrain", "megatrain"), ("megatrain", "ordinary"), ("ordinary", "megatrain")]
)
def test_resume_is_exact_across_strategies(runs, saved_by, loaded_by):
    fabric = make_fabric("megatrain" if loaded_by == "megatrain" else "auto")
    raw, model, optimizer, scheduler = set_up(fabric)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    assert fabric.load(runs[saved_by]["ckpt"], state) == {}
    assert state["step"] == SAVE_AT
    losses, _ = train(fabric, model, optimizer, scheduler, range(SAVE_AT, STEPS))
    assert losses == runs["ordinary"]["losses"][SAVE_AT * MICRO :]
    assert_same_weights(weights(fabric, raw), runs["ordinary"]["weights"])


def test_checkpoint_holds_torch_layouts(runs):
    """What fabric.save wrote is what ordinary Fabric writes: the same keys, dtypes and optimizer layout."""
    mine = torch.load(runs["megatrain"]["ckpt"], weights_only=True)
    theirs = torch.load(runs["ordinary"]["ckpt"], weights_only=True)
    assert mine.keys() == theirs.keys()
    assert {k: v.dtype for k, v in mine["model"].items()} == {k: v.dtype for k, v in theirs["model"].items()}
    assert mine["optimizer"]["param_groups"] == theirs["optimizer"]["param_groups"]
    assert mine["optimizer"]["state"].keys() == theirs["optimizer"]["state"].keys()
    for i, s in mine["optimizer"]["state"].items():
        assert s.keys() == theirs["optimizer"]["state"][i].keys()
        assert all(torch.equal(s[k], theirs["optimizer"]["state"][i][k]) for k in s)


@pytest.mark.parametrize("overlap", [False, True])
def test_overlap_optimizer_steps_during_the_last_backward(overlap):
    """overlap_optimizer=True: the last micro-batch's backward steps the host masters already (seen before
    optimizer.step()); the default waits for the step. Both equal ordinary training without clipping."""
    steps = range(2)
    fabric = make_fabric()
    raw, model, optimizer, scheduler = set_up(fabric)
    expected, _ = train(fabric, model, optimizer, scheduler, steps, clip=None)
    expected_weights = weights(fabric, raw)

    fabric = make_fabric(MegatrainFabricStrategy(overlap_optimizer=overlap, host_threads=1))
    raw, model, optimizer, scheduler = set_up(fabric)
    engine, changed = fabric.strategy.engine, []
    before = {k: v.clone() for k, v in engine.master_state_dict().items()}

    def look(step: int) -> None:
        if step == 0:
            now = engine.master_state_dict()  # waits for the host steps queued so far
            changed.append(any(not torch.equal(before[k], now[k]) for k in before))

    losses, _ = train(fabric, model, optimizer, scheduler, steps, clip=None, on_last_backward=look)
    assert changed == [overlap]
    assert losses == expected
    assert_same_weights(weights(fabric, raw), expected_weights)


def test_overlap_with_clipping(runs):
    """overlap_optimizer=True with clipping=True is exact with clipping; without clipping=True, clipping is refused."""
    fabric = make_fabric(MegatrainFabricStrategy(overlap_optimizer=True, clipping=True, host_threads=1))
    _, model, optimizer, scheduler = set_up(fabric)
    losses, _ = train(fabric, model, optimizer, scheduler, range(SAVE_AT))
    assert losses == runs["ordinary"]["losses"][: SAVE_AT * MICRO]
    fabric.strategy.teardown()

    fabric = make_fabric(MegatrainFabricStrategy(overlap_optimizer=True, host_threads=1))
    _, model, optimizer, scheduler = set_up(fabric)
    with pytest.raises(RuntimeError, match="clipping=True"):
        train(fabric, model, optimizer, scheduler, range(1))
    fabric.strategy.teardown()


VALUE_STEPS, CLIP_VAL = range(2), 1e-3


@pytest.fixture(scope="module")
def clipped_by_value():
    """Ordinary Fabric clipping by value: its losses and weights."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEGATRAIN_CPU_ADAM", "torch")
        fabric = make_fabric()
        raw, model, optimizer, scheduler = set_up(fabric)
        losses, _ = train(fabric, model, optimizer, scheduler, VALUE_STEPS, clip=CLIP_VAL, by="clip_val")
    return losses, weights(fabric, raw)


@pytest.mark.parametrize("strategy", ["megatrain", "overlap"])
def test_clip_by_value_matches_ordinary_fabric(runs, clipped_by_value, strategy):
    """fabric.clip_gradients(clip_val=...) clamps the step's gradient (the micro-batches' sum) as
    torch.nn.utils.clip_grad_value_ does on .grad: the same losses and weights bit for bit; with
    overlap_optimizer=True too, given clipping=True (the step then waits for the clip)."""
    expected, expected_weights = clipped_by_value
    assert expected[MICRO:] != runs["ordinary"]["losses"][MICRO : len(expected)]  # the clamp changes the steps
    if strategy == "overlap":
        strategy = MegatrainFabricStrategy(overlap_optimizer=True, clipping=True, host_threads=1)
    fabric = make_fabric(strategy)
    raw, model, optimizer, scheduler = set_up(fabric)
    losses, returned = train(fabric, model, optimizer, scheduler, VALUE_STEPS, clip=CLIP_VAL, by="clip_val")
    assert returned == [None] * len(VALUE_STEPS)  # as ordinary Fabric returns for clip_val
    assert losses == expected
    assert_same_weights(weights(fabric, raw), expected_weights)


def test_non_finite_norm_as_ordinary_fabric():
    """A non-finite total norm raises, as clip_grad_norm_ does (before anything is clipped); with
    error_if_nonfinite=False the norm is returned, as ordinary Fabric returns it."""
    norms = {}
    for name in ("auto", "megatrain"):
        fabric = make_fabric(name)
        raw, model, optimizer, _ = set_up(fabric)
        batch = BATCHES[0]
        fabric.backward(model(input_ids=batch, labels=batch).loss * float("inf"))
        with pytest.raises(RuntimeError, match="non-finite|cannot be clipped"):
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
        norms[name] = fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
        if name == "megatrain":
            fabric.strategy.teardown()
    assert not torch.isfinite(norms["auto"])
    assert torch.equal(norms["megatrain"], norms["auto"]) or (norms["megatrain"].isnan() and norms["auto"].isnan())


def test_setup_module_then_optimizers(runs):
    """fabric.setup_module(model), then an optimizer set up on its own: the parameters stay registered."""
    fabric = make_fabric("megatrain")
    _, model, optimizer, scheduler = set_up(fabric, separately=True)
    losses, _ = train(fabric, model, optimizer, scheduler, range(2))
    assert losses == runs["ordinary"]["losses"][: 2 * MICRO]
    fabric.strategy.teardown()


def test_registry_precision_and_devices(tmp_path):
    fabric = Fabric(accelerator="cpu", devices=1, strategy="megatrain", precision="bf16-true")
    assert isinstance(fabric.strategy, MegatrainFabricStrategy)
    assert isinstance(fabric.strategy.precision, MegatrainFabricPrecision)
    assert fabric.strategy.precision.precision == "bf16-true"
    raw = hf_llama(layers=2)
    fabric.launch()  # not needed on one device (make_fabric calls none), but allowed, as for ordinary Fabric
    model, optimizer = fabric.setup(raw, torch.optim.AdamW(raw.parameters(), lr=1e-2))
    before = {k: v.clone() for k, v in fabric.strategy.engine.master_state_dict().items()}
    batch = BATCHES[0]
    fabric.backward(model(input_ids=batch, labels=batch).loss)
    optimizer.step()
    fabric.save(tmp_path / "bf16.ckpt", {"model": model})
    after = weights(fabric, raw)
    assert all(v.dtype == torch.float32 for v in after.values())  # the masters stayed fp32 (no bf16 cast)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # The checkpoint holds the fp32 masters, not the bf16 compute copies of the embedding and head.
    assert_same_weights(torch.load(tmp_path / "bf16.ckpt", weights_only=True)["model"], after)

    with make_fabric("megatrain", precision="bf16-mixed").autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="trains on one device"):
        Fabric(accelerator="cpu", devices=2, strategy="megatrain")


@pytest.mark.parametrize("precision", ["16-true", "64-true"])
def test_unsupported_precision_flag(precision):
    with pytest.raises(ValueError, match=f"precision='{precision}' is not supported"):
        Fabric(accelerator="cpu", devices=1, strategy="megatrain", precision=precision)


def test_fp16_mixed_refused():
    """On the CPU Fabric itself turns precision="16-mixed" into "bf16-mixed"; the plugin, as passed on a GPU, is refused."""
    with pytest.raises(ValueError, match="precision='16-mixed' is not supported.*bf16-mixed"):
        Fabric(accelerator="cpu", devices=1, strategy="megatrain", plugins=MixedPrecision("16-mixed", "cpu"))
    with pytest.raises(ValueError, match="precision='16-mixed' is not supported"):
        MegatrainFabricPrecision("16-mixed")


def test_any_torch_optimizer_matches_ordinary_fabric():
    """SGD with momentum steps itself on the host masters (engine/generic_optim.py): bit for bit."""
    out = []
    for strategy in ("auto", "megatrain"):
        fabric = make_fabric(strategy)
        raw = hf_llama(layers=2)
        sgd = torch.optim.SGD(raw.parameters(), lr=0.05, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.LambdaLR(sgd, warmup_cosine(2, STEPS))
        model, optimizer = fabric.setup(raw, sgd)
        losses, _ = train(fabric, model, optimizer, scheduler, range(2), clip=None)
        out.append((losses, weights(fabric, raw)))
    assert out[1][0] == out[0][0]
    assert_same_weights(out[1][1], out[0][1])


def test_optimizer_and_clipping_errors():
    fabric = make_fabric("megatrain")
    raw = hf_llama(layers=2)
    with pytest.raises(ValueError, match="exactly one optimizer"):
        fabric.setup(raw, torch.optim.AdamW(raw.parameters()), torch.optim.Adam(raw.parameters()))
    with pytest.raises(ValueError, match="not parameters of the trained model"):
        fabric.setup(raw, torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))]))
    assert fabric.strategy.engine is None  # each error left the model as it was
    assert all(p.grad is None and p.dtype == torch.float32 for p in raw.parameters())
    with pytest.raises(RuntimeError, match="set the model up first"):
        fabric.setup_optimizers(torch.optim.AdamW(raw.parameters()))

    model, optimizer = fabric.setup(raw, torch.optim.AdamW(raw.parameters()))
    with pytest.raises(ValueError, match="clip_val=-0.1: give a positive value"):
        fabric.clip_gradients(model, optimizer, clip_val=-0.1)
    with pytest.raises(ValueError, match="norm_type=inf"):
        fabric.clip_gradients(model, optimizer, max_norm=1.0, norm_type=float("inf"))
    with pytest.raises(ValueError, match="one optimizer"):
        fabric.setup_optimizers(torch.optim.AdamW(raw.parameters()))
    fabric.strategy.teardown()
