"""The megatrain command: fit with a config and overrides, its errors, plan, env, and the ready configs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

from megatrain_lightning import MegatrainStrategy
from megatrain_lightning.cli.commands import plan_from_config
from megatrain_lightning.cli.main import MegatrainProgressBar, one_line, run
from megatrain_lightning.lightning.callbacks import MegatrainMonitor
from megatrain_lightning.lightning.module import resolve_config
from megatrain_lightning.models import LlamaForCausalLM, save_pretrained
from megatrain_lightning.planning.planner import format_size

REPO = Path(__file__).resolve().parents[1]
DEMO = str(REPO / "configs" / "demo.yaml")
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def quick(tmp_path: Path, *extra: str) -> list[str]:
    """The demo config shortened to a few tiny steps."""
    return [
        "fit",
        "--config",
        DEMO,
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.max_steps=3",
        "--trainer.val_check_interval=3",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.limit_val_batches=2",
        "--trainer.enable_progress_bar=false",
        "--data.seq_len=32",
        "--data.batch_size=4",
        "--trainer.callbacks.max_new_tokens=4",
        *extra,
    ]  # (the config's last callback: ExportAndSample)


def test_fit_with_config_and_overrides(tmp_path):
    cli = run(
        quick(
            tmp_path,
            "--model.overrides.num_hidden_layers=2",
            "--model.lr=0.01",
            "--monitor.every_n_batches=1",
            "--trainer.enable_progress_bar=true",
        )
    )
    assert cli.model.config.num_hidden_layers == 2 and cli.model.config.hidden_size == 128
    assert cli.model.config.head_dim == 32  # re-derived for the overridden width
    assert cli.model.hparams.lr == 0.01 and cli.trainer.global_step == 3
    assert isinstance(cli.trainer.strategy, MegatrainStrategy)
    assert cli.trainer.precision == "32-true"  # the CPU default for precision: null
    [monitor] = [c for c in cli.trainer.callbacks if isinstance(c, MegatrainMonitor)]
    assert monitor.every_n_batches == 1 and monitor.last["perf/tokens_per_sec"] > 0
    assert (tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt").is_file()
    # the tqdm bar, whatever is installed (console.py; tests/test_demo.py runs it with and without rich)
    assert isinstance(cli.trainer.progress_bar_callback, TQDMProgressBar) and cli.trainer.max_epochs == -1


def test_progress_bar_reads_epochs_without_a_negative_total():
    bar, lightnings = MegatrainProgressBar(), RichProgressBar()
    for max_epochs, ours, theirs in ((-1, "Epoch 1", "Epoch 1/-2"), (3, "Epoch 1/2", "Epoch 1/2")):
        bar._trainer = lightnings._trainer = SimpleNamespace(max_epochs=max_epochs)
        assert bar._get_train_description(1).strip() == ours
        assert lightnings._get_train_description(1).strip() == theirs  # the bug this bar avoids


def test_resume_through_the_cli_takes_the_checkpoints_model(tmp_path):
    """`fit --ckpt_path` continues a run; the model's arguments come from the checkpoint, as in LightningCLI."""
    first = run(quick(tmp_path / "a", "--model.overrides.num_hidden_layers=2"))
    last = first.trainer.checkpoint_callback.last_model_path
    again = run(quick(tmp_path / "b", f"--ckpt_path={last}", "--trainer.max_steps=5"))
    assert again.trainer.global_step == 5 and again.model.config.num_hidden_layers == 2


