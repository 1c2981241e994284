"""Finding the repeated blocks of a model, and refusing block lists the engine would train wrongly.

The rule (docs/user-guide.md, "How blocks are found"): the blocks are the ``nn.ModuleList`` of at least 2
modules that holds the most parameters, whatever the classes and sizes of its modules (a hybrid model
mixes attention and state-space layers in one list; host units and device slots size to the largest
block). It must hold at least :data:`MIN_SHARE` of the model's parameters, and no list outside it may
come close (:data:`CLOSE`): otherwise the choice is the user's, ``blocks=`` a dotted name or a callable.

Whatever picked the list, :func:`check_sharing` refuses a list in which one module sits at several
positions, or a parameter is shared between two blocks or between a block and the rest of the model:
each block's parameters become views of that block's own host buffer, so a shared one would be held
twice and stepped twice with part of its gradient each time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from torch import nn

# Everything outside the blocks stays on the device for the whole run (embedding, head, norms, and any
# other stack), so a list holding less than half the parameters saves less device memory than it leaves
# there: streaming it is almost surely not what the user meant (a list nested inside a shared layer, or
# one of two stacks of an encoder-decoder). Decoder-only models put most of their parameters in their
# layer list (Llama 3.1 8B: 87%; the tiny test models, with their relatively large embeddings, 70-94%).
MIN_SHARE = 0.5
# A list outside the best one holding at least this fraction of the best one's parameters is a real
# alternative (the other stack of an encoder-decoder): the engine does not guess between them.
CLOSE = 0.5


@dataclass(frozen=True)
class Candidate:
    """A module list that could be streamed: its dotted name, the list and its share of the parameters."""

    name: str
    blocks: nn.ModuleList
    share: float

    def describe(self) -> str:
        return f"{self.name} ({len(self.blocks)} blocks, {self.share:.0%} of the parameters)"


def find_blocks(model: nn.Module, blocks: str | Callable[[nn.Module], nn.ModuleList] | None = None) -> Candidate:
    """The list of blocks to stream: `blocks` (a dotted module name or a callable model -> ModuleList) when
    given, else the largest candidate by the rule above; a ValueError of one line when there is none, or
    when the rule cannot decide. The list is checked with :func:`check_sharing`."""
    found = candidates(model)
    if blocks is None:
        best = _pick(model, found)
    elif isinstance(blocks, str):
        best = _by_name(model, blocks, found)
    else:
        best = _by_callable(model, blocks, found)
    check_sharing(model, best.name, best.blocks)
    return best


def candidates(model: nn.Module) -> list[Candidate]:
    """Every nn.ModuleList of >= 2 modules that holds parameters, largest first."""
    total = _numel(model)
    found = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2 and _numel(module) > 0:
            found.append(Candidate(name, module, _numel(module) / total))
    return sorted(found, key=lambda c: -c.share)


def _pick(model: nn.Module, found: list[Candidate]) -> Candidate:
    kind = type(model).__name__
    if not found:
        raise ValueError(
            f"strategy='megatrain' streams a model's repeated decoder blocks, and {kind} has none: it looks for an "
            "nn.ModuleList of at least 2 modules that hold parameters (the decoder layers, e.g. `model.layers` "
            "of a Hugging Face *ForCausalLM). Keep the layers in an nn.ModuleList, or train this model with an "
            "ordinary strategy."
        )
    best = found[0]
    rivals = [c for c in found[1:] if not _nested(c.name, best.name) and c.share >= CLOSE * best.share]
    listed = "; ".join(c.describe() for c in found[:4])
    if best.share < MIN_SHARE:
        why = f"the largest module list of {kind} holds less than {MIN_SHARE:.0%} of its parameters"
    elif rivals:
        why = f"two module lists of {kind} are close in size"
    else:
        return best
    raise ValueError(
        f"strategy='megatrain' will not guess which blocks to stream: {why} (found: {listed}). Name the list "
        "with blocks='<dotted name>' (or a callable model -> nn.ModuleList), or train with an ordinary strategy."
    )


def _by_name(model: nn.Module, name: str, found: list[Candidate]) -> Candidate:
    try:
        module = model.get_submodule(name)
    except AttributeError:
        module = None
    if not isinstance(module, nn.ModuleList) or len(module) == 0:
        what = "is not a module" if module is None else f"is a {type(module).__name__}, not a non-empty nn.ModuleList"
        names = ", ".join(c.describe() for c in found[:6]) or "none"
        raise ValueError(f"blocks={name!r} {what} of {type(model).__name__}: choose one of its module lists ({names})")
    return Candidate(name, module, _numel(module) / _numel(model))


def _by_callable(model: nn.Module, pick: Callable[[nn.Module], nn.ModuleList], found: list[Candidate]) -> Candidate:
    module = pick(model)
    name = next((n for n, m in model.named_modules() if m is module), None)
    if not isinstance(module, nn.ModuleList) or name is None or len(module) == 0:
        names = ", ".join(c.describe() for c in found[:6]) or "none"
        raise ValueError(
            f"blocks={getattr(pick, '__name__', pick)!r} returned a {type(module).__name__}, not a non-empty "
            f"nn.ModuleList inside the model: return one of its module lists ({names})"
        )
    return Candidate(name, module, _numel(module) / _numel(model))


def check_sharing(model: nn.Module, name: str, blocks: nn.ModuleList) -> None:
    """A ValueError of one line when a module sits at several positions of `blocks`, or a parameter is
    reachable from two blocks, or from a block and from outside the blocks."""
    first: dict[int, int] = {}
    for i, blk in enumerate(blocks):
        j = first.setdefault(id(blk), i)
        if j != i:
            raise ValueError(
                f"{name}.{j} and {name}.{i} are one module ({type(blk).__name__}, weights shared across depth): "
                "strategy='megatrain' keeps one host copy per position and does not train a shared block. Build "
                "one module per position (e.g. copy.deepcopy), or train this model with an ordinary strategy."
            )
    owner: dict[int, tuple[str, str]] = {}  # parameter id -> (a block index or "outside", its name)
    for where, pname, p in _params_by_owner(model, name, blocks):
        seen = owner.setdefault(id(p), (where, pname))
        if seen[0] != where:
            between = "two blocks" if "outside" not in (where, seen[0]) else "a block and the rest of the model"
            raise ValueError(
                f"{seen[1]} and {pname} are one parameter shared by {between}: strategy='megatrain' keeps each "
                f"block's parameters in its own host buffer and would step a shared one twice, with part of its "
                "gradient each time. Untie them (give each its own nn.Parameter), or train this model with an "
                "ordinary strategy."
            )


def _params_by_owner(model: nn.Module, name: str, blocks: nn.ModuleList) -> Iterator[tuple[str, str, nn.Parameter]]:
    """(block index or "outside", name, parameter) for every parameter of every block, then for those that
    modules outside every block hold themselves. By module, not by name: a block the model also keeps under
    another attribute is still that block (calling it there runs its streamed forward)."""
    inside = {id(m) for blk in blocks for m in blk.modules()}
    for i, blk in enumerate(blocks):
        for pname, p in blk.named_parameters(remove_duplicate=False):
            yield str(i), f"{name}.{i}.{pname}", p
    for mname, module in model.named_modules(remove_duplicate=False):
        if id(module) not in inside:
            for pname, p in module.named_parameters(recurse=False):
                yield "outside", f"{mname}.{pname}" if mname else pname, p


def _nested(a: str, b: str) -> bool:
    """Whether one of the modules named `a` and `b` contains the other."""
    return a == b or a.startswith(f"{b}.") or b.startswith(f"{a}.") or not a or not b


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
