"""Parameters outside the decoder blocks (embedding, final norm, head): device copies rewritten after a step.

Mixed into :class:`~megatrain_lightning.engine.engine.StreamingEngine`. Each outer parameter is a unit of
its own whose compute copy lives on the device for the whole run. An optimizer step marks the stepped
ones *stale*; ``optimizer_step`` then rewrites each one as soon as its own Adam step is done (not after
every step queued before it), and issues the next forward's first blocks after them. So when control
returns to the caller every outer parameter is current again: a callback or an EMA of the weights reading
it between steps sees the stepped weights, as in ordinary training. The blocks' parameters (views of their
masters) are still being stepped in the background then: ``state_dict()`` waits for each block's step
(engine.py), the next forward for each block's before it runs, ``engine.flush()`` for all of them.

    H2D      |        | embedding, norm, head | block 0 |          ...
    worker   | ... step 1 | step 0 | step embedding |
    compute  |                                 | embed | block 0 | ...
"""

from __future__ import annotations

import torch

from megatrain_lightning.engine.host import HostUnit


class OuterParams:
    """Device copies of the outer parameters: built, uploaded, marked stale by a step, then rewritten."""

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
        self._hooks = [  # a frozen parameter gets no gradient, hence no hook
            e.param.register_post_accumulate_grad_hook(self._outer_grad_hook(u))
            for u in self.outer_units
            for e in u.entries
            if e.param.requires_grad
        ]

    def _upload_outer(self, unit: HostUnit, dev: torch.Tensor) -> None:
        """Refresh the device copy of an outer parameter from its host copy and bind the parameter to it."""
        self.streams.wait(self.streams.h2d, self.streams.event())  # earlier compute may still read it
        unit.upload_done = self._upload(unit, dev)
        self.stats["h2d_bytes"] += dev.numel() * dev.element_size()
        self.streams.wait(None, unit.upload_done)
        _bind(unit, dev)

    def _refresh_outer(self) -> None:
        """Rewrite the stale device copies, each after its own optimizer step; compute issued from here on
        waits for the upload."""
        for unit, dev in zip(self.outer_units, self._outer_device):
            if unit in self._stale:
                self._wait(unit)
                self._upload_outer(unit, dev)
                self._stale.discard(unit)


def _bind(unit: HostUnit, flat: torch.Tensor) -> None:
    """Point each parameter of `unit` at its slice of `flat` (no copy)."""
    for e in unit.entries:
        e.param.data = flat[e.offset : e.offset + e.numel].view(e.shape)
