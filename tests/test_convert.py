"""Sharded checkpoints outside the strategy: loading in a fresh process, `megatrain convert`, old indexes."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import fsspec
import lightning.pytorch as L
import pytest
import torch
from torch import nn

import megatrain_lightning as mt
from megatrain_lightning.checkpoint import CheckpointError, ModelCheckpoint, is_checkpoint, store, stream
from megatrain_lightning.cli.main import run
from megatrain_lightning.lightning.convert import lightning_checkpoint, to_hf
from megatrain_lightning.lightning.data import TextDataModule
from megatrain_lightning.lightning.module import CausalLMModule, resolve_config
from megatrain_lightning.models import LlamaForCausalLM, save_pretrained
from tests.helpers import fit, hf_llama, hf_loss, quiet, token_batches, trainer, warmup_cosine

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
BATCHES = token_batches(8)  # accumulate 2: four optimizer steps an epoch
PROBE = token_batches(1, seed=7)[0]
TRAIN = dict(accumulate_grad_batches=2, gradient_clip_val=1.0)


class HFLM(L.LightningModule):
    """A transformers Llama (tied embeddings) built from saved hyper-parameters; two param groups, a schedule."""

    def __init__(self, layers: int = 2, lr: float = 1e-2, extra: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = hf_llama(layers, tie_word_embeddings=True)
        if extra:
            self.extra = nn.Parameter(torch.zeros(3))
        self.losses: list[float] = []
        self.loaded_step: int | None = None

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.loaded_step = checkpoint["global_step"]

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = hf_loss(self.model, batch)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        params = list(self.model.parameters())
        groups = [
            {"params": [p for p in params if p.ndim >= 2]},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
        opt = torch.optim.AdamW(groups, lr=self.hparams.lr, betas=(0.9, 0.95), weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(2, 8))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def logits_of(module: L.LightningModule) -> torch.Tensor:
    with torch.no_grad():
        out = module.model(PROBE)
    return out.logits if hasattr(out, "logits") else out


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    """HFLM trained one epoch with strategy='megatrain', its sharded last.ckpt, the trained weights and logits."""
    d = tmp_path_factory.mktemp("hf_run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEGATRAIN_CPU_ADAM", "torch")  # bitwise comparisons need torch's own arithmetic
        module = HFLM()
        cb = ModelCheckpoint(dirpath=str(d), save_last=True, save_top_k=0)
        fit(module, BATCHES, enable_checkpointing=True, callbacks=[cb], **TRAIN)
    assert is_checkpoint(str(d / "last.ckpt"))
    torch.save({"state_dict": module.state_dict(), "logits": logits_of(module)}, d / "expected.pt")
    return d


def llama_pairs(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(b[:, :-1], b[:, 1:]) for b in token_batches(n, seq=17)]


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """CausalLMModule (this project's Llama) fine-tuned from a Hugging Face directory that is gone afterwards."""
    d = tmp_path_factory.mktemp("llama_run")
    save_pretrained(LlamaForCausalLM(resolve_config("tiny", {"num_hidden_layers": 2})), d / "init")
    module = CausalLMModule(init_from=str(d / "init"), warmup_steps=1, max_steps=4)
    cb = ModelCheckpoint(dirpath=str(d), save_last=True, save_top_k=0)
    fit(module, llama_pairs(4), enable_checkpointing=True, callbacks=[cb])
    shutil.rmtree(d / "init")  # the fine-tuning source is not needed to load the result
    torch.save({"state_dict": module.state_dict(), "logits": logits_of(module)}, d / "expected.pt")
    return d


FRESH = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {repo!r})
    import megatrain_lightning as mt
    from megatrain_lightning.lightning.module import CausalLMModule
    from tests.test_convert import HFLM, logits_of

    results = {{}}
    try:
        HFLM.load_from_checkpoint({hf_ckpt!r})
        results["plain"] = "loaded"
    except Exception as err:
        results["plain"] = f"{{type(err).__name__}}: {{err}}"
    hf = mt.load_from_checkpoint(HFLM, {hf_ckpt!r}, lr=0.5)
    results["hf"] = {{"state_dict": hf.state_dict(), "logits": logits_of(hf), "lr": hf.hparams.lr,
                     "layers": hf.hparams.layers, "loaded_step": hf.loaded_step, "tied": hf.model.lm_head.weight is
                     hf.model.model.embed_tokens.weight}}
    llama = mt.load_from_checkpoint(CausalLMModule, {llama_ckpt!r})
    results["llama"] = {{"state_dict": llama.state_dict(), "logits": logits_of(llama)}}
    torch.save(results, {out!r})
    """
)


def test_a_fresh_process_loads_sharded_checkpoints(hf_run, llama_run, tmp_path):
    """The documented call, in a process that never trained: exact weights and logits, hyper-parameters from
    the checkpoint with kwargs overriding them, on_load_checkpoint called; Lightning's own call names it."""
    script = FRESH.format(
        repo=str(REPO),
        hf_ckpt=str(hf_run / "last.ckpt"),
        llama_ckpt=str(llama_run / "last.ckpt"),
        out=str(tmp_path / "results.pt"),
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = torch.load(tmp_path / "results.pt", weights_only=False)
    assert "load_from_checkpoint(YourModule, path) from megatrain_lightning" in results["plain"]
    for name, run_dir in (("hf", hf_run), ("llama", llama_run)):
        expected = torch.load(run_dir / "expected.pt")
        got = results[name]["state_dict"]
        assert got.keys() == expected["state_dict"].keys()
        assert all(torch.equal(got[k], expected["state_dict"][k]) for k in got), name
        assert torch.equal(results[name]["logits"], expected["logits"]), name
    assert results["hf"]["lr"] == 0.5 and results["hf"]["layers"] == 2  # kwargs override, the rest is saved
    assert results["hf"]["loaded_step"] == 4 and results["hf"]["tied"]


def test_strict_keys_and_plain_checkpoints_behave_as_in_lightning(hf_run, tmp_path):
    ckpt = str(hf_run / "last.ckpt")
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"extra\""):
        mt.load_from_checkpoint(HFLM, ckpt, extra=True)
    with pytest.warns(UserWarning, match="not in the checkpoint: \\['extra'\\]"):
        loose = mt.load_from_checkpoint(HFLM, ckpt, extra=True, strict=False)
    expected = torch.load(hf_run / "expected.pt")["state_dict"]
    assert torch.equal(loose.model.model.norm.weight, expected["model.model.norm.weight"])
    with pytest.raises(TypeError, match="must be a LightningModule class"):
        mt.load_from_checkpoint(loose, ckpt)


