"""host_layout="lean": no persistent compute copy, gradients through a ring, the same training bit for bit.

The lean layout changes where bytes wait on the host, never their values: uploads cast the fp32 master
into a staging buffer (the same rounding the step's fused cast does) and gradients land from a ring
buffer instead of a per-unit slab. So it must equal the default layout bit for bit, in fp32 and in
bf16-mixed, with accumulation and clipping, and resume exactly.
"""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from megatrain_lightning import Engine, EngineConfig, MegatrainStrategy
from megatrain_lightning.engine.host.units import host_bytes_per_param
from tests import async_streams
from tests.helpers import CausalLM, assert_same, fit, hf_llama, params_of, token_batches

STEPS = 20
SMALL_PIECE = 1000  # elements: every unit of the tiny model is cut into pieces, most parameters split


pytestmark = pytest.mark.usefixtures("torch_adam")  # bitwise comparisons need torch's own AdamW arithmetic


def small_pieces(monkeypatch) -> None:
    """Rings (and the NVMe tier) in pieces of SMALL_PIECE elements: a tiny model's units are smaller than the
    smallest piece a real run uses (engine/host/ring.py), so without this every unit would be a single piece."""
    monkeypatch.setattr("megatrain_lightning.engine.build.piece_numel", lambda largest: SMALL_PIECE)


def train(layout: str, precision: str, ckpt_path=None, vocab: int | None = None, **trainer_kwargs) -> CausalLM:
    torch.manual_seed(0)
    model = hf_llama(layers=3, **({} if vocab is None else {"vocab_size": vocab}))
    module = CausalLM(model, split_decay=True, schedule=STEPS)
    torch.manual_seed(5)
    fit(
        module,
        token_batches(STEPS),
        strategy=MegatrainStrategy(host_layout=layout),
        precision=precision,
        ckpt_path=ckpt_path,
        **trainer_kwargs,
    )
    return module


