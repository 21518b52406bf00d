"""How the ranks of a run cooperate: every rank runs the same loop; the rollout engines are spread over them.

Under ``torchrun`` every rank builds the learner and calls its collectives. The rollout engines live on the
ranks ``rollout/layout.py`` names (``trainer/engine_pool/pool.py``): each generates, scores and evaluates its share,
and the ranks exchange what the others need (the scored samples) in a separate gloo *control group* whose
timeout is the run's ``phase_timeout_s`` (hours), not the learner's collective timeout (minutes): a long
rollout is not a hang, a dead rank still is. ``relay`` makes one rank's failure every rank's error, and
``on_main`` runs what only rank 0 does (run directory, model building). A single process is a world of one.
"""
from __future__ import annotations

import datetime
import os
from typing import Any, Callable, TypeVar

import torch.distributed as dist
from sparse_rl_megatron.learner.parallel import init_process_group
from sparse_rl_megatron.utils.errors import UserError

T = TypeVar("T")


class MainRankFailed(RuntimeError):
    """Raised on the other ranks when rank 0 failed in work only it does (set-up, building the models)."""

_CONTROL: dict[str, Any] = {}


def env_world_size() -> int:
    """The world size torchrun announces (1 without torchrun); readable before any process group exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def env_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def init(phase_timeout_s: int) -> None:
    """Join the default process group (the learner's) and create the control group. Idempotent."""
    init_process_group()
    if "group" not in _CONTROL:
        _CONTROL["group"] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=phase_timeout_s))


def _group():
    return _CONTROL["group"]


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else env_rank()


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else env_world_size()


def is_main() -> bool:
    """True on global rank 0 (the run directory's owner, and the first engine's rank)."""
    return rank() == 0


def broadcast_from_main(obj: T | None) -> T:
    """``obj`` of rank 0 on every rank (pickled; any Python object)."""
    if world_size() == 1:
        return obj  # type: ignore[return-value]
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_group())
    return box[0]


def on_main(fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 and hand its result to every rank. If it raises, rank 0 re-raises the error and the
    other ranks raise ``MainRankFailed`` with its message (instead of waiting for a result that never comes);
    a ``UserError`` stays a ``UserError`` everywhere."""
    outcome: tuple[str, Any, int] | None = None
    error: BaseException | None = None
    if is_main():
        try:
            outcome = ("ok", fn(), 0)
        except Exception as err:  # handed to the other ranks, then re-raised here
            error = err
            outcome = ("user_error" if isinstance(err, UserError) else "error", f"{type(err).__name__}: {err}",
                       getattr(err, "exit_code", 1))
    kind, value, code = broadcast_from_main(outcome)
    if error is not None:
        raise error
    if kind == "user_error":
        relayed = UserError(value.split(": ", 1)[1])
        relayed.relayed_from_main = True  # rank 0 prints it; the CLI of the others stays quiet
        relayed.exit_code = code  # a failure (RunFailed: 1) is not a mistake in the command (2)
        raise relayed
    if kind == "error":
        raise MainRankFailed(f"rank 0 failed: {value}")
    return value


def gather_objects(obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order, on every rank."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj, group=_group())
    return out


def relay(error: BaseException | None, error_type: type[Exception] = RuntimeError) -> None:
    """Collective: every rank says whether its own part of a phase failed (``error``); if any rank's did, every
    rank raises, instead of some ranks waiting for results that never come. The failing ranks raise their own
    error; the others an ``error_type`` with the message of the lowest failing rank (which names what failed
    and where), plus how many others failed. A ``UserError`` stays a ``UserError`` everywhere (printed once)."""
    mine = None if error is None else (isinstance(error, UserError), str(error) or type(error).__name__,
                                       getattr(error, "exit_code", 1))
    failed = [(r, x) for r, x in enumerate(gather_objects(mine)) if x is not None]
    if not failed:
        return
    if error is not None:
        raise error
    (_, (user, message, code)), more = failed[0], len(failed) - 1
    if more:
        message += f" (and {more} other rank(s) failed: {', '.join(str(r) for r, _ in failed[1:])})"
    if user:
        relayed = UserError(message)
        relayed.relayed_from_main = True  # the failing rank prints it; the CLI of the others stays quiet
        relayed.exit_code = code  # a failure (RunFailed: 1) is not a mistake in the command (2)
        raise relayed
    raise error_type(message)


def wait_for_main() -> None:
    """Barrier on the control group (the others wait here while rank 0 works alone)."""
    if world_size() > 1:
        dist.barrier(group=_group())


def shutdown() -> None:
    """Destroy the process groups (end of run)."""
    _CONTROL.clear()
    if dist.is_initialized():
        dist.destroy_process_group()
