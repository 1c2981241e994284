"""One rank of a data-parallel launch of tests/test_data_parallel.py: train the same tiny model on the same
global batches with ``strategy="megatrain"`` and with ``strategy="ddp"``, both over every rank of the launch.

Started by ``python -m torch.distributed.run --standalone --nproc-per-node W -m tests.dp_run OUT CASES...``
(TorchElastic starts the ranks), or by ``python -m tests.dp_run OUT CASES... --devices W`` (Lightning's
script launcher, in the first Trainer, starts ranks 1..W-1 by running this module again). The megatrain run
comes first, so that its strategy launches the ranks and sets up the process group; the DDP run finds it.

Per case and strategy, rank 0 writes the final parameters (the module's after fit: the engine gives every
rank the whole model back, as DDP leaves it) to ``OUT/{case}.{strategy}.safetensors``, and every rank its
losses and validation loss to ``OUT/{case}.{strategy}.rank{r}.json``. Stages beside the cases: ``resume``
(RESUMED's second epoch from the checkpoint each strategy saved at the end of its first; megatrain's, which
every rank writes its shards of, is also read back as ``megatrain convert`` reads it, and saved over once more
after fit, which is refused), ``validate`` (validate and predict without fit) and ``refusals``; and, each in
launches of their own (``python -m tests.dp_run OUT killed-step killed-save --devices 2``, which forks the
ranks), a rank killed mid-step or mid-save: what the other says.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, EMAWeightAveraging, ModelCheckpoint
from safetensors.torch import save_file

from megatrain_lightning import MegatrainStrategy
from megatrain_lightning.checkpoint import stream
from megatrain_lightning.lightning.convert import lightning_checkpoint
from tests.helpers import CausalLM, loader, own_llama, own_loss, params_of, quiet, token_batches, trainer
from tests.s3_server import free_port

LAYERS = 2
ROWS = 2  # rows per rank's micro-batch (the global micro-batch has W x ROWS rows)

# name: (module kwargs, trainer kwargs, precision, optimizer steps)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any], str, int]] = {
    # accumulation, clipping by norm (the engine all-reduces partial norms), an LR schedule, two param groups;
    # the schedule runs over two epochs: the second is the resume's (RESUMED)
    "accumulate-clip": (
        dict(split_decay=True, schedule=10),
        dict(accumulate_grad_batches=2, gradient_clip_val=0.5),
        "32-true",
        5,
    ),
    "accumulate-clip-bf16": (
        dict(split_decay=True, schedule=10),
        dict(accumulate_grad_batches=2, gradient_clip_val=0.5),
        "bf16-mixed",
        5,
    ),
    # no clipping and no accumulation: every unit steps on the host as its gradient lands (the overlapped step)
    "overlap": (dict(split_decay=True, schedule=4), dict(), "32-true", 4),
    # manual optimization: manual_backward over 2 micro-batches, clip_gradients by norm, the scheduler by hand
    "manual": (dict(manual=2, manual_clip=0.5, split_decay=True, schedule=4), dict(), "32-true", 4),
}


# megatrain's options per case (default: none): the overlap case also streams through the lean layout's rings
# and keeps Adam's moments in the NVMe tier (each rank its shards), bitwise the default layout's arithmetic
OPTIONS: dict[str, dict[str, Any]] = {"overlap": dict(host_layout="lean", nvme_dir="nvme")}


def micro_batches(case: str, world: int) -> list[torch.Tensor]:
    """The dataset every rank's train loader reads (Lightning's DistributedSampler picks each rank's share)."""
    module_kwargs, trainer_kwargs, _, steps = CASES[case]
    accumulate = trainer_kwargs.get("accumulate_grad_batches", module_kwargs.get("manual") or 1)
    return token_batches(steps * accumulate * world, batch=ROWS)


def global_batches(case: str, world: int, epoch: int = 0) -> list[torch.Tensor]:
    """The same data for one process. Lightning's DistributedSampler for training always shuffles (seed 0, as
    PL_GLOBAL_SEED is unset; ``set_epoch`` each epoch): rank r's k-th micro-batch is ``order[k * world + r]``
    of the epoch's permutation, so global micro-batch k is those `world` micro-batches' rows, concatenated in
    rank order. The loss is a mean over tokens and every rank's rows hold as many, so the mean over the
    concatenation is the mean over ranks that DDP's gradient averaging takes."""
    batches = micro_batches(case, world)
    order = torch.randperm(len(batches), generator=torch.Generator().manual_seed(epoch)).tolist()
    return [torch.cat([batches[i] for i in order[k : k + world]]) for k in range(0, len(order), world)]


