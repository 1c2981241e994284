"""Sharded checkpoints on fsspec storage: exact resume, backends, atomicity under kill -9, errors, memory."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
import uuid
import warnings

import fsspec
import pytest
import torch

from megatrain_lightning import Engine, EngineConfig, MegatrainStrategy
from megatrain_lightning.checkpoint import CheckpointError, ModelCheckpoint, export_hf, restore, save, store
from megatrain_lightning.models import LlamaConfig, LlamaForCausalLM, from_pretrained
from tests.helpers import CausalLM, fit, hf_llama, params_of, token_batches, twin


def checkpointed(module, batches, url, **kwargs):
    cb = ModelCheckpoint(dirpath=url, save_last=True, every_n_train_steps=kwargs.pop("every", 5), save_top_k=1)
    fit(module, batches, enable_checkpointing=True, callbacks=[cb], **kwargs)
    return cb


def test_twenty_steps_equal_ten_plus_resume_plus_ten(tmp_path, torch_adam):
    """Accumulation 2, clipping 1.0, warm-up + cosine: 20 optimizer steps straight equal 10 + resume + 10."""
    batches = token_batches(20)  # one epoch = 10 optimizer steps
    kwargs = dict(accumulate_grad_batches=2, gradient_clip_val=1.0)
    a, b = twin(hf_llama)
    c = copy.deepcopy(b)
    straight = CausalLM(a, schedule=20, split_decay=True)
    fit(straight, batches, max_epochs=2, **kwargs)
    checkpointed(CausalLM(b, schedule=20, split_decay=True), batches, str(tmp_path), max_epochs=1, **kwargs)
    resumed = CausalLM(c, schedule=20, split_decay=True)
    cb = ModelCheckpoint(dirpath=str(tmp_path), save_last=True)
    fit(resumed, batches, max_epochs=2, ckpt_path="last", callbacks=[cb], enable_checkpointing=True, **kwargs)
    assert resumed.losses == straight.losses[20:]
    assert all(torch.equal(x, y) for x, y in zip(params_of(resumed.model).values(), params_of(straight.model).values()))


def storage_url(kind: str, tmp_path, s3_endpoint_factory) -> str:
    if kind == "local":
        return str(tmp_path / "ckpts")
    if kind == "memory":
        return f"memory://megatrain-{uuid.uuid4().hex[:8]}"
    s3_endpoint_factory()
    return f"s3://megatrain/run-{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("kind", ["local", "memory", "s3"])
def test_save_list_resume_and_top_k_deletion(kind, tmp_path, request, recwarn, torch_adam):
    url = storage_url(kind, tmp_path, lambda: request.getfixturevalue("s3_env"))
    batches = token_batches(12)
    a, b = twin(hf_llama)
    c = copy.deepcopy(b)
    straight = CausalLM(a)
    fit(straight, batches, max_epochs=2)
    checkpointed(CausalLM(b), batches, url, every=4, max_epochs=1)
    assert not [str(w.message) for w in recwarn if "interrupted save" in str(w.message)]  # last.ckpt: 3 saves
    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    # Files, not listing entries: some stores (SeaweedFS) keep an emptied prefix as a directory entry.
    tops = {p[len(root.rstrip("/")) + 1 :].split("/", 1)[0] for p in fs.find(root)}
    # save_top_k=1 without a monitor keeps the newest step checkpoint; the older ones were deleted whole.
    assert tops == {"epoch=0-step=12.ckpt", "epoch=0-step=12.ckpt.d", "last.ckpt", "last.ckpt.d"}
    resumed = CausalLM(c)
    cb = ModelCheckpoint(dirpath=url, save_last=True)
    fit(resumed, batches, max_epochs=2, ckpt_path="last", callbacks=[cb], enable_checkpointing=True)
    assert resumed.losses == straight.losses[12:]


KILL_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {repo!r})
    import megatrain_lightning.checkpoint as store
    from lightning.pytorch.callbacks import ModelCheckpoint
    from tests.helpers import CausalLM, fit, hf_llama, token_batches

    saves = {{"n": 0}}
    real_save = store.save

    def dying_save(engine, url, state, **kw):
        saves["n"] += 1
        if saves["n"] == 4:  # epoch 1 rewrites last.ckpt: die with SIGKILL after two of its unit shards
            kw["after_unit"] = lambda i: i == 1 and os.kill(os.getpid(), signal.SIGKILL)
        return real_save(engine, url, state, **kw)

    store.save = dying_save
    cb = ModelCheckpoint(dirpath={url!r}, save_last=True, every_n_epochs=1, save_top_k=-1)
    fit(CausalLM(hf_llama()), token_batches(3), max_epochs=3, enable_checkpointing=True, callbacks=[cb])
    """
)


