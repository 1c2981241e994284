"""Block inputs saved for backward in pinned host memory (offload_inputs): exact, and off the device.

fp32 on the CPU with the torch-op optimizer backend: training with offloaded inputs equals ordinary
training bit for bit (the inputs make a round trip through host memory, unchanged), also under the
asynchronous copy-stream double, where a copy that is read before its event was waited on shows stale data.

offload_inputs="auto" decides per forward pass from the free device memory; on the CPU the tests inject
that figure (engine.free_device_bytes), since a CPU device on its own never offloads.

offload_inputs_dtype stores the offloaded inputs smaller (bf16, fp8), which is lossy: those trainings stay
close to ordinary training, within the bounds below; its default (None) is the exact round trip above.

Not shown here: a prefetched input never fetched is freed in the compute stream's order while its copy
(H2D stream) may still write it, unless the engine records the copy stream on it. The CPU has no caching
allocator and no second stream to show that; tests/test_cuda.py does, on a GPU.
"""

from __future__ import annotations

import copy
import functools
import gc
import logging
import weakref
from collections.abc import Callable

import lightning.pytorch as L
import pytest
import torch

import megatrain_lightning.engine.build as build_module
from megatrain_lightning import Engine, EngineConfig, MegatrainFabricStrategy, MegatrainStrategy
from megatrain_lightning.engine import Probes
from megatrain_lightning.engine.device.input_codec import InputCodec
from megatrain_lightning.engine.device.saved_inputs import offload_needed
from megatrain_lightning.models import LlamaForCausalLM
from megatrain_lightning.planning.device_memory import free_device_bytes
from tests import async_streams
from tests.helpers import CausalLM, assert_same, fit, hf_llama, own_llama, params_of, token_batches, twin

pytestmark = pytest.mark.usefixtures("torch_adam")  # bitwise comparisons need torch's own AdamW arithmetic


@functools.cache
def _ordinary(batches: int, schedule: int | None = None) -> tuple[torch.nn.Module, CausalLM]:
    """(an untouched copy of the dropout Llama, its ordinary Lightning fit on `batches` batches: accumulation
    2, clipping 0.5, two param groups): computed once, shared by the cases that differ only in how the engine
    runs (copy streams, offloading pattern), which ordinary training does not see."""
    a, initial = twin(lambda: hf_llama(layers=3, attention_dropout=0.1))
    ref = CausalLM(a, split_decay=True, schedule=schedule)
    torch.manual_seed(5)
    fit(ref, token_batches(batches), strategy="auto", accumulate_grad_batches=2, gradient_clip_val=0.5)
    return initial, ref


@pytest.mark.parametrize("streams", ["sync", "async-lazy", "async-seed0"])
def test_offloaded_inputs_train_exactly(streams, monkeypatch):
    """Accumulation 2, clipping, schedule, two groups; dropout in the attention (RNG replay) too."""
    if streams != "sync":
        async_streams.install(monkeypatch, **({"hold": 1.0} if streams == "async-lazy" else {"seed": 0}))
    batches, train = token_batches(12), dict(accumulate_grad_batches=2, gradient_clip_val=0.5)
    initial, ref = _ordinary(12, schedule=6)
    mt = CausalLM(copy.deepcopy(initial), split_decay=True, schedule=6)
    torch.manual_seed(5)
    fit(mt, batches, strategy=MegatrainStrategy(offload_inputs=True), **train)
    assert_same(ref, mt)


def input_bytes(model: LlamaForCausalLM, batch: torch.Tensor) -> int:
    """One block's input in fp32."""
    return batch.numel() * model.config.hidden_size * 4


def train_and_count_kept(model: LlamaForCausalLM, engine: Engine, steps: int) -> list[int]:
    """Train `steps` steps; per step, how many block inputs the forward left alive for backward."""
    opt = engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    inputs = []
    for blk in engine.blocks:
        blk.register_forward_pre_hook(lambda module, args: inputs.append(weakref.ref(args[0])))
    kept = []
    for batch in token_batches(steps):
        inputs.clear()
        loss = model(batch, targets=batch)
        gc.collect()
        assert len(inputs) == len(engine.blocks)
        kept.append(sum(ref() is not None for ref in inputs))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return kept


