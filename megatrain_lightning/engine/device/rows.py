"""Layer-major steps: a block call of many rows run as chunks of ``row_chunk`` rows.

With ``row_chunk`` set, a training call of a block whose hidden state has more rows (its first dimension) than
that runs the block once per chunk of rows: every chunk through this block, then every chunk through the
next, in the forward and in the backward's recompute (the backward differentiates each chunk's recompute and
sums the weights' gradients over the chunks in fp32, in chunk order). So a block's weights go up once and its
gradient comes down once however many rows the micro-batch has, and the device holds one chunk's activations
inside a block, not the whole micro-batch's: the rows a step takes no longer depend on device memory. The
block inputs, one hidden state per block, are saved as any block input is (on the host with
``offload_inputs``).

Rows are independent in a transformer block (attention mixes positions within a row, never rows), so each
chunk computes exactly what its rows would in the whole call, up to the reduction order of the weight
gradients: ordinary training sums a weight's gradient over all rows in one product, the engine over each
chunk and then over the chunks. Blocks where that is not so, or where the engine could not replay a chunked
call exactly, are refused at their first chunked call, in one line naming the block and the cause:

- rows that affect each other: a module that normalizes over the batch (BatchNorm in training) is refused
  before the call, and every block, at its first chunked call, passes a behavioural test: its first chunk's
  output must not change (bit for bit) when the second chunk's rows change;
- random numbers drawn in the call (dropout): each chunk would draw its own, not the slice of one draw;
- buffers or attributes the call changes, tensors that leave the block besides its hidden state (hooks, side
  outputs, lists it writes into), arguments or shared parameters that require grad: each would be produced
  once per chunk, where ordinary training produces it once.

Which arguments are per row: every tensor argument with two or more dimensions whose first is the number of
rows (an attention mask, per-row positions), and every argument that is a list or tuple of plain values (no
tensor) with one element per row (this project's Llama's document spans), is cut with the rows; every other
argument goes to each chunk whole (a sequence-long cache position, positions shared by all rows, spans given
once for all rows). When the number of rows equals another
dimension of the hidden state (as many rows as positions), an argument of that first dimension could be
either, and the call is refused rather than guessed.

Evaluation calls (no grad) are not chunked: they keep no activations for backward, and a KV cache filled
chunk by chunk would not be the cache of one call.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from megatrain_lightning.engine.device.block_state import flatten

RowChunk = int | Literal["auto"] | None

# "auto" gives a chunk's activations (the bytes its ops save for backward) at most this share of the device
# memory free at its call: the rest is the backward's transients, about as large (engine/device/recompute.py).
ROW_SHARE = 0.5


def check_row_chunk(value: Any) -> RowChunk:
    """`value` if it is None, "auto" or a row count of at least 1, else a ValueError naming it and the fix."""
    if value is None or value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ValueError(
        f"row_chunk={value!r}: give the rows each chunk of a block call computes at a time (an int >= 1), 'auto' "
        "(chunks as the device memory requires), or None to run each block call whole"
    )


RANDOM = "draws random numbers (dropout?), which each chunk would draw anew"


class RowChunks:
    """Decides which calls run in chunks of rows, and refuses the blocks that cannot (module docstring).

    ``row_chunk="auto"``: decided at each training call, from the device memory free then and the bytes the
    block saves for backward (`estimate`, measured as ``recompute="auto"`` measures them, engine/device/recompute.py):
    the most rows whose saved bytes fit :data:`ROW_SHARE` of the free memory, or the whole call when all of
    them do. A block not yet measured runs its first chunk on one row, measured, and the rest of the call in
    chunks sized from that. On a device with no memory measure (the CPU) every call is whole."""

    def __init__(
        self,
        row_chunk: RowChunk,
        free_bytes: Callable[[], int | None] = lambda: None,
        estimate: Callable[[int, int], int | None] = lambda idx, numel: None,
    ) -> None:
        self.size = check_row_chunk(row_chunk)
        self.free_bytes, self.estimate = free_bytes, estimate
        self._independent: set[int] = set()  # blocks whose rows were shown independent

    @property
    def auto(self) -> bool:
        return self.size == "auto"

    def size_for(self, idx: int, hidden: torch.Tensor) -> int | None:
        """The rows each chunk of this training call of block `idx` on `hidden` computes (None: the call is
        whole; 0: "auto" on a block not yet measured, whose first chunk is one row, measured)."""
        if self.size is None or hidden.dim() < 2:
            return None
        rows = hidden.shape[0]
        if not self.auto:
            return self.size if rows > self.size else None
        if rows < 2 or (free := self.free_bytes()) is None:
            return None
        need = self.estimate(idx, hidden.numel())
        if need is None:
            return 0
        most = int(ROW_SHARE * free * rows // max(need, 1))
        return None if most >= rows else max(most, 1)

    def refuse_before(self, name: str, block: nn.Module, state: Any, hidden: torch.Tensor) -> None:
        """Refuse, before anything runs, a call the chunks could not reproduce (from what it was given)."""
        norm = next((type(m).__name__ for m in block.modules() if _batch_norm_training(m)), None)
        if norm is not None:
            self._refuse(name, f"normalizes over the rows of a batch ({norm} in training mode)")
        if state.sinks is not None:
            self._refuse(name, "is passed lists or dicts it writes tensors into")
        if state.grad_inputs:
            self._refuse(name, "takes arguments or parameters shared with other modules that require grad")
        rows, others = hidden.shape[0], set(hidden.shape[1:])
        if rows in others and any(_per_row(t, rows) for t in flatten((state.args, state.kwargs))[0]):
            self._refuse(
                name,
                f"has as many rows as positions or features ({rows}), so a tensor argument of first dimension "
                f"{rows} could be per row or not",
            )

    def refuse_after(self, name: str, state: Any, side: list[torch.Tensor], rng_drawn: bool) -> None:
        """Refuse a chunked forward that did what the chunks cannot reproduce (seen once it ran)."""
        if rng_drawn:
            self._refuse(name, RANDOM)
        if state.changed:
            self._refuse(name, "changes its buffers or attributes in forward, which each chunk would do again")
        if side or any(isinstance(t, torch.Tensor) for t in state.extra):
            self._refuse(name, "outputs tensors besides its hidden state (side outputs, hooks, attributes)")

    def check_independent(
        self,
        idx: int,
        name: str,
        run: Callable[[torch.Tensor, int], torch.Tensor],
        x: torch.Tensor,
        device: torch.device,
        size: int,
    ) -> None:
        """At block `idx`'s first chunked call: its first chunk's output (`size` rows) must not change when the
        rows of the second chunk do (``run(rows, n)``: the block's hidden output on `rows`, the first `n` rows
        of the call). The generators are left as they were."""
        if idx in self._independent or _no_values(x):
            return
        n = min(2 * size, x.shape[0])
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            before = rng_states(device)
            first = run(x[:n], n)[:size]
            if drew(before, device, x):
                self._refuse(name, RANDOM)
            other = x[:n].clone()
            other[size:] = other[size:].flip(-1) * 2 + 1
            again = run(other, n)[:size]
        if not torch.equal(first, again):
            self._refuse(name, "lets rows affect each other (its first rows' output changed with the next rows)")
        self._independent.add(idx)

    def forward(
        self,
        idx: int,
        name: str,
        state: Any,
        inner: Callable[..., Any],
        x: torch.Tensor,
        checks: Any,
        size: int,
        measuring: Callable[[torch.Tensor, list[Any]], AbstractContextManager],
    ) -> Any:
        """Block `idx`'s call on `x` in chunks of `size` rows (a CallState `state`, the block's own forward
        `inner`): each chunk's hidden output written into one output of all the rows, each chunk's fingerprint
        kept for its recompute (engine/self_checks.py); the call's other outputs are its chunks', which hold no
        tensor. `size` 0 (``"auto"``, the block not yet measured): the first chunk is one row, counted by
        `measuring` (what the chunk saves beyond the call's inputs, whose views it saves), and the rest of the
        call is chunked by what it saved."""
        rows = x.shape[0]

        def run(part: torch.Tensor, n: int) -> torch.Tensor:
            return state.split(state.call(inner, part, rows=(rows, 0, n)))[0]

        with state.tape.pause() if state.tape is not None else nullcontext():  # (trial calls keep nothing)
            self.check_independent(idx, name, run, x, x.device, max(size, 1))
        held = [x, *flatten((state.args, state.kwargs))[0]]  # (a chunk's views of them hold no memory of its own)
        before, out, unsplit, start = rng_states(x.device), None, None, 0
        while start < rows:
            end = min(start + max(size, 1), rows)
            with measuring(x[start:end], held) if size == 0 else nullcontext():
                part, unsplit, state.extra = state.split(state.call(inner, x[start:end], rows=(rows, start, end)))
            if part.dim() == 0 or part.shape[0] != end - start:
                self._refuse(name, f"returns a hidden state of shape {tuple(part.shape)} for {end - start} rows")
            if out is None:
                out = part.new_empty((rows, *part.shape[1:]))
            with torch.no_grad():
                out[start:end] = part
            checks.forward_done(state, [part])
            state.chunk_prints.append(state.fingerprint)
            state.row_spans.append((start, end))
            if size == 0:  # measured: the rest of the call's rows in chunks that fit (one row, unmeasurable)
                fit = self.size_for(idx, x)
                size = rows - end if fit is None else max(fit, 1)
            start = end
        state.drew = drew(before, x.device, x)
        return unsplit(out, state.extra)

    @staticmethod
    def backward(
        state: Any,
        inner: Callable[..., Any],
        hidden: torch.Tensor,
        grads_out: list[torch.Tensor | None],
        input_grad: bool,
        weights: list[torch.Tensor],
        recompute_done: Callable[[list[torch.Tensor]], None],
        measuring: Callable[[torch.Tensor, list[Any]], Any],
    ) -> tuple:
        """The backward of a chunked call: each chunk recomputed and differentiated alone, in the forward's
        order; the gradients of the `weights` summed over the chunks in fp32, in chunk order, then given the
        dtype a whole call's gradients have. Returns (the input's gradient if `input_grad`, *the weights')."""
        (grad_out,) = grads_out  # (a chunked call has no side outputs and no grad arguments: refused)
        grad_x = torch.empty_like(hidden) if input_grad else None  # (each chunk's rows written below)
        sums: list[torch.Tensor | None] = [None] * len(weights)
        rows, held = hidden.shape[0], [hidden, *flatten((state.args, state.kwargs))[0]]
        for (start, end), print_ in zip(state.row_spans, state.chunk_prints):
            x = hidden[start:end].detach().requires_grad_(input_grad)
            with torch.enable_grad(), state.replay(), measuring(x, held):
                out = state.split(state.call(inner, x, rows=(rows, start, end)))[0]
            state.fingerprint = print_
            recompute_done([out])
            grads = []
            if grad_out is not None and out.requires_grad:
                grads = list(
                    torch.autograd.grad(
                        [out], ([x] if input_grad else []) + weights, [grad_out[start:end]], allow_unused=True
                    )
                )
            if input_grad:
                g = grads.pop(0) if grads else None
                grad_x[start:end] = 0 if g is None else g
            for k, g in enumerate(grads):
                if g is not None:
                    sums[k] = g.to(torch.float32, copy=True) if sums[k] is None else sums[k].add_(g)
        return (
            *([grad_x] if input_grad else []),
            *(s if s is None else s.to(w.dtype) for s, w in zip(sums, weights)),
        )

    def _refuse(self, name: str, cause: str) -> None:
        raise RuntimeError(
            f"row_chunk={self.size!r}: block {name} {cause}, which chunks of rows would not compute as one call "
            "does; set row_chunk=None for this model"
        )


def rows_of(args: tuple[tuple, dict], rows: int, start: int, end: int) -> tuple[tuple, dict]:
    """A call's (positional, keyword) arguments with each per-row one (module docstring) cut to rows
    `start`..`end`."""
    positional, named = args
    return tuple(_cut(a, rows, start, end) for a in positional), {
        k: _cut(v, rows, start, end) for k, v in named.items()
    }


def _cut(value: Any, rows: int, start: int, end: int) -> Any:
    leaves, unflatten = flatten(value)
    if isinstance(value, (list, tuple)) and len(value) == rows and not any(isinstance(t, torch.Tensor) for t in leaves):
        return value[start:end]  # a sequence of plain values, one per row (this project's Llama's document spans)
    return unflatten([t[start:end] if _per_row(t, rows) else t for t in leaves])


def _per_row(t: Any, rows: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[0] == rows


def _batch_norm_training(m: nn.Module) -> bool:
    return isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training


def rng_states(device: torch.device) -> list[torch.Tensor]:
    """The generators a block call may draw from: the CPU's, and the device's when it is a GPU."""
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def drew(before: list[torch.Tensor], device: torch.device, x: torch.Tensor) -> bool:
    """Whether the generators moved since `before` (never told on fake tensors, see _no_values)."""
    return not _no_values(x) and any(not torch.equal(a, b) for a, b in zip(before, rng_states(device)))


def _no_values(x: torch.Tensor) -> bool:
    """Fake tensors, or a dispatch mode recording the ops (the planner's measurement, the schedule model): no
    values to compare, and no extra calls to record."""
    return isinstance(x, FakeTensor) or _get_current_dispatch_mode() is not None
