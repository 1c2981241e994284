"""bench/throughput.py's report: the figures of each run, the markdown tables and the summary line.

MFU has one definition (megatrain_lightning/planning/flops.py): model FLOPs per second over the GPU's dense
bf16 peak from the vendor's datasheet. A large bf16 matmul measured in the same run is printed beside
it as the matmul-relative utilization, never as MFU.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from alone import micro_batch_seconds
from peers import COMPETITORS

from megatrain_lightning.engine import EngineConfig
from megatrain_lightning.planning import flops
from megatrain_lightning.planning.planner import RunShape, plan

GiB = 2**30
PRECISION = "bf16-mixed"
MAIN_COLUMNS = (
    "run",
    "tokens/step",
    "clip",
    "step s",
    "tokens/s",
    "model TFLOPS",
    "MFU",
    "matmul-relative util",
    "H2D GB/s",
    "H2D % peak",
    "D2H GB/s",
    "D2H % peak",
    "CPU opt s/step",
    "peak GPU GiB",
    "planner GPU GiB",
    "slots",
    "kept blocks",
    "offloaded blocks",
    "host B/param",
    "overlap",
)
_KEYS = (
    "step_s",
    "tokens_per_s",
    "tflops",
    "mfu",
    "vs_matmul",
    "h2d_gbps",
    "h2d_pct",
    "d2h_gbps",
    "d2h_pct",
    "cpu_opt_s",
    "peak_gib",
    "planner_gib",
    "slots",
    "kept",
    "offloaded",
    "host_bpp",
    "overlap",
)


def fmt(x: float | str | None, digits: int = 3) -> str:
    """`digits` significant digits as plain decimals (no exponent, no separators); None -> 'na'."""
    if x is None or isinstance(x, str):
        return x or "na"
    if x == 0 or not math.isfinite(x):
        return str(x)
    return f"{x:.{max(0, digits - 1 - math.floor(math.log10(abs(x))))}f}"


def depth_name(shape: str, layers: int, preset_layers: int) -> str:
    """The preset's name, saying so when the model has another depth: 'llama-3.1-8b[16 of 32 layers]'."""
    return shape if layers == preset_layers else f"{shape}[{layers} of {preset_layers} layers]"


def clip_text(clip: float) -> str:
    """A row's gradient_clip_val: '1' or 'off'."""
    return f"{clip:g}" if clip else "off"


def recompute_text(mode: bool | str | None) -> str:
    """What a run's name adds for its recompute: nothing for the strategy's default ("auto"; a peer: None)."""
    return "" if mode in ("auto", None) else f" recompute={mode}"


def overlap_figure(step_s: float, alone: dict[str, float]) -> float:
    """Step time over the slowest resource's time alone: 1.0 = perfect overlap."""
    slowest = max(alone.values())
    if not slowest > 0:
        raise ValueError(f"alone-times {alone} have no positive entry; nothing to compare the step with")
    return step_s / slowest


# -- figures of one run -----------------------------------------------------------------------------
def figures(state: dict, entry: dict) -> dict[str, Any] | None:
    """The table's numbers for one run (None when it failed or did not run)."""
    r = entry["result"]
    if "step_s" not in r:
        return None
    config = dataclasses.replace(state["config"], num_hidden_layers=entry["layers"])
    step, work, peak = r["step_s"], flops.model_flops(config, entry["tokens"], state["seq_len"]), state["peak"]["flops"]
    rate = work / step
    f: dict[str, Any] = {
        "step_s": step,
        "tokens_per_s": entry["tokens"] / step,
        "tflops": rate / 1e12,
        "mfu": flops.mfu(work, step, peak) if peak else None,
        "vs_matmul": rate / state["peaks"]["matmul"]["flops"],
        "peak_gib": r["peak_device_bytes"] / GiB,
        "host_bpp": r["rss_peak_bytes"] / r["num_parameters"],
    }
    engine, per, copy = r.get("engine"), r.get("per_step", {}), state["peaks"]["copy"]
    if engine is None:
        return f
    up, down = per["h2d_bytes"] / step, per["d2h_bytes"] / step
    kept = engine.get("kept_blocks", 0.0)
    f.update(
        planner_gib=planned(state, entry).gpu_peak / GiB,
        slots=str(engine["slots"]),  # a count: no decimals
        kept=kept,
        offloaded=engine.get("offloaded_blocks", 0.0),
        h2d_gbps=up / 1e9,
        d2h_gbps=down / 1e9,
        h2d_pct=100 * up / copy["h2d"],
        d2h_pct=100 * down / copy["d2h"],
        cpu_opt_s=per["host_step_seconds"],
        host_bpp=sum(engine["host_bytes"].values()) / engine["num_parameters"],
    )
    if "compute" in state:
        alone = {
            "GPU compute": entry["accumulate"] * micro_batch_seconds(state["compute"], entry["layers"], kept),
            "transfer": engine["transfer_alone"]["both_s"],
            "CPU worker": engine["cpu_alone"]["total_s"],
        }
        f.update(
            alone=alone,
            overlap=overlap_figure(step, alone),
            bound=max(alone, key=alone.get),
            serial=sum(alone.values()) / max(alone.values()),
        )
    return f