def test_convert_to_torch_loads_plainly_and_resumes_like_megatrain(hf_run, tmp_path, monkeypatch):
    """`megatrain convert --to torch`: Lightning's own load_from_checkpoint gets the exact weights, and an
    ordinary strategy resumed from it trains exactly as strategy='megatrain' resumed from the sharded one."""
    monkeypatch.setenv("MEGATRAIN_CPU_ADAM", "torch")
    out = tmp_path / "model.ckpt"
    line = run(["convert", str(hf_run / "last.ckpt"), "--to", "torch", str(out)])
    assert "with the optimizer state" in line
    expected = torch.load(hf_run / "expected.pt")["state_dict"]
    for loaded in (HFLM.load_from_checkpoint(out), mt.load_from_checkpoint(HFLM, out)):  # the latter delegates
        assert all(torch.equal(loaded.state_dict()[k], v) for k, v in expected.items())
    raw = torch.load(out, weights_only=True)
    assert [len(g["params"]) for g in raw["optimizer_states"][0]["param_groups"]] == [15, 5]  # matrices, norms
    sharded, ordinary = HFLM(), HFLM()
    fit(sharded, BATCHES, max_epochs=2, ckpt_path=str(hf_run / "last.ckpt"), **TRAIN)
    fit(ordinary, BATCHES, strategy="auto", max_epochs=2, ckpt_path=str(out), **TRAIN)
    assert len(ordinary.losses) == len(BATCHES) and ordinary.losses == sharded.losses
    assert all(torch.equal(a, b) for a, b in zip(ordinary.parameters(), sharded.parameters()))


