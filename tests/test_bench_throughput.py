"""bench/throughput.py and bench/timeline.py: the whole harness in its CPU dry mode, and its pure helpers.

The GPU figures themselves are owed (docs/benchmarks.md, "GPU"); what CI checks is that the harness
computes them: every column, the summary line, a trace showing the host worker beside the compute, and
the per-step transfer volume it times alone equal to what the engine really moved.
"""

from __future__ import annotations

import importlib.util
import io
import json
import math
import re
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch

from megatrain_lightning.callbacks import flop_params as module_flop_params
from megatrain_lightning.models import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # bench/ is a folder of scripts
import throughput as tp  # noqa: E402
import timeline  # noqa: E402

SUMMARY = re.compile(
    r"^gpu_summary: device=(?P<device>\S+) shape=(?P<shape>\S+)x(?P<layers>\d+) tokens_per_step=(?P<tokens>\d+) "
    r"megatrain/deepspeed=(?P<ds>\S+) megatrain/fsdp=(?P<fsdp>\S+) mfu=(?P<mfu>\S+) overlap=(?P<overlap>\S+)$"
)


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    out = tmp_path_factory.mktemp("throughput")
    stdout, stderr = io.StringIO(), io.StringIO()
    with redirect_stdout(stdout), redirect_stderr(stderr):
        rc = tp.main(["--dry", "--out", str(out)])
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


def test_dry_run_table_has_every_column_with_finite_numbers_for_megatrain(dry):
    rc, text, out = dry
    assert rc == 0
    rows = table(text, "| run |")
    assert list(rows[0]) == list(tp.MAIN_COLUMNS)
    for column in ("tokens/s", "model TFLOPS", "MFU", "H2D GB/s", "D2H GB/s", "CPU opt s/step", "peak GPU GiB",
                   "host B/param", "overlap"):  # fmt: skip
        assert column in rows[0]
    megatrain = [r for r in rows if r["run"] == "megatrain"]
    assert [int(r["tokens/step"]) for r in megatrain] == [256, 128]  # accumulate 2 and 1
    for row in megatrain:
        values = {k: float(v) for k, v in row.items() if k != "run"}
        assert all(math.isfinite(v) and v >= 0 for v in values.values()), row
        assert values["overlap"] > 0 and values["tokens/s"] > 0 and values["MFU"] > 0
    assert [float(r["host B/param"]) for r in megatrain] == [20.0, 16.0]  # the fp32 accumulator only with k > 1
    rivals = [r for r in rows if r["run"] != "megatrain"]
    assert {r["run"] for r in rivals} == set(tp.COMPETITORS.values())
    assert all(r["step s"] == "skipped: needs CUDA" for r in rivals)
    alone = table(text, "| tokens/step | k |")
    assert len(alone) == 2 and all(r["bound"] in ("GPU compute", "transfer", "CPU worker") for r in alone)
    assert (out / "throughput.md").read_text() == text


def test_dry_run_ends_with_the_machine_readable_summary(dry):
    _, text, _ = dry
    match = SUMMARY.match(text.rstrip("\n").splitlines()[-1])
    assert match, text.splitlines()[-1]
    assert match["device"] == "cpu-dry" and match["shape"] == "tiny" and match["layers"] == "4"
    assert match["tokens"] == "128" and match["ds"] == match["fsdp"] == "na"
    assert float(match["mfu"]) > 0 and float(match["overlap"]) > 0


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


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen"])
def test_model_flops_against_a_hand_count(preset):
    config = LlamaConfig.from_preset(preset)
    # tiny: q 64x64 + k, v 64x32 + o 64x64 + MLP 3x64x128 + two norms of 64 = 36,992 per block, 4 blocks,
    # head 256x64 (tiny-qwen: tied, so the embedding is the head; plus q/k/v biases 64 + 2x32), final norm 64.
    per_block = 4096 + 2048 + 2048 + 4096 + 3 * 64 * 128 + 2 * 64 + (128 if preset == "tiny-qwen" else 0)
    n = 4 * per_block + 256 * 64 + 64
    assert tp.flop_params(config) == n == module_flop_params(LlamaForCausalLM(config))
    attention = 12 * 4 * (4 * 16) * 64**2  # layers x heads x head_dim x seq²
    assert tp.model_flops(config, seq_len=64, sequences=3) == 3 * (6 * n * 64 + attention)


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


def test_uploaded_blocks_per_step():
    assert tp.uploaded_blocks(4, 2, 1) == [0, 1, 2, 3, 0, 1]  # L + (L - S)
    assert len(tp.uploaded_blocks(6, 2, 3)) == (6 + 4) + 2 * (4 + 4)  # later micro-batches find 0..S-1 resident
    assert tp.uploaded_blocks(2, 3, 2) == [0, 1]  # every block stays resident


def test_overlap_figure_and_bound():
    alone = {"GPU compute": 2.0, "transfer": 1.0, "CPU worker": 0.5}
    assert tp.overlap_figure(3.0, alone) == 1.5
    assert tp.overlap_figure(2.0, alone) == 1.0  # the step lasts exactly as long as its slowest resource
    with pytest.raises(ValueError):
        tp.overlap_figure(1.0, {"GPU compute": 0.0})


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
    assert tp.competitor_blocker("fsdp", torch.device("cpu")) == "skipped: needs CUDA"


def test_timeline_lanes_from_gpu_events():
    worker_tid = 7
    events = [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": worker_tid, "args": {"name": timeline.WORKER}},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 10, "tid": 70},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 12, "dur": 8, "tid": 70},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 5, "dur": 10, "tid": 71},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 18, "dur": 4, "tid": 72},
        {"ph": "X", "cat": "user_annotation", "name": "megatrain-host/adam_step", "ts": 20, "dur": 10, "tid": worker_tid},
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
