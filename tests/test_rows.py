"""Layer-major steps (engine/device/rows.py): a block call of many rows run in chunks of ``row_chunk`` rows, every
chunk through a block before the next block, trains as ordinary training on the whole batch does.

The bounds, and why:
- fp32: the forward computes each row as the whole call does, so the losses of the first step are ordinary
  training's bit for bit. A weight's gradient is summed over each chunk's rows and then over the chunks, where
  ordinary training sums over all rows in one product: round-off of fp32 sums, measured 2.4e-7 of each
  tensor's norm here; the bound is 1e-6. After three Adam steps the total update differs by the Adam-amplified
  round-off of near-zero gradient elements (measured up to 5e-6 of the update's norm); the bound is 2e-5.
- bf16: each chunk's weight gradient comes out of its product rounded to bf16 (2^-9 of its size at most)
  before the fp32 sum over chunks, where one call rounds once: against the engine without chunks, each
  gradient tensor within 1e-2 of its norm (measured below 4e-3).
With one chunk (``row_chunk`` at least the rows) every call is whole: bit for bit ordinary training.
"""

from __future__ import annotations

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from megatrain_lightning import Engine, EngineConfig
from megatrain_lightning.engine.device.rows import ROW_SHARE
from megatrain_lightning.engine.probes import Probes
from megatrain_lightning.lightning.fabric import MegatrainFabricStrategy
from megatrain_lightning.lightning.strategy import MegatrainStrategy
from tests.helpers import CausalLM, fit, hf_llama, hf_loss, own_llama, own_loss, params_of, token_batches

pytestmark = pytest.mark.usefixtures("torch_adam")  # bit-for-bit claims need torch's own AdamW arithmetic

ROWS, SEQ, STEPS = 8, 16, 3
BATCHES = token_batches(STEPS, batch=ROWS, seq=SEQ)
MODELS = {"hf-llama": (hf_llama, hf_loss), "own-llama": (own_llama, own_loss)}


