"""What the engine checks of itself at every step: that it can replay what it streams.

The engine recomputes a block in backward and trusts that the recompute computes what the forward did; it
lands a block's parameter gradients from its own autograd node and trusts that nothing else sends them one;
it streams the parameters it adopted at setup and trusts that they are still the model's. None of that can
be proven for every model, so :class:`SelfChecks` checks each, at every step, for the cost of a reduction
per block output and a walk over each block's parameter dict:

- **The recompute agrees with the forward.** Each recomputed block call's outputs get a fingerprint in the
  forward (:func:`fingerprint`: a projection onto fixed random signs and the norm, two fp32 numbers per
  output, reduced on the device and kept there: no host sync) and again in the recompute. On the CPU they
  must be equal bit for bit (the forward and the recompute run the same kernels). On a GPU grad mode may
  pick another attention kernel, so they must agree within :func:`tolerance` of the output's norm. A
  mismatch stops the step before the block's gradient is used: on the CPU at once, on a GPU the block's
  host jobs (landing, the Adam step) read the comparison first, after the copy they wait for anyway.
  A call that keeps its graph (``recompute="auto"``/``False``) is not recomputed: nothing to compare.
- **No stray gradients.** A gradient that reaches a streamed parameter outside its block's call (a penalty
  over block weights in the loss, a custom autograd Function that runs the layers itself and leaves their
  gradients in ``.grad``, as reversible layers do, a weight used outside its block) lands in that
  parameter's ``.grad``, where ordinary training would sum it too. The engine adds it to the parameter's
  gradient on the host after the backward (fp32, as ordinary training's ``.grad``), or refuses in one line
  when the parameter was already stepped during that backward.
- **The model is what the engine adopted.** Parameters renamed or moved into new submodules after setup
  (``torch.nn.utils.prune``: ``weight`` becomes ``weight_orig`` with a ``weight_mask`` buffer;
  ``torch.nn.utils.parametrize``), buffers added or replaced, or a parameter's ``.data`` assigned
  (``prune.remove``) are followed at the block's next call and at ``close()``; a parameter replaced by a new
  object, or added, is refused in one line naming it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

if TYPE_CHECKING:
    from megatrain_lightning.engine.host.units import HostUnit


# -- the recompute's fingerprint ------------------------------------------------------------------------

# Device bytes a recomputed call's fingerprint holds until its recompute, per output: two fp32 numbers.
FINGERPRINT_BYTES = 8

_SIGNS: dict[tuple[int, int, str, torch.dtype], torch.Tensor] = {}
# Fake tensors (the planner's measurement, the schedule model) each belong to one fake mode: cached per mode,
# so a recording sees the signs made once, as a real run does.
_FAKE_SIGNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _signs(n: int, salt: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """n fixed pseudo-random +-1 on `device`, the same in every call of the process (cached)."""
    key = (n, salt, str(device), dtype)
    mode = _active_fake_mode()
    cache = _SIGNS if mode is None else _FAKE_SIGNS.setdefault(mode, {})
    if key in cache:
        return cache[key]
    g = torch.Generator().manual_seed(0x5E1F + salt)
    signs = (torch.randint(0, 2, (n,), generator=g) * 2 - 1).to(device=device, dtype=dtype)
    if mode is not None or not isinstance(signs, FakeTensor):
        cache[key] = signs
    return signs


def _active_fake_mode() -> Any:
    """The fake tensor mode on the dispatch stack now, or None (one lookup: this runs per block call)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)