def module(case: str) -> CausalLM:
    # lr 1e-3 (helpers' default is 1e-2): a fine-tuning rate, at which Adam's normalization amplifies the
    # ranks' reduction-order ulps less (tests/test_data_parallel.py: bounds)
    return CausalLM(own_llama(LAYERS), loss_fn=own_loss, lr=1e-3, **CASES[case][0])


class SaveAtEnd(Callback):
    """Every rank saves the sharded checkpoint at the end of training, while the engine still holds the state.
    A save that fails (on every rank alike) is recorded, not raised: the run's other results still count."""

    def __init__(self, path: Path) -> None:
        self.path, self.error = path, ""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        try:
            trainer.save_checkpoint(self.path)
        except Exception as e:  # noqa: BLE001
            self.error = f"{type(e).__name__}: {e}"
        ok = torch.tensor([0 if self.error else 1])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # saved on every rank, or it did not save
        if not ok.item() and not self.error:
            self.error = "another rank's save failed"


def val_batches(world: int) -> list[torch.Tensor]:
    return token_batches(2 * world, batch=ROWS, seed=7)


RESUMED = "accumulate-clip"  # the case whose checkpoints (megatrain's, DDP's) the resume stage continues for an epoch


def checkpoint(out: Path, case: str, strategy: str) -> Path:
    """Where `case`'s run with `strategy` saves its checkpoint at the end (sharded; DDP: Lightning's file)."""
    return out / f"{case}.ckpt" if strategy == "megatrain" else out / f"{case}.{strategy}.ckpt"


def checkpoint_params(ckpt: Path, lm: CausalLM) -> dict[str, torch.Tensor]:
    """The module's parameters as the sharded checkpoint at `ckpt` holds them (read as `megatrain convert` does)."""
    state = lightning_checkpoint(str(ckpt), optimizer=False)["state_dict"]
    names = dict(lm.model.named_parameters())
    return {k.removeprefix("model."): state[k].contiguous() for k in state if k.removeprefix("model.") in names}


def run(case: str, strategy: str, out: Path, devices: int, resume: bool = False) -> tuple[L.Trainer, str]:
    """Fit `case` (`resume`: its second epoch, from the first's checkpoint of the same strategy) and write what
    it ends with: the module's parameters after fit (the engine gives every rank the whole model back, as DDP
    leaves it); RESUMED's first epoch also saves a checkpoint at the end (megatrain's read back as
    `megatrain convert` reads it). Returns the Trainer and the save's error ("" when saved or not saved)."""
    _, trainer_kwargs, precision, _ = CASES[case]
    lm = module(case)
    name = f"{case}.resumed" if resume else case
    save = SaveAtEnd(checkpoint(out, case, strategy)) if case == RESUMED and not resume else None
    options = dict(OPTIONS.get(case, {}))
    if "nvme_dir" in options:
        (out / options["nvme_dir"]).mkdir(exist_ok=True)
        options["nvme_dir"] = str(out / options["nvme_dir"])
    t = trainer(
        MegatrainStrategy(**options) if strategy == "megatrain" else strategy,
        devices=devices,
        precision=precision,
        callbacks=[save] if save else [],
        max_epochs=2 if resume else 1,
        **trainer_kwargs,
    )
    with quiet():  # validation once, at the end of the epoch: the final weights, each rank its share
        t.fit(
            lm,
            loader(micro_batches(case, devices)),
            loader(val_batches(devices)),
            ckpt_path=str(checkpoint(out, case, strategy)) if resume else None,
        )
    rank, world = t.global_rank, t.world_size
    assert world == devices == dist.get_world_size(), (world, devices)
    # the ranks' shares: DistributedSampler gave this rank every world-th micro-batch of its permutation
    assert len(lm.losses) == len(micro_batches(case, devices)) // world
    record = {"losses": lm.losses, "val_loss": float(t.callback_metrics["val_loss"])}
    (out / f"{name}.{strategy}.rank{rank}.json").write_text(json.dumps(record))
    if save is not None and save.error:
        (out / f"{name}.save-error.rank{rank}.txt").write_text(save.error)
    if save is not None and not save.error and strategy == "megatrain":
        (out / f"{name}.after-fit.rank{rank}.json").write_text(json.dumps(save_after_fit(t, save.path)))
    if rank == 0:
        save_file(params_of(lm.model), str(out / f"{name}.{strategy}.safetensors"))
        if save is not None and not save.error and strategy == "megatrain":
            save_file(checkpoint_params(save.path, lm), str(out / f"{name}.checkpoint.safetensors"))
    dist.barrier()
    return t, save.error if save is not None else ""


