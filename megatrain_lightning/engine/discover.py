"""Finding the stacks of repeated blocks a model streams, and what their blocks share.

The rule (docs/user-guide.md, "How blocks are found"): a stack is an ``nn.ModuleList`` of at least 2
modules, whatever their classes and sizes (a hybrid model mixes attention and state-space layers in one
list; host units and device slots size to the largest block), or an ``nn.Sequential`` of blocks (timm's
vision transformers, many user models): at least 2 of its modules hold parameters, and each that does is a
block, a module made of modules, not a single layer (an ``nn.Sequential`` of a ``Linear``, an activation and
another ``Linear`` is an MLP, not a stack). A Sequential calls its blocks itself; each block's forward is the
engine's either way. The largest one must hold at least
:data:`MIN_SHARE` of the model's parameters; every other list that holds at least :data:`STREAM_SHARE` and
neither sits inside a stack already chosen nor holds one (an encoder beside a decoder, a vision tower
beside a language model) is streamed too. ``blocks=`` (dotted names or a callable) overrides the rule.

Sharing (:func:`layout`): a module at several positions of the stacks (weights shared across depth) is one
block, streamed as one host unit at each of its calls, its gradients summed. A parameter reachable from two
blocks, or from a block and from the rest of the model, is held once as an outer parameter (on the device
for the whole run, stepped once with its summed gradient) and each block that uses it takes it as an input
of its autograd node, so its gradient reaches it as in ordinary training.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import nn

# The largest list holding less than this share of the parameters is not the model's body: a list nested
# inside a layer (adapters, the experts of a one-layer MoE) holds a few percent. Streaming it would save
# little and is almost surely not what the user meant. Real decoders put most of their parameters in their
# layer list (Llama 3.1 8B: 87%); tiny test models, whose embeddings and heads are relatively large, 30-94%.
MIN_SHARE = 0.2
# Another list outside the stacks chosen is streamed when it holds at least this share: an encoder (about
# 40% of T5 or BART), a vision tower (4-8% of a 7B vision-language model: CLIP ViT-L in LLaVA-1.5 7B holds
# 0.3B of 7.1B, Qwen2-VL 7B's 0.68B of 8.3B). A smaller list trains as ordinary modules on the device,
# exactly, and the setup line names it (:func:`unstreamed`); ``blocks=`` can stream it anyway.
STREAM_SHARE = 0.04
# Lists left on the device that hold at least this share are named in the strategy's setup line.
NAMED = 0.01

BlocksOption = str | Sequence[str] | Callable[[nn.Module], nn.ModuleList | Sequence[nn.ModuleList]] | None
Stack = nn.ModuleList | nn.Sequential  # (both iterate over their blocks in order)


@dataclass(frozen=True)
class Candidate:
    """A module list that could be streamed: its dotted name, the list and its share of the parameters."""

    name: str
    blocks: Stack
    share: float

    def describe(self) -> str:
        return f"{self.name} ({len(self.blocks)} blocks, {self.share:.0%} of the parameters)"


@dataclass
class Layout:
    """What the engine streams: the stacks, and each distinct block module once.

    ``blocks[i]`` is streamed as host unit ``names[i]`` (its stack's name and its first position) and belongs
    to ``stacks[stack_of[i]]``; ``shared`` maps the id of every parameter reachable from two blocks, or from a
    block and the rest of the model, to its name: those are outer parameters."""

    stacks: list[Candidate]
    blocks: list[nn.Module] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    stack_of: list[int] = field(default_factory=list)
    shared: dict[int, str] = field(default_factory=dict)
    repeated: list[str] = field(default_factory=list)  # "<name> at positions 0, 2": modules at several positions
    whole: list[str] = field(default_factory=list)  # blocks all of whose parameters are shared: not streamed

    def describe(self, model: nn.Module) -> str:
        """The setup line: what streams, what is shared, what stays on the device."""
        stacks = " and ".join(c.describe() for c in self.stacks)
        parts = [f"streaming {stacks}"]
        if self.repeated:
            parts.append(f"one host unit for each block at several positions ({'; '.join(self.repeated)})")
        if self.shared:
            names = sorted(self.shared.values())
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            parts.append(
                f"{len(names)} parameters shared between blocks or with the rest of the model held once on the "
                f"device ({', '.join(names[:3])}{more})"
            )
        if self.whole:
            parts.append(f"blocks holding only shared parameters run as ordinary modules ({', '.join(self.whole)})")
        others = unstreamed(model, self.stacks)
        if others:
            listed = "; ".join(c.describe() for c in others)
            parts.append(f"not streamed, trained as ordinary modules on the device: {listed}")
        return "; ".join(parts)


def find_blocks(model: nn.Module, blocks: BlocksOption = None) -> Layout:
    """The stacks to stream (`blocks`: a dotted module name, several, or a callable model -> ModuleList or
    list of them; else by the rule above) and how their blocks share modules and parameters. A ValueError of
    one line when there is none, or when the rule cannot decide."""
    return layout(model, find_stacks(model, blocks))


def find_stacks(model: nn.Module, blocks: BlocksOption = None) -> list[Candidate]:
    found = candidates(model)
    if blocks is None:
        return _pick(model, found)
    if isinstance(blocks, str):
        picked = [_by_name(model, blocks, found)]
    elif callable(blocks):
        picked = _by_callable(model, blocks, found)
    else:
        picked = [_by_name(model, name, found) for name in blocks]
    for i, a in enumerate(picked):
        for b in picked[:i]:
            if _overlap(a.blocks, _modules_of([b])):
                raise ValueError(
                    f"blocks: {b.name} and {a.name} hold the same modules (one inside the other, or listed "
                    "twice): name each stack of blocks once"
                )
    return picked


def candidates(model: nn.Module) -> list[Candidate]:
    """Every nn.ModuleList of >= 2 modules that holds parameters, and every nn.Sequential of blocks, largest
    first."""
    total = _numel(model)
    found = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2 and _numel(module) > 0 or _is_block_sequence(module):
            found.append(Candidate(name, module, _numel(module) / total))
    return sorted(found, key=lambda c: -c.share)


def _is_block_sequence(module: nn.Module) -> bool:
    """An nn.Sequential of at least 2 modules holding parameters, each of them made of modules that hold them."""
    if not isinstance(module, nn.Sequential):
        return False
    holding = [m for m in module if _numel(m) > 0]
    return len(holding) >= 2 and all(any(_numel(c) > 0 for c in m.children()) for m in holding)


def _pick(model: nn.Module, found: list[Candidate]) -> list[Candidate]:
    kind = type(model).__name__
    if not found:
        raise ValueError(
            f"strategy='megatrain' streams a model's repeated blocks, and {kind} has none: it looks for an "
            "nn.ModuleList of at least 2 modules that hold parameters (the decoder layers, e.g. `model.layers` "
            "of a Hugging Face *ForCausalLM) or an nn.Sequential of at least 2 such blocks. Keep the layers in "
            "an nn.ModuleList or nn.Sequential of their own, or train this model with an ordinary strategy."
        )
    if found[0].share < MIN_SHARE:
        listed = "; ".join(c.describe() for c in found[:4])
        raise ValueError(
            f"strategy='megatrain' will not guess which blocks to stream: the largest module list of {kind} holds "
            f"less than {MIN_SHARE:.0%} of its parameters (found: {listed}). Name the list with "
            "blocks='<dotted name>' (or a callable model -> nn.ModuleList), or train with an ordinary strategy."
        )
    chosen = [found[0]]
    for c in found[1:]:
        if c.share >= STREAM_SHARE and not _overlap(c.blocks, _modules_of(chosen)):
            chosen.append(c)
    return _in_model_order(model, chosen)


def unstreamed(model: nn.Module, stacks: list[Candidate]) -> list[Candidate]:
    """The lists outside every stack holding at least :data:`NAMED` of the parameters (trained as ordinary
    modules on the device): what the setup line names beside the streamed stacks."""
    inside = _modules_of(stacks)
    return [c for c in candidates(model) if c.share >= NAMED and not _overlap(c.blocks, inside)]


def layout(model: nn.Module, stacks: list[Candidate]) -> Layout:
    """Each distinct block once (first position), and the parameters shared between blocks or with the rest."""
    out = Layout(stacks)
    first: dict[int, str] = {}
    positions: dict[int, list[int]] = {}
    for s, stack in enumerate(stacks):
        for i, blk in enumerate(stack.blocks):
            positions.setdefault(id(blk), []).append(i)
            if id(blk) not in first:
                first[id(blk)] = f"{stack.name}.{i}"
                out.blocks.append(blk)
                out.names.append(first[id(blk)])
                out.stack_of.append(s)
    for name, blk in zip(out.names, out.blocks):
        if len(positions[id(blk)]) > 1:
            out.repeated.append(f"{name} at positions {', '.join(map(str, positions[id(blk)]))}")
    owners: dict[int, set[int]] = {}  # parameter id -> the blocks reaching it (-1: the rest of the model)
    names: dict[int, str] = {}
    for b, blk in enumerate(out.blocks):
        for pname, p in blk.named_parameters():
            owners.setdefault(id(p), set()).add(b)
            names.setdefault(id(p), f"{out.names[b]}.{pname}")
    inside = {id(m) for blk in out.blocks for m in blk.modules()}
    for _, module in model.named_modules(remove_duplicate=False):
        if id(module) not in inside:
            for p in module.parameters(recurse=False):
                owners.setdefault(id(p), set()).add(-1)
    out.shared = {k: names[k] for k, who in owners.items() if len(who) > 1 and k in names}
    keep = [i for i, blk in enumerate(out.blocks) if any(id(p) not in out.shared for p in blk.parameters())]
    # (a block without parameters, an activation between an nn.Sequential's blocks, just runs: not named)
    out.whole = [out.names[i] for i, blk in enumerate(out.blocks) if i not in keep and _numel(blk) > 0]
    out.blocks, out.names, out.stack_of = ([xs[i] for i in keep] for xs in (out.blocks, out.names, out.stack_of))
    if not out.blocks:
        raise ValueError(
            f"strategy='megatrain' has no block to stream in {', '.join(c.name for c in stacks)}: every parameter "
            "of its blocks is shared with another block or the rest of the model. Train this model with an "
            "ordinary strategy, or name other blocks with blocks='<dotted name>'."
        )
    return out


def unit_parameters(
    model: nn.Module, layout: Layout
) -> tuple[list[list[tuple[str, nn.Parameter]]], list[tuple[str, nn.Parameter]]]:
    """The engine's host units: for each streamed block its own (not shared) parameters, and every other
    parameter of the model (outer, a unit each, a shared one once). The engine and the planner both take
    their units from here, so the bytes planned are the bytes allocated."""
    block_params = [[(n, p) for n, p in b.named_parameters() if id(p) not in layout.shared] for b in layout.blocks]
    in_blocks = {id(p) for params in block_params for _, p in params}
    return block_params, [(n, p) for n, p in model.named_parameters() if id(p) not in in_blocks]


def _by_name(model: nn.Module, name: str, found: list[Candidate]) -> Candidate:
    try:
        module = model.get_submodule(name)
    except AttributeError:
        module = None
    if not isinstance(module, Stack) or len(module) == 0:
        what = "is not a module" if module is None else f"is a {type(module).__name__}, not a non-empty nn.ModuleList"
        what += f" of {type(model).__name__}" + ("" if module is None else " (nor an nn.Sequential)")
        names = ", ".join(c.describe() for c in found[:6]) or "none"
        raise ValueError(f"blocks={name!r} {what}: choose one of its module lists ({names})")
    return Candidate(name, module, _numel(module) / _numel(model))


def _by_callable(model: nn.Module, pick: Callable, found: list[Candidate]) -> list[Candidate]:
    got = pick(model)
    lists = list(got) if isinstance(got, (list, tuple)) else [got]
    named = {id(m): n for n, m in model.named_modules()}
    out = []
    for module in lists:
        name = named.get(id(module))
        if not isinstance(module, Stack) or name is None or len(module) == 0:
            names = ", ".join(c.describe() for c in found[:6]) or "none"
            raise ValueError(
                f"blocks={getattr(pick, '__name__', pick)!r} returned a {type(module).__name__}, not a non-empty "
                f"nn.ModuleList inside the model (nor an nn.Sequential, or a list of them): return one of its module "
                f"lists ({names})"
            )
        out.append(Candidate(name, module, _numel(module) / _numel(model)))
    return out


def _in_model_order(model: nn.Module, stacks: list[Candidate]) -> list[Candidate]:
    """Stacks in the order the model registers them: the order they usually run in (an encoder before its
    decoder, a vision tower before the language model), which the prefetches follow."""
    order = {id(m): i for i, m in enumerate(model.modules())}
    return sorted(stacks, key=lambda c: order[id(c.blocks)])


def _modules_of(stacks: list[Candidate]) -> set[int]:
    return {id(m) for c in stacks for m in c.blocks.modules()}


def _overlap(blocks: Stack, modules: set[int]) -> bool:
    """Whether `blocks` holds, or sits inside, a module of `modules` (ids of a stack's modules)."""
    return any(id(m) in modules for m in blocks.modules())


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
