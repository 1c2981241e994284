"""bench/throughput.py and its modules (alone, peers, report, timeline): the harness in its CPU dry mode,
and the pieces that keep its figures honest.

The GPU figures themselves are owed (docs/benchmarks.md, "GPU"); what CI checks is that the harness
computes them: every column of both clip rows, the summary line, a trace showing the host worker beside
the compute, the per-step transfer volume it times alone equal to what the engine really moved, a
worker-alone timing that leaves the trained state as it was, a name that says when the depth is not the
preset's, and a DeepSpeed row that needs DeepSpeedCPUAdam's compiled op.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import json
import math
import re
import sys
import types
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
import yaml
from torch.utils.data import DataLoader

from megatrain_lightning import Engine, EngineConfig
from megatrain_lightning.engine.probes import Probes
from megatrain_lightning.lightning.strategy import MegatrainStrategy
from megatrain_lightning.models import LlamaConfig
from tests.helpers import hf_llama, hf_loss, token_batches

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # bench/ is a folder of scripts
import alone  # noqa: E402
import peers  # noqa: E402
import report  # noqa: E402
import throughput as tp  # noqa: E402
import timeline  # noqa: E402

SUMMARY = re.compile(
    r"^gpu_summary: device=(?P<device>\S+) shape=(?P<shape>\S+)x(?P<layers>\d+) tokens_per_step=(?P<tokens>\d+) "
    r"megatrain/deepspeed=(?P<ds>\S+) megatrain/fsdp=(?P<fsdp>\S+) mfu=(?P<mfu>\S+) overlap=(?P<overlap>\S+)$"
)
PEAK_TFLOPS = 0.05  # a stand-in peak: the CPU has no datasheet entry, and MFU is computed only against one


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    out = tmp_path_factory.mktemp("throughput")
    stdout, stderr = io.StringIO(), io.StringIO()
    with redirect_stdout(stdout), redirect_stderr(stderr):
        rc = tp.main(["--dry", "--peak-tflops", str(PEAK_TFLOPS), "--out", str(out)])
    return rc, stdout.getvalue(), out


def table(text: str, header_start: str) -> list[dict[str, str]]:
    lines = text.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith(header_start))
    columns = [c.strip() for c in lines[i].strip("|").split("|")]
    rows = []
    for line in lines[i + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(columns, (c.strip() for c in line.strip("|").split("|")))))
    return rows


def test_dry_run_table_has_every_column_for_both_clip_rows(dry):
    rc, text, out = dry
    assert rc == 0
    rows = table(text, "| run |")
    assert list(rows[0]) == list(report.MAIN_COLUMNS)
    megatrain = [r for r in rows if r["run"] == "megatrain"]
    # Each point with clipping as configs/demo.yaml (the tiny preset's config) sets it, and without.
    points = [(int(r["tokens/step"]), r["clip"]) for r in megatrain]
    assert points == [(256, "1"), (256, "off"), (128, "1"), (128, "off")]
    for row in megatrain:
        values = {k: float(v) for k, v in row.items() if k not in ("run", "clip")}
        assert all(math.isfinite(v) and v >= 0 for v in values.values()), row
        assert values["overlap"] > 0 and values["tokens/s"] > 0 and values["matmul-relative util"] > 0
        # MFU is model FLOP/s over the given peak; the matmul-relative figure divides by the measured matmul.
        assert values["MFU"] == pytest.approx(values["model TFLOPS"] / PEAK_TFLOPS, rel=0.01)
    assert [float(r["host B/param"]) for r in megatrain] == [20.0, 20.0, 16.0, 16.0]  # fp32 accumulator with k > 1
    rivals = [r for r in rows if r["run"] != "megatrain"]
    assert {r["run"] for r in rivals} == set(peers.COMPETITORS.values())
    assert all(r["step s"] == "skipped: needs CUDA" and r["clip"] == "1" for r in rivals)  # at megatrain's point
    alone_rows = table(text, "| tokens/step | k |")
    assert len(alone_rows) == 4 and all(r["bound"] in ("GPU compute", "transfer", "CPU worker") for r in alone_rows)
    assert (out / "throughput.md").read_text() == text
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert all(r["result"]["gradient_clip_val"] == (r["clip"] or None) for r in runs)  # what the Trainer got


def test_dry_run_ends_with_the_machine_readable_summary(dry):
    _, text, _ = dry
    match = SUMMARY.match(text.rstrip("\n").splitlines()[-1])
    assert match, text.splitlines()[-1]
    assert match["device"] == "cpu-dry" and match["shape"] == "tiny" and match["layers"] == "4"
    assert match["tokens"] == "128" and match["ds"] == match["fsdp"] == "na"
    assert float(match["mfu"]) > 0 and float(match["overlap"]) > 0


def test_without_a_known_peak_mfu_is_na_and_the_matmul_figure_stays(dry):
    _, _, out = dry
    state = json.loads((out / "results.json").read_text())
    state["config"] = LlamaConfig(**state["config"])
    state["peak"] = tp.peak_choice(tp.parse_args(["--dry"]), torch.device("cpu"), "cpu-dry")
    assert state["peak"]["flops"] is None and "--peak-tflops" in state["peak"]["what"]
    text = report.render(state)
    rows = [r for r in table(text, "| run |") if r["run"] == "megatrain"]
    assert all(r["MFU"] == "na" and float(r["matmul-relative util"]) > 0 for r in rows)
    assert SUMMARY.match(text.splitlines()[-1])["mfu"] == "na"


def test_dry_run_trace_shows_the_host_worker_beside_the_compute(dry):
    _, _, out = dry
    events = timeline.load_trace(out / "timeline.trace.json.gz")
    worker = timeline.named_tids(events, timeline.WORKER)
    spans = [e for e in events if e.get("ph") == "X"]
    assert worker and any(e["tid"] in worker and e["name"] == "megatrain-host/adam_step" for e in spans)
    lanes = timeline.lanes(events)
    assert lanes["compute"] and lanes[timeline.WORKER]
    assert any(e["name"] in ("aten::mm", "aten::addmm", "aten::linear") and e["tid"] not in worker for e in spans)
    if importlib.util.find_spec("matplotlib") is not None:  # without it the harness says so and skips the PNG
        assert (out / "timeline.png").stat().st_size > 0


def test_transfer_alone_moves_what_the_engine_moved_per_step(dry):
    _, _, out = dry
    runs = json.loads((out / "results.json").read_text())["runs"]
    for run in runs:
        engine, per_step = run["result"]["engine"], run["result"]["per_step"]
        assert engine["formula_h2d_bytes"] == per_step["h2d_bytes"] == engine["transfer_alone"]["h2d_bytes"]
        assert engine["formula_d2h_bytes"] == per_step["d2h_bytes"] == engine["transfer_alone"]["d2h_bytes"]
        assert (engine["cpu_alone"]["norm_s"] > 0) == bool(run["clip"])  # the global norm only when clipping


# -- the trained state is not stepped by the measurements ---------------------------------------------
def host_state(engine, slabs: bool = True) -> list:
    """Every unit's master, moments, copy, accumulator and (with `slabs`) gradient slab, cloned, with its step
    counts and gradient state."""
    out = []
    for u in engine.all_units():
        tensors = [None if t is None else t.clone() for t in (u.master, u.m, u.v, u.copy, u.acc)]
        out.append(
            (
                u.name,
                tensors + ([u.slab.clone()] if slabs and u.slab is not None else []),
                list(u.steps),
                list(u.grad.present),
                u.grad.state,
            )
        )
    return out


def identical(a: list, b: list) -> bool:
    for (name, ta, *rest_a), (name_b, tb, *rest_b) in zip(a, b, strict=True):
        same = [x is y if x is None or y is None else torch.equal(x, y) for x, y in zip(ta, tb)]
        if name != name_b or not all(same) or rest_a != rest_b:
            return False
    return True


def test_the_alone_timings_leave_the_trained_state_bit_identical():
    config = dataclasses.replace(LlamaConfig.from_preset("tiny"), num_hidden_layers=2)
    seen = {}

    class Measure(L.Callback):
        def on_train_end(self, trainer, pl_module):
            engine = trainer.strategy.engine
            engine.flush()
            before = host_state(engine)
            seen["cpu"] = alone.cpu_worker_alone(engine, accumulate=2, clip=True, piece=1000)  # pieces cut units
            seen["after_cpu"] = identical(before, host_state(engine))
            # The transfers write the slabs (D2H lands there), which hold no gradient between steps.
            before = host_state(engine, slabs=False)
            seen["transfer"] = alone.transfer_alone(engine, accumulate=2)
            seen["after_transfer"] = identical(before, host_state(engine, slabs=False))

    data = DataLoader(tp.RandomTokens(8, 32, config.vocab_size), batch_size=2)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=MegatrainStrategy(),
        precision="bf16-mixed",
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,
        max_steps=2,
        callbacks=[Measure()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(tp.BenchLM(config, "megatrain"), train_dataloaders=data)
    assert seen["cpu"]["land_s"] > 0 and seen["cpu"]["norm_s"] > 0 and seen["cpu"]["adam_s"] > 0
    assert seen["after_cpu"] and seen["after_transfer"]
    assert seen["transfer"]["d2h_bytes"] > 0


def test_group_runs_cover_every_owned_parameter():
    unit = types.SimpleNamespace(
        entries=[
            types.SimpleNamespace(group=0, offset=0, numel=4),
            types.SimpleNamespace(group=1, offset=4, numel=2),
            types.SimpleNamespace(group=1, offset=6, numel=2),
            types.SimpleNamespace(group=None, offset=8, numel=3),
            types.SimpleNamespace(group=0, offset=11, numel=5),
        ]
    )
    assert alone.group_runs(unit) == [(0, 0, 4), (1, 4, 8), (0, 11, 16)]


# -- clipping as the configs set it ---------------------------------------------------------------------
def test_every_shipped_config_clips_and_the_bench_clips_the_same():
    configs = sorted(tp.CONFIGS.glob("*.yaml"))
    assert configs
    for path in configs:
        assert yaml.safe_load(path.read_text())["trainer"]["gradient_clip_val"] > 0, path
    assert tp.shipped_clip("llama-3.1-8b") == (1.0, "llama-3.1-8b.yaml")
    assert tp.shipped_clip("tiny") == (1.0, "demo.yaml")
    assert tp.shipped_clip("llama-120b")[0] == 1.0  # no config trains it: the value all of them agree on


def test_shipped_clip_refuses_configs_that_disagree(tmp_path):
    (tmp_path / "a.yaml").write_text("trainer: {gradient_clip_val: 1.0}\nmodel: {model: tiny}\n")
    (tmp_path / "b.yaml").write_text("trainer: {max_steps: 3}\nmodel: {model: tiny-qwen}\n")
    assert tp.shipped_clip("tiny-qwen", tmp_path) == (0.0, "b.yaml")  # it does not clip: one row, unclipped
    with pytest.raises(ValueError, match="--clip-val"):
        tp.shipped_clip("llama-3.1-8b", tmp_path)


# -- the name says when the depth is not the preset's -----------------------------------------------------
def test_a_reduced_depth_shows_in_every_name():
    assert report.depth_name("llama-3.1-8b", 32, 32) == "llama-3.1-8b"
    assert report.depth_name("llama-3.1-8b", 16, 32) == "llama-3.1-8b[16 of 32 layers]"
    args = tp.parse_args(["--dry", "--layers", "2", "--parts", "megatrain,compare,depth"])
    state = tp.setup_state(args, torch.device("cpu"))
    assert state["name"] == "tiny[2 of 4 layers]" and state["layers"] == 2
    labels = [label for label, _, _ in tp.jobs(state, args, "trace")]
    assert all("tiny[2 of 4 layers]" in label for label in labels[:-2])
    assert labels[-2:] == ["depth tiny[2 of 4 layers]", "depth tiny"]  # --depth-layers 2,4 of the 4-layer preset
    match = SUMMARY.match(report.summary_line(state))
    assert match["shape"] == "tiny[2-of-4-layers]" and match["layers"] == "2"


def test_jobs_run_the_peers_at_megatrains_clipped_point_first():
    args = tp.parse_args(["--dry", "--parts", "megatrain,compare"])
    state = tp.setup_state(args, torch.device("cpu"))
    order = [(spec["kind"], spec["tokens"], spec["clip"]) for _, spec, _ in tp.jobs(state, args, "trace")]
    assert order == [
        ("megatrain", 128, 1.0),
        ("megatrain", 128, 0.0),
        ("deepspeed", 128, 1.0),
        ("fsdp", 128, 1.0),
        ("megatrain", 256, 1.0),
        ("megatrain", 256, 0.0),
    ]
    off = tp.parse_args(["--dry", "--parts", "megatrain,compare", "--clip", "off"])
    assert {spec["clip"] for _, spec, _ in tp.jobs(tp.setup_state(off, torch.device("cpu")), off, "t")} == {0.0}


# -- DeepSpeed runs only with DeepSpeedCPUAdam's compiled op ---------------------------------------------
def fake_deepspeed(monkeypatch, make_op):
    """A `deepspeed` package whose DeepSpeedCPUAdam loads what `make_op()` returns (or raises)."""

    class DeepSpeedCPUAdam:
        def __init__(self, params, adamw_mode=True, **hp):
            self.ds_opt_adam = make_op()

    adam = types.ModuleType("deepspeed.ops.adam")
    adam.DeepSpeedCPUAdam = DeepSpeedCPUAdam
    for name in ("deepspeed", "deepspeed.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "deepspeed.ops.adam", adam)


def compiled_op(path: str = "/root/.cache/torch_extensions/py311_cu124/cpu_adam/cpu_adam.so") -> types.ModuleType:
    op = types.ModuleType("cpu_adam")
    op.__file__, op.adam_update = path, lambda *args: None
    return op


def test_deepspeed_row_runs_with_the_compiled_op(monkeypatch):
    fake_deepspeed(monkeypatch, compiled_op)
    opt, note = peers.optimizer("deepspeed", [{"params": []}], {"lr": 1e-5})
    assert note == "DeepSpeedCPUAdam, compiled op cpu_adam.so" and peers.compiled_origin(opt.ds_opt_adam)


def test_deepspeed_row_fails_when_the_op_did_not_build(monkeypatch):
    def build_fails():
        raise RuntimeError("Error building extension 'cpu_adam'\nninja: build stopped: subcommand failed.")

    fake_deepspeed(monkeypatch, build_fails)
    with pytest.raises(RuntimeError, match=r"DeepSpeedCPUAdam did not build its C\+\+ op \(ninja: build stopped"):
        peers.optimizer("deepspeed", [{"params": []}], {"lr": 1e-5})
    log = "Traceback (most recent call last):\n...\nRuntimeError: DeepSpeedCPUAdam did not build its C++ op (x)\n"
    assert tp.failure_summary(1, log).startswith("RuntimeError: DeepSpeedCPUAdam did not build")  # the row's cell


@pytest.mark.parametrize("op", [object(), compiled_op("/site-packages/deepspeed/ops/adam/cpu_adam.py")])
def test_deepspeed_row_fails_on_a_stand_in_op(monkeypatch, op):
    fake_deepspeed(monkeypatch, lambda: op)
    with pytest.raises(RuntimeError, match="not a compiled extension"):
        peers.optimizer("deepspeed", [{"params": []}], {"lr": 1e-5})


def test_peers_are_skipped_without_cuda():
    assert peers.blocker("fsdp", torch.device("cpu")) == "skipped: needs CUDA"
    assert peers.blocker("deepspeed", torch.device("cpu")) == "skipped: needs CUDA"


# -- pure helpers ---------------------------------------------------------------------------------------
def test_layers_for_host_is_the_most_that_fit_the_planned_budget():
    config = LlamaConfig.from_preset("tiny")
    block, outer = 36_992, 2 * 256 * 64 + 64
    three_layers = 16 * (outer + 3 * block)  # bf16: 16 B/param without accumulation
    assert tp.layers_for_host(config, 2 * three_layers, accumulate=1, fraction=0.5) == 3
    assert tp.layers_for_host(config, 2 * three_layers - 2, accumulate=1, fraction=0.5) == 2
    assert tp.layers_for_host(config, 2 * three_layers, accumulate=4, fraction=0.5) == 2  # + 4 B/param accumulator
    assert tp.layers_for_host(config, 10**12, accumulate=1, fraction=0.7) == 4  # capped at the preset's depth
    with pytest.raises(ValueError, match="even 2 layers"):
        tp.layers_for_host(config, 10**5, accumulate=1, fraction=0.7)


def test_peak_for_mfu_by_device_name_or_flag():
    cuda, args = torch.device("cuda", 0), tp.parse_args(["--dry"])
    assert tp.peak_choice(args, cuda, "NVIDIA H100 80GB HBM3")["flops"] == 989e12
    assert tp.peak_choice(args, cuda, "NVIDIA GeForce GTX 1080")["flops"] is None
    flagged = tp.parse_args(["--dry", "--peak-tflops", "500"])
    assert tp.peak_choice(flagged, cuda, "NVIDIA GeForce GTX 1080")["flops"] == 500e12


def test_uploaded_blocks_per_step():
    assert alone.uploaded_blocks(4, 2, 1) == [0, 1, 2, 3, 0, 1]  # L + (L - S)
    assert len(alone.uploaded_blocks(6, 2, 3)) == (6 + 4) + 2 * (4 + 4)  # later micro-batches find 0..S-1 resident
    assert alone.uploaded_blocks(2, 3, 2) == [0, 1]  # every block stays resident


@pytest.mark.parametrize(
    "layers, slots, accumulate, recompute",
    [(6, 3, 1, "auto"), (6, 4, 2, "auto"), (6, 4, 2, True), (6, 2, 2, False)],
    ids=["auto-keeps-1", "auto-keeps-2-accumulating", "every-block-recomputed", "every-graph-kept"],
)
def test_uploaded_blocks_count_what_the_engine_uploads_with_kept_graphs(layers, slots, accumulate, recompute):
    """Kept graphs pin the last blocks' slots; the formula (which the transfer-alone timing replays) must still
    count the uploads of a step. "auto" keeps on the CPU only with a free-memory figure: a stand-in one."""
    torch.manual_seed(0)
    net = hf_llama(layers=layers)
    probes = Probes(device_free_bytes=lambda: 10**15)
    config = EngineConfig(device="cpu", precision="32-true", offload_inputs=False, recompute=recompute, num_slots=slots)
    engine = Engine(net, config, probes)
    opt = engine.optimizer(torch.optim.AdamW(net.parameters(), lr=1e-3))
    for batch in token_batches(3, batch=2 * accumulate):  # the last step is counted: the first ones measure
        uploads, kept = engine.pool.uploads, engine.stats["kept_calls"]
        for i, micro in enumerate(batch.chunk(accumulate)):
            with engine.backward(accumulate=i < accumulate - 1):
                hf_loss(net, micro).backward()
        opt.step()
        opt.zero_grad()
    engine.flush()
    kept_per_pass = (engine.stats["kept_calls"] - kept) / accumulate
    assert kept_per_pass == {"auto": slots - 2, True: 0, False: layers}[recompute]  # two slots stay unpinned
    expected = alone.uploaded_blocks(layers, engine.pool.num_slots, accumulate)
    assert engine.pool.uploads - uploads == len(expected)
    engine.close()


def test_compute_alone_counts_kept_blocks_as_they_run():
    pieces = {
        "block_forward_s": 1.0,
        "block_recompute_backward_s": 3.0,
        "block_keep_forward_s": 1.5,
        "block_kept_backward_s": 2.0,
        "outer_s": 0.5,
    }
    assert alone.micro_batch_seconds(pieces, layers=4, kept=0) == 4 * 4.0 + 0.5
    assert alone.micro_batch_seconds(pieces, layers=4, kept=1) == 3 * 4.0 + 3.5 + 0.5
    assert alone.micro_batch_seconds(pieces, layers=4, kept=4) == 4 * 3.5 + 0.5
    with pytest.raises(ValueError, match="kept=5"):
        alone.micro_batch_seconds(pieces, layers=4, kept=5)


def test_recompute_rows_run_in_the_order_given_and_say_so():
    assert tp.parse_recompute("auto,true,TRUE,false") == ["auto", True, False]
    with pytest.raises(ValueError, match="--recompute 'sometimes'"):
        tp.parse_recompute("sometimes")
    args = tp.parse_args(["--dry", "--parts", "megatrain,timeline", "--clip", "on", "--recompute", "auto,true"])
    state = tp.setup_state(args, torch.device("cpu"))
    jobs = tp.jobs(state, args, "trace")
    assert [(spec["tokens"], spec["recompute"]) for _, spec, _ in jobs] == [
        (128, "auto"),
        (128, True),
        (256, "auto"),
        (256, True),
    ]
    assert [spec["timeline"] for _, spec, _ in jobs] == ["trace", None, None, None]  # the first value's at 128
    assert jobs[0][0].endswith("clip 1") and jobs[1][0].endswith("clip 1 recompute=True")


def test_device_grad_sums_reach_every_megatrain_run_and_the_notes():
    args = tp.parse_args(["--dry", "--device-grad-sums", "auto"])
    assert args.device_grad_sums == "auto"
    assert tp.megatrain_strategy({"num_slots": "auto", "device_grad_sums": args.device_grad_sums}).device_grad_sums == (
        "auto"
    )
    assert tp.megatrain_strategy({"num_slots": "auto"}).device_grad_sums == 0  # the strategy's default
    state = tp.setup_state(tp.parse_args(["--dry", "--device-grad-sums", "3"]), torch.device("cpu"))
    assert any(note.startswith("--device-grad-sums 3:") for note in state["notes"])
    assert not any(
        "device-grad-sums" in note for note in tp.setup_state(tp.parse_args(["--dry"]), torch.device("cpu"))["notes"]
    )
    with pytest.raises(SystemExit), redirect_stderr(io.StringIO()):
        tp.parse_args(["--dry", "--device-grad-sums", "some"])


def test_overlap_figure_and_bound():
    times = {"GPU compute": 2.0, "transfer": 1.0, "CPU worker": 0.5}
    assert report.overlap_figure(3.0, times) == 1.5
    assert report.overlap_figure(2.0, times) == 1.0  # the step lasts exactly as long as its slowest resource
    with pytest.raises(ValueError):
        report.overlap_figure(1.0, {"GPU compute": 0.0})


def test_points_and_accumulation():
    assert tp.parse_tokens("128k,32k") == [131072, 32768]
    assert tp.accumulation(131072, 8, 4096) == 4 and tp.accumulation(32768, 8, 4096) == 1
    with pytest.raises(ValueError, match="multiple of 32768"):
        tp.accumulation(100_000, 8, 4096)


def test_failure_summary_names_oom_timeouts_and_the_last_line():
    assert tp.failure_summary(1, "Traceback...\ntorch.OutOfMemoryError: CUDA out of memory.") == "OOM"
    assert tp.failure_summary(-9, "loading\n") == "OOM (killed, likely host memory)"
    assert tp.failure_summary(None, "") == "timeout"
    assert tp.failure_summary(1, "Traceback\nValueError: bad shape\n\n") == "ValueError: bad shape"


# -- timeline -------------------------------------------------------------------------------------------
def test_timeline_lanes_from_gpu_events():
    worker_tid = 7
    events = [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": worker_tid, "args": {"name": timeline.WORKER}},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 10, "tid": 70},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 12, "dur": 8, "tid": 70},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 5, "dur": 10, "tid": 71},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 18, "dur": 4, "tid": 72},
        {
            "ph": "X",
            "cat": "user_annotation",
            "name": "megatrain-host/adam_step",
            "ts": 20,
            "dur": 10,
            "tid": worker_tid,
        },
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaEventSynchronize", "ts": 30, "dur": 5, "tid": worker_tid},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1, "tid": 1},
    ]
    lanes = timeline.lanes(events)
    assert lanes["compute"] == [(0, 10), (12, 20)] and lanes["H2D"] == [(5, 15)] and lanes["D2H"] == [(18, 22)]
    assert lanes[timeline.WORKER] == [(20, 30)] and lanes["issue"] == [(0, 1)]  # waiting on a copy is not work
    summary = timeline.summarize(lanes)
    assert summary["span_ms"] == 30 / 1e3  # the wait is in no lane
    assert summary["lanes"]["H2D"]["under_compute"] == pytest.approx(0.8)  # 8 of its 10 us under a kernel
    assert summary["lanes"][timeline.WORKER]["under_compute"] == 0.0


def test_interval_union_and_shared_time():
    assert timeline.union([(5, 6), (0, 2), (1, 3)]) == [(0, 3), (5, 6)]
    assert timeline.busy([(0, 2), (1, 3), (5, 6)]) == 4
    assert timeline.shared([(0, 3), (5, 6)], [(2, 5.5)]) == 1.5


def test_row_chunk_and_speculative_step_reach_the_strategy_and_the_notes():
    args = tp.parse_args(["--dry", "--row-chunk", "1", "--speculative-step"])
    spec = {"num_slots": "auto", "row_chunk": args.row_chunk, "speculative_step": args.speculative_step}
    strategy = tp.megatrain_strategy(spec)
    assert (strategy.row_chunk, strategy.speculative_step) == (1, True)
    notes = tp.setup_state(args, torch.device("cpu"))["notes"]
    assert any(n.startswith("--row-chunk 1:") for n in notes) and any(
        n.startswith("--speculative-step:") for n in notes
    )
    plain = tp.parse_args(["--dry"])
    assert (plain.row_chunk, plain.speculative_step) == (None, False)
    assert tp.megatrain_strategy({"num_slots": "auto"}).row_chunk is None


def test_the_planners_gpu_figure_counts_the_runs_device_sums_and_row_chunks():
    """The first H200 run measured 17.2 GiB with device sums against a planner figure of 17.0 that left them
    out (and 59.7 planned for a layer-major run that peaked at 9.8): the figure is planned with the run's options."""
    from megatrain_lightning.models import LlamaConfig

    state = {"config": LlamaConfig.from_preset("llama-3.2-1b"), "seq_len": 4096, "num_slots": "auto"}
    state["gpu_mem"] = 139 << 30
    run = {"layers": 16, "clip": 1.0, "recompute": "auto"}
    whole = report.planned({**state, "micro_batch": 1}, {**run, "accumulate": 8}).gpu_peak
    sums = report.planned({**state, "micro_batch": 1}, {**run, "accumulate": 8, "device_grad_sums": "auto"}).gpu_peak
    assert sums - whole >= 4 * 16 * 60_000_000  # at least the blocks' fp32 sums (~61M parameters a block)
    rows = {**state, "micro_batch": 8}
    assert (
        report.planned(rows, {**run, "accumulate": 1, "row_chunk": 1}).gpu_peak
        < report.planned(rows, {**run, "accumulate": 1}).gpu_peak / 2
    )


def test_block_overhead_times_both_loops_and_prints_its_line(monkeypatch, capsys):
    """bench/block_overhead.py, shortened: the engine's and ordinary training's per-block-call times, positive,
    in its table and its last line (the figures themselves are the benchmark's, not a test's)."""
    import block_overhead

    monkeypatch.setattr(sys, "argv", ["block_overhead.py", "--layers", "2", "--micro", "2", "--steps", "2"])
    threads = torch.get_num_threads()
    try:
        assert block_overhead.main() == 0
    finally:
        torch.set_num_threads(threads)  # (it times on one thread)
    out = capsys.readouterr().out.strip().splitlines()
    line = re.fullmatch(
        r"block_overhead: engine_ms_per_block_call=(\S+) ordinary_ms_per_block_call=(\S+) overhead_ms=\S+", out[-1]
    )
    assert line and float(line[1]) > 0 and float(line[2]) > 0
    assert any(r.startswith("| engine (32-true") for r in out) and any(r.startswith("| ordinary") for r in out)