def test_kill_during_save_keeps_the_previous_checkpoint(tmp_path, torch_adam):
    url = str(tmp_path / "ckpts")
    script = KILL_SCRIPT.format(repo=str(__import__("pathlib").Path(__file__).parents[1]), url=url)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    # Saves: epoch 0 file, last (step 3), epoch 1 file, then last (step 6) died two shards into its new version.
    # Epochs are cut at checkpoints so that resuming needs no mid-epoch loader position.
    assert (tmp_path / "ckpts" / "epoch=1-step=6.ckpt").is_file()
    versions = list((tmp_path / "ckpts" / "last.ckpt.d").iterdir())
    assert len(versions) == 2  # the committed step-3 version and the partial one
    assert sum((v / "index.json").exists() for v in versions) == 1
    batches = token_batches(3)
    a, b = twin(hf_llama)
    straight = CausalLM(a)
    fit(straight, batches, max_epochs=3)
    resumed = CausalLM(b)
    cb = ModelCheckpoint(dirpath=url, save_last=True, every_n_epochs=1)
    with pytest.warns(UserWarning, match="interrupted save"):
        fit(resumed, batches, max_epochs=3, ckpt_path="last", callbacks=[cb], enable_checkpointing=True)
    assert resumed.losses == straight.losses[3:]  # resumed from the step-3 last, the committed one
    # The stale partial is gone; the checkpoint the last save replaced stays, for readers of its marker.
    assert all((v / "index.json").is_file() for v in (tmp_path / "ckpts" / "last.ckpt.d").iterdir())


def engine_with_state(layers: int = 3):
    model = LlamaForCausalLM(LlamaConfig.from_preset("tiny") if layers == 4 else _tiny(layers))
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true"))
    for unit in engine.all_units():
        unit.alloc_optimizer_state()
        unit.m.normal_()
        unit.v.uniform_()
        unit.steps = [7] * len(unit.entries)
    return model, engine


def _tiny(layers: int) -> LlamaConfig:
    cfg = LlamaConfig.from_preset("tiny")
    cfg.num_hidden_layers = layers
    return cfg


def test_round_trip_restores_masters_moments_and_steps(tmp_path):
    _, engine = engine_with_state()
    url = str(tmp_path / "c.ckpt")
    save(engine, url, {"epoch": 1})
    _, other = engine_with_state()
    restore(other, url, optimizer=True)
    for u, v in zip(engine.all_units(), other.all_units()):
        assert torch.equal(u.master, v.master) and torch.equal(u.m, v.m) and torch.equal(u.v, v.v)
        assert v.steps == [7] * len(v.entries)


