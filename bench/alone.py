"""Each resource of a megatrain step timed by itself: GPU compute, transfers, the host worker; and the peaks.

bench/throughput.py compares a training step with these: overlap = step time / the slowest resource's
time alone. Nothing here changes the trained state: the transfers go into the engine's weight slots
(whose residency is forgotten afterwards) and its gradient slabs (empty between steps), and the host
worker's arithmetic runs on scratch copies of each unit's buffers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from megatrain_lightning.engine.host.units import GradState, HostUnit
from megatrain_lightning.optim import kernels

GiB = 2**30
PIECE = 2**26  # elements a scratch buffer of the worker-alone timing holds: 256 MiB in fp32, beyond any cache


class Clock:
    """CUDA events on a GPU (no host sync inside a timed region), perf_counter on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self, stream: Any = None) -> Any:
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream if stream is not None else torch.cuda.current_stream())
        return ev

    def seconds(self, start: Any, end: Any) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def time(self, fn: Callable[[], Any], reps: int, warmup: int = 1) -> float:
        """Best of `reps` runs of `fn`."""
        for _ in range(warmup):
            fn()
        best = math.inf
        for _ in range(reps):
            start = self.mark()
            fn()
            best = min(best, self.seconds(start, self.mark()))
        return best

    def on_streams(self, work: list[tuple[Any, Callable[[], None]]]) -> float:
        """Seconds until every (stream, fn)'s work is done, the streams running concurrently from one start."""
        if self.cuda:
            torch.cuda.synchronize()
        start, ends = self.mark(), []
        for stream, fn in work:
            if self.cuda:
                stream.wait_event(start)
            with torch.cuda.stream(stream) if self.cuda else nullcontext():
                fn()
            ends.append(self.mark(stream))
        return max(self.seconds(start, end) for end in ends)


