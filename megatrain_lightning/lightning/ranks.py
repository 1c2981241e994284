"""The Trainer strategy's rank code: every answer of ``strategy="megatrain"`` that depends on how many ranks run.

Two policies, one per kind of run, each holding the strategy it answers for:

- :class:`OneProcess` (``devices=1``, one node): a single-device strategy's answers. Rank 0 of 1, collectives
  the identity (no ``torch.distributed`` call), no launcher, no process group, the cluster environment left
  alone at teardown (it is not this process's to touch); whole weights live here, so Lightning's state dict
  holds the masters, a single-file checkpoint loads and a callback's averaged weights go into the shards.
- :class:`SeveralRanks` (N x M > 1, or several Ray Train workers): DDP's answers, through Lightning's
  launcher, process group and collectives; and the refusals of what needs whole weights or gradients in one
  process, which no rank holds.

:func:`policy` is the one place the count is tested. The strategy asks it on every use rather than once at
construction: Lightning sets what the count is made of (``devices``, ``num_nodes``, the cluster environment)
after it builds the strategy, and a policy chosen before then would answer for the wrong run. Asking costs one
small object; the policies keep no state of their own.

The strategy's hooks delegate here (``self._ranks.barrier(name)``, ...) and keep Lightning's names and
docstrings; the policies read the strategy's attributes (:class:`RankedStrategy`) and never the reverse.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
import torch.distributed
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _all_gather_ddp_if_available,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.imports import _TORCH_GREATER_EQUAL_2_3
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.strategies import ParallelStrategy, Strategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from typing_extensions import override

from megatrain_lightning.checkpoint.replaced import replaced_weights
from megatrain_lightning.lightning import peers


class RankedStrategy(Protocol):
    """What the policies read of the strategy (lightning/strategy.py's ``MegatrainStrategy``)."""

    ranks: int
    num_processes: int
    num_nodes: int
    cluster_environment: Any
    root_device: torch.device
    lightning_module: Any
    checkpoint_format: str
    grad_hooks: list[str]
    _device_arg: Any
    _layer_sync: Any
    _released: Any
    _launcher: Any

    def set_world_ranks(self) -> None: ...

    def peer_lost(self) -> peers.RankExitedError: ...


def policy(strategy: RankedStrategy) -> OneProcess | SeveralRanks:
    """The policy for `strategy`'s rank count as it is now (the one test of the count)."""
    return SeveralRanks(strategy) if strategy.ranks > 1 else OneProcess(strategy)


class OneProcess:
    """Rank 0 of 1: no process group, every collective the identity."""

    distributed = False
    """Whether Lightning gives each rank a share of the data (``DistributedSampler``) and syncs logs."""

    def __init__(self, strategy: RankedStrategy) -> None:
        self.strategy = strategy

    # -- who this process is ---------------------------------------------------------------------
    def global_rank(self) -> int:
        return 0

    def local_rank(self) -> int:
        return 0

    def node_rank(self) -> int:
        return 0

    def world_size(self) -> int:
        return 1

    # -- launch and process group ----------------------------------------------------------------
    def set_world_ranks(self) -> None:
        """Nothing to tell the cluster environment."""

    def configure_launcher(self) -> None:
        """No launcher: this process is the run."""

    def setup_environment(self) -> None:
        """No process group."""

    def refuse(self, trainer: Any) -> None:
        """Nothing to refuse: this process holds whole weights and gradients."""

    def process_group(self) -> Any:
        """The engine's ``group``: none, so its host state is not partitioned."""
        return None

    def teardown(self) -> None:
        """As a single-device strategy: the cluster environment is not this process's to touch."""
        Strategy.teardown(self.strategy)  # type: ignore[arg-type]

    # -- collectives ------------------------------------------------------------------------------
    def barrier(self, name: str | None = None) -> None:
        """No one to wait for."""

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return tensor

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return tensor

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision

    def process_dataloader(self, dataloader: object) -> object:
        """Every dataloader as it is: no other rank to run the same forwards."""
        return dataloader

    # -- checkpoints ------------------------------------------------------------------------------
    def module_state_dict(self, engine: Any) -> dict[str, Any]:
        """The fp32 masters (whole: this process holds them all)."""
        return engine.master_state_dict()

    def saved_weights(self, engine: Any, checkpoint: Mapping[str, Any]) -> Any:
        """A weight average a callback put in the state dict, to go to the shards as the weights (as it goes to
        Lightning's file); the masters it replaced are in the state too, as the callback left them."""
        return replaced_weights(engine, checkpoint.get("state_dict", {}))

    def refuse_save_after_fit(self) -> None:
        """Nothing to refuse: after fit this process still holds the whole Adam state."""

    def refuse_single_file(self, path: str) -> None:
        """Nothing to refuse: a single file's whole weights load here."""


class SeveralRanks:
    """One of N x M ranks: Lightning's launcher, process group and collectives, as for ``strategy="ddp"``; what
    needs whole weights or gradients in one process is refused, naming the rank count."""

    distributed = True
    """Whether Lightning gives each rank a share of the data (``DistributedSampler``) and syncs logs."""

    def __init__(self, strategy: RankedStrategy) -> None:
        self.strategy = strategy

    # -- who this process is: the cluster environment's answers, as ParallelStrategy gives them --------
    def global_rank(self) -> int:
        return ParallelStrategy.global_rank.fget(self.strategy)  # type: ignore[attr-defined]

    def local_rank(self) -> int:
        return ParallelStrategy.local_rank.fget(self.strategy)  # type: ignore[attr-defined]

    def node_rank(self) -> int:
        return ParallelStrategy.node_rank.fget(self.strategy)  # type: ignore[attr-defined]

    def world_size(self) -> int:
        return ParallelStrategy.world_size.fget(self.strategy)  # type: ignore[attr-defined]

    # -- launch and process group ----------------------------------------------------------------
    def set_world_ranks(self) -> None:
        """Tell the cluster environment this process's rank (as DDP does)."""
        s = self.strategy
        if s.cluster_environment is not None:
            s.cluster_environment.set_global_rank(s.node_rank * s.num_processes + s.local_rank)
            s.cluster_environment.set_world_size(s.ranks)
        rank_zero_only.rank = utils_rank_zero_only.rank = s.global_rank

    def configure_launcher(self) -> None:
        """Lightning's script launcher (it starts this node's other ranks, unless torchrun or SLURM started
        them), once the options no rank can honour are refused: before any process starts."""
        s = self.strategy
        self.refuse_options()
        assert s.cluster_environment is not None
        s._launcher = ScriptLauncher(s, s.cluster_environment, s.num_processes, s.num_nodes)

    def setup_environment(self) -> None:
        """The process group over the ranks (nothing if it exists already), NCCL on GPUs, gloo on the CPU."""
        s = self.strategy
        reset_seed()  # the seed of seed_everything, in the ranks Lightning started (as DDP)
        s.set_world_ranks()
        backend = _get_default_process_group_backend_for_device(s.root_device)  # nccl, or gloo on the CPU
        kwargs: dict[str, Any] = {"timeout": default_pg_timeout}
        if _TORCH_GREATER_EQUAL_2_3:
            kwargs["device_id"] = s.root_device if s.root_device.type != "cpu" else None
        _init_dist_connection(s.cluster_environment, backend, **kwargs)  # (nothing if it exists already)

    def refuse(self, trainer: Any) -> None:
        """The strategy's options and what the Trainer brings that need whole weights or gradients."""
        self.refuse_options()
        self.refuse_under_ranks(trainer)

    def refuse_options(self) -> None:
        """The strategy's options that the partitioned engine cannot honour."""
        s = self.strategy
        where = f"data parallel over {s.ranks} ranks (devices={s.num_processes}, num_nodes={s.num_nodes})"
        if s._device_arg is not None:
            raise ValueError(
                f"MegatrainStrategy(device={str(s._device_arg)!r}) names one device, but {where} gives each rank "
                "its own: leave device unset (choose the GPUs with Trainer(devices=[...]))"
            )
        if s.checkpoint_format == "torch":
            raise ValueError(
                f"checkpoint_format='torch' builds the whole model in one process, which no rank holds with {where}: "
                "use checkpoint_format='sharded' (every rank writes its shards; `megatrain convert` makes a "
                "single file of it)"
            )

    def refuse_under_ranks(self, trainer: Any) -> None:
        """What the Trainer brings that needs whole weights or gradients in one process."""
        s = self.strategy
        where = f"data parallel over {s.ranks} ranks"
        if s.grad_hooks:
            raise ValueError(
                f"{', '.join(s.grad_hooks)} read or edit gradients, which no rank holds whole with {where} "
                "(each holds its shard): remove the hook (clipping needs none: gradient_clip_val), or train "
                "with devices=1 and num_nodes=1"
            )
        averaging = [
            type(cb).__name__
            for cb in trainer.callbacks
            if isinstance(cb, (WeightAveraging, StochasticWeightAveraging))
        ]
        if averaging:
            raise ValueError(
                f"{', '.join(averaging)} averages the whole model's weights, which no rank holds with {where}: "
                "remove the callback, or train with devices=1 and num_nodes=1"
            )
        if s._layer_sync is not None:
            raise ValueError(f"sync_batchnorm=True is not supported by strategy='megatrain' ({where}): remove it")

    def process_group(self) -> Any:
        """The engine's ``group``: the world, whose ranks its host state is partitioned over."""
        return torch.distributed.group.WORLD

    def teardown(self) -> None:
        """As a parallel strategy: the cluster environment's teardown too."""
        ParallelStrategy.teardown(self.strategy)  # type: ignore[arg-type]

    # -- collectives ------------------------------------------------------------------------------
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.strategy.root_device.index])
        else:
            torch.distributed.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src, group=torch.distributed.group.WORLD)
        return box[0]

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if not isinstance(tensor, torch.Tensor):
            return tensor
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return _all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return ParallelStrategy.reduce_boolean_decision(self.strategy, decision, all=all)  # type: ignore[arg-type]

    def process_dataloader(self, dataloader: object) -> object:
        """Prediction data the ranks would not share evenly, refused: Lightning does not pad it (as it pads
        validation's), but every rank must run the same forwards, since the engine all-gathers each block.
        Collective: every rank processes its dataloaders (before any may skip)."""
        s = self.strategy
        trainer = s.lightning_module.trainer if s.lightning_module is not None else None
        if trainer is None or trainer.state.fn != TrainerFn.PREDICTING:
            return dataloader
        try:
            length: float = len(dataloader)  # type: ignore[arg-type]
        except TypeError:
            length = float("inf")  # an iterable dataset: the ranks' counts cannot be known in advance
        counts: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(
            counts, _parse_num_batches(RunningStage.PREDICTING, length, trainer.limit_predict_batches)
        )
        if len(set(counts)) > 1:
            raise ValueError(
                f"trainer.predict over {s.ranks} ranks: the ranks get {counts} batches (Lightning does not pad "
                "prediction data), but every rank must run the same forwards with strategy='megatrain': give the "
                f"ranks as many samples each (a number divisible by {s.ranks}), set limit_predict_batches, or "
                "predict with devices=1"
            )
        return dataloader

    # -- checkpoints ------------------------------------------------------------------------------
    def module_state_dict(self, engine: Any) -> dict[str, Any]:
        """Nothing: no rank holds whole weights; each rank's shards stream to the (sharded) checkpoint from
        the engine."""
        return {}

    def saved_weights(self, engine: Any, checkpoint: Mapping[str, Any]) -> Any:
        """None: the shards' weights are the engine's (no averaging callback runs with several ranks)."""
        return None

    def refuse_save_after_fit(self) -> None:
        """A save after a data-parallel fit, refused before anything is built or written: the engine is
        released, each rank's Adam moments are its shard of them and no longer match the whole units."""
        s = self.strategy
        if s._released is not None:
            raise RuntimeError(
                f"trainer.save_checkpoint after fit over {s.ranks} ranks: each rank holds only its shard of the "
                "Adam state once fit returns, so nothing was written; save before fit returns, with "
                "ModelCheckpoint(save_last=True) or trainer.save_checkpoint in a callback's on_train_end"
            )

    def refuse_single_file(self, path: str) -> None:
        """A single-file checkpoint holds whole weights, which no rank takes."""
        raise ValueError(
            f"ckpt_path={path!r} is a single-file checkpoint, which data parallel over {self.strategy.ranks} ranks "
            "cannot load (no rank holds whole weights): resume from a sharded checkpoint, or load this one "
            "with devices=1 and num_nodes=1 and save a sharded one"
        )


class ScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's script launcher (several ranks), whose run ends in one line when a collective loses its peer:
    which rank exited and the last committed checkpoint (:mod:`megatrain_lightning.lightning.peers`), in place of the
    collective library's message. Every collective of the run (the engine's, a checkpoint's, Lightning's
    own) is issued inside `launch`; Lightning's teardown of a failed run comes after it."""

    def __init__(self, strategy: RankedStrategy, *args: Any) -> None:
        super().__init__(*args)
        self.strategy = strategy

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        except RuntimeError as err:
            if not peers.lost_peer(err):
                raise
            raise self.strategy.peer_lost() from None


def is_ray_environment(environment: Any) -> bool:
    """Whether `environment` is Ray Train's (``RayLightningEnvironment``; told by its module, to import no Ray)."""
    return environment is not None and type(environment).__module__.startswith("ray.")


def check_ray_environment(environment: Any) -> None:
    """Refuse to run as one of several Ray Train workers without Ray's cluster environment: Lightning would find
    none (Ray sets LOCAL_RANK but not what torchrun sets), take this process for a run of one, and every worker
    would train alone, each on all the data."""
    train = sys.modules.get("ray.train")  # (a Ray Train worker has imported it; nothing else is imported here)
    if is_ray_environment(environment) or train is None:
        return
    try:
        workers = train.get_context().get_world_size()
    except Exception:  # noqa: BLE001  (not in a Ray Train worker: no train context)
        return
    if workers > 1:
        raise ValueError(
            f"this process is one of {workers} Ray Train workers, but the Trainer's cluster environment is "
            f"{type(environment).__name__}, so each worker would train alone: pass "
            "Trainer(plugins=[ray.train.lightning.RayLightningEnvironment()]) to train them as one data-parallel run"
        )