@pytest.mark.parametrize("offload", [True, "auto"])
def test_no_block_input_stays_on_the_device(offload):
    """Each block's input leaves the device after its forward; backward brings it back, and the host
    buffers are reused from step to step (one per block). "auto" does so when device memory is short."""
    model = own_llama(3)
    # less than one block's input: used by "auto" only
    probes = Probes(device_free_bytes=lambda: 1024)
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true", offload_inputs=offload), probes)
    assert train_and_count_kept(model, engine, steps=3) == [0, 0, 0]
    assert len(engine.saved_inputs.buffers) == 3
    one_input = input_bytes(model, token_batches(1)[0])
    assert engine.stats["input_offload_bytes"] == 3 * 3 * 2 * one_input  # steps x blocks x (down and up)
    assert engine.stats["offloaded_passes"] == 3


@pytest.mark.parametrize("offload", [False, "auto"])
def test_inputs_stay_on_a_cpu_device(offload):
    """Without offloading every block's input is kept for backward; on a CPU device "auto" (the default)
    never offloads: the device's memory is host memory already."""
    model = own_llama(3)
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true", offload_inputs=offload))
    assert engine.config.offload_inputs == offload
    assert train_and_count_kept(model, engine, steps=2) == [3, 3]
    assert engine.stats["offloaded_passes"] == 0 and engine.stats["input_offload_bytes"] == 0
    assert not engine.saved_inputs.buffers