def test_installed_console_script(tmp_path):
    # Scripts land beside the interpreter; PATH may not list that directory (e.g. pyenv shims not rehashed).
    exe = shutil.which("megatrain") or shutil.which("megatrain", path=os.path.dirname(sys.executable))
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("the megatrain console script must be installed in CI (pip install -e .)")
        pytest.skip("the megatrain script is not installed (pip install -e .)")
    out = subprocess.run([exe, *quick(tmp_path)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "checkpoint:" in out.stdout and (tmp_path / "hf" / "config.json").is_file()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["fit", "--config", "/nope/run.yaml"], r"config file '/nope/run.yaml' does not exist"),
        (
            ["fit", "--config", DEMO, "--model.model=llama-9"],
            r"model='llama-9' is neither a preset.*llama-3.1-8b, .*tiny",
        ),
        (["fit", "--config", DEMO, "--data.path=/data/x.jsonl"], r"data path '/data/x.jsonl' does not exist; expected"),
        (["fit", "--config", DEMO, "--model.overrides.layers=2"], r"overrides \['layers'\] are not LlamaConfig fields"),
        (["fit", "--config", DEMO, "--trainer.precision=fp8"], r"--trainer.precision=fp8: use 32-true, bf16-mixed"),
        (["fit", "--config", DEMO, "--trainer.max_steps=ten"], r"--trainer.max_steps=ten: Expected a <class 'int'>"),
        # a typo that argparse would take as the one option it abbreviates (max_steps, config)
        (["fit", "--config", DEMO, "--trainer.max_step=50"], r"unrecognized arguments: --trainer.max_step=50 "),
        (["fit", "--conf", DEMO], r"unrecognized arguments: --conf "),
        (["fit", "--config", DEMO, "--ckpt_path=/nope/last.ckpt"], r"ckpt_path='/nope/last.ckpt' does not exist"),
        (["fit", "--config", DEMO, f"--ckpt_path={REPO}"], r"is a directory; give the checkpoint file in it"),
        (["fit", "--config", DEMO, f"--ckpt_path={DEMO}"], r"torch.load cannot read it \(UnpicklingError"),
        (
            ["fit", "--config", DEMO, "--optimizer=AdamW"],
            r"--optimizer=torch.optim.AdamW would replace CausalLMModule.configure_optimizers, .*param groups.*"
            r"--model.lr, --model.weight_decay, --model.betas, --model.warmup_steps",
        ),
        (
            ["fit", "--config", DEMO, "--lr_scheduler=StepLR", "--lr_scheduler.step_size=3"],
            r"--lr_scheduler=torch.optim.lr_scheduler.StepLR would replace .*warm-up \+ cosine",
        ),
    ],
)
def test_user_errors_are_one_clear_line(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("megatrain: error: ") and re.search(message, err[-1]), err
    assert not any("Traceback" in line or line.startswith("usage:") for line in err), err


def test_jsonargparse_messages_become_one_line():
    many = 'Parser key "trainer.devices":\n  Does not validate\n  Errors:\n    - Expected an int\n  Given value: x'
    assert one_line(many) == "--trainer.devices=x: Does not validate (`megatrain fit --help` lists the options)"


def demo_checkpoint(directory: Path) -> LlamaForCausalLM:
    """A Hugging Face checkpoint with the demo model's shapes."""
    config = resolve_config(
        "tiny", {"hidden_size": 128, "intermediate_size": 384, "max_position_embeddings": 1024, "loss_chunk_size": 1024}
    )
    model = LlamaForCausalLM(config)
    save_pretrained(model, directory)
    return model


def test_fine_tune_from_a_hugging_face_checkpoint(tmp_path):
    """--model.init_from loads the checkpoint's weights (here checked through `megatrain validate`)."""
    source = demo_checkpoint(tmp_path / "ckpt")
    cli = run(
        [
            "validate",
            "--config",
            DEMO,
            f"--model.init_from={tmp_path / 'ckpt'}",
            "--trainer.limit_val_batches=2",
            "--trainer.enable_progress_bar=false",
            "--data.seq_len=32",
            f"--trainer.default_root_dir={tmp_path}",
        ]
    )
    loaded, original = cli.model.model.state_dict(), source.state_dict()
    assert all(torch.equal(loaded[k], original[k]) for k in original)


def test_fine_tune_refuses_a_checkpoint_of_other_shapes(tmp_path, capsys):
    demo_checkpoint(tmp_path / "ckpt")
    with pytest.raises(SystemExit):
        run(quick(tmp_path, f"--model.init_from={tmp_path / 'ckpt'}", "--model.overrides.num_hidden_layers=2"))
    assert "num_hidden_layers: checkpoint 4, model 2" in capsys.readouterr().err


def test_data_vocabulary_larger_than_the_model_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run(quick(tmp_path, "--model.overrides.vocab_size=128"))
    assert exit_info.value.code == 2
    assert "256 token ids but the model's vocab_size is 128" in capsys.readouterr().err


def test_plan_prints_the_table(capsys):
    plan = run(["plan", "--model", "llama-3.1-8b", "--seq-len", "4096", "--micro-batch", "1", "--no-measure"])
    out = capsys.readouterr().out
    assert "llama-3.1-8b: 8.03B parameters" in out and f"{plan.host_total / 2**30:.2f}" in out
    assert re.search(r"total\s+16\s+119.66", out)


def test_plan_refuses_what_does_not_fit(capsys):
    with pytest.raises(SystemExit) as exit_info:
        run(
            [
                "plan",
                "--model",
                "qwen2.5-72b",
                "--seq-len",
                "4096",
                "--micro-batch",
                "1",
                "--host-mem",
                "512GiB",
                "--no-measure",
            ]
        )
    assert exit_info.value.code == 1
    captured = capsys.readouterr()
    assert "needs 1083.4 GiB" in captured.err and "--nvme-dir DIR" in captured.err
    # auto falls back to lean, which does not fit either: 12 bytes/param plus its bf16 rings. A piece is
    # 1/32 of the 1.246B embedding rounded up to 38 x 2^20 elements; a 0.878B block takes 23 of them, so
    # 24 gradient pieces and 4 staging pieces.
    piece = 38 * 2**20
    assert 37 * 2**20 < 152064 * 8192 / 32 <= piece
    name, params, host, nvme, fits = host_plan(captured.out)
    assert (name, params, nvme, fits) == ("qwen2.5-72b", 72706203648, 0.0, "no")
    assert host == round((12 * params + (24 + 4) * piece * 2) / 2**30, 1)


HOST_PLAN = re.compile(r"^host_plan: model=(\S+) params=(\d+) host_gib=(\d+\.\d) nvme_gib=(\d+\.\d) fits=(yes|no)$")


def host_plan(out: str) -> tuple[str, int, float, float, str]:
    """The fields of the host_plan line, which must be the last line of stdout."""
    found = HOST_PLAN.match(out.splitlines()[-1])
    assert found, out.splitlines()[-1]
    name, params, host, nvme, fits = found.groups()
    return name, int(params), float(host), float(nvme), fits


def test_plan_of_a_120b_model_fits_1536_gib_with_the_defaults(capsys):
    """--model plans 4096 tokens x 1 sequence unless told otherwise, and host_layout auto: lean fits."""
    result = run(["plan", "--model", "llama-120b", "--host-mem", "1536GiB", "--no-measure"])
    out = capsys.readouterr().out
    assert (result.seq_len, result.micro_batch, result.host_layout, result.nvme) == (4096, 1, "lean", False)
    name, params, host, nvme, fits = host_plan(out)
    assert (name, fits, nvme) == ("llama-120b", "yes", 0.0) and params > 100e9 and host <= 1536
    explicit = run(
        [
            "plan",
            "--model",
            "llama-120b",
            "--seq-len",
            "4096",
            "--micro-batch",
            "1",
            "--host-mem",
            "1536GiB",
            "--no-measure",
        ]
    )
    assert capsys.readouterr().out.splitlines()[-1] == out.splitlines()[-1] and explicit.host == result.host


def test_plan_of_a_120b_model_in_512_gib_needs_the_nvme_dir(capsys, tmp_path):
    args = [
        "plan",
        "--model",
        "llama-120b",
        "--seq-len",
        "4096",
        "--micro-batch",
        "1",
        "--host-mem",
        "512GiB",
        "--no-measure",
    ]
    result = run([*args, "--nvme-dir", str(tmp_path), "--nvme-gbps", "7"])
    out = capsys.readouterr().out
    name, params, host, nvme, fits = host_plan(out)
    assert fits == "yes" and params > 100e9 and host <= 512 and nvme > 0 and result.nvme_dir == str(tmp_path)
    assert "traffic per optimizer step" in out and "7.0 GB/s read" in out
    with pytest.raises(SystemExit) as exit_info:
        run(args)
    captured = capsys.readouterr()
    assert exit_info.value.code == 1 and host_plan(captured.out)[-1] == "no"
    assert (
        "--nvme-dir DIR" in captured.err and f"fits: {host:.1f} GiB of host memory" in captured.err
    )  # as planned above


def test_plan_with_clipping_and_an_explicit_layout(capsys):
    args = ["plan", "--model", "llama-3.1-8b", "--host-layout", "lean", "--no-measure"]
    lean, clipped = run(args), run([*args, "--clip"])
    assert clipped.host_total - lean.host_total == 2 * lean.num_parameters  # the bf16 slab until the step
    assert lean.host_layout == clipped.host_layout == "lean" and clipped.clipping and not lean.clipping


def test_plan_counts_offloaded_inputs_as_stored(tmp_path, capsys):
    """``--offload-inputs-dtype fp8``: a byte per element and a 4-byte scale per token (llama-3.1-8b: 32 layers x
    4096 tokens x (4096 + 4) bytes) in place of bf16's 2 bytes per element; also from a config's strategy."""
    args = ["plan", "--model", "llama-3.1-8b", "--seq-len", "4096", "--micro-batch", "1", "--offload-inputs"]
    exact, fp8 = run([*args, "--no-measure"]), run([*args, "--offload-inputs-dtype", "fp8", "--no-measure"])
    assert exact.host["activations"] == 32 * 4096 * 4096 * 2 and fp8.host["activations"] == 32 * 4096 * 4100
    assert exact.host_total - fp8.host_total == exact.host["activations"] - fp8.host["activations"]
    assert "offloaded block inputs (pinned, offload_inputs, fp8)" in capsys.readouterr().out
    config = tmp_path / "fp32.yaml"
    config.write_text(
        "trainer:\n  precision: 32-true\n  strategy:\n    class_path: megatrain_lightning.MegatrainStrategy\n"
        "    init_args:\n      offload_inputs: true\n      offload_inputs_dtype: bf16\n"
        "model:\n  model: llama-3.1-8b\ndata:\n  seq_len: 4096\n  batch_size: 1\n"
    )
    assert plan_from_config(str(config)).host["activations"] == 32 * 4096 * 4096 * 2  # fp32 stored as bf16


def test_plan_of_a_config_takes_its_host_layout_nvme_dir_and_clipping(tmp_path, capsys):
    config = tmp_path / "big.yaml"
    config.write_text(
        "trainer:\n  precision: bf16-mixed\n  gradient_clip_val: 1.0\n  strategy:\n"
        "    class_path: megatrain_lightning.MegatrainStrategy\n"
        f"    init_args:\n      host_layout: lean\n      nvme_dir: {tmp_path}\n"
        "model:\n  model: llama-120b\ndata:\n  seq_len: 4096\n  batch_size: 1\n"
    )
    planned = run(["plan", "--config", str(config), "--no-measure"])
    assert (planned.host_layout, planned.nvme, planned.clipping, planned.nvme_dir) == (
        "lean",
        True,
        True,
        str(tmp_path),
    )
    n = planned.num_parameters
    overridden = run(["plan", "--config", str(config), "--no-clip", "--host-layout", "default", "--no-measure"])
    assert (overridden.host_layout, overridden.clipping) == ("default", False) and overridden.nvme
    assert planned.host["slab"] == 2 * n and host_plan(capsys.readouterr().out)[0] == "llama-120b"
    assert (
        plan_from_config(str(REPO / "configs" / "llama-3.1-70b.yaml")).host_layout == "default"
    )  # the strategy's default


def test_plan_prints_the_host_plan_line_last_on_stdout_of_the_process():
    """In a real process (buffered stdout, errors on stderr) the summary is still stdout's last line."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatrain_lightning.cli.main",
            "plan",
            "--model",
            "llama-120b",
            "--host-mem",
            "512GiB",
            "--no-measure",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1 and "megatrain plan: error: host memory" in out.stderr
    assert out.stdout.endswith("fits=no\n") and host_plan(out.stdout)[0] == "llama-120b"


def test_plan_sizes_auto_slots_by_default(capsys):
    """`megatrain plan` plans the strategy's default num_slots="auto" (a slot per block for llama-3.1-8b at
    4k tokens in 80 GiB), or the count given; a count that is neither is one line on stderr."""
    args = ["plan", "--model", "llama-3.1-8b", "--seq-len", "4096", "--gpu-mem", "80GiB", "--no-measure"]
    auto, three = run(args), run([*args, "--num-slots", "3"])
    assert (auto.num_slots, auto.slots_asked, three.num_slots) == (32, "auto", 3)
    assert "32 slots (auto)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        run([*args, "--num-slots", "many"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and "'many' is not a number of slots or auto" in err[0]


def test_plan_with_offloaded_inputs_fits_128k_tokens_of_8b_in_less_gpu_memory(capsys):
    """--offload-inputs moves 32 saved block inputs (1 GiB each at 128k tokens in bf16) to host memory;
    by default (auto) they stay on the GPU, where they fit."""
    args = [
        "plan",
        "--model",
        "llama-3.1-8b",
        "--seq-len",
        "131072",
        "--micro-batch",
        "1",
        "--gpu-mem",
        "80GiB",
        "--num-slots",
        "2",
        "--no-measure",
    ]  # (the slots "auto" would add differ with the inputs' place)
    auto, kept, offloaded = run(args), run([*args, "--no-offload-inputs"]), run([*args, "--offload-inputs"])
    out = capsys.readouterr().out
    assert "block inputs offloaded to host" in out and offloaded.fits and kept.fits
    assert auto.gpu == kept.gpu and not auto.offload_inputs
    assert kept.gpu_peak - offloaded.gpu_peak == 31 * 2**30  # 32 inputs on the device -> 1
    assert offloaded.host["activations"] == 32 * 2**30 and kept.host["activations"] == 0


def test_plan_of_a_config_takes_the_long_context_options_too(capsys):
    config = str(REPO / "configs" / "llama-3.1-8b.yaml")
    plain = run(["plan", "--config", config, "--no-measure"])
    tiled = run(["plan", "--config", config, "--token-chunk-size", "1024", "--offload-inputs", "--no-measure"])
    assert tiled.config.token_chunk_size == 1024 and tiled.tile == 1024 and plain.tile is None
    assert tiled.offload_inputs and not plain.offload_inputs
    assert tiled.gpu["recompute"] < plain.gpu["recompute"] and tiled.gpu["saved_inputs"] < plain.gpu["saved_inputs"]


def test_plan_measures_one_step_beside_the_formulas(capsys):
    """By default the plan runs one step on fake tensors; its peak (+ the context allowance) is printed
    beside the formulas and counts for the fit."""
    plan = run(["plan", "--model", "tiny", "--seq-len", "256", "--micro-batch", "2", "--gpu-mem", "2GiB"])
    captured = capsys.readouterr()
    assert plan.measured is not None and plan.measured.peak > 0 and "fake tensors" in captured.err
    assert re.search(r"measured: one step on fake tensors \+ context allowance\s+[\d.]+", captured.out)
    assert plan.measured_peak == plan.measured.peak + plan.gpu["cuda_context"]


def test_plan_rejects_a_bad_size(capsys):
    with pytest.raises(SystemExit):
        run(["plan", "--model", "tiny", "--seq-len", "8", "--micro-batch", "1", "--gpu-mem", "80G", "--no-measure"])
    assert "ambiguous" in capsys.readouterr().err


def test_env_names_the_optimizer_backend(capsys):
    run(["env"])
    out = capsys.readouterr().out
    assert re.search(r"optimizer backend: (native|torch) \(native kernel: ", out)
    assert "torch " in out and "pinned-memory limit" in out and "CPU cores" in out


def test_env_says_whom_a_low_pinned_memory_limit_binds(capsys, monkeypatch):
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda which: (8 * 2**20, 8 * 2**20))
    run(["env"])
    [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("pinned-memory limit")]
    assert "8 MiB (does not cap the engine's pinned buffers" in line and "InfiniBand" in line, line
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    run(["env"])
    assert "pinned-memory limit (ulimit -l, RLIMIT_MEMLOCK): unlimited\n" in capsys.readouterr().out


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_comments_match_the_planner(path):
    """The memory written at the top of each config is what the planner says for it (cannot go stale)."""
    header = path.read_text().split("\nseed_everything")[0]
    plan = plan_from_config(str(path))
    assert f"host memory: {format_size(plan.host_total)}" in header
    gpu = re.search(r"GPU peak: ([\d.]+ [GM]iB)", header)
    assert gpu is None or gpu.group(1) == format_size(plan.gpu_peak)


def test_ready_configs_cover_the_real_shapes():
    names = {p.stem for p in CONFIGS}
    assert {
        "demo",
        "llama-3.2-1b",
        "llama-3.1-8b",
        "qwen2.5-7b",
        "qwen2.5-14b",
        "qwen2.5-32b",
        "qwen2.5-72b",
        "llama-3.1-70b",
    } <= names


SECRETS = {
    "key": "AKIAEXAMPLESECRET7",
    "secret": "wJalrXUtnFEMI-EXAMPLE-9",
    "client_kwargs": {"token": "tok-EXAMPLE-3"},
}


def secret_run(tmp_path: Path, *extra: str) -> list[str]:
    """A 2-step run of a tiny model that writes everything a run writes (config, logs, checkpoints, export)
    with credentials in the strategy's storage_options."""
    (tmp_path / "text.txt").write_text("The quick brown fox jumps over the lazy dog. " * 60)
    return [
        "fit",
        "--model.model=tiny",
        '--model.overrides={"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, '
        '"num_attention_heads": 2, "num_key_value_heads": 1}',
        f"--data.path={tmp_path / 'text.txt'}",
        "--data.seq_len=16",
        "--data.batch_size=2",
        f"--trainer.default_root_dir={tmp_path / 'run'}",
        "--trainer.max_steps=2",
        "--trainer.limit_val_batches=1",
        "--trainer.val_check_interval=2",
        "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false",
        "--trainer.callbacks+=megatrain_lightning.checkpoint.ModelCheckpoint",
        "--trainer.callbacks.save_last=true",
        "--trainer.callbacks+=megatrain_lightning.lightning.callbacks.ExportAndSample",
        "--trainer.callbacks.max_new_tokens=2",
        "--trainer.strategy=megatrain_lightning.MegatrainStrategy",
        f"--trainer.strategy.init_args.storage_options={json.dumps(SECRETS)}",
        *extra,
    ]