def test_index_names_tied_parameters_and_the_model_to_export(tmp_path):
    """The tie's second name is an alias, not a buffer; the model to export and its config are recorded;
    the marker is JSON inside a pickle that torch.load refuses, and is read back."""
    model = LlamaForCausalLM(LlamaConfig.from_preset("tiny-qwen"))
    engine = Engine(model, EngineConfig(device="cpu", precision="32-true"))
    url = str(tmp_path / "c.ckpt")
    save(engine, url, {})
    _, _, index = store.read_index(url)
    assert index["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert store.read_buffers(*store.read_index(url)[:2], index) == {}
    assert index["export"]["library"] == "megatrain" and index["export"]["prefix"] == ""
    assert LlamaConfig(**index["export"]["llama_config"]) == model.config
    assert all(p["group"] is None for rec in index["units"] for p in rec["params"])  # no optimizer attached
    raw = (tmp_path / "c.ckpt").read_bytes()
    assert store.parse_marker(raw)["format"] == "megatrain-checkpoint" and store.is_checkpoint(url)
    with pytest.raises(Exception, match="megatrain_lightning sharded checkpoint"):
        torch.load(url)


def test_corrupted_shard_is_refused(tmp_path):
    _, engine = engine_with_state()
    url = str(tmp_path / "c.ckpt")
    save(engine, url, {})
    shard = next((tmp_path / "c.ckpt.d").iterdir()) / "units" / "00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum.*damaged.*earlier checkpoint"):
        restore(engine_with_state()[1], url, optimizer=True)


def test_missing_index_and_missing_marker_are_refused(tmp_path):
    _, engine = engine_with_state()
    url = str(tmp_path / "c.ckpt")
    save(engine, url, {})
    (next((tmp_path / "c.ckpt.d").iterdir()) / "index.json").unlink()
    with pytest.raises(CheckpointError, match="index .* is missing"):
        restore(engine, url, optimizer=False)
    with pytest.raises(CheckpointError, match="no checkpoint at .*commit marker is missing"):
        restore(engine, str(tmp_path / "never.ckpt"), optimizer=False)


def test_checkpoint_of_another_shape_is_refused(tmp_path):
    _, engine = engine_with_state(layers=3)
    url = str(tmp_path / "c.ckpt")
    save(engine, url, {})
    with pytest.raises(CheckpointError, match="another shape"):
        restore(engine_with_state(layers=2)[1], url, optimizer=False)
    wider = LlamaForCausalLM(LlamaConfig(**{**_tiny(3).__dict__, "intermediate_size": 96}))
    with pytest.raises(CheckpointError, match="another shape"):
        restore(Engine(wider, EngineConfig(device="cpu", precision="bf16-true")), url, optimizer=False)


def test_export_hf_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    model, engine = engine_with_state()
    export_hf(engine, model, tmp_path / "hf", dtype=torch.float32)
    tokens = token_batches(1)[0] % 256
    with torch.no_grad():
        ours = model(tokens)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()(tokens).logits
        reloaded = from_pretrained(tmp_path / "hf")(tokens)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    assert torch.equal(reloaded, ours)


MEMORY_SCRIPT = textwrap.dedent(
    """
    import sys, threading, time
    sys.path.insert(0, {repo!r})
    import torch
    from megatrain_lightning import Engine, EngineConfig
    from megatrain_lightning.lightning.callbacks import rss_bytes as rss
    from megatrain_lightning.checkpoint import save
    from megatrain_lightning.models import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                      num_attention_heads=16, num_key_value_heads=4)
    engine = Engine(LlamaForCausalLM(cfg), EngineConfig(device="cpu", precision="32-true"))
    for u in engine.all_units():
        u.alloc_optimizer_state(); u.m.fill_(1e-3); u.v.fill_(1e-6); u.steps = [1] * len(u.entries)
    n = engine.num_parameters()
    largest = max(u.numel for u in engine.all_units()) * 12
    peak, before, done = [0], rss(), [False]
    def sample():
        while not done[0]:
            peak[0] = max(peak[0], rss()); time.sleep(0.002)
    t = threading.Thread(target=sample); t.start()
    save(engine, {url!r}, {{}})
    done[0] = True; t.join()
    print(n, before, peak[0] - before, largest)
    """
)


