"""``Trainer(strategy="megatrain", devices=W)``: data parallel on the CPU with gloo, against ``strategy="ddp"`` on
the same ranks and global batches, and against ``strategy="megatrain", devices=1`` on the same global batches.

Two launches of tests/dp_run.py (which trains both, megatrain first, in one process group):

- W=2 by ``python -m torch.distributed.run --standalone`` (TorchElastic): accumulation over 2 micro-batches,
  clipping by norm, a warm-up + cosine LR schedule, two param groups, in fp32 and in bf16-mixed; manual
  optimization; and what setup refuses with several ranks.
- W=3 by Lightning's own script launcher (the script started once; the megatrain Trainer starts ranks 1 and 2):
  no clipping and no accumulation (each unit steps on the host as its gradient lands), the same schedule and
  groups, with the lean layout and the NVMe tier; and ``trainer.validate`` without fit.
- Two more launches of 2 ranks, forked by one process, each losing a rank to SIGKILL (mid-step, mid-save):
  what the survivor says.

Every run validates once at the end (each rank its share of the validation batches). The megatrain runs'
weights are the module's after fit (the engine gathers the whole model back into every rank, as DDP leaves
it); RESUMED's first epoch also saves a sharded checkpoint on every rank, read back and resumed on 2 ranks
and on 1.

Bounds, fp32 with the torch-op optimizer (``MEGATRAIN_CPU_ADAM=torch``; lr 1e-3): megatrain over W ranks is
within 1e-6 of DDP over the same W ranks, relative per tensor as ||a - b|| / ||b||, and per loss. Not bitwise:
each rank's gradient is the same bits (one device's megatrain equals ordinary training bitwise,
tests/test_strategy.py), but the mean over ranks is taken in another order. The engine sums, per unit, every
rank's part divided by W in rank order (engine/ranks.py); DDP sums its buckets divided by W in the order
of gloo's ring (for W=3, (a/3 + b/3) + c/3 against a/3 + (b/3 + c/3)); with accumulation DDP sums each
rank's micro-batches first (``no_sync``) and then averages, (a1 + a2)/2 + (b1 + b2)/2, where the engine
averages each micro-batch as it leaves backward and sums the means, (a1/2 + b1/2) + (a2/2 + b2/2); manual
optimization's DDP averages the sum so far again at each backward, (g + a2)/2 + (g + b2)/2 against
g + (a2/2 + b2/2); and the clipping norm is summed from the ranks' pieces in fp64 rather than over each
whole tensor. These differences are ulps of a gradient; Adam divides each element by its own gradient's
scale, so an element whose gradient is a near-cancelling sum turns its ulps into a visible share of its
update: the largest element-wise error of a tensor reaches a few 1e-6 of its largest element in 5 steps
(measured; larger still for DDP against one device), while norm-wise the runs stay 5e-8 to 1e-7 apart
(measured; at lr 1e-2, 3-7e-7).

Against ``devices=1`` on the global batch (the ranks' rows concatenated in one backward, not summed per
rank) more sums are re-ordered: DDP itself ends 1.4-5.8e-7 away from it norm-wise (measured; up to 5e-6 at
lr 1e-2), so megatrain over W ranks must be no further from it than twice DDP's distance (or 1e-6), and each
global micro-batch's loss, the mean of the ranks' losses, within 1e-6 of one device's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatrain_lightning import MegatrainStrategy
from megatrain_lightning.checkpoint import load_trainer_state
from megatrain_lightning.lightning.convert import lightning_checkpoint
from tests.dp_run import CASES, KILLED, LAYERS, RESUMED, checkpoint, global_batches, module
from tests.helpers import fit, own_llama, params_of, trainer, update_error

REPO = Path(__file__).resolve().parents[1]
FP32_BOUND = 1e-6  # relative per tensor, ||a - b|| / ||b||, and per loss (see the module docstring)


class Launch:
    """tests/dp_run.py over `world` ranks on this machine, started now (the launches run side by side, and
    beside the tests' own runs); a fresh port for each (torchrun's --standalone rendezvous takes a free one;
    Lightning's environment finds one when MASTER_PORT is unset)."""

    def __init__(self, out: Path, world: int, cases: list[str], torchrun: bool) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "TORCHELASTIC_"))}
        for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "PL_GLOBAL_SEED"):
            env.pop(k, None)
        env.update(OMP_NUM_THREADS="1", MEGATRAIN_CPU_ADAM="torch", PYTHONPATH=str(REPO))
        module_args = ["-m", "tests.dp_run", str(out), *cases]
        if torchrun:
            launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
            self.cmd = [*launcher, *module_args]
        else:
            self.cmd = [sys.executable, *module_args, f"--devices={world}"]
        self.out, self.log = out, out / "launch.log"
        with open(self.log, "w") as log:
            # its own session: stop() ends the ranks with it, whoever started them
            self.proc = subprocess.Popen(
                self.cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait(self) -> Path:
        try:
            code = self.proc.wait(timeout=300)
        finally:
            self.stop()
        assert code == 0, f"{' '.join(self.cmd)} exited with {code}:\n{self.log.read_text()[-12000:]}"
        return self.out

    def stop(self) -> None:
        """End this launch's processes (its session), if any are left."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[int | str, Launch]:
    w2 = ["accumulate-clip", "accumulate-clip-bf16", "manual", "resume", "refusals"]
    started = {
        2: Launch(tmp_path_factory.mktemp("w2"), 2, w2, torchrun=True),
        3: Launch(tmp_path_factory.mktemp("w3"), 3, ["overlap", "validate"], torchrun=False),
        # two launches of 2 ranks, each losing one; one process forks their ranks (tests/dp_run.py)
        "killed": Launch(tmp_path_factory.mktemp("killed"), 2, list(KILLED), torchrun=False),
    }
    yield started
    for launch in started.values():
        launch.stop()


def params(out: Path, case: str, strategy: str) -> dict[str, torch.Tensor]:
    return load_file(str(out / f"{case}.{strategy}.safetensors"))


def records(out: Path, case: str, strategy: str, world: int) -> list[dict]:
    return [json.loads((out / f"{case}.{strategy}.rank{r}.json").read_text()) for r in range(world)]


def one_device(case: str, world: int, monkeypatch) -> tuple[dict[str, torch.Tensor], list[float]]:
    """strategy='megatrain', devices=1, here, on the launch's global batches: final parameters and losses."""
    monkeypatch.setenv("MEGATRAIN_CPU_ADAM", "torch")
    _, trainer_kwargs, precision, _ = CASES[case]
    lm = module(case)
    fit(lm, global_batches(case, world), strategy="megatrain", precision=precision, **trainer_kwargs)
    return params_of(lm.model), lm.losses


def worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest ||a - b|| / ||b|| over tensors, and the tensor's name."""
    assert a.keys() == b.keys() and len(a) > 0
    return max((((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)).item(), k) for k in a)


def rel(xs: list[float], ys: list[float]) -> float:
    assert len(xs) == len(ys) > 0
    return max(abs(x - y) / abs(y) for x, y in zip(xs, ys))


def assert_fp32_equal(launch: Launch, case: str, world: int, monkeypatch) -> None:
    single, losses = one_device(case, world, monkeypatch)  # while the launch runs
    out = launch.wait()
    mt, ddp = params(out, case, "megatrain"), params(out, case, "ddp")
    assert worst(mt, ddp)[0] <= FP32_BOUND, worst(mt, ddp)
    mt_runs, ddp_runs = records(out, case, "megatrain", world), records(out, case, "ddp", world)
    for m, d in zip(mt_runs, ddp_runs):  # rank by rank: the same share of every global batch
        assert rel(m["losses"], d["losses"]) <= FP32_BOUND
        assert rel([m["val_loss"]], [d["val_loss"]]) <= FP32_BOUND
    ddp_gap = worst(ddp, single)[0]  # DDP's own distance from one device (which is ordinary training, bitwise)
    assert worst(mt, single)[0] <= max(2 * ddp_gap, FP32_BOUND), (worst(mt, single), ddp_gap)
    # devices=1's loss of a global micro-batch is the mean of the ranks' losses on their rows of it
    means = [sum(r["losses"][j] for r in mt_runs) / world for j in range(len(losses))]
    assert rel(means, losses) <= FP32_BOUND


def test_two_ranks_equal_ddp_and_one_device(launches, monkeypatch):
    """W=2, torchrun: accumulation 2, clipping 0.5, LR schedule, two param groups, fp32, validation."""
    assert_fp32_equal(launches[2], "accumulate-clip", 2, monkeypatch)


def test_two_ranks_manual_optimization_equals_ddp_and_one_device(launches, monkeypatch):
    """W=2, torchrun: manual_backward over 2 micro-batches, clip_gradients by norm, the scheduler stepped by
    hand: gradients wait for the step (the mean over ranks of the sum over micro-batches), as DDP's do."""
    assert_fp32_equal(launches[2], "manual", 2, monkeypatch)


def test_three_ranks_equal_ddp_and_one_device(launches, monkeypatch):
    """W=3, Lightning's script launcher: no clipping or accumulation (the overlapped host step), validation."""
    assert_fp32_equal(launches[3], "overlap", 3, monkeypatch)


def test_two_ranks_bf16_mixed(launches, monkeypatch):
    """bf16-mixed over 2 ranks tracks fp32 DDP about as well as Lightning's bf16-mixed DDP does, and is closer
    to bf16-mixed megatrain on one device than bf16 training is to fp32 training.

    bf16 keeps 8 significant bits, and Adam normalizes each element's update, so elements with tiny gradients
    follow the rounding noise: on these tiny models Lightning's own bf16-mixed DDP ends 1.5% (lr 1e-3) of the
    update away from fp32 DDP (``update_error``), and that distance is the scale of the bounds. megatrain's
    bf16-mixed rounds every weight copy to bf16 (norm weights and the embedding too, where autocast rounds
    only the matmuls' inputs) and its gradients come back in bf16, so on one device it is already somewhat
    further from fp32 than AMP is (tests/test_strategy.py allows 1.25x); over 2 ranks each rank's half of
    the batch is also rounded apart. Bound: 1.5x AMP's distance (measured 1.15x), and losses within 2% of
    fp32's rank by rank. Against one device's bf16-mixed megatrain, which differs only in where gradients
    are rounded and summed (a part of what separates bf16 from fp32 training): within AMP's distance itself
    (measured 0.58x). A real bug (a stale shard, an unaveraged gradient) moves the update by far more.
    """
    single, _ = one_device("accumulate-clip-bf16", 2, monkeypatch)
    w2 = launches[2].wait()
    start = params_of(own_llama(LAYERS))
    fp32 = params(w2, "accumulate-clip", "ddp")
    amp = params(w2, "accumulate-clip-bf16", "ddp")
    mt = params(w2, "accumulate-clip-bf16", "megatrain")
    bf16_noise = update_error(amp, fp32, start)
    assert update_error(mt, fp32, start) <= 1.5 * bf16_noise, (update_error(mt, fp32, start), bf16_noise)
    for m, f in zip(records(w2, "accumulate-clip-bf16", "megatrain", 2), records(w2, "accumulate-clip", "ddp", 2)):
        assert rel(m["losses"], f["losses"]) < 2e-2
    assert update_error(mt, single, start) <= bf16_noise, (update_error(mt, single, start), bf16_noise)


def saved(out: Path, name: str, world: int) -> None:
    """Fail with the store's error when the launch's checkpoint `name` was not saved."""
    errors = [out / f"{name}.save-error.rank{r}.txt" for r in range(world)]
    found = {e.name: e.read_text() for e in errors if e.exists()}
    assert not found, f"the checkpoint {name} was not saved: {found}"


def test_checkpoint_of_every_rank_reads_back_as_the_trained_weights(launches):
    """Each of 2 ranks writes its shards at the end of training; read as `megatrain convert` reads, the
    checkpoint is the weights fit handed back, bit for bit."""
    w2 = launches[2].wait()
    saved(w2, RESUMED, 2)
    trained, read = params(w2, RESUMED, "megatrain"), load_file(str(w2 / f"{RESUMED}.checkpoint.safetensors"))
    assert trained.keys() == read.keys()
    assert all(torch.equal(read[k], trained[k]) for k in trained)


def test_save_after_fit_is_refused_in_one_line_on_every_rank(launches):
    """trainer.save_checkpoint after a 2-rank fit, over the checkpoint saved at its end: each rank holds only its
    shard of the Adam state then, so every rank refuses in one line before writing anything (the resumes below
    read that checkpoint)."""
    w2 = launches[2].wait()
    saved(w2, RESUMED, 2)
    for r in range(2):
        record = json.loads((w2 / f"{RESUMED}.after-fit.rank{r}.json").read_text())
        assert record["error"].startswith("RuntimeError: trainer.save_checkpoint after fit over 2 ranks"), record
        assert "\n" not in record["error"] and "on_train_end" in record["error"] and record["unchanged"]


def test_resume_on_two_ranks_equals_ddp_resumed(launches):
    """The first epoch's checkpoint (2 ranks, each writing its shards) resumed on 2 ranks for a second epoch
    trains as DDP resumed from its own checkpoint: weights, Adam moments, step counts and the schedule come
    back. (Lightning's data order on resume is whatever it is for both: DDP takes the same path.)"""
    w2 = launches[2].wait()
    saved(w2, RESUMED, 2)
    name = f"{RESUMED}.resumed"
    mt, ddp = params(w2, name, "megatrain"), params(w2, name, "ddp")
    assert worst(mt, ddp)[0] <= FP32_BOUND, worst(mt, ddp)
    for m, d in zip(records(w2, name, "megatrain", 2), records(w2, name, "ddp", 2)):
        assert rel(m["losses"], d["losses"]) <= FP32_BOUND


def test_two_ranks_checkpoint_resumes_on_one_device(launches, monkeypatch):
    """The same checkpoint resumed on one device (its shards do not depend on the world size) trains as one
    device resumed from DDP's checkpoint of the same first epoch, on the second epoch's global batches."""
    monkeypatch.setenv("MEGATRAIN_CPU_ADAM", "torch")
    _, trainer_kwargs, precision, _ = CASES[RESUMED]
    second = global_batches(RESUMED, 2, epoch=1)
    w2 = launches[2].wait()
    saved(w2, RESUMED, 2)
    resumed = {}
    for strategy in ("megatrain", "ddp"):
        lm = module(RESUMED)
        ckpt = str(checkpoint(w2, RESUMED, strategy))
        fit(lm, second, max_epochs=2, precision=precision, ckpt_path=ckpt, **trainer_kwargs)
        resumed[strategy] = params_of(lm.model)
    assert worst(resumed["megatrain"], resumed["ddp"])[0] <= FP32_BOUND, worst(resumed["megatrain"], resumed["ddp"])


def test_validate_and_predict_without_fit_equal_ddp(launches):
    """trainer.validate and trainer.predict over 3 ranks (an engine for evaluation only): each rank's loss on
    its share and its predictions as DDP's. Prediction data the ranks would not share evenly (Lightning does
    not pad it) is refused on every rank, instead of leaving one rank waiting in a collective."""
    w3 = launches[3].wait()
    for r in range(3):
        mt, ddp = (json.loads((w3 / f"validate.{s}.rank{r}.json").read_text()) for s in ("megatrain", "ddp"))
        assert rel([mt["val_loss"]], [ddp["val_loss"]]) <= FP32_BOUND
        assert len(mt["predictions"]) == len(ddp["predictions"]) == 2
        assert rel(mt["predictions"], ddp["predictions"]) <= FP32_BOUND
        assert mt["uneven"] is not None and mt["uneven"].startswith(
            "trainer.predict over 3 ranks: the ranks get [3, 3, 2]"
        )


def test_setup_refuses_what_needs_whole_weights_or_gradients(launches):
    """Hooks reading gradients, weight averaging, sync_batchnorm: refused on every rank at setup; resuming
    from a single-file checkpoint: refused before it is read. One line naming the value and the fix."""
    messages = json.loads((launches[2].wait() / "refusals.json").read_text())
    expected = {
        "gradient hook": "ReadsGradients.on_before_optimizer_step read or edit gradients",
        "weight averaging": "EMAWeightAveraging averages the whole model's weights",
        "sync_batchnorm": "sync_batchnorm=True is not supported",
        "single-file checkpoint": "ckpt_path=",
    }
    for name, start in expected.items():
        message = messages[name]
        assert message is not None and message.startswith(start) and "\n" not in message, (name, message)
    assert "devices=1" in messages["gradient hook"] and "devices=1" in messages["weight averaging"]
    assert "is a single-file checkpoint" in messages["single-file checkpoint"]


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(checkpoint_format="torch"), r"checkpoint_format='torch' builds the whole model in one process"),
        (dict(device="cpu"), r"MegatrainStrategy\(device='cpu'\) names one device"),
    ],
)
def test_options_refused_before_any_rank_starts(options, match):
    """Options the partitioned engine cannot honour: refused by Trainer(...), before a process is launched."""
    with pytest.raises(ValueError, match=match):
        trainer(MegatrainStrategy(**options), devices=2)