def loop(model, row_chunk="ordinary", precision="32-true", steps=STEPS, **config):
    """A plain loop over BATCHES: ordinary training (``row_chunk="ordinary"``) or the engine with `row_chunk`.
    Returns (losses, the first step's gradients in fp32, engine stats or None)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    engine = None
    if row_chunk != "ordinary":
        options = dict(device="cpu", precision=precision, row_chunk=row_chunk, overlap_optimizer=False, **config)
        engine = Engine(model, EngineConfig(**options))
        opt = engine.optimizer(opt)
    lossf = hf_loss if model.__class__.__module__.startswith("transformers") else own_loss
    losses, first = [], None
    for i, batch in enumerate(BATCHES[:steps]):
        if engine is None:
            loss = lossf(model, batch)
            loss.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        else:
            with engine.autocast(), engine.backward():
                loss = lossf(model, batch)
                loss.backward()
            with engine.gradients_visible():
                grads = {n: p.grad.float().clone() for n, p in model.named_parameters()}
        first = grads if i == 0 else first
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    stats = None
    if engine is not None:
        engine.flush()
        stats = dict(engine.stats)
        engine.close()
    return losses, first, stats


def grad_error(a: dict, b: dict) -> float:
    """The largest, over tensors, of ||a - b|| / ||b||."""
    return max(float((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-30)) for n in b)


def update_error(a: nn.Module, b: nn.Module, start: dict) -> float:
    pa, pb = params_of(a), params_of(b)
    num = sum(float((pa[k] - pb[k]).norm()) ** 2 for k in start) ** 0.5
    return num / sum(float((pb[k] - start[k]).norm()) ** 2 for k in start) ** 0.5


@pytest.mark.parametrize("chunk", [2, 3])  # 3: chunks of 3, 3 and 2 rows
@pytest.mark.parametrize("name", MODELS)
def test_chunks_of_rows_train_as_ordinary_training_on_the_whole_batch(name, chunk):
    make, _ = MODELS[name]
    ref_model, model = make(), make()
    start = params_of(ref_model)
    ref = loop(ref_model)
    got = loop(model, chunk)
    assert got[0][0] == ref[0][0]  # the first forward: bit for bit
    assert grad_error(got[1], ref[1]) < 1e-6
    assert update_error(model, ref_model, start) < 2e-5
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got[0], ref[0]))


def test_one_chunk_of_all_the_rows_is_ordinary_training_bit_for_bit():
    ref_model, model = hf_llama(), hf_llama()
    ref, got = loop(ref_model), loop(model, ROWS)
    assert got[0] == ref[0]
    for name, t in params_of(ref_model).items():
        assert torch.equal(params_of(model)[name], t), name


def test_in_bf16_chunks_round_each_chunks_gradient_once_more():
    whole, chunked = hf_llama(), hf_llama()
    a, b = loop(whole, None, "bf16-mixed", steps=1), loop(chunked, 2, "bf16-mixed", steps=1)
    assert a[0] == b[0]  # the forward: bit for bit
    assert grad_error(b[1], a[1]) < 1e-2


def record_rows(engine: Engine, seen: list[int]) -> None:
    """Append to `seen` the rows of every call of the engine's blocks' own forwards."""
    for runner in engine.runners:

        def recorded(hidden, *args, _inner=runner.inner, **kwargs):
            seen.append(hidden.shape[0])
            return _inner(hidden, *args, **kwargs)

        runner.inner = recorded


def test_each_block_runs_on_chunks_and_its_weights_go_up_once_per_micro_batch():
    """The block sees chunks of rows only (after its first call's independence check on two chunks), in the
    forward and the recompute; the bytes uploaded and downloaded are those of whole calls."""
    whole, chunked = hf_llama(), hf_llama()
    base = loop(whole, None, steps=2)[2]
    engine = Engine(chunked, EngineConfig(device="cpu", precision="32-true", row_chunk=2, overlap_optimizer=False))
    seen: list[int] = []
    record_rows(engine, seen)
    opt = engine.optimizer(torch.optim.AdamW(chunked.parameters(), lr=1e-2, weight_decay=0.1))
    for batch in BATCHES[:2]:
        with engine.backward():
            hf_loss(chunked, batch).backward()
        opt.step()
        opt.zero_grad()
    engine.flush()
    stats = dict(engine.stats)
    engine.close()
    blocks = len(chunked.model.layers)
    checks = [4, 4] * blocks  # each block's first call: the first two chunks as one call, twice
    calls = [2] * (ROWS // 2) * blocks * 2 * 2  # chunks of 2 rows, forward and recompute, 2 steps
    assert sorted(seen) == sorted(checks + calls)
    assert stats["h2d_bytes"] == base["h2d_bytes"] and stats["d2h_bytes"] == base["d2h_bytes"]


def test_offloaded_block_inputs_with_chunks_train_as_inputs_kept_on_the_device():
    kept, offloaded = hf_llama(), hf_llama()
    a = loop(kept, 2, steps=2, offload_inputs=False)
    b = loop(offloaded, 2, steps=2, offload_inputs=True)
    assert b[0] == a[0] and b[2]["input_offload_bytes"] > 0 == a[2]["input_offload_bytes"]
    for name, t in params_of(kept).items():
        assert torch.equal(params_of(offloaded)[name], t), name


# -- row_chunk="auto" ------------------------------------------------------------------------------------


def saved_bytes_of_one_row(model: nn.Module) -> int:
    """What the first block of an HF Llama saves for backward in ordinary training on one row, beyond its
    inputs (held by its caller anyway): each storage once, the parameters not counted. The engine measures the
    same; this counts it independently of the engine."""
    block = model.model.layers[0]
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    counted: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            counted[ptr] = t.untyped_storage().nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def enter(_module, args, kwargs):
        leaves = [*args, *kwargs.values(), *kwargs.get("position_embeddings", ())]
        skip.update(t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor))
        hooks.__enter__()

    block.register_forward_pre_hook(enter, with_kwargs=True)
    block.register_forward_hook(lambda *_: hooks.__exit__(None, None, None))
    hf_loss(model, BATCHES[0][:1])
    return sum(counted.values())


def auto_run(model: nn.Module, free: int | None) -> tuple[list[int], tuple]:
    """Two steps of the engine with ``row_chunk="auto"`` on a device with `free` bytes free (None: no memory
    measure, the CPU's): the rows of every call of the blocks' own forwards, and loop()'s results."""
    seen: list[int] = []
    original = Engine.__init__

    def init(self, *args, **kwargs):
        original(self, *args, Probes(device_free_bytes=lambda: free) if free is not None else None)
        record_rows(self, seen)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Engine, "__init__", init)
        got = loop(model, "auto", steps=2)
    return seen, got


def test_auto_without_a_memory_measure_runs_every_call_whole_as_ordinary_training():
    ref_model, model = hf_llama(), hf_llama()
    seen, got = auto_run(model, None)
    assert set(seen) == {ROWS}
    assert got[0] == loop(ref_model, steps=2)[0]
    for name, t in params_of(ref_model).items():
        assert torch.equal(params_of(model)[name], t), name


def test_auto_chunks_each_call_by_what_a_row_saves_and_the_memory_free():
    """Room for 3.5 rows' saved bytes in half the free memory: chunks of 3 rows. A block's first call checks
    its rows' independence (two calls on 2 rows), runs one row measured, then chunks of 3; its later calls,
    chunks of 3 from the start; the recompute repeats its forward's chunks."""
    ref_model, model = hf_llama(), hf_llama()
    start = params_of(ref_model)
    need = saved_bytes_of_one_row(hf_llama())
    seen, got = auto_run(model, int(3.5 * need / ROW_SHARE))
    blocks = len(model.model.layers)
    first, later = [1, 3, 3, 1], [3, 3, 2]
    assert sorted(seen) == sorted(([2, 2] + 2 * first + 2 * later) * blocks)
    ref = loop(ref_model, steps=2)
    assert got[0][0] == ref[0][0]  # the first forward: bit for bit
    assert grad_error(got[1], ref[1]) < 1e-6
    assert update_error(model, ref_model, start) < 2e-5


def test_auto_with_room_for_every_row_runs_whole_calls_once_a_row_is_measured():
    model = hf_llama()
    seen, got = auto_run(model, 10**15)
    blocks = len(model.model.layers)
    # first call: the independence check, one row measured, the other seven together (forward and recompute);
    # then whole calls, each kept or recomputed (recompute="auto" decides) but never chunked
    assert sorted(seen[: 6 * blocks]) == sorted([2, 2, 1, 7, 1, 7] * blocks)
    assert set(seen[6 * blocks :]) == {ROWS}


def test_the_trainer_with_row_chunk_trains_as_ordinary_lightning():
    ref, got = CausalLM(hf_llama()), CausalLM(hf_llama())
    start = params_of(ref.model)
    fit(ref, BATCHES, strategy="auto")
    fit(got, BATCHES, strategy=MegatrainStrategy(row_chunk=3))
    assert got.losses[0] == ref.losses[0]
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got.losses, ref.losses))
    assert update_error(got.model, ref.model, start) < 2e-5