def test_auto_offloads_beyond_half_the_free_memory(caplog):
    """The rule: offload when blocks x one block's input exceeds half the free device memory; an INFO
    line says so once, with the sizes."""
    assert not offload_needed(100, 200) and offload_needed(101, 200) and offload_needed(1, 1)
    model = own_llama(3)
    saved = 3 * input_bytes(model, token_batches(1)[0])
    free = iter([2 * saved, 2 * saved - 2, 2 * saved - 2, 2 * saved])
    engine = Engine(
        model, EngineConfig(device="cpu", precision="32-true"), Probes(device_free_bytes=lambda: next(free))
    )
    with caplog.at_level(logging.INFO, logger="megatrain_lightning"):
        assert train_and_count_kept(model, engine, steps=4) == [3, 0, 0, 3]
    assert engine.stats["offloaded_passes"] == 2
    lines = [r for r in caplog.records if r.name == "megatrain_lightning" and "host memory" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert f"{saved / 2**30:.2f} GiB" in lines[0].getMessage()


def two_forwards_one_backward(probes: Probes | None = None, **options) -> Engine:
    """A loss over two forwards of a 2-block model, its gradients checked against ordinary autograd's."""
    ref, mt = own_llama(2), own_llama(2)
    engine = Engine(mt, EngineConfig(device="cpu", precision="32-true", **options), probes)
    engine.optimizer(torch.optim.AdamW(mt.parameters(), lr=1e-3))
    x, y = token_batches(2)
    (ref(x, targets=x) + 0.5 * ref(y, targets=y)).backward()
    with engine.backward(accumulate=True):
        (mt(x, targets=x) + 0.5 * mt(y, targets=y)).backward()
    engine.flush()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for unit in engine.units:
        for name, e in zip(engine.qualified_names(unit), unit.entries):
            assert torch.equal(unit.acc[e.offset : e.offset + e.numel].view(e.shape), grads[name]), name
    return engine


def test_two_forwards_before_one_backward():
    """Each block call keeps its own host buffer: a loss over two forwards of the model is exact."""
    engine = two_forwards_one_backward(offload_inputs=True)
    assert len(engine.saved_inputs.buffers) == 4


def test_free_cuda_memory_counts_what_the_allocator_caches_unused(monkeypatch):
    """The driver's free memory plus the caching allocator's reserved-but-unallocated memory (where the
    previous step's saved inputs go once its backward frees them)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (3 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 10 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 6 << 30)
    assert free_device_bytes(torch.device("cuda", 0)) == 7 << 30
    assert free_device_bytes(torch.device("cpu")) is None


def test_forwards_deciding_differently_before_one_backward():
    """Two forwards of one loss, the first keeping its inputs on the device and the second offloading:
    each block's backward finds its input where its own forward put it, and the gradients are exact."""
    free = iter([10**12, 0])  # the first pass has room, the second none
    engine = two_forwards_one_backward(Probes(device_free_bytes=lambda: next(free)))
    assert engine.stats["offloaded_passes"] == 1 and len(engine.saved_inputs.buffers) == 2


class FreeDeviceMemory(L.Callback):
    """Sets the free device memory "auto" sees before each training batch (`free(batch_idx)`), and keeps
    the engine's stats past teardown."""

    def __init__(self, free: Callable[[int], int]) -> None:
        self.free = free
        self.stats: dict = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self.batch_idx = batch_idx
        self.stats = trainer.strategy.engine.stats

    def device_free_bytes(self, device: torch.device) -> int:
        """What the engine reads as the free device memory (in place of device_memory.free_device_bytes)."""
        return self.free(self.batch_idx)


@pytest.mark.parametrize(
    ("streams", "pattern"), [("sync", "always"), ("async-seed0", "always"), ("sync", "odd"), ("async-lazy", "odd")]
)
def test_auto_offloading_trains_exactly(streams, pattern, monkeypatch):
    """offload_inputs="auto" with little free device memory trains as ordinary Lightning does, bit for bit;
    also when passes alternate between keeping and offloading, inside an accumulation window too."""
    if streams != "sync":
        async_streams.install(monkeypatch, **({"hold": 1.0} if streams == "async-lazy" else {"seed": 0}))
    batches, train = token_batches(8), dict(accumulate_grad_batches=2, gradient_clip_val=0.5)
    initial, ref = _ordinary(8)
    mt = CausalLM(copy.deepcopy(initial), split_decay=True)
    short = (lambda i: True) if pattern == "always" else (lambda i: i % 2 == 1)
    free = FreeDeviceMemory(lambda i: 0 if short(i) else 10**12)
    monkeypatch.setattr(build_module, "free_device_bytes", free.device_free_bytes)
    torch.manual_seed(5)
    fit(mt, batches, strategy=MegatrainStrategy(), callbacks=[free], **train)
    assert_same(ref, mt)
    assert free.stats["offloaded_passes"] == sum(short(i) for i in range(len(batches)))


@pytest.mark.parametrize("value", ["yes", None, 1, "True"])
def test_a_bad_offload_inputs_value_is_refused(value):
    with pytest.raises(ValueError, match=r"offload_inputs=.*True.*False.*'auto'") as err:
        MegatrainStrategy(offload_inputs=value)
    assert repr(value) in str(err.value)
    with pytest.raises(ValueError, match="offload_inputs="):
        Engine(own_llama(2), EngineConfig(device="cpu", precision="32-true", offload_inputs=value))


def test_a_step_dropped_without_backward_returns_its_buffers():
    model = own_llama(2)
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true", offload_inputs=True))
    engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    for batch in token_batches(3):
        loss = model(batch, targets=batch)  # e.g. a step skipped for a non-finite loss
        del loss
        gc.collect()
    assert len(engine.saved_inputs.buffers) == 2


def test_the_stream_double_catches_a_removed_wait(monkeypatch):
    """Recomputing from an input whose upload was not waited for reads stale memory: the recompute differs
    from the forward, which the engine's self-check stops before anything is stepped with its gradient (or,
    where it cannot tell, training differs).

    (The upload's own wait for the input's download cannot be shown reliably here: on the CPU double the
    gradient downloads, queued behind the input downloads on the same stream, usually force them first.)"""
    removed = ("fetch", "compute")
    made = async_streams.install(monkeypatch, hold=1.0, skip=(removed,))
    a, b = twin(lambda: hf_llama(layers=3))
    ref, mt = CausalLM(a), CausalLM(b)
    batches = token_batches(4)
    fit(ref, batches, strategy="auto")
    try:
        fit(mt, batches, strategy=MegatrainStrategy(offload_inputs=True))
    except RuntimeError as error:  # (stopped: the self-check)
        assert "its recompute in backward did not reproduce its forward" in str(error)
    else:  # (the recompute read the same stale input as its forward would have: trained on wrong data)
        pr, pm = params_of(ref.model), params_of(mt.model)
        assert mt.losses != ref.losses or any(not torch.equal(pm[n], pr[n]) for n in pr)
    assert made and made[0].skipped[removed] > 0


# -- the host-memory check counts the pinned buffers of offloaded inputs ---------------------------------


@pytest.mark.parametrize("spare", [-1, 0])
def test_offloaded_inputs_that_do_not_fit_the_host_are_refused_before_pinning(spare):
    """A budget that holds the training state (16 B/param in fp32: master 4, Adam 8, gradient slab 4) but
    not the layers x tokens x hidden x 4 bytes of offloaded inputs is refused at the first forward, before
    any input buffer is pinned; one byte more and the step runs."""
    model, layers = own_llama(2), 2
    numel = sum(p.numel() for p in model.parameters())
    batch = token_batches(1)[0]
    inputs = layers * batch.numel() * model.config.hidden_size * 4
    budget = 16 * numel + inputs + spare
    engine = None

    def available() -> int:  # the budget less what the engine holds so far (the OS's MemAvailable)
        return budget - (sum(engine.host_bytes().values()) if engine is not None else 0)

    config = EngineConfig(device="cpu", precision="32-true", offload_inputs=True)
    engine = Engine(model, config, Probes(host_available_bytes=available))
    engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    if spare < 0:
        with pytest.raises(build_module.HostMemoryError) as err:
            model(batch, targets=batch)
        message = str(err.value)
        assert f"{inputs} bytes" in message and "\n" not in message
        assert "offload_inputs=False" in message and "Shorten seq_len" in message
        assert engine.saved_inputs.buffers == []  # refused before pinning
    else:
        model(batch, targets=batch).backward()
        assert engine.saved_inputs.host_bytes() == inputs
    engine.close()


# -- offload_inputs_dtype: the offloaded inputs stored smaller (lossy) -----------------------------------


def stored_input_bytes(stored: str | None, tokens: int, hidden: int, elt: int) -> int:
    """One block input as the host holds it, from the formats: exactly (elt bytes per element), bfloat16 (2),
    or float8 (1) plus one fp32 scale per token."""
    return {None: tokens * hidden * elt, "bf16": tokens * hidden * 2, "fp8": tokens * (hidden + 4)}[stored]


@pytest.mark.parametrize(
    ("precision", "stored", "share"),
    [("32-true", "bf16", 1 / 2), ("32-true", "fp8", 1 / 4), ("bf16-true", "fp8", 1 / 2)],
)
def test_stored_inputs_take_their_share_of_the_host_and_the_link(precision, stored, share):
    """The pinned buffers and the bytes moved (down and up, per block and step) are those of the stored
    form: half or a quarter of the lossless ones (fp8 plus 4 bytes of scale per token)."""
    model, engine, _ = train_steps(precision, offload_inputs=True, offload_inputs_dtype=stored)
    tokens, hidden = token_batches(1)[0].numel(), model.config.hidden_size
    one = stored_input_bytes(stored, tokens, hidden, 4 if precision == "32-true" else 2)
    lossless = stored_input_bytes(None, tokens, hidden, 4 if precision == "32-true" else 2)
    assert one == share * lossless + (4 * tokens if stored == "fp8" else 0)
    assert engine.saved_inputs.host_bytes() == 3 * one  # one buffer per block, reused by the second step
    assert engine.stats["input_offload_bytes"] == 2 * 3 * 2 * one  # steps x blocks x (down and up)


def train_steps(precision: str, steps: int = 2, **options) -> tuple[LlamaForCausalLM, Engine, list[float]]:
    """`steps` optimizer steps of a 3-block model on the engine, and their losses."""
    model = own_llama(3)
    engine = Engine(model, EngineConfig(device="cpu", precision=precision, **options))
    opt = engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    losses = []
    for batch in token_batches(steps):
        loss = model(batch, targets=batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    engine.flush()  # the last step's host work done: the parameters are its result
    return model, engine, losses


@pytest.mark.parametrize("offload", [False, "auto"])
def test_stored_inputs_do_nothing_while_the_inputs_stay_on_the_device(offload, caplog):
    """offload_inputs_dtype with offloading off (or "auto" on a CPU device, which never offloads): training
    is bitwise the lossless one, nothing goes to the host, and nothing is logged about it."""
    with caplog.at_level(logging.DEBUG, logger="megatrain_lightning"):
        model, engine, losses = train_steps("32-true", offload_inputs=offload, offload_inputs_dtype="fp8")
    ref_model, _, ref_losses = train_steps("32-true", offload_inputs=offload)
    assert losses == ref_losses and all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))
    assert engine.stats["input_offload_bytes"] == 0 and not engine.saved_inputs.buffers
    assert not [r for r in caplog.records if "offload" in r.getMessage()]