def save_after_fit(t: L.Trainer, path: Path) -> dict[str, Any]:
    """``trainer.save_checkpoint`` after fit over the sharded checkpoint every rank saved at its end (how most
    scripts end): what it raised, and whether the checkpoint's marker is still the bytes it was."""
    marker = path.read_bytes()
    try:
        t.save_checkpoint(path)
        error = None
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    dist.barrier()
    return {"error": error, "unchanged": path.read_bytes() == marker}


def validate(out: Path, devices: int) -> None:
    """``trainer.validate`` and ``trainer.predict`` without fit (the engine built for evaluation only), each
    strategy: every rank's validation loss and predictions on its share, to
    OUT/validate.{strategy}.rank{r}.json; and megatrain's refusal of prediction data the ranks do not share
    evenly (two batches more than a multiple of the ranks), as ``"uneven"``."""
    for strategy in ("megatrain", "ddp"):
        t = trainer(strategy, devices=devices)
        with quiet():
            (record,) = t.validate(module("overlap"), loader(val_batches(devices)), verbose=False)
            predictions = t.predict(module("overlap"), loader(val_batches(devices)))
        record["predictions"] = [float(p) for p in predictions]
        if strategy == "megatrain":
            try:
                with quiet():
                    t.predict(module("overlap"), loader(val_batches(devices) + val_batches(1)))
                record["uneven"] = None
            except ValueError as e:
                record["uneven"] = str(e)
        (out / f"validate.{strategy}.rank{t.global_rank}.json").write_text(json.dumps(record))
    dist.barrier()


class ReadsGradients(CausalLM):
    def on_before_optimizer_step(self, optimizer: Any) -> None:
        pass


# name: what setup must refuse with several ranks (a module, Trainer kwargs)
REFUSED: dict[str, tuple[type[CausalLM], dict[str, Any]]] = {
    "gradient hook": (ReadsGradients, {}),
    "weight averaging": (CausalLM, dict(callbacks=[EMAWeightAveraging()])),
    "sync_batchnorm": (CausalLM, dict(sync_batchnorm=True)),
    "single-file checkpoint": (CausalLM, dict(ckpt_path=True)),
}


def refusals(out: Path, devices: int) -> None:
    """Fit what setup refuses with several ranks: every rank raises the same ValueError before any collective
    of the engine; rank 0 writes the messages to OUT/refusals.json."""
    messages = {}
    single = out / "single-file.ckpt"  # not a sharded checkpoint: refused before it is read
    if dist.get_rank() == 0:
        single.write_bytes(b"")
    dist.barrier()
    for name, (cls, kwargs) in REFUSED.items():
        kwargs = dict(kwargs)
        ckpt_path = str(single) if kwargs.pop("ckpt_path", False) else None
        t = trainer(MegatrainStrategy(), devices=devices, **kwargs)
        try:
            with quiet():
                lm = cls(own_llama(LAYERS), loss_fn=own_loss)
                t.fit(lm, loader(token_batches(devices, batch=ROWS)), ckpt_path=ckpt_path)
        except ValueError as e:
            messages[name] = str(e)
        else:
            messages[name] = None
    if dist.get_rank() == 0:
        (out / "refusals.json").write_text(json.dumps(messages))
    dist.barrier()


# stage: the rank killed, and where
KILLED = {"killed-step": 1, "killed-save": 0}