def test_fabric_with_row_chunk_trains_as_ordinary_fabric():
    def run(strategy) -> tuple[list[float], nn.Module]:
        raw = hf_llama()
        fabric = Fabric(accelerator="cpu", devices=1, precision="32-true", strategy=strategy)
        model, opt = fabric.setup(raw, torch.optim.AdamW(raw.parameters(), lr=1e-2, weight_decay=0.1))
        losses = []
        for batch in BATCHES:
            loss = model(input_ids=batch, labels=batch).loss
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        if isinstance(fabric.strategy, MegatrainFabricStrategy):
            fabric.strategy.teardown()
        return losses, raw

    start = params_of(hf_llama())
    ref, got = run("auto"), run(MegatrainFabricStrategy(row_chunk=2))
    assert got[0][0] == ref[0][0]
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got[0], ref[0]))
    assert update_error(got[1], ref[1], start) < 2e-5


# -- refusals ----------------------------------------------------------------------------------------------


class Block(nn.Module):
    """A residual block whose `mix` decides what it does besides a linear layer (the refusal cases)."""

    def __init__(self, mix: str) -> None:
        super().__init__()
        self.linear, self.mix = nn.Linear(8, 8), mix
        self.norm = nn.BatchNorm1d(SEQ) if mix == "batch-norm" else None
        self.drop = nn.Dropout(0.5) if mix == "dropout" else None
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        y = self.linear(x)
        if self.mix == "batch-mean":
            y = y - y.mean(0, keepdim=True)  # every row's output depends on the others
        elif self.norm is not None:
            y = self.norm(y)
        elif self.drop is not None:
            y = self.drop(y)
        elif self.mix == "counter":
            self.calls += 1
        elif self.mix == "side":
            self.last = y * 2  # an attribute a loss may read: a side output
        if mask is not None:
            y = y * mask
        return x + y


