"""Speculative steps (``speculative_step``, engine/host/host_steps.py): each unit's Adam step taken into a spare copy as
its gradient of the step's last backward lands, kept when the step finds what it assumed, discarded otherwise.

The oracle is the same run without the option (which the rest of the suite holds to ordinary training): the
same losses, norms, fp32 masters and Adam moments, bit for bit, whether the speculation was kept (no clipping
happened) or discarded (clipped; the learning rate changed after backward; a hook edited the gradients), in a
plain loop (with and without device sums, over micro-batches), under the Trainer and under Fabric. The stats
say which path ran. And the point of it: with the speculation kept, the next forward runs while the steps
proper (masters and moments) are still held back.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import Callback

from megatrain_lightning import Engine, EngineConfig
from megatrain_lightning.engine.device.ahead import UploadsAhead
from megatrain_lightning.lightning.fabric import MegatrainFabricStrategy
from megatrain_lightning.lightning.strategy import MegatrainStrategy
from megatrain_lightning.optim import kernels
from tests.helpers import CausalLM, fit, hf_llama, hf_loss, requires_native, token_batches, twin

pytestmark = pytest.mark.usefixtures("torch_adam")  # bitwise comparisons need torch's own AdamW arithmetic

STEPS, LAYERS = 3, 2
BATCHES = token_batches(2 * STEPS)
NOT_CLIPPED, CLIPPED = 1e6, 1e-3  # max_norm far above and far below these gradients' norms


def loop(
    model, speculative: bool, *, clip: float | None = None, micro: int = 1, before_step=None, forward=None, **options
):
    """A plain bf16 loop of STEPS steps of `micro` micro-batches; `before_step(engine, opt, step)` runs between
    the step's last backward and ``opt.step()``, `forward(step)` after each step's first forward. Returns
    (losses, norms, masters and moments, engine stats)."""
    config = EngineConfig(device="cpu", precision="bf16-true", speculative_step=speculative, **options)
    engine = Engine(model, config)
    opt = engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    losses, norms = [], []
    for step in range(STEPS):
        for m in range(micro):
            loss = hf_loss(model, BATCHES[(step * micro + m) % len(BATCHES)])
            if forward is not None and m == 0:
                forward(step)
            with engine.backward(accumulate=m < micro - 1, clip=clip is not None):
                (loss / micro).backward()
            losses.append(loss.item())
        if clip is not None:
            norms.append(float(engine.grad_norm()))
            engine.clip_grad_norm_(clip)
        if before_step is not None:
            before_step(engine, opt, step)
        opt.step()
        opt.zero_grad()
    engine.flush()
    state = {f"master.{u.name}": u.master.clone() for u in engine.all_units()}
    state.update({f"{k}.{i}": t for i, s in opt.state_dict()["state"].items() for k, t in s.items()})
    stats = dict(engine.stats)
    engine.close()
    return losses, norms, state, stats


def assert_same_run(a, b) -> None:
    assert a[0] == b[0] and a[1] == b[1]
    assert a[2].keys() == b[2].keys()
    for k, t in a[2].items():
        assert torch.equal(t, b[2][k]), k


def units_of(model) -> int:
    """Units of an hf_llama: its blocks, and the embedding, final norm and head."""
    return LAYERS + 3


@pytest.mark.parametrize(
    "case",
    ["not-clipped", "clipped", "accumulated", "accumulated-device-sums", "not-overlapped"],
)
def test_kept_or_discarded_the_run_is_the_one_without_speculation(case):
    kwargs: dict[str, Any] = {
        "not-clipped": dict(clip=NOT_CLIPPED),
        "clipped": dict(clip=CLIPPED),
        "accumulated": dict(clip=NOT_CLIPPED, micro=2),
        "accumulated-device-sums": dict(clip=NOT_CLIPPED, micro=2, device_grad_sums=LAYERS),
        "not-overlapped": dict(overlap_optimizer=False),  # no clipping: the steps wait for opt.step()
    }[case]
    a, b = twin(lambda: hf_llama(layers=LAYERS))
    plain, speculated = loop(a, False, **kwargs), loop(b, True, **kwargs)
    assert_same_run(speculated, plain)
    stats = speculated[3]
    if case == "clipped":
        assert stats["speculative_kept"] == 0 and stats["speculative_discarded"] == STEPS * units_of(b)
    else:
        assert stats["speculative_kept"] == STEPS * units_of(b) and stats["speculative_discarded"] == 0
    assert plain[3]["speculative_kept"] == plain[3]["speculative_discarded"] == 0


@requires_native
def test_on_the_native_kernel_a_kept_speculation_is_the_run_without_it(monkeypatch):
    """The native kernel's peek (the speculative step's new weights, master and moments only read) against the
    native step of the run without speculation: the same run, bit for bit, every speculation kept."""
    monkeypatch.setenv("MEGATRAIN_CPU_ADAM", "native")
    a, b = twin(lambda: hf_llama(layers=LAYERS))
    plain, speculated = loop(a, False, clip=NOT_CLIPPED), loop(b, True, clip=NOT_CLIPPED)
    assert_same_run(speculated, plain)
    assert speculated[3]["speculative_kept"] == STEPS * units_of(b)


def _new_lr(engine, opt, step):
    if step == 1:
        for group in opt.param_groups:
            group["lr"] = 3e-3  # (a warmup written in optimizer_step does this)


def _edit_grads(engine, opt, step):
    if step == 1:
        with engine.gradients_visible():
            for p in opt.param_groups[0]["params"]:
                if p.grad is not None:
                    p.grad.mul_(0.5)


@pytest.mark.parametrize("between", [_new_lr, _edit_grads], ids=["new-lr", "edited-grads"])
def test_what_changes_after_backward_discards_the_speculation(between):
    """What the speculative step assumed changed before the step: it is discarded (for that step only), and the
    step is the ordinary one."""
    a, b = twin(lambda: hf_llama(layers=LAYERS))
    plain = loop(a, False, clip=NOT_CLIPPED, before_step=between)
    speculated = loop(b, True, clip=NOT_CLIPPED, before_step=between)
    assert_same_run(speculated, plain)
    n = units_of(b)
    assert speculated[3]["speculative_discarded"] == n and speculated[3]["speculative_kept"] == (STEPS - 1) * n


def test_the_next_forward_runs_before_the_steps_proper(monkeypatch):
    """With the speculation kept, the next forward uploads the spare copies: it computes its loss while every step
    proper (masters and moments: the kernel's calls with no copy to write) is held back; they go on once it
    has, and the run is still the one without speculation. (A forward that waited for them would see each
    wait time out instead, and count steps proper done before it.)"""
    release, done, seen, timed_out = threading.Event(), [], [], []
    step = kernels.adam_step_

    def held_back(master, m, v, grad, copy, *args, **kwargs):
        if copy is None:  # a step proper after a kept speculation
            if not release.wait(timeout=30):
                timed_out.append(1)
            done.append(1)
        step(master, m, v, grad, copy, *args, **kwargs)

    def before_step(engine, opt, n):
        seen.append(len(done))
        if n < STEPS - 1:
            release.clear()  # the steps proper this opt.step() queues wait for the next forward
        else:
            release.set()  # (the last: nothing follows but the flush)

    def forward(n):
        if n >= 1:
            seen.append(len(done))  # steps proper finished before this forward's loss: none since opt.step()
            release.set()  # (the backward ships gradients into buffers the steps proper still read)

    a, b = twin(lambda: hf_llama(layers=LAYERS))
    plain = loop(a, False, clip=NOT_CLIPPED)
    monkeypatch.setattr(kernels, "adam_step_", held_back)
    try:
        speculated = loop(b, True, clip=NOT_CLIPPED, forward=forward, before_step=before_step)
    finally:
        release.set()
    n = units_of(b)
    assert seen == [0, 0, n, n, 2 * n] and not timed_out  # (before each opt.step() and at the next forward)
    assert_same_run(speculated, plain)


def host_keeps_up(monkeypatch) -> None:
    """Each block's speculative step is done before the next block's backward is issued (a host faster than the
    backward), so every block but the last of a backward sends its new weights up ahead of the step."""
    ahead = UploadsAhead.backward_call

    def waiting(self, idx):
        for j in self.waiting:
            spec = self.host.speculation(self.units[j])
            if spec is not None and spec.future is not None:
                spec.future.exception()  # (waits for it)
        ahead(self, idx)

    monkeypatch.setattr(UploadsAhead, "backward_call", waiting)


def _forward_before_step(outputs: list):
    """A forward between the step's last backward and the step (a metric on the pre-step weights)."""

    def before_step(engine, opt, step):
        with torch.no_grad():
            outputs.append(hf_loss(engine.model, BATCHES[0]))

    return before_step


@pytest.mark.parametrize("case", ["kept", "discarded", "forward-before-step"])
def test_weights_sent_up_ahead_of_the_step_are_used_only_where_it_kept_them(monkeypatch, case):
    """Every block resident (one slot each): during the step's last backward each block's speculative weights go
    up into the slot holding its present ones, and the next forward uses them when the step kept the
    speculation. Clipped, it discards them, and the forward uploads the step's weights; a forward before the step
    reads the present weights, not the ahead ones. Every run is the one without speculation, bit for bit."""
    host_keeps_up(monkeypatch)
    clip = CLIPPED if case == "discarded" else NOT_CLIPPED
    seen: dict[bool, list] = {False: [], True: []}
    runs = {}
    for speculative, model in zip((False, True), twin(lambda: hf_llama(layers=LAYERS))):
        between = _forward_before_step(seen[speculative]) if case == "forward-before-step" else None
        runs[speculative] = loop(model, speculative, clip=clip, num_slots=LAYERS, before_step=between)
    assert_same_run(runs[True], runs[False])
    assert seen[True] == seen[False] and len(seen[True]) == (STEPS if case == "forward-before-step" else 0)
    # The blocks but the last of each backward went up ahead; the next forward of all steps but the last took them.
    expected = 0 if case != "kept" else (STEPS - 1) * (LAYERS - 1)
    assert runs[True][3]["uploads_ahead"] == expected


def test_refused_where_there_is_no_compute_copy_or_another_optimizer():
    with pytest.raises(ValueError, match=r"speculative_step=True with precision='32-true' .* pass speculative_step"):
        EngineConfig(precision="32-true", speculative_step=True)
    with pytest.raises(ValueError, match=r"speculative_step=True with host_layout='lean'"):
        EngineConfig(precision="bf16-mixed", host_layout="lean", speculative_step=True)
    model = hf_llama(layers=LAYERS)
    engine = Engine(model, EngineConfig(device="cpu", precision="bf16-true", speculative_step=True))
    with pytest.raises(ValueError, match=r"speculative_step=True with SGD: .* pass speculative_step=False"):
        engine.optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    engine.close()


class Stats(Callback):
    def on_train_end(self, trainer, pl_module) -> None:
        trainer.strategy.engine.flush()
        self.kept = trainer.strategy.engine.stats["speculative_kept"]


def test_the_trainer_and_fabric_take_the_option_and_train_as_without_it():
    a, b = twin(lambda: hf_llama(layers=LAYERS))
    runs = []
    for model, speculative in ((a, False), (b, True)):
        module, stats = CausalLM(model), Stats()
        strategy = MegatrainStrategy(speculative_step=speculative)
        fit(module, BATCHES, strategy=strategy, precision="bf16-true", gradient_clip_val=NOT_CLIPPED, callbacks=[stats])
        runs.append((module.losses, stats.kept))
    assert runs[1][0] == runs[0][0] and runs[0][1] == 0 and runs[1][1] == len(BATCHES) * units_of(b)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))

    c, d = twin(lambda: hf_llama(layers=LAYERS))
    for model, speculative in ((c, False), (d, True)):
        fabric = Fabric(
            accelerator="cpu",
            precision="bf16-true",
            strategy=MegatrainFabricStrategy(speculative_step=speculative, clipping=True),
        )
        model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        for batch in BATCHES:
            fabric.backward(hf_loss(model, batch))
            fabric.clip_gradients(model, opt, max_norm=NOT_CLIPPED)
            opt.step()
            opt.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(c.parameters(), d.parameters()))
