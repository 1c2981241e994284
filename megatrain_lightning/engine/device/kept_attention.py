"""Attention outputs kept from a block's forward, so that its recompute in backward does not run attention again.

A recomputed block runs its forward twice: once in the forward pass, once in backward to rebuild its graph.
The second run's attention forward (a fifth of attention's time at 8k tokens) only remakes what autograd saves
for attention's backward: the output and the log-sum-exp of its rows. With ``keep_attention=True`` each block call
keeps them from the forward instead (in host memory beside the block's input when the input is offloaded, else on
the device) and the recompute is handed them back, so attention's backward runs on the very tensors the forward
computed, as in ordinary training, where autograd saves them once.

How, for any model: while a training call of a block runs, a torch-function mode (:class:`_Redirect`) sends each
``F.scaled_dot_product_attention`` through :func:`_kept_attention_call`, which runs it eagerly (outside ``torch.compile``'s
graph: ``compile_blocks`` compiles the block in pieces around it) under a dispatch mode (:class:`_Tap`) that sees
the fused kernel torch picked, one of :data:`KEPT_OPS`. In the forward the tap keeps that kernel's outputs; in the
recompute it returns them in place of running the kernel, after checking that the kernel and its arguments are the
forward's and that its query, key and value are the forward's (their fingerprint, engine/self_checks.py: bitwise
on the CPU, within the recompute's tolerance on a GPU). Autograd above the tap records the kernel's node as in any
run and differentiates it with torch's own backward for that kernel. An attention torch computes as separate
matmuls and softmax (the math backend), or a model's own attention code, is not kept: it is recomputed, as before.

What stops a call with an unexpected order (a kernel with other arguments, more or fewer attention calls in the
recompute) is a RuntimeError naming the block, not a guess.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# The fused kernels whose outputs are what autograd saves for their backward (the output and the log-sum-exp, with
# the random state of their dropout): CPU flash, CUDA flash, memory-efficient, cuDNN and the overrideable one.
KEPT_OPS = frozenset(
    getattr(torch.ops.aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
    )
    if hasattr(torch.ops.aten, name)
)


# The name of the eager attention call, in the reason torch.compile gives for breaking a block's graph there.
KEPT_CALL = "_kept_attention_call"


class Kept:
    """One attention kernel's call in a block's forward: the kernel, its arguments' signature, its outputs (the large
    ones possibly in host memory: :meth:`Tape.stow`) and its query, key and value's fingerprint."""

    __slots__ = ("op", "signature", "outputs", "inputs_print")

    def __init__(self, op: Any, signature: tuple, outputs: tuple, inputs_print: torch.Tensor | None) -> None:
        self.op, self.signature, self.outputs, self.inputs_print = op, signature, outputs, inputs_print


class Tape:
    """The attention kernels' outputs of one training call of a block (of each of its row chunks, in order), kept
    by its forward and handed back, in the same order, to its recompute.

    `block`: the block's name (errors); `fingerprint`: the engine's fingerprint of a list of tensors;
    `compare(before, now)`: the engine's check that two fingerprints agree (raises, or flags the step); `stats`: the
    engine's counters (``"kept_attention"``: the attention calls handed back)."""

    def __init__(
        self,
        block: str,
        fingerprint: Callable[[list[torch.Tensor]], torch.Tensor | None],
        compare: Callable[[torch.Tensor | None, torch.Tensor | None], None],
        stats: dict,
    ) -> None:
        self.block, self.fingerprint, self.compare, self.stats = block, fingerprint, compare, stats
        self.kept: deque[Kept] = deque()
        self.replaying = False
        self.paused = False

    @contextmanager
    def running(self) -> Iterator[None]:
        """Inside, the block's attention calls are kept (the forward) or handed back (inside :meth:`replay`)."""
        if self.paused:
            yield
            return
        with _Redirect(self):
            yield

    def replay(self) -> AbstractContextManager[None]:
        """Inside, the calls hand back what the forward kept (the recompute)."""
        return self._while("replaying")

    def pause(self) -> AbstractContextManager[None]:
        """Inside, attention runs as it would without the tape (a trial call the engine makes besides the real ones)."""
        return self._while("paused")

    @contextmanager
    def _while(self, flag: str) -> Iterator[None]:
        setattr(self, flag, True)
        try:
            yield
        finally:
            setattr(self, flag, False)

    def stow(self, store: Callable[[torch.Tensor], Any]) -> None:
        """Move every kept output of two or more dimensions (the output and the log-sum-exp; not the scalars of a
        dropout's random state) to wherever `store` puts it (host memory), keeping the handle it returns. Each goes
        in its own memory order (a kernel's output is often a transposed view), so no copy is made to flatten it,
        and comes back with the same strides."""
        for k in self.kept:
            k.outputs = tuple(
                _Stowed.of(t, store) if isinstance(t, torch.Tensor) and t.dim() >= 2 else t for t in k.outputs
            )

    def stowed(self) -> list[Any]:
        """The handles :meth:`stow` keeps, in order."""
        return [t.handle for k in self.kept for t in k.outputs if isinstance(t, _Stowed)]

    def bring(self, fetch: Callable[[Any], torch.Tensor]) -> list[Any]:
        """Put the stowed outputs back as tensors (`fetch` of each handle) before the recompute; the handles."""
        handles = self.stowed()
        for k in self.kept:
            k.outputs = tuple(t.back(fetch) if isinstance(t, _Stowed) else t for t in k.outputs)
        return handles

    # -- what the tap does at each attention kernel ---------------------------------------------------------------
    def record(self, op: Any, args: tuple, kwargs: dict) -> Any:
        if _dropout(op, args, kwargs):
            # Handed back, the kernel would not advance the generator as it did in the forward, and every random
            # number the recompute draws after it would be another.
            raise RuntimeError(
                f"block {self.block}: keep_attention=True cannot keep an attention with dropout ({op}): its recompute "
                "would draw other random numbers after it. Pass keep_attention=False, or set the attention's dropout "
                "to 0 (Hugging Face: attention_dropout=0.0)"
            )
        outputs = op(*args, **kwargs)
        # (aliases without autograd's history, which the forward's node is about to give the outputs themselves)
        held = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in outputs)
        self.kept.append(Kept(op, _signature(args, kwargs), held, self.fingerprint(list(args[:3]))))
        return outputs

    def hand_back(self, op: Any, args: tuple, kwargs: dict) -> Any:
        if not self.kept:
            raise RuntimeError(
                f"block {self.block}: its recompute in backward calls attention ({op}) more often than its forward "
                "did, so the attention outputs kept from the forward (keep_attention=True) cannot stand in for it. "
                "Make the block run the same code in both, or pass keep_attention=False"
            )
        k = self.kept.popleft()
        if k.op is not op or k.signature != _signature(args, kwargs):
            raise RuntimeError(
                f"block {self.block}: its recompute in backward calls attention as {op} with other arguments than its "
                f"forward did ({k.op}), so the attention outputs kept from the forward (keep_attention=True) cannot "
                "stand in for it. Make the block run the same code in both, or pass keep_attention=False"
            )
        self.compare(k.inputs_print, self.fingerprint(list(args[:3])))
        self.stats["kept_attention"] += 1
        return k.outputs

    def left_over(self) -> None:
        """After the recompute: every kept call was handed back (else the recompute called attention less often)."""
        if self.kept:
            n = len(self.kept)
            self.kept.clear()
            raise RuntimeError(
                f"block {self.block}: its recompute in backward called attention {n} times fewer than its forward, "
                "so the attention outputs kept from the forward (keep_attention=True) do not belong to it. Make the "
                "block run the same code in both, or pass keep_attention=False"
            )