class Net(nn.Module):
    def __init__(self, mix: str, blocks: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 8)
        self.blocks = nn.ModuleList(Block(mix) for _ in range(blocks))
        self.head = nn.Linear(8, 11)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(ids)
        for blk in self.blocks:
            x = blk(x, mask) if mask is not None else blk(x)
        return self.head(x).float().logsumexp(-1).mean()


@pytest.mark.parametrize(
    "mix, cause",
    [
        ("batch-norm", "normalizes over the rows of a batch \\(BatchNorm1d in training mode\\)"),
        ("batch-mean", "lets rows affect each other"),
        ("dropout", "draws random numbers"),
        ("counter", "changes its buffers or attributes"),
        ("side", "outputs tensors besides its hidden state"),
    ],
)
def test_a_block_chunks_cannot_reproduce_is_refused_in_one_line_naming_it(mix, cause):
    model = Net(mix)
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true", row_chunk=2))
    ids = torch.randint(0, 11, (4, SEQ), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match=rf"^row_chunk=2: block blocks\.0 {cause}.*set row_chunk=None") as err:
        with engine.backward():
            model(ids).backward()
    assert "\n" not in str(err.value)
    engine.close()


def test_rows_that_could_be_positions_are_refused_rather_than_guessed():
    """As many rows as positions: a (16, 16, 1) mask could be per row or per position."""
    model = Net("none")
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true", row_chunk=4))
    ids = torch.randint(0, 11, (SEQ, SEQ), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match=r"^row_chunk=4: block blocks\.0 has as many rows as positions"):
        with engine.backward():
            model(ids, torch.ones(SEQ, SEQ, 1)).backward()
    engine.close()


def test_a_per_row_mask_is_cut_with_the_rows():
    """A (rows, positions, 1) mask goes with its rows: the same loss and gradients as ordinary training."""
    ids = torch.randint(0, 11, (6, SEQ), generator=torch.Generator().manual_seed(0))
    mask = (torch.rand(6, SEQ, 1, generator=torch.Generator().manual_seed(1)) > 0.3).float()
    ref, model = Net("none"), Net("none")
    ref(ids, mask).backward()
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true", row_chunk=4, overlap_optimizer=False))
    engine.optimizer(torch.optim.AdamW(model.parameters()))
    with engine.backward():
        loss = model(ids, mask)
        loss.backward()
    assert loss.item() == ref(ids, mask).item()
    with engine.gradients_visible():
        got = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert grad_error(got, {n: p.grad for n, p in ref.named_parameters()}) < 1e-6
    engine.close()


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "auto-ish"])
def test_row_chunk_is_checked_with_the_fix_in_one_line(bad):
    with pytest.raises(ValueError, match=r"^row_chunk=.*: give the rows each chunk") as err:
        EngineConfig(row_chunk=bad)
    assert "\n" not in str(err.value)


def test_packed_documents_keep_to_their_rows_in_chunks():
    """This project's Llama with positions restarting inside rows (packed documents): the per-row positions and
    document spans are cut with the rows, and training is ordinary training's."""
    g = torch.Generator().manual_seed(2)
    positions = torch.stack([torch.cat([torch.arange(k), torch.arange(SEQ - k)]) for k in (3, 5, 8, 11, 2, 9)])
    batch = torch.randint(0, 97, (6, SEQ), generator=g)

    def loss(model: nn.Module) -> torch.Tensor:
        targets = torch.cat([batch[:, 1:], torch.full_like(batch[:, :1], -100)], dim=1)
        return model(batch, targets=targets, position_ids=positions)

    ref, model = own_llama(), own_llama()
    first = loss(ref)
    first.backward()
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true", row_chunk=4, overlap_optimizer=False))
    engine.optimizer(torch.optim.AdamW(model.parameters()))
    with engine.backward():
        got = loss(model)
        got.backward()
    assert got.item() == first.item()
    with engine.gradients_visible():
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert grad_error(grads, {n: p.grad for n, p in ref.named_parameters()}) < 1e-6
    engine.close()