# -- peaks measured in the run ----------------------------------------------------------------------
def matmul_peak(device: torch.device) -> dict[str, Any]:
    """FLOP/s of a large matmul: bf16 8192³ on a GPU; fp32 512³ on the CPU (dry). Not MFU's denominator
    (that is the datasheet's peak): printed beside it as the matmul-relative utilization."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    t = Clock(device).time(lambda: a @ b, reps=10, warmup=3)
    return {"flops": 2 * n**3 / t, "what": f"{str(dtype)[6:]} {n}x{n}x{n} matmul, best of 10"}


def copy_peak(device: torch.device) -> dict[str, Any]:
    """Bytes/s of one large copy each way: pinned host <-> GPU; on the CPU (dry) plain memcpy."""
    cuda = device.type == "cuda"
    n = GiB if cuda else 16 * 2**20
    host = torch.ones(n, dtype=torch.uint8, pin_memory=cuda)
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    clock = Clock(device)
    h2d = clock.time(lambda: dev.copy_(host, non_blocking=True), reps=5)
    d2h = clock.time(lambda: host.copy_(dev, non_blocking=True), reps=5)
    what = "pinned" if cuda else "memcpy (dry)"
    return {"h2d": n / h2d, "d2h": n / d2h, "what": f"{what}, {n / 2**20:.0f} MiB, best of 5"}


# -- GPU compute alone ------------------------------------------------------------------------------
def compute_alone(
    one_layer: nn.Module, layers: int, micro_batch: int, seq_len: int, device: torch.device, reps: int
) -> dict:
    """Device seconds of one micro-batch with nothing streaming, from `one_layer` (the model with one
    block, bf16, on the device): that block's calls as the engine runs them, under autocast, plus
    embedding, final norm, head and loss forward and backward. Packing gradients is not counted.

    A recomputed block runs a forward without a graph, then in backward its forward again with one and
    that graph's backward; a block that keeps its graph (``recompute``: False, or "auto"'s last blocks)
    runs one forward with a graph and, in backward, only that graph's backward. ``micro_batch_s`` is the
    micro-batch with every block recomputed; :func:`micro_batch_seconds` gives it for `kept` blocks."""
    out = _time_pieces(one_layer, micro_batch, seq_len, device, reps)
    out["micro_batch_s"] = micro_batch_seconds(out, layers, kept=0)
    out["timer"] = "CUDA events" if device.type == "cuda" else "perf_counter"
    return out


def micro_batch_seconds(compute: dict, layers: int, kept: float) -> float:
    """One micro-batch's compute alone (:func:`compute_alone`'s pieces) with `kept` of its `layers` blocks
    keeping their graph per forward pass (a mean over passes may be fractional) and the rest recomputed."""
    if not 0 <= kept <= layers:
        raise ValueError(f"kept={kept} blocks per pass: must be between 0 and the model's {layers} blocks")
    recomputed = compute["block_forward_s"] + compute["block_recompute_backward_s"]
    keeping = compute["block_keep_forward_s"] + compute["block_kept_backward_s"]
    return (layers - kept) * recomputed + kept * keeping + compute["outer_s"]


def _time_pieces(model: nn.Module, micro_batch: int, seq_len: int, device: torch.device, reps: int) -> dict:
    block, trunk, clock = model.model.layers[0], model.model, Clock(device)
    ids = torch.randint(model.config.vocab_size, (micro_batch, seq_len), device=device)
    params = list(block.parameters())
    with torch.autocast(device.type, dtype=torch.bfloat16):
        x = trunk.embed_tokens(ids).detach()
        cos, sin = trunk.position_embeddings(ids, None, x.dtype)
        grad_out = torch.randn_like(x)

        def forward() -> None:
            with torch.no_grad():
                block(x, cos, sin)

        def keep_forward() -> tuple[torch.Tensor, torch.Tensor]:
            xx = x.detach().requires_grad_(True)
            return xx, block(xx, cos, sin)

        def recompute_backward() -> None:
            xx = x.detach().requires_grad_(True)
            torch.autograd.grad(block(xx, cos, sin), [xx, *params], grad_out)

        def outer() -> None:
            model.loss_from_hidden(trunk.norm(trunk.embed_tokens(ids)), ids).backward()
            model.zero_grad(set_to_none=True)

        pieces = (
            ("block_forward_s", forward),
            ("block_keep_forward_s", keep_forward),
            ("block_recompute_backward_s", recompute_backward),
            ("outer_s", outer),
        )
        out = {name: clock.time(fn, reps) for name, fn in pieces}
        out["block_kept_backward_s"] = _kept_backward(clock, keep_forward, params, grad_out, reps)
        return out


def _kept_backward(
    clock: Clock,
    forward: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    params: list,
    grad_out: torch.Tensor,
    reps: int,
) -> float:
    """Best of `reps` backwards through a graph a forward kept (the forward itself is not timed: on a GPU
    its kernels are queued before the start event)."""
    best = math.inf
    for rep in range(reps + 1):  # the first is a warm-up
        x, out = forward()
        start = clock.mark()
        torch.autograd.grad(out, [x, *params], grad_out)
        took = clock.seconds(start, clock.mark())
        best = best if rep == 0 else min(best, took)
    return best


# -- transfers alone --------------------------------------------------------------------------------
def uploaded_blocks(layers: int, slots: int, accumulate: int) -> list[int]:
    """Block indices one optimizer step uploads. After a step every block is stale: the first forward
    uploads all L, its backward skips the S still resident from forward's end. A later micro-batch's
    forward also finds blocks 0..S-1 resident from the previous backward: 2·(L - S) each.

    Blocks that keep their graph (``recompute`` False or "auto") change none of this: a kept block is one
    of the last of the pass, its slot pinned until its backward, so the S blocks resident at forward's end
    are still the last S (the kept ones and, in the unpinned slots, those just before them). S is the
    pool's size after the run (``recompute=False`` grows it to one slot per block)."""
    kept = min(slots, layers)
    first = list(range(layers)) + list(range(layers - kept))
    later = list(range(kept, layers)) + list(range(layers - kept))
    return first + later * (accumulate - 1)