@pytest.mark.slow
def test_save_memory_stays_within_a_few_blocks(tmp_path):
    """~200M parameters: saving adds at most a few units' worth of resident memory to the model state."""
    script = MEMORY_SCRIPT.format(
        repo=str(__import__("pathlib").Path(__file__).parents[1]), url=str(tmp_path / "m.ckpt")
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, check=True)
    params, state_rss, growth, largest_unit = map(int, out.stdout.split())
    assert params > 190e6
    assert growth <= 3 * largest_unit, (growth, largest_unit, state_rss)


def test_validate_from_a_fit_checkpoint_with_param_groups(tmp_path, torch_adam):
    """The layout does not depend on the optimizer: a checkpoint written by fit (two param groups) loads
    into validate (no optimizer) and gives the trained model's validation loss."""
    batches = token_batches(4)
    module = CausalLM(hf_llama(), split_decay=True)
    cb = ModelCheckpoint(dirpath=str(tmp_path), save_last=True)
    trainer = fit(module, batches, enable_checkpointing=True, callbacks=[cb])
    expected = trainer.validate(module, torch.utils.data.DataLoader(batches, batch_size=None), verbose=False)
    fresh = CausalLM(hf_llama(), split_decay=True)
    got = trainer.validate(
        fresh,
        torch.utils.data.DataLoader(batches, batch_size=None),
        ckpt_path=str(tmp_path / "last.ckpt"),
        verbose=False,
    )
    assert got == expected


def test_save_outside_fit_says_it_writes_the_single_file_format(tmp_path, torch_adam):
    module = CausalLM(hf_llama())
    trainer = fit(module, token_batches(2))
    with pytest.warns(UserWarning, match="single-file format"):
        trainer.save_checkpoint(tmp_path / "after.ckpt")
    assert "state_dict" in torch.load(tmp_path / "after.ckpt", weights_only=False)


def test_save_after_fit_over_a_sharded_checkpoint_writes_one_that_resumes_exactly(tmp_path, torch_adam):
    """trainer.save_checkpoint after fit over the sharded last.ckpt ModelCheckpoint wrote: a new sharded
    version from the units fit left (a single file there would sit beside the marker's data and neither would
    load), from which the next epoch trains bit for bit as the run would have straight on."""
    batches = token_batches(4)
    a, b = twin(hf_llama)
    c = copy.deepcopy(b)
    straight = CausalLM(a)
    fit(straight, batches, max_epochs=2)
    cb = ModelCheckpoint(dirpath=str(tmp_path), save_last=True)
    trainer = fit(CausalLM(b), batches, enable_checkpointing=True, callbacks=[cb])
    path = tmp_path / "last.ckpt"
    saved_by_fit = store.parse_marker(path.read_bytes())["data"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no "single-file format" warning)
        trainer.save_checkpoint(path)
    assert store.parse_marker(path.read_bytes())["data"] != saved_by_fit  # a new version, committed
    resumed = CausalLM(c)
    fit(resumed, batches, max_epochs=2, ckpt_path=str(path))
    assert resumed.losses == straight.losses[4:]
    assert all(torch.equal(x, y) for x, y in zip(params_of(resumed.model).values(), params_of(straight.model).values()))


def test_save_after_fit_with_the_moments_on_nvme_is_refused_before_anything_is_written(tmp_path):
    """The NVMe tier's moments are scratch and go with the run: a save after fit says so in one line and leaves
    the checkpoint there as it was; the weights alone still save."""
    cb = ModelCheckpoint(dirpath=str(tmp_path), save_last=True)
    strategy = MegatrainStrategy(nvme_dir=str(tmp_path))
    trainer = fit(CausalLM(hf_llama()), token_batches(2), strategy=strategy, enable_checkpointing=True, callbacks=[cb])
    path = tmp_path / "last.ckpt"
    marker = path.read_bytes()
    with pytest.raises(RuntimeError, match=r"after fit with nvme_dir: the Adam moments .* nothing was written") as err:
        trainer.save_checkpoint(path)
    assert "\n" not in str(err.value) and path.read_bytes() == marker
    trainer.save_checkpoint(path, weights_only=True)
    assert not store.read_index(str(path))[2]["optimizer"]