def test_convert_this_projects_llama_to_hugging_face(llama_run, tmp_path):
    """fp32 by default (the masters as trained); --dtype bf16 stores the fp32 weights cast to bf16."""
    from safetensors.torch import load_file

    trained = {k.removeprefix("model."): v for k, v in torch.load(llama_run / "expected.pt")["state_dict"].items()}
    run(["convert", str(llama_run / "last.ckpt"), "--to", "hf", str(tmp_path / "fp32")])
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "fp32", attn_implementation="sdpa").eval()
    assert hf.dtype == torch.float32
    theirs = hf.state_dict()
    assert all(torch.equal(theirs[k], v) for k, v in trained.items())
    with torch.no_grad():
        expected = torch.load(llama_run / "expected.pt")["logits"]
        torch.testing.assert_close(hf(PROBE).logits, expected, rtol=1e-5, atol=1e-5)
    run(["convert", str(llama_run / "last.ckpt"), "--to", "hf", str(tmp_path / "bf16"), "--dtype", "bf16"])
    stored = load_file(tmp_path / "bf16" / "model.safetensors")
    assert stored.keys() == trained.keys()
    assert all(stored[k].dtype == torch.bfloat16 for k in stored)
    assert all(torch.equal(stored[k], v.to(torch.bfloat16)) for k, v in trained.items())
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    bf16 = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    assert torch.equal(bf16.model.norm.weight, trained["model.norm.weight"].to(torch.bfloat16))


def test_convert_a_transformers_model_to_hugging_face(hf_run, tmp_path):
    """A LightningModule wrapping a transformers model: its config was recorded at save time."""
    trained = {k.removeprefix("model."): v for k, v in torch.load(hf_run / "expected.pt")["state_dict"].items()}
    to_hf(str(hf_run / "last.ckpt"), tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.config.tie_word_embeddings and hf.config.use_cache
    assert all(torch.equal(hf.state_dict()[k], v) for k, v in trained.items())
    with torch.no_grad():
        assert torch.equal(hf(PROBE).logits, torch.load(hf_run / "expected.pt")["logits"])


def test_convert_writes_the_runs_tokenizer_and_the_folder_generates(tmp_path):
    """A CausalLMModule trained on TextDataModule's byte tokens: `--to hf` writes them beside the weights
    (the end-of-text byte in config.json, ordinary file modes), and transformers alone generates from it."""
    torch.manual_seed(0)
    data = TextDataModule("builtin:python-docs", seq_len=16, batch_size=2)
    model = CausalLMModule("tiny", overrides={"num_hidden_layers": 2}, max_steps=2)
    cb = ModelCheckpoint(dirpath=str(tmp_path), save_last=True, save_top_k=0)
    with quiet():
        trainer(max_steps=2, callbacks=[cb], enable_checkpointing=True, limit_val_batches=0).fit(model, data)
    umask = os.umask(0o022)
    try:
        line = run(["convert", str(tmp_path / "last.ckpt"), "--to", "hf", str(tmp_path / "hf")])
    finally:
        os.umask(umask)
    assert line.endswith("in float32, with its byte tokenizer"), line
    assert {f.name for f in (tmp_path / "hf").iterdir()} == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o644 for f in (tmp_path / "hf").iterdir())
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["eos_token_id"] == 0 and config["bos_token_id"] is None
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    prompt = tokenizer("The ", return_tensors="pt")
    assert prompt["input_ids"].tolist() == [list(b"The ")]
    out = hf.generate(**prompt, max_new_tokens=8, do_sample=False)
    with torch.no_grad():  # greedy: each new token is the arg-max of the trained model's own logits
        ours = model.model.eval()
        ids = prompt["input_ids"]
        for _ in range(8):
            ids = torch.cat([ids, ours(ids)[:, -1:].argmax(-1)], dim=1)
    assert out.shape[1] > 4 and out.tolist() == ids[:, : out.shape[1]].tolist()  # shorter only if it ended
    assert tokenizer.decode(out[0]) == data.tokenizer.decode(out[0].tolist())


def make_old(src: Path, dst: Path) -> str:
    """A copy of the checkpoint as the first version wrote it: a bare-JSON marker, no parameter order,
    groups, aliases or model description, and the tied head among the buffers."""
    shutil.copy(src, dst)
    shutil.copytree(f"{src}.d", f"{dst}.d")
    marker = store.parse_marker(dst.read_bytes())
    vdir = Path(f"{dst}.d") / marker["data"]
    index = json.loads((vdir / "index.json").read_text())
    for key in ("param_order", "aliases", "export", "data"):
        del index[key]
    for rec in index["units"]:
        rec["step"] = rec["params"][0]["step"]  # one Adam step count per unit, not per parameter
        for p in rec["params"]:
            del p["group"]
            del p["step"]
    embed = index["units"][0]["params"][0]
    assert embed["name"] == "model.model.embed_tokens.weight"
    master = store.read_unit(*store.read_index(str(dst))[:2], index["units"][0])["master"]
    head = master[: embed["shape"][0] * embed["shape"][1]].view(embed["shape"]).clone()
    fs = fsspec.filesystem("file")
    index["buffers"] = stream.write(fs, str(vdir / "buffers.safetensors"), [("model.lm_head.weight", head)])
    raw = json.dumps(index).encode()
    (vdir / "index.json").write_bytes(raw)
    dst.write_text(json.dumps({**marker, "index_crc32": zlib.crc32(raw)}))
    return str(dst)