class Kill(Callback):
    """SIGKILL rank `victim` in the third optimizer step, after its forward ("killed-step"), or in the save
    after that step, once it has written its first unit file ("killed-save")."""

    def __init__(self, stage: str) -> None:
        self.stage, self.victim = stage, KILLED[stage]

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self.stage == "killed-step" and trainer.global_step == 2 and trainer.global_rank == self.victim:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self.stage == "killed-save" and trainer.global_step == 2 and trainer.global_rank == self.victim:
            write, writes = stream.write, []

            def killing(*args: Any, **kwargs: Any) -> dict:
                writes.append(args[1])
                if len(writes) == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
                return write(*args, **kwargs)

            stream.write = killing


def killed(out: Path, devices: int, stage: str) -> None:
    """Train, committing OUT/last.ckpt after every step, while a rank is killed (:class:`Kill`): the other
    writes the error its fit ended with to OUT/killed.rank{r}.txt, and the process ends."""
    t = trainer(
        MegatrainStrategy(),
        devices=devices,
        enable_checkpointing=True,
        callbacks=[Kill(stage), ModelCheckpoint(dirpath=out, every_n_train_steps=1, save_last=True, save_top_k=0)],
    )
    try:
        with quiet():
            t.fit(module("overlap"), loader(token_batches(8, batch=ROWS)))
        said = "fit returned"
    except Exception as e:  # noqa: BLE001  (what the user would see is the result)
        said = f"{type(e).__name__}: {e}"
    (out / f"killed.rank{t.global_rank}.txt").write_text(said)


def kill_launches(out: Path, devices: int, stages: list[str]) -> None:
    """Each stage's `devices` ranks, forked from this process (one import of torch and Lightning for all of
    them), each started as torchrun starts a rank but with no agent: nothing ends the others when one dies,
    so what the survivor does then is its own. Their exit statuses go to OUT/{stage}/codes.json."""
    torch.set_num_threads(1)  # (before the forks: no thread pool is forked)
    ranks = {}
    for stage in stages:
        (out / stage).mkdir()
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(devices)}
        for rank in range(devices):
            pid = os.fork()
            if pid == 0:
                try:
                    os.environ.update(env, LOCAL_RANK=str(rank))
                    killed(out / stage, devices, stage)
                finally:
                    os._exit(0)  # (no teardown of a process group whose peer is gone)
            ranks[pid] = (stage, rank)
    codes = {stage: [0] * devices for stage in stages}
    for pid, (stage, rank) in ranks.items():
        codes[stage][rank] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    for stage in stages:
        (out / stage / "codes.json").write_text(json.dumps(codes[stage]))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("cases", nargs="+", choices=[*CASES, "refusals", "resume", "validate", *KILLED])
    parser.add_argument("--devices", type=int, default=None, help="ranks (default: WORLD_SIZE of torchrun)")
    args = parser.parse_args(argv)
    devices = args.devices or int(os.environ["WORLD_SIZE"])
    if any(stage in KILLED for stage in args.cases):  # (launches of their own: a rank dies)
        kill_launches(args.out, devices, [stage for stage in args.cases if stage in KILLED])
        return
    cases = [case for case in args.cases if case in CASES]
    runs = {
        (case, strategy): run(case, strategy, args.out, devices) for case in cases for strategy in ("megatrain", "ddp")
    }
    for strategy in ("megatrain", "ddp") if "resume" in args.cases else ():
        if not runs[RESUMED, strategy][1]:  # RESUMED's first epoch saved its checkpoint
            run(RESUMED, strategy, args.out, devices, resume=True)
    if "validate" in args.cases:
        validate(args.out, devices)
    if "refusals" in args.cases:
        refusals(args.out, devices)
    # Started by Lightning's launcher (the first trainer's): wait for the ranks it started, failing with them.
    launcher = next(iter(runs.values()))[0].strategy.launcher
    failed = [p.wait() for p in getattr(launcher, "procs", [])]
    if any(failed):
        sys.exit(f"a rank started by Lightning's launcher exited with {failed}")


if __name__ == "__main__":
    main(sys.argv[1:])
    if dist.is_initialized():  # (the kill launches' process only forks the ranks)
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # everything is written: skip the interpreter's teardown of torch (seconds per rank)