def fingerprint(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    """Two fp32 numbers per floating-point tensor, on its device: its projection onto fixed random signs
    (a separable pattern, rows x last dimension, so no weight the tensor's size is held) and its norm.

    The projection changes with any change of the tensor, whichever elements: a difference d moves it by
    about ||d|| (random signs), so it tells rounding (||d|| a few ulps of ||t||) from a different
    computation (a different dropout mask, a branch taken differently) even where the norm stays the same.
    Both are read in the tensor's own dtype (no fp32 copy of an output, which at long context would be
    gigabytes); the per-row sums then go on in fp32."""
    parts = []
    for t in tensors:
        if t is None or not t.is_floating_point():
            continue
        # Whatever autocast the caller runs under (the forward's fingerprint is taken inside it, the
        # recompute's after it), the same arithmetic both times.
        off = torch.autocast(t.device.type, enabled=False) if t.device.type in ("cpu", "cuda") else nullcontext()
        with torch.no_grad(), off:
            x = t.detach().reshape(-1, t.shape[-1] if t.dim() else 1)
            rows = (x @ _signs(x.shape[1], 0, x.device, x.dtype)).float()
            proj = _signs(x.shape[0], 1, x.device, torch.float32) @ rows
            parts.append(torch.stack([proj, torch.linalg.vector_norm(x, dtype=torch.float32)]))
    return torch.stack(parts) if parts else None


def tolerance(dtype: torch.dtype) -> float:
    """How far (relative to the output's norm) a GPU recompute may land from its forward and still count as
    the same computation, per compute dtype.

    The forward runs without grad and the recompute with grad; on a GPU the attention dispatch may then pick
    another kernel (e.g. flash for the forward, memory-efficient for the recompute), which rounds
    differently. Rounding moves an element by at most an ulp of the compute dtype (2^-8 relative in bf16,
    2^-11 in fp16, about 2^-23 in fp32, more with TF32 matmuls: 2^-11), so the difference of two such
    outputs has a norm of at most ~1 ulp of the output's norm; the projection moves by about that norm
    (random signs), the norm by at most it. The tolerance is 8 ulps: a difference of rounding stays below it
    by 8 standard deviations (no false alarm in any run), while a different computation (another dropout
    mask, another branch) moves the output by a share of the block's own update, far above it."""
    return {torch.bfloat16: 2.0**-5, torch.float16: 2.0**-8}.get(dtype, 2.0**-8)  # (fp32: 8 ulps of TF32)


def differs(forward: torch.Tensor, recompute: torch.Tensor, rtol: float | None) -> torch.Tensor | bool:
    """Whether two fingerprints disagree: bitwise (`rtol` None: the CPU), or beyond `rtol` of each output's
    norm (a device tensor, read by the host jobs: no sync here)."""
    if forward.shape != recompute.shape:
        return True
    if rtol is None:
        # Bit patterns, not values: a block whose output is NaN (a run that diverged) reproduces its NaN,
        # and NaN != NaN would report a recompute difference where ordinary training just goes on with NaN.
        return not torch.equal(forward.view(torch.int32), recompute.view(torch.int32))
    # (A NaN on either side compares False: a diverged block is not reported as a differing recompute.)
    return ((recompute - forward).abs() > rtol * forward[:, 1:].abs()).any()


# -- the checks -------------------------------------------------------------------------------------------


class SelfChecks:
    """The engine's self-checks (see the module docstring); the engine calls it at a few points."""

    def __init__(self, engine: Any) -> None:
        # `engine` is the Engine that owns these checks (not imported here: engine.py imports this module).
        self.engine = engine
        self._adopted = [self._shape_of(i) for i in range(len(engine.blocks))]
        # Per unit: the device flags of its recomputes not yet known to agree (a GPU), with their messages.
        self._flags: dict[int, list[tuple[torch.Tensor, Any, str]]] = {}
        self._lock = threading.Lock()  # (the worker reads the flags while this thread adds more)
        self._stray: set[int] = set()  # blocks one of whose parameters got a gradient outside its call
        self._hooks: list[Any] = []
        # Frozen parameters (requires_grad=False) take no hook; each is hooked once it is unfrozen
        # (BackboneFinetuning unfreezes a backbone mid-training), checked before its block's next call.
        self._frozen = [(i, e.param) for i, unit in enumerate(engine.units) for e in unit.layout]
        self._hook_unfrozen()

    # -- the recompute agrees with the forward -------------------------------------------------------------
    def forward_done(self, state: Any, outputs: list[torch.Tensor]) -> None:
        """A recorded forward call that will be recomputed: keep its outputs' fingerprint (on the device)."""
        state.fingerprint = fingerprint(outputs)

    def recompute_done(self, idx: int, state: Any, outputs: list[torch.Tensor]) -> None:
        """The recompute of block `idx`'s call: compare with the forward's fingerprint."""
        before = getattr(state, "fingerprint", None)
        state.fingerprint = None
        now = fingerprint(outputs)
        if self._lossy_input(state):
            return  # (its recompute starts from a rounded input by design: offload_inputs_dtype)
        self.agree(idx, before, now)

    def agree(self, idx: int, before: torch.Tensor | None, now: torch.Tensor | None) -> None:
        """Compare a fingerprint taken in block `idx`'s forward with the recompute's (its outputs', or the inputs of
        an attention call whose outputs the forward kept: engine/device/kept_attention.py)."""
        if before is None or now is None or isinstance(now, FakeTensor) or _get_current_dispatch_mode() is not None:
            # A fake tensor has no values; under a dispatch mode (the planner's measurement, the schedule model's
            # recorder, FlopCounterMode) ops may run as decompositions that round differently with and without
            # grad. The reductions are made (and counted), not compared.
            return
        unit = self.engine.units[idx]
        message = self._mismatch(unit.name)
        if now.device.type == "cpu":
            if differs(before, now, None):
                raise RuntimeError(message)
            return
        flag = differs(before, now, tolerance(self.engine.compute_dtype))
        if isinstance(flag, bool):
            if flag:
                raise RuntimeError(message)
            return
        # Read by the unit's host jobs after the copy they wait for anyway; this thread does not wait.
        host = torch.empty((), dtype=torch.bool, pin_memory=True)
        host.copy_(flag, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        with self._lock:
            self._flags.setdefault(id(unit), []).append((host, event, message))

    def _lossy_input(self, state: Any) -> bool:
        """Whether the call's input came back from the host in a smaller, lossy form (offload_inputs_dtype)."""
        saved, codec = state.saved, self.engine.saved_inputs.codec
        return (
            saved is not None
            and codec.dtype is not None
            and not (codec.dtype == "bf16" and saved.dtype == torch.bfloat16)
        )

    def gate(self, unit: HostUnit) -> None:
        """Run by each host job of `unit` first: raise if a recompute of its block disagreed with its forward
        (the job, a landing or an Adam step, then does nothing)."""
        with self._lock:
            flags = list(self._flags.get(id(unit), ()))
        for host, event, message in flags:
            event.synchronize()
            if bool(host):
                raise RuntimeError(message)  # (it stays: every later job of the unit fails too)
        read = {id(f) for f in flags}
        with self._lock:  # those that agreed are done with
            self._flags[id(unit)] = [f for f in self._flags.get(id(unit), []) if id(f) not in read]

    def _mismatch(self, block: str) -> str:
        how = "bitwise" if self.engine.device.type == "cpu" else f"within {tolerance(self.engine.compute_dtype):g}"
        return (
            f"block {block}: its recompute in backward did not reproduce its forward's outputs ({how}), so its "
            "gradient would be wrong and nothing was stepped with it. Likely the block draws randomness the "
            "engine does not replay (a generator of its own, time, a counter outside its buffers and number "
            "attributes) or its state changed between the forward and the backward. Make the block's output "
            "depend only on its inputs, parameters, buffers and torch's global RNG, or keep its graph instead of "
            "recomputing it (recompute=False)"
        )

    # -- no stray gradients -----------------------------------------------------------------------------
    def _hook_unfrozen(self) -> None:
        """Watch every block parameter that requires grad for gradients arriving in ``.grad``."""
        if not any(p.requires_grad for _, p in self._frozen):
            return
        for i, p in self._frozen:
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(lambda p, i=i: self._arrived(i, p)))
        self._frozen = [(i, p) for i, p in self._frozen if not p.requires_grad]

    def _arrived(self, idx: int, param: nn.Parameter) -> None:
        """A gradient reached `param` of block `idx` in ``.grad``: from outside the engine's path."""
        engine, unit = self.engine, self.engine.units[idx]
        if not engine.ranks.adds_stray_grads:
            raise RuntimeError(
                f"block {unit.name}: a gradient reached {self._param_name(idx, param)} outside the block's call (a "
                "penalty over block weights in the loss, a custom autograd Function that leaves gradients in "
                ".grad), which data-parallel training with strategy='megatrain' cannot add: compute it inside "
                "the block's forward, or train on one device"
            )
        if unit in engine.host._eager:
            raise RuntimeError(
                f"block {unit.name}: a gradient reached {self._param_name(idx, param)} outside the block's call "
                "after the block was already stepped during this backward. Pass overlap_optimizer=False (steps wait "
                "for the whole backward), or compute that term inside the block's forward"
            )
        self._stray.add(idx)
        engine.host.hold = True  # the blocks still to come back land and wait: this one is added to them first

    def fold_strays(self) -> None:
        """After a backward: add what stray gradients left in block parameters' ``.grad`` to their gradients
        on the host (fp32, as ordinary training sums them into ``.grad``), and clear ``.grad``."""
        if not self._stray:
            return
        host = self.engine.host
        host.expose()  # every gradient landed, in the fp32 accumulator (the step reads it from there)
        for idx in sorted(self._stray):
            unit = self.engine.units[idx]
            views = unit.views(unit.acc) if unit.acc is not None else {}
            grads = []
            for e, has in zip(unit.entries, unit.grad.present):
                stray, view = e.param.grad, views.get(e.name) if has else None
                if stray is not None:
                    stray = stray.to(torch.float32).reshape(e.shape)
                    view = stray if view is None else view.add_(stray)
                grads.append(view)
                e.param.grad = None
            host.take_back(unit, grads)
        self._stray.clear()

    def drop_strays(self) -> None:
        """``zero_grad``: the stray gradients go with the others (the host side clears ``.grad``)."""
        self._stray.clear()

    def _param_name(self, idx: int, param: nn.Parameter) -> str:
        unit = self.engine.units[idx]
        name = next((e.name for e in unit.layout if e.param is param), "a parameter")
        return f"parameter {unit.name}.{name}"

    # -- the model is what the engine adopted -------------------------------------------------------------
    def _shape_of(self, idx: int) -> list[tuple[int, str, int]]:
        """Block `idx`'s parameters and buffers as they sit: (module, name, tensor) identities."""
        return [
            (id(m), n, id(t))
            for m in self.engine.blocks[idx].modules()
            for d in (m._parameters, m._buffers)
            for n, t in d.items()
            if t is not None
        ]

    def adopted(self, idx: int, refuse: bool = True) -> None:
        """Before block `idx` runs: follow what changed of its parameters and buffers since setup."""
        if self._frozen:
            self._hook_unfrozen()
        moved = self._moved_data(idx)
        if not moved and self._shape_of(idx) == self._adopted[idx]:
            return
        self._readopt(idx, moved, refuse)

    def adopt_all(self) -> None:
        """Before the engine lets go of the model (``close()``): take in the values assigned to parameters'
        ``.data``, as :meth:`adopted` does (a parameter replaced is not the engine's: it is left alone)."""
        for idx in range(len(self.engine.blocks)):
            self.adopted(idx, refuse=False)

    def _moved_data(self, idx: int) -> list[int]:
        """Entries of block `idx` whose ``.data`` was assigned (``prune.remove``, a lottery-ticket reset):
        between calls each parameter is a view of its fp32 master."""
        unit = self.engine.units[idx]
        if unit.partitioned:
            return []
        size = unit.master.element_size()
        if isinstance(unit.master, FakeTensor):  # (the schedule model's: no data pointers, a storage and offset)

            def at(t: torch.Tensor) -> tuple[int | None, int]:
                # (torch functions off: untyped_storage() could read values, so a pending step's watch waits on it;
                # here only its identity is read, and a wait would put a stall in the model that a run has not)
                with torch._C.DisableTorchFunction():
                    return t.untyped_storage()._cdata, t.storage_offset() * size

        else:  # (data_ptr reads no values: a block's step still pending is not waited for, engine/host/pending_reads.py)

            def at(t: torch.Tensor) -> tuple[int | None, int]:
                return None, t.data_ptr()

        storage, base = at(unit.master)
        return [
            j
            for j, e in enumerate(unit.layout)
            if at(e.param) != (storage, base + e.offset * size) or e.param.dtype != unit.master.dtype
        ]

    def _readopt(self, idx: int, moved: list[int], refuse: bool) -> None:
        engine, unit, block = self.engine, self.engine.units[idx], self.engine.blocks[idx]
        ours = {id(e.param): j for j, e in enumerate(unit.layout)}
        names = {id(m): n for n, m in block.named_modules()}
        refs = []
        for m in block.modules():
            for n, p in m._parameters.items():
                if p is None or id(p) in engine.layout.shared:
                    continue
                if id(p) not in ours and not refuse:
                    continue
                if id(p) not in ours:
                    where = ".".join(s for s in (unit.name, names.get(id(m), ""), n) if s)
                    raise RuntimeError(
                        f"parameter {where} appeared after strategy='megatrain' adopted the model (a new or "
                        "replaced nn.Parameter), so it would not be trained or saved. Add or replace parameters "
                        "before setup (in the module's __init__ or configure_model); to prune, use "
                        "torch.nn.utils.prune, which keeps the parameter"
                    )
                refs.append((m, n, ours[id(p)]))
        if moved:
            engine.flush()
            for j in moved:
                e = unit.layout[j]
                unit.master[e.offset : e.offset + e.numel].copy_(e.param.detach().reshape(-1))
            unit.refresh_copy()
            unit.bind_host()
            engine.pool.invalidate(idx)
        engine.streamer.adopt_block_changes(idx, refs)
        self._adopted = [self._shape_of(i) for i in range(len(engine.blocks))]

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._stray.clear()


def gated(gate: Callable[[Any], None], unit: Any, job: Callable[[], None]) -> Callable[[], None]:
    """`job` run only once `gate(unit)` has passed."""

    def run() -> None:
        gate(unit)
        job()

    return run
