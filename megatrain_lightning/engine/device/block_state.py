"""What a block call takes, returns and changes, as the recompute in backward needs it.

A block's output may be any tree of tensors: a tensor, tuples, lists, dicts, dataclasses, Hugging Face
``ModelOutput`` objects (registered with ``torch.utils._pytree``), with non-tensor leaves passed through.
:func:`flatten` takes it apart into leaves and gives the function that puts the same tree back together.

A block's forward may also change state that outlives the call: buffers (BatchNorm's running statistics
and ``num_batches_tracked``, an EMA, a counter) and plain attributes of its modules (``self.calls += 1``).
The recompute runs the forward a second time. :class:`Mutations` records, per forward call, what the call
changed and the values from before it; the recompute then starts from those values (it computes what the
forward computed) and everything it changes is put back afterwards, so each update happens once, as in
ordinary training.

A tensor argument several blocks of a pass take is chained through their autograd nodes
(:class:`InputChain`), so its gradient is summed in the order ordinary autograd sums it.
"""

from __future__ import annotations

import copy
import dataclasses
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

# Plain attribute values a recompute can put back exactly: immutable, compared by value.
SCALARS = (bool, int, float, complex, str, bytes, type(None))
# Mutable containers in a module's attributes: a recompute that changes one cannot be undone (refused).
CONTAINERS = (list, dict, set)
_MISSING = object()


