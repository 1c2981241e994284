"""A data-parallel rank that exits (killed, out of memory, its machine gone) ends the others' run in one line.

Every rank's engine makes the same collectives in the same order (engine/ranks.py), so when one rank dies
the next collective on each of the others fails at once: gloo reports the TCP connection its peer's exit
closed ("Connection closed by peer", "Connection reset by peer"; NCCL's reports of a remote process that
exited are matched too). Nothing hangs, and nothing a save had not committed is used (checkpoint/store.py
commits only once every rank wrote its part). The collective library's own message says neither that a rank
died nor where the run can resume from; :func:`rank_exited` says both:

    rank 1 exited (rank 0's collective lost its connection to it); the last committed checkpoint is step 12,
    runs/a/last.ckpt (pass it as ckpt_path to resume)

The step is read from storage at that moment, not remembered: a save that rank 0 committed just before its
peer died counts, one it had not committed does not.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# What the collective libraries say when a peer's process is gone (lower case), from gloo's TCP transport and
# NCCL's error reports; a peer that hangs instead ends in a timeout, after the process group's timeout.
_LOST = ("closed by peer", "reset by peer", "broken pipe", "remote process exited", "remote worker crashing")


class RankExitedError(RuntimeError):
    """Another rank of a data-parallel run exited: this one cannot go on (every step needs every rank)."""


def lost_peer(err: BaseException) -> bool:
    """Whether `err` is a collective that failed because a peer rank's process is gone."""
    return isinstance(err, RuntimeError) and any(s in str(err).lower() for s in _LOST)


def rank_exited(rank: int, world: int, checkpoints: Iterable[tuple[str, Any]]) -> RankExitedError:
    """The one line for rank `rank` of `world` whose collective lost its peer: which rank exited (with two
    ranks, the other; with more, the collective library does not say which) and the newest committed
    checkpoint among `checkpoints` ((url, storage options): the run's saves and the one it resumed from)."""
    who = f"rank {1 - rank}" if world == 2 else f"another of the {world} ranks"
    last = last_committed(checkpoints)
    where = "no checkpoint of this run was committed"
    if last is not None:
        where = f"the last committed checkpoint is step {last[0]}, {last[1]} (pass it as ckpt_path to resume)"
    return RankExitedError(f"{who} exited (rank {rank}'s collective lost its connection to it); {where}")


def last_committed(checkpoints: Iterable[tuple[str, Any]]) -> tuple[int, str] | None:
    """(global step, url) of the newest of `checkpoints` that storage holds committed now; None if none."""
    from megatrain_lightning.checkpoint import load_trainer_state

    found = []
    for url, options in checkpoints:
        try:
            step = load_trainer_state(url, options).get("global_step")
        except Exception:  # noqa: BLE001  (uncommitted, removed or unreadable: not one to resume from)
            continue
        if isinstance(step, int):
            found.append((step, url))
    return max(found, default=None)