@pytest.fixture(scope="module")
def ordinary_losses() -> list[float]:
    """Ordinary Lightning training (torch's AdamW) of the model and data of the test below."""
    ref = CausalLM(hf_llama(layers=3), lr=1e-3)
    fit(ref, MEMORIZE, strategy="auto")
    return ref.losses


MEMORIZE = token_batches(2) * 4  # 8 steps over 2 batches: the loss falls by about 0.35 (from 4.63)


@pytest.mark.parametrize(
    ("stored", "bound", "decoded"),
    [("bf16", 2e-4, 1.0), ("fp8", 1e-3, 1.0), ("fp8", 1e-3, 0.9)],
    ids=["bf16", "fp8", "fp8-decoded-10%-off"],
)
def test_stored_inputs_train_close_to_ordinary_training(stored, bound, decoded, ordinary_losses, monkeypatch):
    """Every step's loss within `bound` (nats) of ordinary training's.

    The forward is exact (only backward's recompute reads the stored input), so the first loss is equal;
    after it, each gradient carries the stored input's rounding (relative at most 2**-8 for bf16, 2**-4 for
    fp8; unbiased, so it mostly averages out over a matmul's tokens and features). Measured here: at most
    5e-5 (bf16) and 3e-4 (fp8) against the loss's fall of 0.35; the bounds allow about 3x that. The last
    case decodes 10% off (a bug, not a format's rounding) and leaves the bound (by 2e-3): the bound tells
    the formats' rounding from a wrong input."""
    if decoded != 1.0:
        decode = InputCodec.decode
        monkeypatch.setattr(InputCodec, "decode", lambda self, *args: decode(self, *args) * decoded)
    mt = CausalLM(hf_llama(layers=3), lr=1e-3)
    fit(mt, MEMORIZE, strategy=MegatrainStrategy(offload_inputs=True, offload_inputs_dtype=stored))
    assert mt.losses[0] == ordinary_losses[0] and len(mt.losses) == len(ordinary_losses) == 8
    worst = max(abs(a - b) for a, b in zip(mt.losses, ordinary_losses))
    assert 0 < worst  # lossy: the stored form did round
    assert (worst <= bound) == (decoded == 1.0), worst


