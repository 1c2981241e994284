"""Parameters outside the decoder blocks (embedding, final norm, head): device copies refreshed lazily.

Mixed into :class:`~megatrain_lightning.engine.engine.StreamingEngine`. Each outer parameter is a unit of
its own whose compute copy lives on the device for the whole run. After an optimizer step its device copy
is *stale* until it is rewritten, and each one is rewritten only when the next forward is about to need
it, waiting for its own Adam step and nothing else:

- *early* units (read before the last block's forward: the embedding) are refreshed at the end of
  ``optimizer_step``, after the first blocks' prefetches are issued, so the H2D stream is busy with
  block 0 while the issuing thread waits for the embedding's step (last in the worker's queue when the
  optimizer overlaps backward: its gradient comes last);
- *late* units (read only after the last block: final norm, head) are refreshed when the last block's
  forward has been issued, so their uploads run under that block's compute and the compute stream
  waits for them just before the loss, not before block 0; with clipping their steps are queued after
  every block's (``_step_order``).

Which units are late is learned from the first training step: :meth:`OuterParams.record_outer_use`
(entered by the strategy around its first ``training_step``) watches every torch function call on the
issuing thread, outside the blocks, for outer parameters among its arguments, until the last block's
forward is done. A unit not seen there is late. Until that is learned (and for code driving the engine
without the strategy) every unit is early: refreshed by ``optimizer_step``, as safe as before. A forward
pre-hook on each module that owns an outer parameter refreshes it too, for a forward that calls such a
module without running the blocks.

    H2D      | block 0 | block 1 | embedding |                 ...   | norm, head |
    worker   | ... step 1 | step 0 | step embedding |
    compute  |                            | embed | block 0 | ... | block L-1 | loss (waits head) |
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode, _pop_mode_temporarily
from torch.utils._pytree import tree_leaves

from megatrain_lightning.engine.host import HostUnit


class _OuterUse(TorchFunctionMode):
    """Records the outer units whose parameters a torch function call receives, while `open`."""

    def __init__(self, units: dict[int, HostUnit]) -> None:
        super().__init__()
        self.units, self.seen, self.open = units, set(), True

    def note(self, tree: Any) -> None:
        if self.open:
            self.seen.update(self.units[id(t)] for t in tree_leaves(tree) if id(t) in self.units)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self.note((args, kwargs))
        return func(*args, **kwargs)


class OuterParams:
    """Device copies of the outer parameters: built, uploaded, marked stale by a step, refreshed lazily."""

    def _build_outer(self, outer: list, pin: bool) -> None:
        """A unit per outer parameter, its compute copy on the device, a hook to ship its gradient."""
        for n, p in outer:
            self.outer_units.append(HostUnit(n, [(n, p)], self.compute_dtype, pin, self._keep_copy))
        self._outer_buffers_to(self.device)
        self._outer_device: list[torch.Tensor] = []
        for unit in self.outer_units:
            self._outer_device.append(torch.empty(unit.numel, dtype=self.compute_dtype, device=self.device))
            self._upload_outer(unit, self._outer_device[-1])
        self._stale: set[HostUnit] = set()  # stepped; the device copy is not rewritten yet
        self._late: set[HostUnit] | None = None  # read only after the last block (None: not learned yet)
        self._recorder: _OuterUse | None = None
        self._hooks = [  # a frozen parameter gets no gradient, hence no hook
            e.param.register_post_accumulate_grad_hook(self._outer_grad_hook(u))
            for u in self.outer_units
            for e in u.entries
            if e.param.requires_grad
        ]
        owner = {id(e.param): u for u in self.outer_units for e in u.entries}
        self._hooks += [
            module.register_forward_pre_hook(lambda *_, unit=owner[id(p)]: self._refresh_outer([unit]))
            for module in self.model.modules()
            for p in module._parameters.values()
            if p is not None and id(p) in owner
        ]

    def _upload_outer(self, unit: HostUnit, dev: torch.Tensor) -> None:
        """Refresh the device copy of an outer parameter from its host copy and bind the parameter to it."""
        self.streams.wait(self.streams.h2d, self.streams.event())  # earlier compute may still read it
        unit.upload_done = self._upload(unit, dev)
        self.stats["h2d_bytes"] += dev.numel() * dev.element_size()
        self.streams.wait(None, unit.upload_done)
        _bind(unit, dev)

    def _refresh_outer(self, units: list[HostUnit] | None = None) -> None:
        """Rewrite the stale device copies among `units` (all outer units when None), each after its own
        optimizer step; compute issued from here on waits for the upload."""
        for unit, dev in zip(self.outer_units, self._outer_device):
            if unit in self._stale and (units is None or unit in units):
                self._wait(unit)
                self._upload_outer(unit, dev)
                self._stale.discard(unit)

    def _early_outer(self) -> list[HostUnit]:
        return [u for u in self.outer_units if self._late is None or u not in self._late]

    def _step_order(self, units: list[HostUnit]) -> list[HostUnit]:
        """The order optimizer steps are queued in: what the next forward reads first goes first (early
        outer units, blocks 0..L-1, then late outer units)."""
        late = self._late or set()
        return sorted(units, key=lambda u: 2 if u in late else (0 if u in self.outer_units else 1))

    @contextmanager
    def record_outer_use(self) -> Iterator[None]:
        """Around a training step: learn which outer units its forward reads before the last block is done
        (only the first time; afterwards a no-op)."""
        if self._late is not None or self._recorder is not None:
            yield
            return
        self._recorder = _OuterUse({id(e.param): u for u in self.outer_units for e in u.entries})
        try:
            with self._recorder:
                yield
            if not self._recorder.open:  # the forward reached the last block: what it did not read is late
                self._late = set(self.outer_units) - self._recorder.seen
        finally:
            self._recorder = None

    @contextmanager
    def _unrecorded_block(self, tree: Any) -> Iterator[None]:
        """A block call: its inner ops are not recorded (and not traced through the mode by torch.compile),
        but an outer parameter handed to it counts as read."""
        rec = self._recorder
        depth = torch._C._len_torch_function_stack()
        if rec is None or not rec.open or depth == 0 or torch._C._get_function_stack_at(depth - 1) is not rec:
            yield
            return
        rec.note(tree)
        with _pop_mode_temporarily():
            yield

    def _after_forward_block(self, idx: int) -> None:
        """The last block's forward is issued: close the recording, refresh the late units."""
        if idx == len(self.units) - 1:
            if self._recorder is not None:
                self._recorder.open = False
            self._refresh_outer()


def _bind(unit: HostUnit, flat: torch.Tensor) -> None:
    """Point each parameter of `unit` at its slice of `flat` (no copy)."""
    for e in unit.entries:
        e.param.data = flat[e.offset : e.offset + e.numel].view(e.shape)