def test_one_device_has_no_process_group_or_launcher(monkeypatch):
    """devices=1 is a single-device strategy, even where a launcher's environment says otherwise (here
    torchrun's variables of rank 1 of 2): no launcher, rank 0 of 1, no DistributedSampler, no process group."""
    for k, v in dict(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", GROUP_RANK="0", LOCAL_WORLD_SIZE="2").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    lm = module("overlap")
    t = fit(lm, global_batches("overlap", 1)[:2], strategy="megatrain")
    s = t.strategy
    assert s.launcher is None and not s.is_distributed
    assert (s.global_rank, s.local_rank, s.world_size, s.is_global_zero) == (0, 0, 1, True)
    assert not torch.distributed.is_initialized()
    assert os.environ["WORLD_SIZE"] == "2"  # the environment is not this strategy's to tear down
    assert len(lm.losses) == 2  # every batch: no sampler split them


def test_a_rank_killed_mid_step_or_mid_save_ends_the_other_in_one_line(launches):
    """2 ranks, last.ckpt committed after every step; rank 1 killed (SIGKILL) in the third step, between its
    forward and its backward, and in another launch rank 0 killed in the save after it, having written a unit
    file of it. The survivor's fit ends at its next collective, at once (no hang), with one line naming the
    rank that exited and the checkpoint to resume from, read from storage: the one committed at step 2, which
    is intact (the killed save committed nothing)."""
    launch = launches["killed"]
    root = launch.wait()
    for stage, victim in KILLED.items():
        out, survivor = root / stage, 1 - victim
        codes = json.loads((out / "codes.json").read_text())
        assert codes[victim] == -signal.SIGKILL and codes[survivor] == 0, (stage, codes, launch.log.read_text())
        said = (out / f"killed.rank{survivor}.txt").read_text()
        assert said == (
            f"RankExitedError: rank {victim} exited (rank {survivor}'s collective lost its connection to it); the "
            f"last committed checkpoint is step 2, {out / 'last.ckpt'} (pass it as ckpt_path to resume)"
        ), stage
        assert load_trainer_state(str(out / "last.ckpt"))["global_step"] == 2
        assert lightning_checkpoint(str(out / "last.ckpt"))["state_dict"]  # every unit file checked and read
