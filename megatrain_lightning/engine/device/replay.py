"""What a block's recompute must replay beyond torch's own RNG, and what it refuses to try.

- Random generators outside torch's default ones (:class:`HostRngs`): Python's ``random``, NumPy's global
  generator (``np.random.*``) and the ``torch.Generator`` objects a block owns (attributes of it or of its
  submodules) or is given as an argument. Their states are taken before the block's forward, set again for
  the recompute in backward, and afterwards put back to what they were before the recompute: the block draws
  the forward's numbers twice, and every draw outside it continues as in ordinary training, where the block
  runs once.
- Reentrant checkpoints inside a block (:func:`direct_checkpoints`): ``torch.utils.checkpoint.checkpoint(...,
  use_reentrant=True)``, or Hugging Face's ``gradient_checkpointing_enable(gradient_checkpointing_kwargs=
  {"use_reentrant": True})``. The engine already keeps only the block's input and recomputes the block in
  backward, which is what such a checkpoint does; the reentrant variant cannot run inside that recompute
  (it refuses ``torch.autograd.grad``). While the engine runs a block with grad, a reentrant checkpoint
  therefore calls its function directly, which computes what the checkpoint's own recompute computes.
- A model compiled whole (:func:`refuse_compiled`): ``torch.compile`` draws dropout from its own generator,
  which no eager recompute reproduces; refused at setup, naming ``compile_blocks=True``.
"""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn


class HostRngs:
    """The states of the generators a block call may draw from besides torch's default ones."""

    def __init__(self, modules: list[nn.Module], args: tuple, kwargs: dict) -> None:
        """`modules`: the block's modules (itself and every submodule)."""
        self.python = random.getstate()
        numpy = sys.modules.get("numpy")  # (a block cannot draw from NumPy before something imported it)
        self.numpy = numpy.random.get_state() if numpy is not None else None
        self.generators = [(g, g.get_state()) for g in _generators(modules, args, kwargs)]

    @contextmanager
    def replayed(self) -> Iterator[None]:
        """Inside, every generator is where the forward found it; afterwards where it was before."""
        now = HostRngs.__new__(HostRngs)
        now.python, now.numpy = random.getstate(), self._numpy_state()
        now.generators = [(g, g.get_state()) for g, _ in self.generators]
        self._set()
        try:
            yield
        finally:
            now._set()

    def _numpy_state(self) -> Any:
        return None if self.numpy is None else sys.modules["numpy"].random.get_state()

    def _set(self) -> None:
        random.setstate(self.python)
        if self.numpy is not None:
            sys.modules["numpy"].random.set_state(self.numpy)
        for g, state in self.generators:
            g.set_state(state)


def _generators(modules: list[nn.Module], args: tuple, kwargs: dict) -> list[torch.Generator]:
    """The torch.Generator objects among the attributes of `modules` and the call's arguments, once each."""
    found: dict[int, torch.Generator] = {}
    generator = torch.Generator
    for values in [*(m.__dict__.values() for m in modules), (*args, *kwargs.values())]:
        if generator in set(map(type, values)):  # (runs per block call: the common case, none, stays in C)
            found.update((id(v), v) for v in values if type(v) is generator)
    return list(found.values())


# -- reentrant checkpoints inside a block ---------------------------------------------------------------

_REENTRANT = getattr(torch_checkpoint, "CheckpointFunction", None)
_lock = threading.Lock()
_installed = 0  # block calls (all threads) running with the direct stand-in installed
_here = threading.local()  # .depth: block calls of this thread


class _DirectCheckpoint:
    """Stands in for torch's reentrant ``CheckpointFunction`` while the engine runs a block with grad (this
    thread's calls only; any other thread gets torch's own)."""

    @staticmethod
    def apply(function: Any, preserve_rng_state: bool, *args: Any) -> Any:
        if not getattr(_here, "depth", 0):
            return _REENTRANT.apply(function, preserve_rng_state, *args)
        if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            # A reentrant checkpoint's output needs grad only through its tensor arguments: with none needing it,
            # ordinary training gives the weights inside no gradient, nor anything the output flows into, while
            # a streamed block's output always takes part in the graph.
            raise RuntimeError(
                "strategy='megatrain': a streamed block calls torch.utils.checkpoint.checkpoint(use_reentrant=True) "
                "on inputs none of which require grad, so in ordinary training the weights inside would get no "
                "gradient (torch warns 'None of the inputs have requires_grad=True'): pass use_reentrant=False, or "
                "make the block's input require grad (Hugging Face: model.enable_input_require_grads())"
            )
        return function(*args)


@contextmanager
def direct_checkpoints() -> Iterator[None]:
    """Inside, on this thread, a reentrant checkpoint runs its function directly (see the module's docstring)."""
    global _installed
    if _REENTRANT is None:  # (a torch without it has no reentrant checkpoint to stand in for)
        yield
        return
    with _lock:
        if _installed == 0:
            torch_checkpoint.CheckpointFunction = _DirectCheckpoint
        _installed += 1
    _here.depth = getattr(_here, "depth", 0) + 1
    try:
        yield
    finally:
        _here.depth -= 1
        with _lock:
            _installed -= 1
            if _installed == 0:
                torch_checkpoint.CheckpointFunction = _REENTRANT


# -- a model compiled whole -----------------------------------------------------------------------------


def refuse_compiled(model: nn.Module) -> None:
    """A ValueError of one line when `model`, or a module inside it, was compiled with ``torch.compile``
    (``torch.compile(module)``, ``module.compile()``, or a LightningModule compiled for ``trainer.fit``)."""
    for name, module in model.named_modules():
        compiled = (
            type(module).__name__ == "OptimizedModule"
            or getattr(module, "_compiled_call_impl", None) is not None
            or getattr(module, "_compiler_ctx", None) is not None
        )
        if compiled:
            inner = getattr(module, "_orig_mod", module)  # (what torch.compile wrapped)
            what = (
                f"module {name!r} ({type(inner).__name__}) of {type(model).__name__}" if name else type(inner).__name__
            )
            raise ValueError(
                f"strategy='megatrain': {what} is compiled with torch.compile, which draws dropout and runs the "
                "blocks in a way the engine cannot replay exactly: pass the model uncompiled and use "
                "compile_blocks=True (MegatrainStrategy, EngineConfig) to compile each streamed block"
            )
