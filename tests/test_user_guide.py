"""The user guide's plain PyTorch loop runs as written and trains exactly as ordinary PyTorch training."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch

from megatrain_lightning import Engine, EngineConfig
from megatrain_lightning.models import LlamaConfig, LlamaForCausalLM

GUIDE = Path(__file__).parent.parent / "docs" / "user-guide.md"


def plain_loop_example() -> str:
    text = GUIDE.read_text()
    found = re.search(r"<!-- plain-loop-example[^>]*-->\n```python\n(.*?)```", text, re.S)
    assert found, f"{GUIDE}: the plain-loop example block is missing"
    return found.group(1)


def ordinary_training() -> tuple[list[float], torch.nn.Module]:
    """The example's loop with ordinary PyTorch: .grad, clip_grad_norm_, torch.optim.AdamW."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.from_preset("tiny"))
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(adamw, lambda step: min(1.0, (step + 1) / 3))
    data = torch.Generator().manual_seed(1)
    accumulate, losses = 2, []
    for _ in range(4):
        for _ in range(accumulate):
            tokens = torch.randint(0, model.config.vocab_size, (2, 32), generator=data)
            loss = model(tokens, targets=tokens) / accumulate
            loss.backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        adamw.step()
        adamw.zero_grad()
        scheduler.step()
    return losses, model


def test_the_plain_loop_example_equals_ordinary_training(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_CPU_ADAM", "torch")  # the torch backend: bit for bit torch.optim.AdamW
    monkeypatch.chdir(tmp_path)  # the example saves under ./checkpoints
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU, as ordinary training here
    scope: dict = {}
    exec(compile(plain_loop_example(), str(GUIDE), "exec"), scope)
    ref_losses, ref = ordinary_training()
    assert scope["losses"] == ref_losses and len(ref_losses) == 8
    trained = dict(scope["model"].named_parameters())
    for name, p in ref.named_parameters():
        assert torch.equal(trained[name], p), name
    # The checkpoint it wrote holds those weights: a fresh engine over another model loads them.
    other = copy.deepcopy(ref)
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    with Engine(other, EngineConfig(device="cpu", precision="32-true")) as engine:
        engine.load(str(tmp_path / "checkpoints" / "step-4"), optimizer=False)
        state = engine.master_state_dict()
        assert all(torch.equal(state[name], p) for name, p in ref.named_parameters())


def test_the_generate_example_runs_on_an_exported_folder(tmp_path, monkeypatch, capsys):
    """The guide's transformers block, on a folder exported as the demo exports: this project's Llama with
    byte tokens, saved with its tokenizer. The text it prints is what the model generated, decoded."""
    pytest.importorskip("transformers")
    from megatrain_lightning.lightning.data import ByteTokenizer
    from megatrain_lightning.models import save_pretrained

    torch.manual_seed(0)
    save_pretrained(
        LlamaForCausalLM(LlamaConfig.from_preset("tiny")), tmp_path / "demo_out" / "hf", tokenizer=ByteTokenizer()
    )
    monkeypatch.chdir(tmp_path)
    text = GUIDE.read_text()
    found = re.search(r"<!-- generate-example[^>]*-->\n```python\n(.*?)```", text, re.S)
    assert found, f"{GUIDE}: the generate example block is missing"
    scope: dict = {}
    exec(compile(found.group(1), str(GUIDE), "exec"), scope)
    ids = scope["out"][0].tolist()
    assert ids[:4] == list(b"The ") and 4 < len(ids) <= 64
    new = ids[4 : ids.index(0) if 0 in ids else None]  # up to the end-of-text byte, which is left out
    assert capsys.readouterr().out == "The " + ByteTokenizer().decode(new) + "\n"


def test_what_models_work_lists_the_zoo():
    """The table of "What models work" names exactly the families the zoo trains (tests/test_zoo.py), each
    with the block list the engine finds in it."""
    from megatrain_lightning.engine.discover import find_blocks
    from tests.helpers import ZOO
    from tests.zoo_families import FAMILIES

    text = GUIDE.read_text()
    section = text[text.index("## What models work") :]
    section = section[: section.index("\n## ")]
    listed = re.findall(r"^\| [^|]* \(`([\w-]+)`\) \| `([\w.]+(?:` and `[\w.]+)*)` \|", section, re.M)
    listed = [(name, stacks.replace("` and `", " and ")) for name, stacks in listed]  # (several stacks: T5)
    assert sorted(name for name, _ in listed) == sorted([*ZOO, *FAMILIES])
    zoo = {**ZOO, **FAMILIES}
    found = [(name, " and ".join(c.name for c in find_blocks(zoo[name].make()).stacks)) for name, _ in listed]
    assert found == listed