def transfer_alone(engine: Any, accumulate: int) -> dict[str, float]:
    """One step's copies with nothing else running, through the engine's own pinned buffers, slots and
    copy streams: H2D of the blocks :func:`uploaded_blocks` lists and of every outer copy, D2H of every
    gradient once per micro-batch. Each direction alone, then both at once (as the pipeline runs them).

    Only buffers without state between steps are written: the weight slots (the pool then forgets which
    blocks they held) and the gradient slabs, which must hold no gradient waiting for a step."""
    waiting = [u.name for u in engine.all_units() if u.grad.state is not GradState.EMPTY]
    if waiting:
        raise RuntimeError(f"transfer_alone runs between steps; {waiting[:3]} still hold gradients")
    units, slots = engine.units, engine.pool.buffers
    biggest = max(u.numel for u in engine.all_units())
    up_dst = torch.empty(biggest, dtype=engine.compute_dtype, device=engine.device)
    down_src = torch.zeros(biggest, dtype=engine.compute_dtype, device=engine.device)  # contents are irrelevant
    order = uploaded_blocks(len(units), len(slots), accumulate)
    grads = [u.slab for u in engine.all_units() if u.slab is not None]

    def up() -> None:
        for n, i in enumerate(order):
            slots[n % len(slots)][: units[i].numel].copy_(units[i].copy, non_blocking=True)
        for u in engine.outer_units:
            up_dst[: u.numel].copy_(u.copy, non_blocking=True)

    def down() -> None:
        for _ in range(accumulate):
            for slab in grads:
                slab.copy_(down_src[: slab.numel()], non_blocking=True)

    clock, h2d, d2h = Clock(engine.device), engine.streams.h2d, engine.streams.d2h
    out = {
        "h2d_s": clock.on_streams([(h2d, up)]),
        "d2h_s": clock.on_streams([(d2h, down)]),
        "both_s": clock.on_streams([(h2d, up), (d2h, down)]),
        "h2d_bytes": sum(units[i].copy.nbytes for i in order) + sum(u.copy.nbytes for u in engine.outer_units),
        "d2h_bytes": accumulate * sum(slab.nbytes for slab in grads),
    }
    engine.pool.invalidate()  # the slots now hold whatever was copied last, not the blocks the pool thinks
    return out


# -- the host worker alone --------------------------------------------------------------------------
def group_runs(unit: HostUnit) -> list[tuple[int, int, int]]:
    """(group, start, end): runs of consecutive parameters of one optimizer param group, all of them (a
    step of every parameter, as a full step takes)."""
    runs: list[tuple[int, int, int]] = []
    for e in unit.entries:
        if e.group is None:
            continue
        if runs and runs[-1][0] == e.group and runs[-1][2] == e.offset:
            runs[-1] = (e.group, runs[-1][1], e.offset + e.numel)
        else:
            runs.append((e.group, e.offset, e.offset + e.numel))
    return runs


def cpu_worker_alone(engine: Any, accumulate: int, clip: bool, piece: int = PIECE) -> dict[str, float]:
    """The host's arithmetic for one step with nothing else running, on this thread: landing each unit's
    gradient (k fp32 accumulations when k > 1; nothing when k = 1), its norm when clipping (the global norm
    needs every gradient's), then its AdamW step with the active backend (kernels.adam_step_).

    It runs on scratch buffers, a piece of at most `piece` elements at a time: each piece of a unit's
    master, moments and gradient is copied into them first (not timed), so the arithmetic sees the
    trained values and the trained state itself is left exactly as it was."""
    hyper = engine.host.hyper()
    units = [u for u in engine.all_units() if u.slab is not None and group_runs(u)]
    size = min(piece, max((u.numel for u in units), default=1))
    master, m, v, acc = (torch.empty(size, dtype=torch.float32) for _ in range(4))
    copy = torch.empty(size, dtype=engine.compute_dtype)
    took = {"land_s": 0.0, "norm_s": 0.0, "adam_s": 0.0}
    for unit in units:
        steps = max(unit.steps) + 1
        keep_copy = unit.copy is not None and unit.copy is not unit.master
        for group, start, end in group_runs(unit):
            for lo in range(start, end, size):
                hi = min(end, lo + size)
                n = hi - lo
                master[:n].copy_(unit.master[lo:hi])
                for mine, theirs in ((m, unit.m), (v, unit.v)):
                    if theirs is None:  # the moments live on the NVMe tier: zeros time the same
                        mine[:n].zero_()
                    else:
                        mine[:n].copy_(theirs[lo:hi])
                grad = unit.slab[lo:hi]
                t0 = time.perf_counter()
                if accumulate > 1:
                    for i in range(accumulate):
                        kernels.accumulate_(acc[:n], grad, i == 0)
                    grad = acc[:n]
                t1 = time.perf_counter()
                took["land_s"] += t1 - t0
                if clip:
                    kernels.param_norms(grad, [(0, n)])
                    took["norm_s"] += time.perf_counter() - t1
                t2 = time.perf_counter()
                kernels.adam_step_(master[:n], m[:n], v[:n], grad, copy[:n] if keep_copy else None, hyper[group], steps)
                took["adam_s"] += time.perf_counter() - t2
    return {**took, "total_s": sum(took.values())}
