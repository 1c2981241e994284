"""The engine's public API as a plain loop uses it: options, phases, state, storage, close."""

from __future__ import annotations

import copy

import pytest
import torch

from megatrain_lightning import Engine, EngineConfig
from megatrain_lightning.models import LlamaConfig, LlamaForCausalLM
from tests.helpers import token_batches


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch):
    monkeypatch.setenv("MEGATRAIN_CPU_ADAM", "torch")  # bit for bit torch.optim.AdamW


def tiny(layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig.from_preset("tiny")
    cfg.num_hidden_layers = layers
    return LlamaForCausalLM(cfg)


def streamed(model: torch.nn.Module, **options) -> tuple[Engine, torch.optim.Optimizer]:
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true", **options))
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return engine, engine.optimizer(adamw)


def steps(engine: Engine, model: torch.nn.Module, opt, batches, clip: float | None = None) -> list[float]:
    losses = []
    for batch in batches:
        loss = model(batch, targets=batch)
        with engine.backward(clip=clip is not None):
            loss.backward()
        if clip is not None:
            engine.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    engine.flush()
    return losses


def weights(engine: Engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.master_state_dict().items()}


@pytest.mark.parametrize("how", ["save-load", "state-dict"])
def test_a_run_resumed_from_its_state_continues_exactly(how, tmp_path):
    """Two steps, the state kept, two more; a fresh engine given that state takes the same two steps, bit for
    bit (moments, step counts and the param groups' lr come back)."""
    batches = token_batches(4)
    model = tiny()
    engine, opt = streamed(model)
    steps(engine, model, opt, batches[:2], clip=0.5)
    if how == "save-load":
        engine.save(str(tmp_path / "ckpt"), state={"step": 2})
    else:
        state = copy.deepcopy(engine.state_dict(opt))
    opt.param_groups[0]["lr"] = 3e-3  # changed after the save: the resumed run must get it from the state too
    expected = steps(engine, model, opt, batches[2:], clip=0.5)
    expected_weights = weights(engine)
    engine.close()

    fresh = tiny()
    engine, opt = streamed(fresh)
    opt.param_groups[0]["lr"] = 3e-3
    if how == "save-load":
        assert engine.load(str(tmp_path / "ckpt"))["step"] == 2
        opt.param_groups[0]["lr"] = 3e-3  # the saved groups hold 1e-2; this run changes it as the first did
    else:
        engine.load_state_dict(state, opt)
        opt.param_groups[0]["lr"] = 3e-3
    assert steps(engine, fresh, opt, batches[2:], clip=0.5) == expected
    got = weights(engine)
    assert all(torch.equal(got[k], v) for k, v in expected_weights.items())
    engine.close()


def test_load_restores_the_saved_param_groups(tmp_path):
    model = tiny()
    engine, opt = streamed(model)
    steps(engine, model, opt, token_batches(1))
    opt.param_groups[0]["lr"] = 1.25e-3
    engine.save(str(tmp_path / "ckpt"))
    engine.close()
    fresh = tiny()
    engine, opt = streamed(fresh)
    engine.load(str(tmp_path / "ckpt"))
    assert opt.param_groups[0]["lr"] == 1.25e-3
    engine.close()


def test_a_backward_outside_the_context_waits_for_the_step():
    """Nothing is known of what follows a bare backward: no unit is stepped before optimizer.step(), and the
    result is the same as with the step overlapping backward."""
    batches = token_batches(2)
    runs = []
    for phase in (False, True):
        model = tiny(3)
        engine, opt = streamed(model)
        for batch in batches:
            loss = model(batch, targets=batch)
            if phase:
                with engine.backward():
                    loss.backward()
            else:
                before = [list(u.steps) for u in engine.all_units()]
                loss.backward()
                engine.flush()
                assert [u.steps for u in engine.all_units()] == before  # nothing stepped during backward
            opt.step()
            opt.zero_grad()
        runs.append(weights(engine))
        engine.close()
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


def test_clipping_after_an_overlapped_step_is_refused_with_the_fix():
    model = tiny()
    engine, opt = streamed(model)
    batch = token_batches(1)[0]
    with engine.backward():  # no clip=True: units step as their gradients land
        model(batch, targets=batch).backward()
    with pytest.raises(RuntimeError, match=r"engine.backward\(clip=True\)"):
        engine.clip_grad_norm_(1.0)
    engine.close()


def test_the_context_closes_the_engine_into_an_ordinary_model():
    model = tiny()
    with Engine(model, EngineConfig(device="cpu", precision="bf16-mixed")) as engine:
        assert engine.config.compute_dtype == torch.bfloat16
        with torch.no_grad(), engine.autocast():
            model(token_batches(1)[0])
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
    assert model.model.layers[0].forward.__func__ is type(model.model.layers[0]).forward


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"precision": "16-mixed"}, "precision='16-mixed' is not supported: choose one of 32-true, bf16-mixed"),
        ({"num_slots": 1}, "num_slots=1: give at least 2 slots"),
        ({"offload_inputs": "yes"}, "offload_inputs='yes': choose True"),
        ({"host_layout": "slim"}, "host_layout='slim': choose one of default, lean"),
        ({"host_threads": 0}, "host_threads=0: give an integer from 1"),
        ({"overlap_optimizer": "false"}, "overlap_optimizer='false': pass True or False"),
        ({"piece": 0}, "piece=0: elements per piece"),
        ({"device": "gpu:7"}, "device='gpu:7': give a torch.device"),
        ({"nvme_dir": ""}, "nvme_dir='': give a directory on a local drive"),
        ({"recompute": "yes"}, "recompute='yes': choose True"),
    ],
)
def test_a_bad_option_is_one_line_naming_it(options, message):
    with pytest.raises(ValueError, match=message) as err:
        EngineConfig(**options)
    assert "\n" not in str(err.value)


def test_an_index_less_cuda_device_is_the_current_one(monkeypatch):
    """``device="cuda"`` (a plain loop's usual spelling) resolves to the current GPU's index at once: the host
    worker pins its thread with ``torch.cuda.set_device``, which refuses a device with no index (the worker
    would never start). A fake CUDA layer stands in for the GPU."""
    from megatrain_lightning.engine.build import worker_init

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    for device in ("cuda", torch.device("cuda")):
        assert EngineConfig(device=device).torch_device == torch.device("cuda", 3)
    assert EngineConfig(device="cuda:1").torch_device == torch.device("cuda", 1)  # an index given is kept
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr("megatrain_lightning.engine.build.configure_host_threads", lambda *a, **k: None)
    worker_init(torch.device("cuda"))  # the last guard, for a device that bypassed the config
    assert chosen == [3]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device='cuda': no CUDA GPU is visible.*device='cpu'"):
        EngineConfig(device="cuda")