class _Stowed:
    """A kept output moved out of the device: the handle its store returned, and the order of its dimensions in
    memory (outermost first) it was stored in."""

    __slots__ = ("handle", "order")

    def __init__(self, handle: Any, order: list[int]) -> None:
        self.handle, self.order = handle, order

    @staticmethod
    def of(t: torch.Tensor, store: Callable[[torch.Tensor], Any]) -> _Stowed:
        order = sorted(range(t.dim()), key=lambda i: -t.stride(i))
        if not t.permute(order).is_contiguous():  # (not a permutation of a dense layout: stored as it reads)
            order = list(range(t.dim()))
        return _Stowed(store(t.permute(order)), order)

    def back(self, fetch: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        """The output on the device again, its shape and strides the forward's."""
        inverse = [0] * len(self.order)
        for at, dim in enumerate(self.order):
            inverse[dim] = at
        return fetch(self.handle).permute(inverse)


def _dropout(op: Any, args: tuple, kwargs: dict) -> bool:
    """Whether this attention kernel call drops out (its ``dropout_p`` argument, wherever its schema puts it)."""
    names = [a.name for a in op._schema.arguments]
    if "dropout_p" not in names:
        return False
    at = names.index("dropout_p")
    p = args[at] if at < len(args) else kwargs.get("dropout_p", 0.0)
    return bool(p)


def _signature(args: tuple, kwargs: dict) -> tuple:
    """What must be equal for a kept output to stand in: each tensor argument's shape, strides, dtype and device,
    and every other argument's value."""

    def of(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return ("tensor", tuple(a.shape), a.stride(), a.dtype, a.device)
        return a

    return tuple(of(a) for a in args), tuple(sorted((k, of(v)) for k, v in kwargs.items()))


class _Tap(TorchDispatchMode):
    """Under the attention call: the fused kernel's outputs kept (forward) or handed back (recompute)."""

    def __init__(self, tape: Tape) -> None:
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in KEPT_OPS:
            return func(*args, **kwargs)
        if self.tape.replaying:
            return self.tape.hand_back(func, args, kwargs)
        return self.tape.record(func, args, kwargs)


@torch._dynamo.disable
def _kept_attention_call(tape: Tape, args: tuple, kwargs: dict) -> torch.Tensor:
    # Eager, outside any compiled graph: a dispatch mode inside a compiled graph would make torch.compile run the
    # whole block eagerly instead.
    with _Tap(tape):
        return F.scaled_dot_product_attention(*args, **kwargs)


class _Redirect(TorchFunctionMode):
    """While a block call runs: its ``F.scaled_dot_product_attention`` calls go through :func:`_kept_attention_call`."""

    def __init__(self, tape: Tape) -> None:
        super().__init__()
        self.tape = tape

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is F.scaled_dot_product_attention:
            return _kept_attention_call(self.tape, args, kwargs or {})
        return func(*args, **(kwargs or {}))