def planned(state: dict, entry: dict) -> Any:
    """The planner's Plan of a megatrain run: its shape, batch, slots, recompute, device sums, row chunks and
    speculative step, on this device's memory
    (none on the CPU: the plan then keeps no graph and sizes "auto" slots at their least)."""
    shape = dataclasses.replace(state["config"], num_hidden_layers=entry["layers"])
    return plan(
        RunShape(shape, state["seq_len"], state["micro_batch"], accumulate=entry["accumulate"]),
        EngineConfig(
            precision=PRECISION,
            num_slots=state["num_slots"],
            clipping=bool(entry["clip"]),
            recompute="auto" if entry.get("recompute") is None else entry["recompute"],
            device_grad_sums=entry.get("device_grad_sums") or 0,
            row_chunk=entry.get("row_chunk"),
            speculative_step=bool(entry.get("speculative_step")),
        ),
        gpu_mem=state.get("gpu_mem"),
    )


def at_compare_point(state: dict, entries: list[dict], kind: str) -> dict | None:
    """`kind`'s run at the comparison point: the peers' tokens per step and clipping (megatrain's with the
    first --recompute value)."""
    first = state.get("recompute", ["auto"])[0]
    hits = [
        e
        for e in entries
        if e["kind"] == kind
        and e["tokens"] == state["compare_at"]
        and e["clip"] == state["peer_clip"]
        and (kind != "megatrain" or e.get("recompute", "auto") == first)
    ]
    return hits[0] if hits else None


# -- tables ------------------------------------------------------------------------------------------
def by_tokens(entries: list[dict]) -> list[dict]:
    return sorted(entries, key=lambda e: (-e["tokens"], -e["clip"]))