def flatten(tree: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """`tree`'s leaves and the function that rebuilds it from new leaves. ``torch.utils._pytree`` takes apart
    tuples, lists, dicts and registered types (``ModelOutput``); dataclasses it leaves whole are taken apart
    here, field by field (rebuilt as a shallow copy with the new field values, frozen or not)."""
    leaves, spec = pytree.tree_flatten(tree)
    flat: list[Any] = []
    parts: list[tuple[int, Callable[[list[Any]], Any] | None]] = []
    for leaf in leaves:
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            inner, rebuild = flatten({f.name: getattr(leaf, f.name) for f in dataclasses.fields(leaf)})
            parts.append((len(inner), lambda values, obj=leaf, rebuild=rebuild: _with_fields(obj, rebuild(values))))
            flat.extend(inner)
        else:
            parts.append((1, None))
            flat.append(leaf)

    def unflatten(values: list[Any]) -> Any:
        rebuilt, at = [], 0
        for n, rebuild in parts:
            rebuilt.append(values[at] if rebuild is None else rebuild(values[at : at + n]))
            at += n
        return pytree.tree_unflatten(rebuilt, spec)

    return flat, unflatten


def _with_fields(obj: Any, fields: dict[str, Any]) -> Any:
    new = copy.copy(obj)
    for name, value in fields.items():
        object.__setattr__(new, name, value)
    return new


class Mutations:
    """The buffers and plain attributes one forward call of a block changed, with their values from before
    the call (a buffer's as a copy). Made by :meth:`watch` around the forward, used by :meth:`replayed`
    around the recompute."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self.buffers: list[tuple[nn.Module, str, torch.Tensor | None]] = []  # None: the call created it
        self.attrs: list[tuple[nn.Module, str, Any]] = []  # _MISSING: the call created it

    @classmethod
    @contextmanager
    def watch(cls, block: nn.Module) -> Iterator[Mutations]:
        """Record what the call inside changes. Every buffer is copied before the call (buffers are small:
        statistics, counters, masks); only the copies of those the call changed are kept. A buffer counts as
        changed when it was replaced, its version counter moved, or its values differ: some kernels update
        in place without moving the counter (BatchNorm's running statistics), so the values are compared (on
        a GPU a wait for the block's kernels, paid only by blocks that have buffers)."""
        modules = list(block.modules())
        buffers = {
            (id(m), n): (m, n, b, b._version, b.clone())
            for m in modules
            for n, b in m._buffers.items()
            if b is not None
        }
        snapshots = [(m, m.__dict__.copy()) for m in modules]  # (a C-level copy: this runs per block call)
        found = cls(block)
        yield found
        for m, n, b, version, before in buffers.values():
            if m._buffers.get(n) is not b or b._version != version or not torch.equal(b, before):
                found.buffers.append((m, n, before))
        for m in modules:
            found.buffers.extend((m, n, None) for n in m._buffers if (id(m), n) not in buffers)
        for m, before in snapshots:
            now = m.__dict__
            # Only attributes rebound or added can have changed (numbers and strings are immutable); of those,
            # the ones a scalar was or is now, compared by value.
            changed = [k for k, v in before.items() if now.get(k, _MISSING) is not v] + list(now.keys() - before)
            for k in changed:
                old, new = (_scalar(d.get(k, _MISSING)) for d in (before, now))
                if not _same(old, new):
                    found.attrs.append((m, k, old))

    def __bool__(self) -> bool:
        return bool(self.buffers or self.attrs)

    def _name_of(self, module: nn.Module) -> str:
        """`module`'s name in the block, for an error (looked up only then: the check runs for every block call)."""
        return next((n for n, m in self.block.named_modules() if m is module), "")

    @contextmanager
    def replayed(self, block: str) -> Iterator[None]:
        """Run the recompute inside from the state the forward started from; afterwards put back the state
        from before the recompute. Raises if the recompute changed what cannot be put back: a buffer the
        forward left alone (the block ran other code), or a list, dict or set attribute."""
        modules = list(self.block.modules())
        live_buffers = [(m, n, m._buffers.get(n, _MISSING)) for m, n, _ in self.buffers]
        live_attrs = [(m, k, m.__dict__.get(k, _MISSING)) for m, k, _ in self.attrs]
        for m, n, before in self.buffers:
            _put(m._buffers, n, _MISSING if before is None else before.clone())
        for m, k, before in self.attrs:
            _put(m.__dict__, k, before)
        replayed = {(id(m), n) for m, n, _ in self.buffers}
        others = [
            (m, n, b, b._version)
            for m in modules
            for n, b in m._buffers.items()
            if b is not None and (id(m), n) not in replayed
        ]
        sizes = [(m, k, len(v)) for m in modules for k, v in m.__dict__.items() if isinstance(v, CONTAINERS)]
        try:
            yield
        finally:
            for m, n, live in live_buffers:
                _put(m._buffers, n, live)
            for m, k, live in live_attrs:
                _put(m.__dict__, k, live)
        self._check(block, others, sizes)

    def _check(self, block: str, others: list, sizes: list) -> None:
        where = f"block {block} ({type(self.block).__name__})"
        for m, k, size in sizes:
            value = m.__dict__.get(k, ())
            if len(value) != size:
                name = ".".join(p for p in (self._name_of(m), k) if p)
                raise RuntimeError(
                    f"{where} changed its {type(value).__name__} attribute {name!r} again in the recompute in "
                    "backward (a second time for one call): keep state a block's forward updates in a buffer or a "
                    "number attribute, which the engine replays exactly, or update it outside the block"
                )
        for m, n, b, version in others:
            if m._buffers.get(n) is not b or b._version != version:
                name = ".".join(p for p in (self._name_of(m), n) if p)
                raise RuntimeError(
                    f"{where} changed buffer {name!r} in the recompute in backward but not in its forward: a "
                    "streamed block must run the same code in both (make the update depend only on its inputs and "
                    "train/eval mode)"
                )


def _scalar(value: Any) -> Any:
    """`value` if it is a plain attribute value a recompute can put back (:data:`SCALARS`), else _MISSING."""
    return value if isinstance(value, SCALARS) else _MISSING


def _same(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and a == b)


def _put(where: dict, key: str, value: Any) -> None:
    if value is _MISSING:
        where.pop(key, None)
    else:
        where[key] = value


class InputChain:
    """Tensor arguments that several blocks of one forward pass take (an encoder's output that every decoder
    block attends to, a position bias the first block made) are chained: each block's node returns the
    argument again, and the next block of the pass takes that as its input instead. In backward a block
    then gets the gradient the later blocks sent the argument and adds its own uses to it, starting from
    it, so the sum is formed in the order ordinary autograd forms it (the last block's uses first): bitwise
    the same gradient reaches where the argument came from."""

    def __init__(self) -> None:
        self.links: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}  # id(argument) -> (it, block, link)

    def inputs(self, idx: int, originals: list[torch.Tensor]) -> list[torch.Tensor]:
        """What block `idx` takes as its node's inputs for these arguments: the link an earlier block of this
        pass returned, or the argument itself."""
        # Links from an earlier pass (a block at or after this one made them) or to a freed argument go.
        self.links = {k: v for k, v in self.links.items() if v[1] < idx and v[0]() is not None}
        found = [self.links.get(id(t)) for t in originals]
        return [link[2] if link is not None and link[0]() is t else t for t, link in zip(originals, found)]

    def extend(self, idx: int, originals: list[torch.Tensor], links: list[torch.Tensor]) -> None:
        for t, link in zip(originals, links):
            self.links[id(t)] = (weakref.ref(t), idx, link)

    def clear(self) -> None:
        self.links.clear()
