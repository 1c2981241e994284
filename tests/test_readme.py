"""The README runs as written: every python block on the CPU, every shell command known and parseable, every
link into the user guide landing on a heading, and its test command the one CI runs."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
import torch

from megatrain_lightning.cli.main import USAGE

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
GUIDE = REPO / "docs" / "user-guide.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), re.S | re.M)


PYTHON = blocks("python")


def test_the_readme_has_the_three_examples():
    assert len(PYTHON) == 3, "one each for the Trainer, Fabric and a plain loop"
    assert "L.Trainer(" in PYTHON[0] and "Fabric(" in PYTHON[1] and "Engine(" in PYTHON[2]


@pytest.mark.parametrize("index", range(len(PYTHON)), ids=["trainer", "fabric", "plain-loop"][: len(PYTHON)])
def test_python_blocks_run_as_written_on_the_cpu(index, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # whatever a block writes lands here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU, as on a machine without a GPU
    scope: dict = {"__name__": "__main__"}
    exec(compile(PYTHON[index], f"{README}:block{index}", "exec"), scope)
    if index == 0:
        assert scope["trainer"].global_step == 4
    else:
        steps = re.findall(r"^step (\d): loss ([\d.]+)$", capsys.readouterr().out, re.M)
        assert [s for s, _ in steps] == ["0", "1", "2", "3"] and all(0 < float(x) < 10 for _, x in steps), steps
    assert not any(tmp_path.iterdir()), "a quick try writes nothing"


def commands() -> list[list[str]]:
    """Each command of the shell blocks, split at `&&`."""
    found = []
    for block in blocks("bash"):
        subprocess.run(["bash", "-n"], input=block, text=True, check=True)  # it parses
        for line in block.splitlines():
            found += [shlex.split(part, comments=True) for part in line.split("&&") if part.strip()]
    return found


def test_shell_commands_are_known_and_name_files_that_exist():
    subcommands = set(re.findall(r"^  (\w+) ", USAGE, re.M))
    seen = set()
    for words in commands():
        program = words[0]
        seen.add(program)
        assert program in {"pip", "megatrain", "ruff", "python"}, words
        if program == "megatrain":
            assert words[1] in subcommands, words
        if program == "python":
            assert words[1:3] == ["-m", "pytest"], words
        for word in words:
            if word.startswith("configs/"):
                assert (REPO / word).is_file(), word
    assert seen == {"pip", "megatrain", "ruff", "python"}


def test_the_test_command_is_what_ci_runs():
    """The quick start's second command and .ci/run: the same install, linters and tests."""
    ci = (REPO / ".ci" / "run").read_text()
    test_line = next(b for b in blocks("bash") if "pytest" in b)
    for step in ("torch==2.13.0", '-e ".[test]"', "ruff check .", "ruff format --check .", "pytest -q"):
        assert step in test_line and step in ci, step


def test_links_into_the_guide_land_on_headings():
    def anchor(heading: str) -> str:
        return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", heading.strip().lower()))

    headings = {anchor(h) for h in re.findall(r"^#+ (.*)$", GUIDE.read_text(), re.M)}
    links = re.findall(r"\(docs/user-guide\.md#([^)]+)\)", README.read_text())
    assert len(links) >= 10
    assert not [link for link in links if link not in headings], headings
