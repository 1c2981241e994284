"""The package's shape: no import cycle, the engine and the optimizer import no Lightning, optim/ imports nothing
of engine/, a file over 500 lines says why in its docstring, and importing the package imports no Lightning.

Imports are read from the source (ast), every ``import`` a module names: at the top, in functions, in ``try``,
and under ``if TYPE_CHECKING:`` too (a module that needs another's type where that one imports it takes a
Protocol instead). Importing ``a.b.c`` also runs the packages ``a`` and ``a.b``; those implicit edges are left
out (every module would otherwise reach the package's ``__init__``, which builds the strategies), so a
package's own ``__init__`` imports count as its edges. The Lightning check below counts only imports that
run."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import megatrain_lightning

ROOT = Path(megatrain_lightning.__file__).parent
PACKAGE = "megatrain_lightning"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


MODULES = set(modules())


def imports(path: Path, name: str, typing_too: bool = True) -> set[str]:
    """Every module `path` imports, resolved to module names (relative imports included); with
    `typing_too=False` only those that run (not under ``if TYPE_CHECKING:``)."""
    tree = ast.parse(path.read_text())
    typing = [node for node in ast.walk(tree) if _is_type_checking(node)] if not typing_too else []
    skipped = {id(n) for node in typing for n in ast.walk(node)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            # `from pkg import module` imports the module (pkg's __init__ is the implicit parent edge); `from
            # module import name` imports the module itself.
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names)
    return found


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: {m for m in imports(path, name) if m in known and m != name} for name, path in known.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node], _ = 1, path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node], _ = 2, path.pop()
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_walker_sees_a_cycle_and_resolves_relative_imports():
    """The check itself can fail: a made-up cycle is found, and relative imports resolve."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    llama = imports(ROOT / "models" / "llama.py", f"{PACKAGE}.models.llama")
    assert f"{PACKAGE}.models.config" in llama


def test_no_import_cycle_in_the_package():
    cycle = find_cycle(graph())
    assert cycle is None, " -> ".join(cycle or [])


def test_optim_imports_nothing_of_the_engine():
    edges = graph()
    bad = {m: sorted(t for t in to if t.startswith(f"{PACKAGE}.engine")) for m, to in edges.items()}
    assert not {m: t for m, t in bad.items() if m.startswith(f"{PACKAGE}.optim") and t}


def test_engine_and_optim_import_no_lightning():
    checked = set()
    for name, path in modules().items():
        if name.startswith((f"{PACKAGE}.engine", f"{PACKAGE}.optim")):
            checked.add(name)
            lightning = sorted(
                m
                for m in imports(path, name, typing_too=False)
                if m.split(".")[0] in ("lightning", "pytorch_lightning")
            )
            assert not lightning, f"{name} imports {lightning}"
    assert {f"{PACKAGE}.engine.device.streamer", f"{PACKAGE}.engine.host.host_steps"} <= checked  # the subfolders too


def inside(module: str, *folders: str) -> bool:
    """Whether `module` is one of the package's `folders` (subpackages) or a module in one."""
    return any(module == f"{PACKAGE}.{f}" or module.startswith(f"{PACKAGE}.{f}.") for f in folders)


def test_the_folders_are_layers_with_the_command_line_on_top():
    """cli/ (the command) sits on lightning/ (the Lightning glue) and planning/ (sizing a run), which sit on the
    engine: only ``python -m megatrain_lightning`` imports the command line from outside it, and the engine,
    the optimizer, the models, the checkpoint store, the planner and the schedule model import nothing of
    lightning/ or cli/."""
    edges = graph()
    assert f"{PACKAGE}.cli.main" in edges[f"{PACKAGE}.__main__"]  # the walker sees an import of cli/
    outside = {m: sorted(t for t in to if inside(t, "cli")) for m, to in edges.items() if not inside(m, "cli")}
    assert {m: t for m, t in outside.items() if t} == {f"{PACKAGE}.__main__": [f"{PACKAGE}.cli.main"]}
    below = ("engine", "optim", "models", "checkpoint", "planning", "schedule")
    up = {m: sorted(t for t in to if inside(t, "lightning", "cli")) for m, to in edges.items() if inside(m, *below)}
    assert not {m: t for m, t in up.items() if t}


