"""Reads of block weights while their optimizer step still runs in the background.

When ``optimizer_step`` returns, some blocks' steps are still running on the host worker: they overlap the
next forward, which waits for each block's step when it loads the block. Outside its call a block's parameters
are views of its fp32 master, which that step rewrites in place, so user code reading one in the window (a
weight penalty computed before the forward, a callback logging a weight norm, a held list of parameters) would
see the weights before the step, or half of them. Ordinary training shows the stepped weights.

So while any step is pending, :class:`PendingReads` is a torch-function mode on the training thread: a torch
function given a parameter (or a list holding one) of a block whose step is pending first waits for that
step, then runs. Reads see exactly the stepped weights by construction, whatever path reached the parameter,
and nothing waits when nobody reads. Metadata (``.grad``, shape, dtype, ``requires_grad``, hashing) does not
read the weights and does not wait, so ``zero_grad`` and dictionary lookups keep the overlap. The mode leaves
the stack when the last pending block is loaded (or at ``close``); a mode the user pushed above it meanwhile is
never popped in its place (ours then stays, inert, until it is on top again).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# Functions that read a parameter's metadata, never its values.
_METADATA_ATTRS = ("grad", "requires_grad", "shape", "dtype", "device", "is_leaf", "ndim", "layout", "grad_fn")
_METADATA_ATTRS += ("_version", "is_cuda", "is_meta", "_post_accumulate_grad_hooks", "_backward_hooks")
_METADATA_METHODS = ("size", "dim", "numel", "__hash__", "requires_grad_", "stride", "element_size", "__len__")
_METADATA_METHODS += ("is_contiguous", "register_hook", "register_post_accumulate_grad_hook", "nelement")
_METADATA_METHODS += ("data_ptr", "storage_offset", "get_device", "is_floating_point", "is_complex")
_SKIP = {id(getattr(torch.Tensor, name)) for name in _METADATA_ATTRS + _METADATA_METHODS if hasattr(torch.Tensor, name)}


def _reads_values(func: Any) -> bool:
    return id(func) not in _SKIP and id(getattr(func, "__self__", None)) not in _SKIP


class PendingReads(TorchFunctionMode):
    """Waits for a block's pending optimizer step before a torch function reads one of its parameters."""

    def __init__(self, wait: Callable[[Any], None]) -> None:
        super().__init__()
        self._wait = wait  # blocks until a unit's last host job (its step) is done
        self._owners: dict[int, Any] = {}  # id(parameter) -> its unit, while the unit's step is pending
        self._params: dict[Any, list[torch.Tensor]] = {}
        self._inside = False  # in our own handler: torch has taken the mode off the stack for its duration
        self.waits = 0  # reads that had to wait (the tests count them)

    def watch(self, units: Iterable[Any]) -> None:
        """The units whose step is still running as the optimizer step returns: watch their parameters."""
        for unit in units:
            if unit.future is None or unit.future.done() or unit in self._params:
                continue
            self._params[unit] = [e.param for e in unit.layout]
            for p in self._params[unit]:
                self._owners[id(p)] = unit
        if self._params and not self._on_stack():
            torch._C._push_on_torch_function_stack(self)

    def settled(self, unit: Any) -> None:
        """`unit`'s step is done (the engine waited for it): stop watching it; leave when none is left."""
        for p in self._params.pop(unit, ()):
            self._owners.pop(id(p), None)
        if not self._params:
            self._leave()

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """Off the stack for the engine's own call of a block: its weights are bound to its slot (its step was
        waited for), so nothing in it reads a pending block, and a compiled block sees the mode stack it was
        compiled with (a mode on it would make torch.compile compile the block again)."""
        if not self._on_top():
            yield
            return
        torch._C._pop_torch_function_stack()
        try:
            yield
        finally:
            if self._params:
                torch._C._push_on_torch_function_stack(self)

    def clear(self) -> None:
        self._owners.clear()
        self._params.clear()
        self._leave()

    def _leave(self) -> None:
        if self._on_top():
            torch._C._pop_torch_function_stack()

    def _on_top(self) -> bool:
        n = torch._C._len_torch_function_stack()
        return not self._inside and n > 0 and torch._C._get_function_stack_at(n - 1) is self

    def _on_stack(self) -> bool:
        return any(torch._C._get_function_stack_at(i) is self for i in range(torch._C._len_torch_function_stack()))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._owners and _reads_values(func):
            self._inside = True
            try:
                for unit in {self._owners[i] for i in _tensor_ids(args, kwargs) if i in self._owners}:
                    self._wait(unit)
                    self.waits += 1
                    self.settled(unit)
            finally:
                self._inside = False
        return func(*args, **kwargs)


def _tensor_ids(args: tuple, kwargs: dict) -> list[int]:
    """The ids of the tensors among the arguments, and inside the lists and tuples among them (one level:
    ``torch.cat``, ``torch._foreach_*`` and ``torch.stack`` take their tensors so)."""
    ids = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            ids.append(id(a))
        elif isinstance(a, (list, tuple)):
            ids.extend(id(t) for t in a if isinstance(t, torch.Tensor))
    return ids