def test_checkpoints_of_the_first_format_still_load_and_convert(hf_run, tmp_path):
    old = make_old(hf_run / "last.ckpt", tmp_path / "old.ckpt")
    assert is_checkpoint(old)
    expected = torch.load(hf_run / "expected.pt")["state_dict"]
    with pytest.warns(UserWarning, match="before checkpoints recorded the optimizer's parameter order"):
        ckpt = lightning_checkpoint(old)
    assert "optimizer_states" not in ckpt and ckpt["global_step"] == 4
    assert ckpt["state_dict"].keys() == expected.keys()
    assert all(torch.equal(ckpt["state_dict"][k], v) for k, v in expected.items())
    with pytest.raises(CheckpointError, match="cannot write a Hugging Face directory for this model"):
        to_hf(old, tmp_path / "hf")


def test_training_resumes_from_a_checkpoint_of_the_first_format(hf_run, tmp_path, monkeypatch):
    """Its Adam step counts are per unit: resuming from it equals resuming from the current format."""
    monkeypatch.setenv("MEGATRAIN_CPU_ADAM", "torch")
    old = make_old(hf_run / "last.ckpt", tmp_path / "old.ckpt")
    runs = {}
    for name, path in (("new", str(hf_run / "last.ckpt")), ("old", old)):
        runs[name] = HFLM()
        fit(runs[name], BATCHES, max_epochs=2, ckpt_path=path, **TRAIN)
    assert len(runs["old"].losses) == len(BATCHES) and runs["old"].losses == runs["new"].losses
    for (name, a), b in zip(runs["new"].named_parameters(), runs["old"].parameters()):
        assert torch.equal(a, b), name


def test_the_marker_refuses_plain_torch_load(hf_run):
    marker = str(hf_run / "last.ckpt")
    refusal = r"sharded checkpoint.*load_from_checkpoint\(YourModule, path\) from megatrain_lightning"
    with pytest.raises(Exception, match=refusal):
        torch.load(marker)
    with pytest.raises(ModuleNotFoundError, match="megatrain convert PATH --to torch OUT"):
        torch.load(marker, weights_only=False)  # nothing in the marker can run: its "module" does not exist


def test_a_damaged_shard_is_refused_when_loading(hf_run, tmp_path):
    shutil.copy(hf_run / "last.ckpt", tmp_path / "c.ckpt")
    shutil.copytree(hf_run / "last.ckpt.d", tmp_path / "c.ckpt.d")
    shard = next((tmp_path / "c.ckpt.d").iterdir()) / "units" / "00003.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="00003.safetensors has checksum .* damaged"):
        mt.load_from_checkpoint(HFLM, str(tmp_path / "c.ckpt"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{ckpt}", "--to", "onnx", "x"], r"argument --to: invalid choice: 'onnx'"),
        (["{tmp}/nope.ckpt", "--to", "torch", "x"], r"no checkpoint at .*nope.ckpt"),
        (["{tmp}/plain.ckpt", "--to", "hf", "x"], r"plain.ckpt is not a sharded megatrain checkpoint.*no conversion"),
        (["{ckpt}", "--to", "torch", "{tmp}/x.ckpt", "--dtype", "bf16"], r"--dtype=bf16 applies to --to hf"),
        (["{ckpt}", "--to", "torch", "{ckpt}"], r"is the checkpoint being converted"),
        (["{ckpt}"], r"the following arguments are required: --to, out"),
    ],
)
def test_convert_errors_are_one_line(args, message, hf_run, tmp_path, capsys):
    torch.save({"state_dict": {}}, tmp_path / "plain.ckpt")
    argv = [a.format(ckpt=hf_run / "last.ckpt", tmp=tmp_path) for a in args]
    with pytest.raises(SystemExit) as exit_info:
        run(["convert", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("megatrain convert: error: ") and re.search(message, err), err
