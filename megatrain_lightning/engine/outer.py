"""Parameters outside the decoder blocks (embedding, final norm, head): device copies rewritten after a step.

Held by the engine. Each outer parameter is a unit of
its own whose compute copy lives on the device for the whole run. An optimizer step marks the stepped
ones *stale*; ``optimizer_step`` then rewrites each one as soon as its own Adam step is done (not after
every step queued before it), and issues the next forward's first blocks after them. So when control
returns to the caller every outer parameter is current again (in the compute dtype): a callback reading
it between steps sees the stepped weights. The blocks' parameters (views of their masters) are still being
stepped in the background then: ``state_dict()`` waits for each block's step (engine.py), the next forward
for each block's before it runs, ``engine.flush()`` for all of them, and ``engine.host_view()`` shows every
parameter as its fp32 master once they are done (:meth:`bind_masters`), as a weight average must read them.

    H2D      |        | embedding, norm, head | block 0 |          ...
    worker   | ... step 1 | step 0 | step embedding |
    compute  |                                 | embed | block 0 | ...
"""

from __future__ import annotations

import torch

from megatrain_lightning.engine.device.uploads import Uploader
from megatrain_lightning.engine.host.host_steps import HostSide
from megatrain_lightning.engine.host.units import HostUnit


class OuterParams:
    """Device copies of the outer parameters: built, uploaded, marked stale by a step, then rewritten."""

    def __init__(self, units: list[HostUnit], device: torch.device, streams, uploads: Uploader, host: HostSide) -> None:
        """Each unit's compute copy goes to the device now; a hook ships each trained parameter's gradient."""
        self.units, self.streams, self.uploads, self.host = units, streams, uploads, host
        self.device_copies = [torch.empty(u.device_numel, dtype=u.compute_dtype, device=device) for u in units]
        for unit, dev in zip(units, self.device_copies):
            self._upload(unit, dev)
        self.stale: set[HostUnit] = set()  # stepped; the device copy is not rewritten yet
        self._hooks = [  # a frozen parameter gets no gradient, hence no hook
            e.param.register_post_accumulate_grad_hook(self._grad_hook(u))
            for u in units
            for e in u.entries
            if e.param.requires_grad
        ]

    def _grad_hook(self, unit: HostUnit):
        def hook(param: torch.Tensor) -> None:
            grad, param.grad = param.grad, None
            self.host.ship(unit, grad.reshape(-1), present=[True])

        return hook

    def _upload(self, unit: HostUnit, dev: torch.Tensor) -> None:
        """Refresh the device copy of an outer parameter from its host copy and bind the parameter to it."""
        self.streams.wait(self.streams.h2d, self.streams.event())  # earlier compute may still read it
        unit.upload_done = self.uploads.upload(unit, dev)
        self.streams.wait(None, unit.upload_done)
        unit.bind(dev)

    def mark_stale(self, stepped: set[HostUnit]) -> None:
        self.stale.update(u for u in self.units if u in stepped)

    def refresh(self) -> None:
        """Rewrite the stale device copies, each after its own optimizer step; compute issued from here on
        waits for the upload."""
        for unit, dev in zip(self.units, self.device_copies):
            if unit in self.stale:
                self.host.wait_weights(unit)
                self._upload(unit, dev)
                self.stale.discard(unit)

    def reupload(self) -> None:
        """Every device copy from its host copy (after weights were loaded from outside)."""
        for unit, dev in zip(self.units, self.device_copies):
            self._upload(unit, dev)
        self.stale.clear()

    def bind_masters(self) -> None:
        """Point the parameters at their fp32 masters (to read or load a state dict)."""
        for unit in self.units:
            unit.bind_host()

    def bind_device(self) -> None:
        for unit, dev in zip(self.units, self.device_copies):
            unit.bind(dev)

    def nbytes(self) -> int:
        return sum(d.numel() * d.element_size() for d in self.device_copies)

    def close(self) -> None:
        """The parameters become views of their masters again; the device copies and hooks go."""
        for handle in self._hooks:
            handle.remove()
        self.bind_masters()
        self.device_copies.clear()