def _row(cells: list[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    return [_row(header), _row(["---"] * len(header)), *(_row(r) for r in rows)]


def main_table(state: dict) -> list[str]:
    rows = []
    for entry in by_tokens(state["runs"]) + state["competitors"]:
        f = figures(state, entry)
        failed = [entry["result"].get("error", "not run")] + ["na"] * (len(_KEYS) - 1)
        cells = [fmt(f.get(key)) for key in _KEYS] if f else failed
        name = COMPETITORS.get(entry["kind"], entry["kind"]) + recompute_text(entry.get("recompute"))
        rows.append([name, entry["tokens"], clip_text(entry["clip"]), *cells])
    notes = [
        f"- optimizer of {COMPETITORS.get(e['kind'], e['kind'])}: {e['result']['optimizer']}"
        for e in state["runs"][:1] + state["competitors"]
        if "optimizer" in e["result"]
    ]
    return _table(list(MAIN_COLUMNS), rows) + ([""] + notes if notes else [])


def alone_section(state: dict) -> list[str]:
    rows, details, c = [], [], state.get("compute")
    if c:
        details.append(
            f"- GPU compute alone, one micro-batch with every block recomputed: {fmt(c['micro_batch_s'])} s = "
            f"{state['layers']} layers x ({fmt(c['block_forward_s'])} s forward + "
            f"{fmt(c['block_recompute_backward_s'])} s recompute and backward) + {fmt(c['outer_s'])} s embedding, "
            f"norm, head and loss; a block that keeps its graph takes {fmt(c['block_keep_forward_s'])} s forward "
            f"with the graph + {fmt(c['block_kept_backward_s'])} s backward instead, counted for each run's kept "
            f"blocks per pass; one bf16 block resident, best of 3 ({c['timer']}); times k per step; gradient "
            "packing not counted."
        )
    for entry in by_tokens(state["runs"]):
        f, r = figures(state, entry), entry["result"]
        if f is None or "alone" not in f:
            continue
        a, e, per = f["alone"], r["engine"], r["per_step"]
        times = [fmt(x) for x in (f["step_s"], a["GPU compute"], a["transfer"], a["CPU worker"])]
        rows.append(
            [
                entry["tokens"],
                entry["accumulate"],
                clip_text(entry["clip"]),
                *times,
                f["bound"],
                fmt(f["overlap"]),
                fmt(f["serial"]),
            ]
        )
        t, cpu = e["transfer_alone"], e["cpu_alone"]
        details.append(
            f"- {entry['tokens']} tokens/step, clip {clip_text(entry['clip'])}: transfer alone H2D "
            f"{t['h2d_bytes'] / 1e9:.3g} GB in {fmt(t['h2d_s'])} s, D2H {t['d2h_bytes'] / 1e9:.3g} GB in "
            f"{fmt(t['d2h_s'])} s, both at once {fmt(t['both_s'])} s; per-step bytes, formula vs engine.stats: H2D "
            f"{e['formula_h2d_bytes']} vs {per['h2d_bytes']:.0f}, D2H {e['formula_d2h_bytes']} vs "
            f"{per['d2h_bytes']:.0f}. CPU worker alone (scratch copies): {fmt(cpu['land_s'])} s landing + "
            f"{fmt(cpu['norm_s'])} s norms + {fmt(cpu['adam_s'])} s Adam ({e['cpu_backend']}); in the run the "
            f"worker spent {fmt(per['host_land_seconds'])} s landing and {fmt(per['host_step_seconds'])} s stepping "
            f"per step, and the compute thread waited {fmt(per['host_wait_seconds'])} s on it."
        )
    header = [
        "tokens/step",
        "k",
        "clip",
        "step s",
        "GPU compute alone s",
        "transfer alone s",
        "CPU worker alone s",
        "bound",
        "overlap = step/max",
        "serial = sum/max",
    ]
    return _table(header, rows) + [""] + details


def memory_table(state: dict) -> list[str]:
    rows, preset = [], state["preset_layers"]
    named = [
        (f"{e['kind']}, clip {clip_text(e['clip'])}{recompute_text(e.get('recompute'))}", e)
        for e in by_tokens(state["runs"])
    ]
    for name, entry in named + [(f"depth: {e['layers']} of {preset} layers", e) for e in state["depth"]]:
        r = entry["result"]
        if "step_s" not in r:
            rows.append([name, entry["tokens"], entry["layers"], r.get("error", "not run"), *["na"] * 5])
            continue
        e, n = r.get("engine", {}), r["num_parameters"]
        # Pinned buffers are registered at their exact size (engine/host/pinned.py); the caching host allocator's
        # figure beside it shows that nothing else pins (it rounded each buffer to a power of two).
        host = [sum(e["host_bytes"].values()), e["pinned"], e["allocator"]] if e else []
        per_param = [fmt(None if b is None else b / n) for b in host or [None] * 3]
        gib = [fmt(r["peak_device_bytes"] / GiB), fmt(planned(state, entry).gpu_peak / GiB)]
        rows.append([name, entry["tokens"], entry["layers"], *gib, *per_param, fmt(r["rss_peak_bytes"] / n)])
    header = [
        "run",
        "tokens/step",
        "layers",
        "peak GPU GiB",
        "planner GPU GiB",
        "host B/param (accounting)",
        "pinned B/param",
        "pinned by allocator B/param",
        "peak RSS B/param",
    ]
    return _table(header, rows)


def timeline_section(state: dict) -> list[str]:
    for entry in state["runs"]:
        tl = entry["result"].get("timeline")
        if not tl:
            continue
        rows = [
            [
                lane,
                fmt(v["busy_ms"]),
                v["events"],
                "na" if v["under_compute"] is None else f"{100 * v['under_compute']:.0f}%",
            ]
            for lane, v in tl["lanes"].items()
        ]
        return [
            f"One optimizer step at {entry['tokens']} tokens/step, clip {clip_text(entry['clip'])}, profiled "
            f"after the timed window (span {fmt(tl['span_ms'])} ms with the profiler on): trace `{tl['trace']}`; "
            f"{tl['plot']}.",
            "",
            *_table(["lane", "busy ms", "events", "share under compute"], rows),
        ]
    return ["Not profiled (--parts without timeline, or the run failed)."]


# -- the whole report --------------------------------------------------------------------------------
RUN_FIGURES = ("step_s", "tokens_per_s", "mfu", "slots", "kept", "offloaded", "peak_gib", "planner_gib", "overlap")


def run_lines(state: dict) -> list[str]:
    """One machine-readable line per training run (`run: key=value ...`; a failed run ends with its error)."""
    lines = []
    for entry in by_tokens(state["runs"]) + state["competitors"]:
        head = (
            f"run: kind={entry['kind']} recompute={entry.get('recompute')} tokens_per_step={entry['tokens']} "
            f"clip={clip_text(entry['clip'])}"
        )
        f = figures(state, entry)
        tail = (
            " ".join(f"{k}={fmt(f.get(k))}" for k in RUN_FIGURES)
            if f
            else f"error={entry['result'].get('error', 'not run')}"
        )
        lines.append(f"{head} {tail}")
    return lines


def summary_line(state: dict) -> str:
    """The machine-readable last line: megatrain's figures at the comparison point (the peers' tokens per
    step and clipping) and its tokens/s over each peer's there."""
    mine = at_compare_point(state, state["runs"], "megatrain")
    f = figures(state, mine) if mine else None
    ratios = {}
    for kind in COMPETITORS:
        rival = at_compare_point(state, state["competitors"], kind)
        g = figures(state, rival) if rival else None
        ratios[kind] = fmt(f["tokens_per_s"] / g["tokens_per_s"]) if f and g else "na"
    name = state["name"].replace(" ", "-")  # one field: 'llama-3.1-8b[16-of-32-layers]'
    return (
        f"gpu_summary: device={state['device']} shape={name}x{state['layers']} "
        f"tokens_per_step={state['compare_at']} megatrain/deepspeed={ratios['deepspeed']} "
        f"megatrain/fsdp={ratios['fsdp']} mfu={fmt(f['mfu']) if f else 'na'} "
        f"overlap={fmt(f.get('overlap')) if f else 'na'}"
    )


def mfu_lines(state: dict) -> list[str]:
    s, mm, peak = state, state["peaks"]["matmul"], state["peak"]
    n = flops.matmul_params(s["config"])
    return [
        "- model FLOPs per step = 6·N·tokens + 6·layers·heads·head_dim·(seq+1)·tokens "
        f"(megatrain_lightning/planning/flops.py): N = {n:,} weights of the matmuls (head included, input embedding not), "
        "causal attention forward and backward; recompute (the engine's per block, the loss's logits) not counted",
        f"- MFU = model FLOP/s / {peak['what']}" if peak["flops"] else f"- MFU: na: {peak['what']}",
        f"- matmul-relative util = model FLOP/s / {mm['flops'] / 1e12:.4g} TFLOP/s measured in this run "
        f"({mm['what']}); not MFU",
    ]


def render(state: dict) -> str:
    s, cp = state, state["peaks"]["copy"]
    n = s["config"].num_parameters()
    count = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
    head = [
        f"# Throughput: {s['name']} ({count} parameters), seq {s['seq_len']}, micro-batch {s['micro_batch']}, "
        f"{PRECISION}, num_slots {s['num_slots']}, on {s['device']}",
        "",
        f"- layers: {s['layer_note']}",
        f"- clip: {s['clip_note']}",
        *mfu_lines(s),
        f"- copy peaks measured in this run: H2D {cp['h2d'] / 1e9:.3g} GB/s, D2H {cp['d2h'] / 1e9:.3g} GB/s "
        f"({cp['what']})",
        f"- timed: {s['steps']} optimizer steps after {s['warmup']} warm-up; k = micro-batches per step; host "
        "B/param: megatrain = engine.host_bytes() / params, competitors = peak RSS / params",
        *[f"- {note}" for note in s["notes"]],
        "",
    ]
    mine = at_compare_point(s, s["runs"], "megatrain")
    f = figures(s, mine) if mine else None
    bound = (
        [
            f"The {s['compare_at']}-token run (clip {clip_text(s['peer_clip'])}) is bound by: {f['bound']} (the "
            "largest alone-time)."
        ]
        if f and "bound" in f
        else []
    )
    body = [
        *main_table(s),
        "",
        "## Each resource alone, per optimizer step",
        "",
        *alone_section(s),
        "",
        "## Memory",
        "",
        *memory_table(s),
        "",
        "## Timeline",
        "",
        *timeline_section(s),
        "",
        *bound,
        f"Ratios: megatrain tokens/s over the competitor's at {s['compare_at']} tokens/step, clip "
        f"{clip_text(s['peer_clip'])} (both sides); the summary's mfu and overlap are megatrain's there.",
        "",
        "## One line per run",
        "",
        *run_lines(s),
        "",
    ]
    return "\n".join(head + body + [summary_line(s)]) + "\n"