def test_stored_inputs_keep_the_copy_ordering(monkeypatch):
    """Under the asynchronous copy-stream double (each copy run late, on its stream's own thread), inputs
    stored as fp8 train bit for bit as with synchronous copies: the encoded buffer goes down only once
    written, and is decoded only once its upload has been waited for (else stale memory would be read)."""

    def train() -> CausalLM:
        mt = CausalLM(hf_llama(layers=3), lr=1e-3)
        fit(mt, MEMORIZE[:4], strategy=MegatrainStrategy(offload_inputs=True, offload_inputs_dtype="fp8"))
        return mt

    sync = train()
    made = async_streams.install(monkeypatch, hold=1.0)
    late = train()
    assert made and len(late.losses) == 4
    assert_same(sync, late)


@pytest.mark.parametrize("value", ["fp16", "float8", True, 8])
def test_a_bad_offload_inputs_dtype_is_refused(value):
    expected = rf"offload_inputs_dtype={value!r}: choose None .*'bf16'.*'fp8'"
    for make in (
        lambda: MegatrainStrategy(offload_inputs_dtype=value),
        lambda: MegatrainFabricStrategy(offload_inputs_dtype=value),
        lambda: EngineConfig(device="cpu", offload_inputs_dtype=value),
    ):
        with pytest.raises(ValueError, match=expected) as err:
            make()
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_storage_of_bf16_inputs_is_refused(precision):
    """It would save nothing: the error names the value and the fix."""
    with pytest.raises(ValueError, match=rf"offload_inputs_dtype='bf16' with precision='{precision}'.*use 'fp8'"):
        EngineConfig(device="cpu", precision=precision, offload_inputs=True, offload_inputs_dtype="bf16")
    EngineConfig(device="cpu", precision=precision, offload_inputs=True, offload_inputs_dtype="fp8")
