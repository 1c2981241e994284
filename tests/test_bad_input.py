"""Every bad input of the megatrain command, its configs and the sweep launcher ends in one line.

Each case is a careless user's input: the command exits with status 2 and prints exactly one line on
stderr, ``megatrain[ SUB]: error: ...`` (``sweep: error: ...``), naming the bad value, and no traceback.
The command runs in-process (its ``run`` with argv, SystemExit caught); one case runs the real process to
show its exit status and stderr as a user sees them.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import lightning.pytorch as L
import numpy as np
import pytest
import yaml

import megatrain_lightning.engine.build as build_module
from megatrain_lightning.cli.main import run
from megatrain_lightning.engine.host import host_memory
from megatrain_lightning.lightning.data import write_tokens
from megatrain_lightning.lightning.peers import rank_exited

BASE = {
    "seed_everything": 0,
    "trainer": {
        "max_steps": 1,
        "precision": "32-true",
        "enable_progress_bar": False,
        "logger": False,
        "enable_checkpointing": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
        "default_root_dir": "{d}/out",  # LightningCLI saves the config there
    },
    "model": {
        "model": "tiny",
        "overrides": {
            "num_hidden_layers": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 256,
        },
    },
    "data": {"path": "{d}/text.txt", "seq_len": 32, "batch_size": 2, "val_fraction": 0.0},
}
STRATEGY = "--trainer.strategy=megatrain_lightning.MegatrainStrategy"


@pytest.fixture(scope="module")
def d(tmp_path_factory) -> Path:
    """A directory of good and bad inputs, and base.yaml: a 2-layer model that would train on text.txt."""
    d = tmp_path_factory.mktemp("bad_input")
    (d / "text.txt").write_text("The quick brown fox jumps over the lazy dog. " * 100)
    (d / "short.txt").write_text("hello world " * 20)  # 240 byte tokens
    (d / "empty.txt").write_text("")
    (d / "latin1.txt").write_bytes("café ".encode("latin-1") * 50)
    (d / "odd.bin").write_bytes(b"\x01\x02\x03")
    (d / "empty.bin").write_bytes(b"")
    (d / "garbage.npy").write_bytes(b"this is not an array")
    np.save(d / "floats.npy", np.zeros(100, dtype=np.float32))
    ids = np.arange(1000) % 200  # byte tokens, then one id the model (vocabulary 256) has no embedding for
    write_tokens(np.concatenate([ids, [300]]), d / "id300.bin")
    np.save(d / "negative.npy", np.concatenate([ids, [-7]]))
    np.save(d / "huge.npy", np.concatenate([ids, [2**62]]))
    (d / "broken.jsonl").write_text('{"text": "hi"}\nnot json\n')
    (d / "nofield.jsonl").write_text('{"body": "hi"}\n')
    (d / "no_data").mkdir()
    (d / "a_file").write_text("x")
    (d / "latin1.yaml").write_bytes("model:\n  model: tiny  # café\n".encode("latin-1"))
    (d / "broken.yaml").write_text("trainer:\n  max_steps: [1\nmodel: 3\n")
    (d / "no_model.yaml").write_text("data: {seq_len: 64}\n")
    strategy = "trainer:\n  strategy:\n    class_path: megatrain_lightning.MegatrainStrategy\n    init_args:\n"
    (d / "recompute_yes.yaml").write_text(strategy + "      recompute: 'yes'\n")
    (d / "overlap_false.yaml").write_text(strategy + '      overlap_optimizer: "false"\n')
    (d / "slots_word.yaml").write_text(strategy + "      num_slots: 'on'\n")
    (d / "base.yaml").write_text(yaml.safe_dump(BASE).replace("{d}", str(d)))
    return d


# (id, argv after `fit --config base.yaml` (or a whole argv after "RAW"), what the line must say)
CASES = [
    # the config file itself
    ("config-not-utf8", ["RAW", "fit", "--config", "{d}/latin1.yaml"], r"latin1.yaml' is not UTF-8 \(byte 0xe9"),
    ("config-a-directory", ["RAW", "fit", "--config", "{d}/no_data"], r"no_data' is a directory, not a YAML"),
    ("config-not-yaml", ["RAW", "fit", "--config", "{d}/broken.yaml"], r"broken.yaml' is not valid YAML at line 3"),
    ("config-a-text", ["RAW", "fit", "--config", "{d}/text.txt"], r"text.txt' holds a str, not a mapping"),
    ("config-missing", ["RAW", "fit", "--config", "{d}/nope.yaml"], r"nope.yaml' does not exist"),
    # the Trainer
    ("accumulate-0", ["--trainer.accumulate_grad_batches=0"], r"accumulate_grad_batches=0 must be an integer >= 1"),
    ("accumulate-word", ["--trainer.accumulate_grad_batches=two"], r"--trainer.accumulate_grad_batches=two: Expect"),
    ("clip-negative", ["--trainer.gradient_clip_val=-1"], r"gradient_clip_val=-1 must be a number >= 0"),
    (
        "clip-algorithm",
        ["--trainer.gradient_clip_val=1", "--trainer.gradient_clip_algorithm=sign"],
        r"gradient_clip_algorithm='sign' must be 'norm' \(the default\) or 'value'",
    ),
    ("val-interval-0", ["--trainer.val_check_interval=0"], r"val_check_interval=0 must be above 0"),
    ("val-interval-1.5", ["--trainer.val_check_interval=1.5"], r"val_check_interval=1.5 must be .* in \(0, 1\]"),
    ("max-steps-negative", ["--trainer.max_steps=-5"], r"`max_steps` must be .* You passed in -5"),
    ("max-epochs-negative", ["--trainer.max_epochs=-3"], r"`max_epochs` must be .* You passed in -3"),
    ("devices-0", ["--trainer.devices=0"], r"Trainer\(devices='0'\)"),
    ("limit-negative", ["--trainer.limit_train_batches=-1"], r"invalid value -1 for limit_train_batches"),
    ("precision-fp16", ["--trainer.precision=16-mixed"], r"--trainer.precision=16-mixed: use 32-true, bf16-mixed"),
    ("precision-unknown", ["--trainer.precision=fp8"], r"--trainer.precision=fp8: use 32-true"),
    # the model and its optimizer
    ("lr-negative", ["--model.lr=-1"], r"model lr=-1.0 must be a number above 0"),
    ("lr-zero", ["--model.lr=0"], r"model lr=0.0 must be a number above 0"),
    ("weight-decay-negative", ["--model.weight_decay=-0.1"], r"weight_decay=-0.1 must be a number >= 0"),
    ("beta-above-1", ["--model.betas=[0.9,1.5]"], r"betas=\(0.9, 1.5\) must be two numbers in \[0, 1\)"),
    ("warmup-negative", ["--model.warmup_steps=-3"], r"warmup_steps=-3 must be an integer >= 0"),
    ("schedule-steps-0", ["--model.max_steps=0"], r"model max_steps=0 must be an integer >= 1"),
    ("layers-0", ["--model.overrides.num_hidden_layers=0"], r"num_hidden_layers=0 must be a positive integer"),
    ("model-dir-without-config", ["--model.model={d}/no_data"], r"No config.json in .*no_data"),
    ("init-from-missing", ["--model.init_from={d}/nope"], r"init_from='.*nope' is not a directory"),
    # the data's options
    ("seq-len-0", ["--data.seq_len=0"], r"data seq_len=0 must be an integer >= 1"),
    ("seq-len-word", ["--data.seq_len=abc"], r"--data.seq_len=abc: Expected"),
    ("batch-negative", ["--data.batch_size=-2"], r"data batch_size=-2 must be an integer >= 1"),
    ("val-fraction-1.5", ["--data.val_fraction=1.5"], r"val_fraction=1.5 must be in \[0, 1\)"),
    ("workers-negative", ["--data.num_workers=-1"], r"num_workers=-1 must be an integer >= 0"),
    ("eos-negative", ["--data.eos_token_id=-1"], r"eos_token_id=-1 must be a token id"),
    ("eos-beyond-bytes", ["--data.eos_token_id=300"], r"eos_token_id=300 is not a token of the tokenizer \(ids 0..255"),
    ("format-unknown", ["--data.format=csv"], r"--data.format=csv: Expected"),
    (
        "seq-len-above-positions",
        ["--data.seq_len=1000"],
        r"seq_len=1000 is above the model's max_position_embeddings=256: give a seq_len from 1 to 256",
    ),
    # the data's files
    ("data-missing", ["--data.path={d}/nope.txt"], r"data path '.*nope.txt' does not exist"),
    ("data-dir-empty", ["--data.path={d}/no_data"], r"cannot tell the format of '.*no_data'"),
    ("text-empty", ["--data.path={d}/empty.txt"], r"empty.txt' gives 0 training windows"),
    ("text-not-utf8", ["--data.path={d}/latin1.txt"], r"latin1.txt is not UTF-8 text \(byte 0xe9 at offset 3\)"),
    ("bin-odd-length", ["--data.path={d}/odd.bin"], r"odd.bin holds 3 bytes, .* uint16 token ids"),
    ("bin-empty", ["--data.path={d}/empty.bin"], r"empty.bin holds 0 bytes"),
    ("npy-garbage", ["--data.path={d}/garbage.npy"], r"garbage.npy is not a .npy array of token ids"),
    ("npy-floats", ["--data.path={d}/floats.npy"], r"floats.npy holds float32 of shape \(100,\)"),
    ("jsonl-not-json", ["--data.path={d}/broken.jsonl"], r"broken.jsonl:2 is not JSON"),
    ("id-above-vocab", ["--data.path={d}/id300.bin"], r"id300.bin holds token id 300, outside the model's vocab"),
    ("id-negative", ["--data.path={d}/negative.npy"], r"negative.npy holds token id -7, outside .* of 256 ids"),
    ("id-2-62", ["--data.path={d}/huge.npy"], rf"huge.npy holds token id {2**62}, outside .* \(0..255\)"),
    ("jsonl-no-text", ["--data.path={d}/nofield.jsonl"], r"nofield.jsonl:1 has no string field 'text'"),
    (
        "seq-len-above-data",
        ["--data.path={d}/short.txt", "--data.seq_len=200"],
        r"short.txt' gives 1 training windows of seq_len\+1=201 tokens, fewer than one batch of 2",
    ),
    # the strategy's options
    ("slots-0", [STRATEGY, "--trainer.strategy.init_args.num_slots=0"], r"num_slots=0: give at least 2 slots"),
    ("threads-0", [STRATEGY, "--trainer.strategy.init_args.host_threads=0"], r"host_threads=0: give an integer from"),
    (
        "layout-unknown",
        [STRATEGY, "--trainer.strategy.init_args.host_layout=thin"],
        r"--trainer.strategy.init_args.host_layout=thin: Expected .*'default', 'lean'",
    ),
    (
        "offload-unknown",
        [STRATEGY, "--trainer.strategy.init_args.offload_inputs=maybe"],
        r"--trainer.strategy.init_args.offload_inputs=maybe: .*bool.*'auto'",
    ),
    (
        "offload-dtype-unknown",
        [STRATEGY, "--trainer.strategy.init_args.offload_inputs_dtype=fp16"],
        r"--trainer.strategy.init_args.offload_inputs_dtype=fp16: .*'bf16'.*'fp8'",
    ),
    (
        "offload-dtype-saves-nothing",
        [STRATEGY, "--trainer.precision=bf16-true", "--trainer.strategy.init_args.offload_inputs_dtype=bf16"],
        r"offload_inputs_dtype='bf16' with precision='bf16-true': .*bfloat16 already.*use 'fp8'",
    ),
    ("nvme-missing", [STRATEGY, "--trainer.strategy.init_args.nvme_dir={d}/nvme"], r"nvme_dir='.*nvme' does not exist"),
    ("nvme-a-file", [STRATEGY, "--trainer.strategy.init_args.nvme_dir={d}/a_file"], r"a_file' is not a directory"),
    ("ckpt-a-directory", ["--ckpt_path={d}/no_data"], r"ckpt_path='.*no_data' is a directory"),
    ("nvme-empty", [STRATEGY, "--trainer.strategy.init_args.nvme_dir="], r"nvme_dir='': give a directory on a"),
    (
        "storage-options-not-a-mapping",
        [STRATEGY, "--trainer.strategy.init_args.storage_options=key=abc"],
        r"storage_options=<redacted>: give a mapping of fsspec options such as \{\"profile\": \"name\"\}, or null$",
    ),
    (
        "storage-options-placeholder",
        [STRATEGY, '--trainer.strategy.init_args.storage_options={"key": "<redacted>"}'],
        r"storage_options\['key'\] is '<redacted>', the placeholder a saved config holds .* pass the credentials",
    ),
    # YAML strings for the strategy's yes/no options: jsonargparse alone would read them as booleans
    (
        "recompute-quoted-yes",
        ["--config={d}/recompute_yes.yaml"],
        r"recompute_yes.yaml': trainer.strategy.init_args.recompute='yes': choose True .*; write recompute: true "
        r"or false, unquoted",
    ),
    (
        "overlap-quoted-false",
        ["--config", "{d}/overlap_false.yaml"],
        r"overlap_optimizer='false': pass True or False; write overlap_optimizer: true or false, unquoted",
    ),
    ("slots-quoted-on", ["--config={d}/slots_word.yaml"], r"num_slots='on': give at least 2 slots"),
    # URLs whose scheme fsspec does not know
    (
        "ckpt-unknown-scheme",
        ["--ckpt_path=gopher://host/last.ckpt"],
        r"ckpt_path='gopher://host/last.ckpt': gopher:// is not a scheme fsspec knows; give a local path or a URL "
        r"such as s3://",
    ),
    (
        "root-unknown-scheme",
        ["--trainer.default_root_dir=gopher://host/run"],
        r"--trainer.default_root_dir='gopher://host/run': gopher:// is not a scheme fsspec knows",
    ),
    # the other commands
    ("plan-seq-len-0", ["RAW", "plan", "--model", "tiny", "--seq-len", "0"], r"seq_len=0 must be an integer >= 1"),
    ("plan-size", ["RAW", "plan", "--model", "tiny", "--host-mem", "lots"], r"'lots'"),
    ("plan-accumulate-0", ["RAW", "plan", "--model", "tiny", "--accumulate", "0"], r"accumulate=0 must be an integer"),
    (
        "plan-offload-dtype-saves-nothing",
        ["RAW", "plan", "--model", "tiny", "--precision", "bf16-mixed", "--offload-inputs-dtype", "bf16"],
        r"offload_inputs_dtype='bf16' with precision='bf16-mixed'",
    ),
    ("plan-offload-dtype-unknown", ["RAW", "plan", "--model", "tiny", "--offload-inputs-dtype", "fp4"], r"'fp4'"),
    ("plan-config-not-utf8", ["RAW", "plan", "--config", "{d}/latin1.yaml"], r"latin1.yaml' is not UTF-8"),
    ("plan-config-a-directory", ["RAW", "plan", "--config", "{d}/no_data"], r"no_data' is a directory"),
    ("plan-config-a-text", ["RAW", "plan", "--config", "{d}/text.txt"], r"text.txt' holds a str"),
    ("plan-config-no-model", ["RAW", "plan", "--config", "{d}/no_model.yaml"], r"no_model.yaml' names no model"),
    ("schedule-device", ["RAW", "schedule", "--model", "tiny", "--device", "tpu9"], r"tpu9"),
    (
        "plan-recompute",
        ["RAW", "plan", "--model", "tiny", "--recompute", "maybe"],
        r"--recompute: 'maybe': choose auto",
    ),
    (
        "schedule-recompute",
        ["RAW", "schedule", "--model", "tiny", "--device", "a100", "--recompute", "1"],
        r"--recompute: '1': choose auto",
    ),
    ("plan-devices-0", ["RAW", "plan", "--model", "tiny", "--devices", "0"], r"devices=0 must be an integer >= 1"),
    ("plan-nodes-negative", ["RAW", "plan", "--model", "tiny", "--nodes", "-1"], r"nodes=-1 must be an integer >= 1"),
    ("plan-devices-float", ["RAW", "plan", "--model", "tiny", "--devices", "2.5"], r"--devices: invalid int .*'2.5'"),
    ("schedule-gpus-0", ["RAW", "schedule", "--model", "tiny", "--device", "a100", "--gpus", "0"], r"gpus=0 must be"),
    ("schedule-link", ["RAW", "schedule", "--model", "tiny", "--device", "a100", "--link", "ib"], r"--link: .*'ib'"),
    (
        "schedule-no-nvlink",
        ["RAW", "schedule", "--model", "tiny", "--device", "rtx4090", "--gpus", "2"],
        r"'rtx4090' has no NVLink; .*link='pcie'",
    ),
    (
        "schedule-host-gbps",
        ["RAW", "schedule", "--model", "tiny", "--device", "a100", "--host-gbps", "0"],
        r"host_gbps=0.0: give the rate measured on the machine, a positive number",
    ),
    ("convert-missing", ["RAW", "convert", "{d}/nope.ckpt", "--to", "torch", "{d}/out.ckpt"], r"nope.ckpt"),
]


def argv(case: list[str], d: Path) -> list[str]:
    args = [a.replace("{d}", str(d)) for a in case]
    return args[1:] if args[:1] == ["RAW"] else ["fit", "--config", str(d / "base.yaml"), *args]


def one_error_line(capsys, prog: str = r"megatrain( \w+)?") -> str:
    """The only line on stderr, checked to be the error line (and no traceback anywhere)."""
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and re.match(rf"{prog}: error: ", lines[0]), captured.err
    assert "Traceback" not in captured.err + captured.out
    return lines[0]


@pytest.mark.parametrize(("case", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line(d, capsys, case, expected):
    with pytest.raises(SystemExit) as exit_info:
        run(argv(case, d))
    assert exit_info.value.code == 2
    line = one_error_line(capsys)
    assert re.search(expected, line), line


def test_too_little_host_memory_is_one_line(d, capsys, monkeypatch):
    """The engine refuses the model before allocating (HostMemoryError): the command says so in one line."""
    monkeypatch.setattr(build_module, "available_host_bytes", lambda: 0)
    with pytest.raises(SystemExit) as exit_info:
        run(argv([], d))
    assert exit_info.value.code == 2
    assert re.search(r"parameters need .* of host memory .* but about 0.0 GiB is available", one_error_line(capsys))


def test_a_rank_that_exited_is_one_line(d, capsys, monkeypatch):
    """A data-parallel run whose peer rank died (tests/test_data_parallel.py kills one) ends the command with
    the strategy's line, exit status 1: it is not the input's fault."""
    said = rank_exited(0, 2, [])

    def fit(*args, **kwargs):
        raise said

    monkeypatch.setattr(L.Trainer, "fit", fit)
    with pytest.raises(SystemExit) as exit_info:
        run(argv([], d))
    assert exit_info.value.code == 1
    assert one_error_line(capsys) == (
        "megatrain: error: rank 1 exited (rank 0's collective lost its connection to it); no checkpoint of this "
        "run was committed"
    )


def test_offloaded_inputs_beyond_the_host_memory_are_one_line(d, capsys, monkeypatch):
    """Enough host memory for the model, none left for the pinned inputs of offload_inputs=True: refused at
    the first forward, before pinning, naming the bytes (2 layers x 2 x 32 tokens x 32 hidden x 4 bytes)."""
    readings = iter([1 << 40])  # the engine's check at construction; then nothing is left
    monkeypatch.setattr(build_module, "available_host_bytes", lambda: next(readings, 0))
    with pytest.raises(SystemExit) as exit_info:
        run(argv([STRATEGY, "--trainer.strategy.init_args.offload_inputs=true"], d))
    assert exit_info.value.code == 2
    line = one_error_line(capsys)
    assert f"{2 * 2 * 32 * 32 * 4} bytes" in line and "offload_inputs=False" in line, line


def test_a_full_drive_in_the_final_save_is_one_line(d, tmp_path, capsys, monkeypatch):
    """ENOSPC under the checkpoint written when training ends: one line naming the file, no traceback."""
    from megatrain_lightning.checkpoint import stream

    def full(fs, path, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(stream, "write", full)
    with pytest.raises(SystemExit) as exit_info:
        run(argv(["--trainer.enable_checkpointing=true", f"--trainer.default_root_dir={tmp_path}"], d))
    assert exit_info.value.code == 2
    line = one_error_line(capsys)
    assert re.search(
        r"no space left writing '.*/checkpoints/.*\.ckpt\.d/.*/units/00000\.safetensors' \(No space left on device\): "
        r"free space there or write elsewhere \(--trainer.default_root_dir, a checkpoint callback's dirpath\)",
        line,
    ), line


@pytest.mark.parametrize("limit", ["cgroup", "rlimit"])
def test_a_container_memory_limit_is_one_line(d, tmp_path, capsys, monkeypatch, limit):
    """A cgroup (or ulimit -v) leaving less room than the model needs, however much the machine has free:
    refused at setup in one line naming the limit (fake /proc and /sys/fs/cgroup under tmp_path)."""
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemAvailable: {64 << 20} kB\n")  # 64 GiB free on the machine
    (proc / "self" / "cgroup").write_text("0::/\n")
    (proc / "self" / "status").write_text(f"VmSize: {1 << 20} kB\n")  # 1 GiB mapped
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    getrlimit = host_memory.SOURCES.getrlimit
    if limit == "cgroup":
        (cgroup / "memory.max").write_text(f"{1 << 30}\n")
        (cgroup / "memory.current").write_text(f"{(1 << 30) - 4096}\n")
    else:
        getrlimit = lambda resource: ((1 << 30) + 4096, -1)  # noqa: E731
    monkeypatch.setattr(host_memory, "SOURCES", host_memory.Sources(proc, cgroup, getrlimit))
    with pytest.raises(SystemExit) as exit_info:
        run(argv([], d))
    assert exit_info.value.code == 2
    named = "the cgroup limit .*/memory.max" if limit == "cgroup" else r"ulimit -v \(RLIMIT_AS\)"
    assert re.search(rf"need .* of host memory .* but about 0.0 GiB is available under {named}", one_error_line(capsys))


def test_the_process_exits_2_with_one_line(d):
    """The real command: exit status 2, one line on stderr, no traceback."""
    env = {**os.environ, "MEGATRAIN_NATIVE_ADAMW": "0"}
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "megatrain_lightning", *argv(CASES[0][1], d)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"megatrain: error: config file '{d}/latin1.yaml' is not UTF-8 (byte 0xe9 on line 2); save it as UTF-8"
    ]


# -- the sweep launcher -----------------------------------------------------------------------------------


@pytest.fixture
def no_ray(monkeypatch):
    """A `ray` whose init fails the test: the driver must stop before it contacts a cluster."""

    def refuse(*args, **kwargs):
        raise AssertionError("ray.init called")

    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(init=refuse))


SWEEP_BASE = {
    "model": {"model": "tiny", "warmup_steps": 5},
    "data": {"path": "builtin:python-docs", "seq_len": 64, "batch_size": 8},
    "trainer": {"max_steps": 30, "precision": "32-true"},
}

SWEEP_CASES = [
    ("data-path-missing", {"data": {"path": "/nope/train.jsonl"}}, {}, r"base.data.path='/nope/train.jsonl' does not"),
    ("max-steps-word", {"trainer": {"max_steps": "thirty"}}, {}, r"max_steps='thirty': Input should be a valid int"),
    ("lr-negative", {"model": {"model": "tiny", "lr": -1}}, {}, r"base: model lr=-1 must be a number above 0"),
    ("accumulate-0", {"trainer": {"accumulate_grad_batches": 0}}, {}, r"accumulate_grad_batches=0 must be"),
    ("seq-len-0", {"data": {"path": "builtin:python-docs", "seq_len": 0}}, {}, r"data seq_len=0 must be an integer"),
    (
        "warmup-range",
        {},
        {"search_space": {"model.warmup_steps": {"randint": [-5, 3]}}},
        r"search_space.model.warmup_steps.randint: model warmup_steps=-5 must be an integer >= 0",
    ),
]


def sweep_file(tmp_path: Path, base: dict, **top) -> str:
    sections = {k: {**SWEEP_BASE[k], **base.get(k, {})} for k in SWEEP_BASE}
    cfg = {"name": "s", "storage": str(tmp_path / "storage"), "base": {"seed": 0, **sections}, **top}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.parametrize(("base", "top", "expected"), [c[1:] for c in SWEEP_CASES], ids=[c[0] for c in SWEEP_CASES])
def test_bad_sweep_is_one_line(tmp_path, capsys, no_ray, base, top, expected):
    from ray_jobs.sweep import main

    assert main(["--config", sweep_file(tmp_path, base, **top)]) == 2
    line = one_error_line(capsys, "sweep")
    assert re.search(expected, line), line


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("127.0.0.1:1", r"no Ray cluster answers at 127.0.0.1:1 within 0.5 s \(ConnectionRefusedError"),
        ("192.0.2.1:6379", r"no Ray cluster answers at 192.0.2.1:6379 within 0.5 s"),  # TEST-NET: never answers
        ("head:port", r"--address 'head:port' is not HOST:PORT"),
    ],
)
def test_an_address_without_a_cluster_is_one_line_within_the_timeout(tmp_path, capsys, no_ray, address, expected):
    """ray.init retries an address nothing answers on for many minutes; the probe gives up after the timeout."""
    from ray_jobs.sweep import main

    start = time.monotonic()
    code = main(["--config", sweep_file(tmp_path, {}), "--address", address, "--connect-timeout", "0.5"])
    assert code == 2 and time.monotonic() - start < 5
    line = one_error_line(capsys, "sweep")
    assert re.search(expected, line), line