@pytest.mark.parametrize("pieces", ["whole", "small"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize(
    "train_kwargs",
    [
        {},
        {"accumulate_grad_batches": 2},
        {"gradient_clip_val": 0.5},
        {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5},
    ],
    ids=["plain", "accumulate", "clip", "accumulate+clip"],
)
def test_lean_layout_trains_exactly_like_the_default(precision, train_kwargs, pieces, monkeypatch):
    """ "whole": each unit one piece; "small": uploads, gradient landings and Adam steps go piece by piece,
    pieces cutting through parameters (and through param groups' runs)."""
    if pieces == "small":
        small_pieces(monkeypatch)
    assert_same(train("lean", precision, **train_kwargs), train("default", precision, **train_kwargs))


@pytest.mark.parametrize("streams", ["async-lazy", "async-seed0"])
def test_lean_layout_under_asynchronous_copy_streams(streams, monkeypatch):
    """Staging and gradient ring buffers are reused only after the copy that read or wrote them finished:
    under copy streams that run late, a buffer handed out too early would show stale or torn data. (A
    1000-token vocabulary and pieces of 1000 elements: every unit goes up in pieces through the ring.)"""
    small_pieces(monkeypatch)
    async_streams.install(monkeypatch, **({"hold": 1.0} if streams == "async-lazy" else {"seed": 0}))
    kwargs = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5, "vocab": 1000}
    lean = train("lean", "bf16-mixed", **kwargs)
    monkeypatch.undo()
    monkeypatch.setenv("MEGATRAIN_CPU_ADAM", "torch")
    assert_same(lean, train("default", "bf16-mixed", **kwargs))


class HostBytesAtEnd(L.Callback):
    """The engine's host bytes per kind after the last step (before teardown releases it)."""

    def on_train_end(self, trainer, pl_module):
        engine = trainer.strategy.engine
        engine.flush()
        self.held, self.n, self.piece = engine.host_bytes(), engine.num_parameters(), engine.piece
        self.largest_block = max(u.numel for u in engine.units)
        self.largest = max(u.numel for u in engine.all_units())


def test_the_double_catches_a_staging_buffer_reused_too_early(monkeypatch):
    """Without the hold that keeps a staging buffer until its upload has read it, the next cast overwrites
    weights still on their way, and under the asynchronous double the training changes: the block's
    recompute computes with other weights than its forward, which the engine's self-check stops (or, where
    both read the same overwritten weights, the losses differ)."""
    from megatrain_lightning.engine.host.ring import HostRing

    kwargs = {"gradient_clip_val": 0.5, "vocab": 1000}
    reference = train("default", "bf16-mixed", **kwargs)
    small_pieces(monkeypatch)
    async_streams.install(monkeypatch, seed=0)
    real_hold = HostRing.hold

    def hold_gradients_only(ring, i, until):
        if ring.kind != "staging":
            real_hold(ring, i, until)

    monkeypatch.setattr(HostRing, "hold", hold_gradients_only)
    try:
        broken = train("lean", "bf16-mixed", **kwargs)
    except RuntimeError as error:  # (stopped: the self-check)
        assert "its recompute in backward did not reproduce its forward" in str(error)
    else:
        assert broken.losses != reference.losses


def test_lean_layout_holds_no_copy_and_no_slab_between_steps():
    """bf16 without clipping or accumulation: 12 bytes/param (master, m, v) plus the two rings."""
    probe = HostBytesAtEnd()
    fit(
        CausalLM(hf_llama(layers=4)),
        token_batches(3),
        strategy=MegatrainStrategy(host_layout="lean"),
        precision="bf16-mixed",
        callbacks=[probe],
    )
    held = probe.held
    assert held["copy"] == 0 and held["slab"] == 0 and held["acc"] == 0
    assert held["master"] + held["adam"] == 12 * probe.n
    # 4 staging pieces + a block's pieces and one more for gradients, 2 bytes each (one piece: the embedding)
    assert probe.piece == probe.largest
    assert held["ring"] == (4 + 1 + 1) * probe.piece * 2
    assert host_bytes_per_param(torch.bfloat16, True, layout="lean") == 12


def test_lean_layout_keeps_a_slab_only_for_clipped_gradients():
    """With clipping the gradients wait for the global norm: one slab per unit (2 B/param in bf16)."""
    probe = HostBytesAtEnd()
    fit(
        CausalLM(hf_llama(layers=3)),
        token_batches(3),
        strategy=MegatrainStrategy(host_layout="lean"),
        precision="bf16-mixed",
        gradient_clip_val=0.5,
        callbacks=[probe],
    )
    assert probe.held["slab"] == 2 * probe.n and probe.held["copy"] == 0
    assert host_bytes_per_param(torch.bfloat16, True, layout="lean", clipping=True) == 14


def test_lean_layout_resumes_exactly(tmp_path):
    """Two lean epochs straight == one lean epoch, last.ckpt, and a lean resume for the second (clipping and
    accumulation on: the per-unit slab and the accumulator are rebuilt from the checkpoint's state)."""
    kwargs = dict(gradient_clip_val=0.5, accumulate_grad_batches=2, precision="bf16-mixed")
    batches = token_batches(10)

    def run(max_epochs, ckpt_path=None, callbacks=()):
        torch.manual_seed(0)
        module = CausalLM(hf_llama(layers=3), split_decay=True, schedule=10)
        fit(
            module,
            batches,
            strategy=MegatrainStrategy(host_layout="lean"),
            max_epochs=max_epochs,
            enable_checkpointing=bool(callbacks),
            callbacks=list(callbacks),
            ckpt_path=ckpt_path,
            **kwargs,
        )
        return module

    straight = run(2)
    first = run(1, callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_epochs=1)])
    resumed = run(2, ckpt_path=str(tmp_path / "last.ckpt"))
    assert first.losses == straight.losses[:10] and resumed.losses == straight.losses[10:]
    ps, pr = params_of(straight.model), params_of(resumed.model)
    assert all(torch.equal(ps[k], pr[k]) for k in ps)


def test_bad_layout_is_refused():
    with pytest.raises(ValueError, match="host_layout='slim'"):
        MegatrainStrategy(host_layout="slim")
    with pytest.raises(ValueError, match="host_layout='slim'"):
        Engine(hf_llama(layers=2), EngineConfig(device="cpu", precision="bf16-true", host_layout="slim"))