def leaked(text: bytes) -> list[str]:
    return [s for s in ("AKIAEXAMPLESECRET7", "wJalrXUtnFEMI-EXAMPLE-9", "tok-EXAMPLE-3") if s.encode() in text]


def test_storage_options_secrets_are_written_nowhere(tmp_path, capfd, monkeypatch, recwarn):
    """Credentials given as storage_options reach fsspec whole, but no file the run writes (anywhere under
    its directory or the working directory) and nothing it prints holds them; the saved config holds
    placeholders, which a rerun from it refuses in one line."""
    monkeypatch.chdir(tmp_path)
    cli = run(secret_run(tmp_path))
    assert cli.trainer.global_step == 2 and cli.trainer.strategy.storage_options == SECRETS
    printed = capfd.readouterr()
    assert leaked((printed.out + printed.err).encode()) == []
    assert leaked("".join(str(w.message) for w in recwarn).encode()) == []  # (pytest holds the warnings)
    written = [p for p in tmp_path.rglob("*") if p.is_file() and p.name != "text.txt"]
    run_dir = tmp_path / "run" / "lightning_logs" / "version_0"
    assert {run_dir / "config.yaml", run_dir / "hparams.yaml", tmp_path / "run" / "hf" / "config.json"} <= set(written)
    assert any(".ckpt.d" in str(p) and p.suffix == ".safetensors" for p in written)  # the checkpoint's shards
    assert {str(p.relative_to(tmp_path)): leaked(p.read_bytes()) for p in written} == {
        str(p.relative_to(tmp_path)): [] for p in written
    }
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["strategy"]["init_args"]
    assert saved["storage_options"] == {
        "key": "<redacted>",
        "secret": "<redacted>",
        "client_kwargs": {"token": "<redacted>"},
    }

    with pytest.raises(SystemExit) as exit_info:
        run(["fit", "--config", str(run_dir / "config.yaml")])
    assert exit_info.value.code == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert re.search(r"storage_options\['key'\] is '<redacted>', the placeholder a saved config holds", err[-1]), err


def test_print_config_redacts_storage_options(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run(secret_run(tmp_path, "--print_config"))
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert leaked(out.encode()) == [] and "key: <redacted>" in out and "token: <redacted>" in out, out
