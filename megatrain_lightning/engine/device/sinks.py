"""Lists and dicts passed into a block that the block adds tensors to (an auxiliary-loss sink).

    def forward(self, x, aux_losses):          # the model calls block(h, aux_losses) for each block
        aux_losses.append(self.balance_loss(x))

In ordinary training the list then holds a tensor with its graph, and the loss that sums it sends a gradient
into the block. The engine runs a block's forward without a graph and again in backward, so left alone the
list would get a tensor that takes no gradient, and a second one from the recompute. Instead each call runs
on its own copy of the argument's lists and dicts (the tensors in them are not copied); what the call adds
or replaces there is a side output of the block's autograd node (as a tensor a hook records is) and, after
the forward, is written into the caller's containers. The recompute's copy is thrown away, so nothing is
added twice, and what the recompute adds is what its gradient is taken of.

A block may change the lists and dicts anywhere in its arguments (through tuples, lists and dicts) in any
way (append, insert, set, pop, remove, add or set keys); the values it puts in may be tensors, numbers,
strings, None, and tuples, lists, dicts and dataclasses of them. An object holding tensors the engine cannot
see into is refused with one line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatrain_lightning.engine.device.block_state import flatten


class Sinks:
    """The lists and dicts in one block call's arguments, and what the latest run of the call changed in them."""

    def __init__(self, block: str, args: tuple, kwargs: dict, user: list[list | dict]) -> None:
        self.block, self.args, self.kwargs, self.user = block, args, kwargs, user
        self.changes: list[tuple[int, list]] = []  # (container's index in walk order, its content: see collect)
        self.tensors: list[torch.Tensor] = []  # the floating-point tensors among the changed values
        self._seen: list[tuple[list | dict, list | dict]] = []
        self._inputs: set[int] = set()

    @classmethod
    def find(cls, block: str, user: tuple, held: tuple) -> Sinks | None:
        """The sinks of a call whose caller passed `user` (args, kwargs; the hidden state left out) and whose
        state holds `held` (the same tree, with stand-ins for tensors that require grad); None without any
        list or dict in them."""
        containers = _containers(*user)
        # (held privately: without a stand-in among them, `held` are the caller's containers themselves)
        return cls(block, *_copy(held), containers) if containers else None

    def fresh(self) -> tuple[tuple, dict]:
        """Arguments to run the call with: lists and dicts copied, their contents noted."""
        args, kwargs = _copy((self.args, self.kwargs))
        self._seen = [(c, c.copy()) for c in _containers(args, kwargs)]
        return args, kwargs

    def collect(self, inputs: set[int]) -> None:
        """After a run: what its copies hold now (:attr:`changes`: per changed container, its new content
        with each item it held before named by its place then, each new value kept; :attr:`tensors`: the
        floating-point tensors among the new values). A tensor the call took as an input (ids in `inputs`:
        its hidden state, the tensors that require grad) goes in as a copy made now, after the call: its
        gradient from the caller's use then reaches the input before the block's own uses, as in ordinary
        training, where that use comes later."""
        self.changes, self.tensors, self._inputs = [], [], inputs
        for i, (now, before) in enumerate(self._seen):
            old = {id(v): k for k, v in (enumerate(before) if isinstance(before, list) else before.items())}
            items = list(enumerate(now)) if isinstance(now, list) else list(now.items())
            same = len(now) == len(before) and all(old.get(id(v), _NEW) == k for k, v in items)
            if not same:
                content = [(k, (_OLD, old[id(v)]) if id(v) in old else (_NEW, self._new(now, k, v))) for k, v in items]
                self.changes.append((i, content))
        self._seen, self._inputs = [], set()

    def apply(self, replace: Callable[[Any], Any]) -> None:
        """Give the caller's containers the forward's content: what they held before where the call kept it,
        the new values with each tensor through `replace` (an output of the block's autograd node for a side
        output, the caller's tensor for a stand-in)."""
        for i, content in self.changes:
            target = self.user[i]
            values = [(k, target[v] if how is _OLD else _replaced(v, replace)) for k, (how, v) in content]
            if isinstance(target, list):
                target[:] = [v for _, v in values]
            else:
                target.clear()
                target.update(values)
        self.changes, self.tensors = [], []

    def _new(self, container: list | dict, key: Any, value: Any) -> Any:
        """`value`, new in `container` at `key`, with its inputs copied; its tensors noted."""
        leaves, rebuild = flatten(value)
        leaves = [t.clone() if isinstance(t, torch.Tensor) and id(t) in self._inputs else t for t in leaves]
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                if leaf.is_floating_point():
                    self.tensors.append(leaf)
            elif hasattr(leaf, "__dict__") and any(isinstance(v, torch.Tensor) for v in vars(leaf).values()):
                raise TypeError(
                    f"strategy='megatrain': block {self.block} put a {type(leaf).__name__} holding tensors into "
                    f"a {type(container).__name__} it was passed (at {key!r}), whose tensors would get no "
                    "gradient: put the tensors in themselves, or in a tuple, list, dict or dataclass"
                )
        return rebuild(leaves)


_OLD, _NEW = object(), object()


def _replaced(value: Any, replace: Callable[[Any], Any]) -> Any:
    leaves, rebuild = flatten(value)
    return rebuild([replace(t) if isinstance(t, torch.Tensor) else t for t in leaves])


def _containers(args: tuple, kwargs: dict) -> list[list | dict]:
    """The lists and dicts in a call's arguments (through tuples, lists and dicts: what :func:`_copy` copies),
    depth first."""
    found: list[list | dict] = []

    def walk(node: Any) -> None:
        if type(node) in (list, dict):
            found.append(node)
        if type(node) in (list, tuple) or _is_namedtuple(node):
            for v in node:
                walk(v)
        elif type(node) is dict:
            for v in node.values():
                walk(v)

    for value in (*args, *kwargs.values()):
        walk(value)
    return found


def _copy(tree: Any) -> Any:
    """`tree` with every list and dict (through tuples, lists and dicts) a new one; the rest shared."""
    if type(tree) is list:
        return [_copy(v) for v in tree]
    if type(tree) is dict:
        return {k: _copy(v) for k, v in tree.items()}
    if type(tree) is tuple:
        return tuple(_copy(v) for v in tree)
    if _is_namedtuple(tree):
        return type(tree)(*(_copy(v) for v in tree))
    return tree


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")
