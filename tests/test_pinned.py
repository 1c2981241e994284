"""Exact-size pinned host memory (engine/host/pinned.py) and a host-memory check that counts what is allocated.

No GPU is needed: CUDA host registration is replaced by a recorder, so the engine's pinned buffers, their
sizes and their unregistration at release are checked on the CPU. tests/test_cuda.py covers the real thing.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler

import megatrain_lightning.engine.build as build_module
from megatrain_lightning import Engine, EngineConfig, HostMemoryError
from megatrain_lightning.engine import Probes
from megatrain_lightning.engine.host import pinned
from megatrain_lightning.engine.host.units import host_bytes_per_param
from megatrain_lightning.models import LlamaForCausalLM
from tests.helpers import CausalLM, fit, hf_llama, own_llama, token_batches
from tests.streamed import precision_of


class FakeCuda:
    """Stands in for cudaHostRegister / cudaHostUnregister: records every call, fails when told to."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}  # ptr -> nbytes, currently registered
        self.calls: list[tuple[int, int, int]] = []  # every registration: (ptr, nbytes, flags)
        self.unregistered: list[int] = []
        self.fail_with = 0  # error code the next registrations return (0: succeed)
        self.last_error = 0  # CUDA's "last error": a failed call leaves it set until cudaGetLastError

    def register(self, ptr: int, nbytes: int, flags: int) -> int:
        if self.fail_with:
            self.last_error = self.fail_with
            return self.fail_with
        assert ptr not in self.registered, "a range was registered twice"
        self.calls.append((ptr, nbytes, flags))
        self.registered[ptr] = nbytes
        return 0

    def unregister(self, ptr: int) -> int:
        if ptr not in self.registered:
            self.last_error = 713
            return 713  # cudaErrorHostMemoryNotRegistered
        del self.registered[ptr]
        self.unregistered.append(ptr)
        return 0

    def get_last_error(self) -> int:
        code, self.last_error = self.last_error, 0
        return code