def test_the_engine_parts_reach_neither_its_facade_nor_its_build():
    """engine/device/ and engine/host/ are the engine's parts: build.py wires them, engine.py (the facade) holds
    them, and no part imports either, or the package's public face (engine/__init__.py)."""
    edges = graph()
    wiring = {f"{PACKAGE}.engine", f"{PACKAGE}.engine.engine", f"{PACKAGE}.engine.build"}
    parts = {m: sorted(to & wiring) for m, to in edges.items() if inside(m, "engine.device", "engine.host")}
    assert {f"{PACKAGE}.engine.device.streamer", f"{PACKAGE}.engine.host.host_steps"} <= set(parts)
    assert not {m: t for m, t in parts.items() if t}


def test_the_clients_reach_the_engine_only_through_its_public_face():
    """The Lightning glue, the command line and the Ray jobs import the engine as ``megatrain_lightning.engine``
    (its __init__: the facade, its options and its errors), never one of its modules, nor one of optim/'s (the
    kernels the engine wraps)."""
    clients = {name: path for name, path in modules().items() if inside(name, "lightning", "cli")}
    jobs = ROOT.parent / "ray_jobs"
    clients.update({f"ray_jobs.{p.stem}": p for p in jobs.glob("*.py")})
    assert f"{PACKAGE}.cli.env" in clients and "ray_jobs.sweep" in clients
    private = {
        name: sorted(m for m in imports(path, name) if m.startswith((f"{PACKAGE}.engine.", f"{PACKAGE}.optim.")))
        for name, path in clients.items()
    }
    assert not {name: found for name, found in private.items() if found}


def test_a_long_file_says_why():
    """Files of roughly 100-400 lines; one over 500 states the reason in its docstring ("Why one file")."""
    for path in modules().values():
        text = path.read_text()
        if text.count("\n") > 500:
            doc = ast.get_docstring(ast.parse(text)) or ""
            assert "Why one file" in doc, (
                f"{path.relative_to(ROOT.parent)}: {text.count(chr(10))} lines, no reason given"
            )


def test_the_package_top_holds_the_small_stable_set_and_the_configs_name_it():
    """What users import or name in a config comes from the package top, and that set stays small: the
    strategies, the engine with its options and errors, the module, the data module, the checkpoint
    callback and the loaders. The shipped configs name their callbacks' classes through it where it has them."""
    import megatrain_lightning as top

    assert set(top.__all__) == {
        "CausalLMModule",
        "Engine",
        "EngineConfig",
        "HostAdamW",
        "HostMemoryError",
        "MegatrainFabricStrategy",
        "MegatrainStrategy",
        "ModelCheckpoint",
        "PinnedMemoryError",
        "TextDataModule",
        "empty_init",
        "load_from_checkpoint",
        "load_hf_weights",
    }
    assert all(getattr(top, name) is not None for name in top.__all__)
    named = set()
    for config in (ROOT.parent / "configs").glob("*.yaml"):
        named.update(re.findall(r"class_path: (megatrain_lightning\.\S+)", config.read_text()))
    assert "megatrain_lightning.ModelCheckpoint" in named
    for path in named:
        module, _, name = path.rpartition(".")
        assert module != "megatrain_lightning" or name in top.__all__, path
        assert getattr(importlib.import_module(module), name) is not None, path


# A process that imports the package, and the modules a Ray driver or `megatrain plan` use, imports no Lightning;
# once Lightning is imported, from anywhere (here: the package's own strategy, which imports it), both strategies are
# registered, and the registered names build this package's classes.
LIGHTNING_LAST = """
import sys
import megatrain_lightning as mt
import megatrain_lightning.cli.main, megatrain_lightning.planning.planner, megatrain_lightning.schedule
import ray_jobs.sweep, ray_jobs.train
assert "lightning" not in sys.modules, sorted(m for m in sys.modules if m.startswith("lightning"))[:5]
from megatrain_lightning import MegatrainStrategy
import lightning as L
trainer = L.Trainer(strategy="megatrain", accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
assert type(trainer.strategy) is MegatrainStrategy, trainer.strategy
assert type(L.Fabric(strategy="megatrain", accelerator="cpu", devices=1).strategy) is mt.MegatrainFabricStrategy
print("ok")
"""
LIGHTNING_FIRST = """
import lightning as L
import megatrain_lightning as mt
trainer = L.Trainer(strategy="megatrain", accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
assert type(trainer.strategy) is mt.MegatrainStrategy, trainer.strategy
assert type(L.Fabric(strategy="megatrain", accelerator="cpu", devices=1).strategy) is mt.MegatrainFabricStrategy
print("ok")
"""


@pytest.mark.parametrize("script", [LIGHTNING_LAST, LIGHTNING_FIRST], ids=["lightning-last", "lightning-first"])
def test_the_package_imports_lightning_only_when_used_and_registers_its_strategies_either_way(script):
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT.parent)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