@pytest.fixture
def cuda(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setattr(pinned, "_host_register", fake.register)
    monkeypatch.setattr(pinned, "_host_unregister", fake.unregister)
    monkeypatch.setattr(pinned, "_cuda_get_last_error", lambda: fake.get_last_error)
    yield fake
    pinned.unregister_all()  # whatever a failed test left behind, while the fake is still in place


def step(engine: Engine, model: LlamaForCausalLM, accumulate: int = 1) -> None:
    """One optimizer step over `accumulate` micro-batches, as the strategy drives the engine."""
    opt = engine.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    for i, batch in enumerate(token_batches(accumulate)):
        with engine.backward(accumulate=i < accumulate - 1):
            model(batch, targets=batch).backward()
    opt.step()
    engine.flush()


PINNED_KINDS = {torch.bfloat16: ("copy", "slab"), torch.float32: ("master", "slab")}


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pinned_bytes_are_exactly_the_accounted_pinned_buffers(cuda, dtype, accumulate):
    """Registered bytes = the bytes host_bytes() gives the pinned kinds (bf16: copy and slab; fp32: the
    master, which is the copy, and the slab), buffer by buffer at its exact size: no power-of-two rounding.
    Adam moments and the fp32 accumulator are ordinary memory."""
    model = own_llama()
    engine = Engine(model, EngineConfig(device="cpu", precision=precision_of(dtype), pin_memory=True))
    step(engine, model, accumulate)
    accounted = engine.host_bytes()
    assert (accounted["acc"] > 0) == (accumulate > 1)
    expected = sum(accounted[kind] for kind in PINNED_KINDS[dtype])
    assert sum(cuda.registered.values()) == expected == engine.pinned_bytes() == pinned.registered_bytes()

    buffers = {}
    for unit in engine.all_units():
        for kind in PINNED_KINDS[dtype]:
            t = getattr(unit, kind)
            buffers[t.data_ptr()] = t.numel() * t.element_size()
    assert cuda.registered == buffers  # each range is one whole buffer at its own size
    assert any(n & (n - 1) for n in buffers.values())  # sizes that a power-of-two allocator would round up
    assert all(flags == pinned.CUDA_HOST_REGISTER_PORTABLE for _, _, flags in cuda.calls)
    for unit in engine.all_units():
        assert not any(pinned.is_registered(t) for t in (unit.m, unit.v, unit.acc))
    engine.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_release_unregisters_every_range(cuda, dtype):
    model = own_llama()
    engine = Engine(model, EngineConfig(device="cpu", precision=precision_of(dtype), pin_memory=True))
    step(engine, model)
    registered = {ptr for ptr, _, _ in cuda.calls}
    masters = {name: t.clone() for name, t in engine.master_state_dict().items()}
    engine.close()
    assert sorted(cuda.unregistered) == sorted(registered) and not cuda.registered
    assert engine.pinned_bytes() == 0 and pinned.registered_bytes() == 0
    # The memory itself stays: the model's parameters are the (now ordinary) fp32 masters.
    assert all(torch.equal(p, masters[name]) for name, p in model.named_parameters())
    engine.close()  # a second release has nothing left to unregister
    assert len(cuda.unregistered) == len(registered)


def test_registration_failure_names_the_size_and_the_fix(cuda):
    cuda.fail_with = 2  # cudaErrorMemoryAllocation
    model = own_llama()
    first_copy = sum(p.numel() for p in model.model.layers[0].parameters()) * 2  # block 0's bf16 copy
    with pytest.raises(
        pinned.PinnedMemoryError, match=rf"\({first_copy} bytes\).*returned 2.*RLIMIT_MEMLOCK.*ulimit -l"
    ):
        Engine(model, EngineConfig(device="cpu", precision="bf16-true", pin_memory=True))
    assert pinned.registered_bytes() == 0
    # The failure left no error behind for the next kernel launch to raise (the retry without pinning runs).
    assert cuda.last_error == 0


def test_unregister_failure_keeps_the_buffer_alive(cuda):
    t = pinned.pinned_empty(1000, torch.float32)
    cuda.registered.clear()  # CUDA no longer knows the range: unregistering it fails
    with pytest.warns(UserWarning, match="cudaHostUnregister.*returned 713"):
        assert pinned.unregister([t]) == 0
    assert pinned.is_registered(t)  # still held, so never freed while (possibly) locked
    assert cuda.last_error == 0  # and CUDA's error was cleared
    cuda.registered[t.data_ptr()] = 4000
    assert pinned.unregister([t]) == 4000 and not pinned.is_registered(t)


def test_empty_buffers_are_not_registered(cuda):
    assert pinned.pinned_empty(0, torch.bfloat16).numel() == 0 and not cuda.calls


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_pinning_without_cuda_is_a_clear_error():
    with pytest.raises(pinned.PinnedMemoryError, match="needs a CUDA GPU.*pin_memory=False"):
        Engine(own_llama(2), EngineConfig(device="cpu", precision="bf16-true", pin_memory=True))


# -- the host-memory check counts the fp32 accumulator when accumulating ---------------------------------


def host_check_limits(model) -> tuple[int, int]:
    """(available bytes that fit 16 bytes/param but not 20, reclaimed bytes) for `model` in bf16."""
    numel = sum(p.numel() for p in model.parameters())
    blocks = model.model.layers if hasattr(model, "model") else model.layers
    reclaim = sum(p.numel() * p.element_size() for p in blocks.parameters())
    return 18 * numel - reclaim, numel


def test_host_check_counts_the_accumulator():
    assert host_bytes_per_param(torch.bfloat16, True) == 16
    assert host_bytes_per_param(torch.bfloat16, True, accumulating=True) == 20
    assert host_bytes_per_param(torch.float32, True, accumulating=True) == 20
    model = own_llama()
    available, _ = host_check_limits(model)
    Engine(
        model, EngineConfig(device="cpu", precision="bf16-true"), Probes(host_available_bytes=lambda: available)
    ).close()  # 16 B/param fits
    model = own_llama()
    with pytest.raises(
        HostMemoryError, match=r"20 bytes/param: .*fp32 gradient accumulator\).*accumulate_grad_batches=1"
    ):
        Engine(
            model,
            EngineConfig(device="cpu", precision="bf16-true", accumulating=True),
            Probes(host_available_bytes=lambda: available),
        )


@pytest.mark.parametrize("how", ["accumulate_grad_batches", "scheduler"])
def test_strategy_counts_the_accumulator_when_fitting_with_accumulation(monkeypatch, how):
    module = CausalLM(hf_llama())
    available, _ = host_check_limits(module.model)
    monkeypatch.setattr(build_module, "available_host_bytes", lambda: available)
    fit(module, token_batches(2), precision="bf16-mixed")  # 16 B/param fits
    module = CausalLM(hf_llama())
    kwargs = (
        {"accumulate_grad_batches": 2}
        if how == "accumulate_grad_batches"
        else {"callbacks": [GradientAccumulationScheduler({0: 1, 1: 2})], "max_epochs": 2}
    )
    with pytest.raises(HostMemoryError, match="fp32 gradient accumulator"):
        fit(module, token_batches(2), precision="bf16-mixed", **kwargs)


def test_offloaded_block_inputs_are_pinned_at_their_exact_size_and_released(cuda):
    """offload_inputs: one pinned buffer per block call, exactly the hidden state's bytes, unregistered at release."""
    model = own_llama(3)
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true", pin_memory=True, offload_inputs=True))
    step(engine, model)
    saved = engine.saved_inputs.buffers
    batch = token_batches(1)[0]
    assert len(saved) == 3 and engine.saved_inputs.host_bytes() == 3 * batch.numel() * model.config.hidden_size * 4
    assert all(cuda.registered[t.data_ptr()] == t.numel() * 4 for t in saved)
    engine.close()
    assert not cuda.registered
