"""Per-rank memory under data parallelism: scale the Problem for DDP or FSDP2.

The budget is per device. Activations depend on the per-rank batch (the
example inputs are one rank's batch), so only the resident state changes:

- `ddp`: parameters, gradients and optimizer state are replicated on every
  rank. DDP also keeps its gradient buckets, one more copy of the trainable
  parameters' gradients, for the whole run (unless the user passes
  `gradient_as_bucket_view=True`); they are counted as resident.
- `fsdp` (FSDP2 `fully_shard`): parameters, gradients and optimizer state
  are sharded, 1/world_size of each per rank; buffers are replicated. The
  parameters FSDP all-gathers for the unit it is running are not counted.

Planning under torch.distributed is collective (`plan_collectively`): ranks that plan on their own
clocks choose different regions, and ranks whose checkpointing differs deadlock in FSDP's collectives.
Rank 0 plans (profiles, solves, and makes any measured choice); the plan goes to every rank as JSON
(`broadcast_object_list`); each other rank rebuilds it on its own model, which checks the plan's graph
fingerprint and re-simulates its figures; a rank that refuses it makes every rank raise. A failure on
rank 0 (an infeasible budget, a bad argument) is raised on every rank.
"""

from __future__ import annotations

import contextvars
import json
import math
import pickle
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from .errors import InputError, PlanMismatchError, PlannerError
from .settings import DistributedConfig
from .solvers.problem import Problem

__all__ = ["check_sharding", "shard_problem", "rank_problem", "planning_is_collective", "plan_collectively", "checks_agreed"]

_INSIDE = contextvars.ContextVar("ckpt_planner_collective", default=False)

def check_sharding(world_size: int, sharding: str | None) -> None:
    """Validate optimize()'s world_size / sharding arguments (settings.DistributedConfig's rules)."""
    DistributedConfig(world_size=world_size, sharding=sharding)


def _unique_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def shard_problem(problem: Problem, model: torch.nn.Module, *, world_size: int, sharding: str | None) -> tuple[Problem, list[str]]:
    """The per-rank Problem and a note saying what was counted."""
    check_sharding(world_size, sharding)
    if sharding is None:
        return problem, []
    grads = _unique_bytes(p for p in model.parameters() if p.requires_grad)  # bytes
    if sharding == "ddp":
        scaled = replace(problem, param_bytes=problem.param_bytes + grads)
        return scaled, [
            f"ddp x{world_size}: parameters, gradients and optimizer state replicated; DDP's gradient buckets "
            f"({grads / 1e6:.2f} MB) counted as resident (gradient_as_bucket_view=True frees them)"
        ]
    buffers = _unique_bytes(model.buffers())
    params = max(0, problem.param_bytes - buffers)
    nodes = tuple(replace(n, param_grad_bytes=math.ceil(n.param_grad_bytes / world_size)) for n in problem.nodes)
    scaled = replace(
        problem,
        nodes=nodes,
        param_bytes=buffers + math.ceil(params / world_size),
        optimizer_bytes=math.ceil(problem.optimizer_bytes / world_size),
    )
    return scaled, [
        f"fsdp x{world_size}: parameters, gradients and optimizer state counted at 1/{world_size} per rank "
        f"(buffers replicated); the parameters all-gathered for the running unit are not counted"
    ]


def rank_problem(cost: Any, model: torch.nn.Module, *, optimizer_bytes: int, world_size: int, sharding: str | None,
                 d2h_bytes_per_s: float = 0.0, h2d_bytes_per_s: float = 0.0, host_budget_bytes: int = 0,
                 rank_optimizer_bytes: int | None = None) -> tuple[Problem, list[str]]:
    """The solvers' problem of one rank, from a profile (`cost`, a profile.graph.CostGraph) of `model`: the
    one way it is built, for planning (choose/profiled.py) and for checking a loaded plan (plan_check.py).
    `optimizer_bytes`: the whole model's optimizer state, sharded with the rest; `rank_optimizer_bytes`:
    one rank's, already sharded (a loaded plan's breakdown), set after sharding in its place. The copy
    bandwidths (bytes/s) and host budget (bytes) price offloads; 0: none. Returns (problem, notes)."""
    problem = cost.to_problem(optimizer_bytes=optimizer_bytes, name=type(model).__name__,
                              d2h_bytes_per_s=d2h_bytes_per_s, h2d_bytes_per_s=h2d_bytes_per_s,
                              host_budget_bytes=host_budget_bytes)
    problem, notes = shard_problem(problem, model, world_size=world_size, sharding=sharding)
    if rank_optimizer_bytes is not None:
        problem = replace(problem, optimizer_bytes=int(rank_optimizer_bytes))
    return problem, notes


def planning_is_collective() -> bool:
    """True when torch.distributed runs more than one rank and no collective plan is already being made."""
    if _INSIDE.get() or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return False
    return torch.distributed.get_world_size() > 1


def _portable(e: BaseException) -> BaseException:
    """`e` itself when it survives pickling (the other ranks raise the same class), else a PlannerError."""
    try:
        pickle.loads(pickle.dumps(e))
    except Exception:  # noqa: BLE001 - an error class whose arguments do not round-trip
        return PlannerError(f"planning on rank 0 failed: {type(e).__name__}: {e}")
    return e


def plan_collectively(
    make: Callable[[], Any], load: Callable[[dict, str], Any], model: Any, example_inputs: Any, on_larger_shape: str
) -> Any:
    """Rank 0 runs `make()` (optimize as usual); every rank returns that Plan, the other ranks theirs made
    by `load(data, source)` (Plan.from_dict) from its JSON and rebuilt on their own model."""
    import torch.distributed as dist

    from .capture.exported import accept_exported
    from .model_state import ModelState

    if on_larger_shape == "replan":
        raise InputError(
            "on_larger_shape: 'replan' under torch.distributed would re-plan on each rank alone, and ranks "
            "whose plans differ deadlock in collectives; plan with the largest inputs (on_larger_shape='error')"
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    box: list[Any] = [None]
    plan = None
    if rank == 0:
        token = _INSIDE.set(True)
        try:
            plan = make()
        except Exception as e:  # noqa: BLE001 - sent to the other ranks, then raised here too
            box[0] = ("error", _portable(e))
            dist.broadcast_object_list(box, src=0)
            raise
        finally:
            _INSIDE.reset(token)
        plan.notes = (*plan.notes, f"planned on rank 0 of {world} and broadcast: every rank runs this plan "
                      "(its graph fingerprint checked on each rank's model)")
        box[0] = ("plan", json.dumps(plan.to_dict()))
    dist.broadcast_object_list(box, src=0)
    kind, payload = box[0]
    if kind == "error":
        raise payload
    refused = None
    if rank != 0:
        plan = load(json.loads(payload), "the plan rank 0 broadcast")
        module, inputs, _ = accept_exported(model, example_inputs)
        token = _INSIDE.set(True)  # this rebuild's verdict is gathered below, not by the rebuild itself
        try:
            with ModelState(module).preserved():
                plan.rebuild(module, inputs, check_step=False)  # rank 0 checked the step; one rank alone would wait on the others
        except Exception as e:  # noqa: BLE001 - raised on every rank below: one rank raising alone would hang the rest
            refused = f"rank {rank}: {type(e).__name__}: {e}"
        finally:
            _INSIDE.reset(token)
    verdicts: list[Any] = [None] * world
    dist.all_gather_object(verdicts, refused)
    bad = [v for v in verdicts if v]
    if bad:
        raise PlanMismatchError(f"the plan rank 0 made does not fit every rank's model: {'; '.join(bad)}")
    return plan


def checks_agreed(check: Callable[[bool], Any]) -> Any:
    """`check(leader)` on every rank of a running process group, and every rank learns every verdict: a
    loaded plan refused on one rank is refused on all, and no rank runs it. `leader` is True on the one
    rank that runs the checks a rank cannot make alone without the others waiting (rank 0: one training
    step against the model's own); every rank makes the rest (its graph, its figures), which need no
    collective. In one process (or inside collective planning, which gathers its own verdicts) `check(True)`
    as it is. The rank that refused raises its own error; the others a PlanMismatchError naming it."""
    if not planning_is_collective():
        return check(True)
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    result, error, refused = None, None, None
    try:
        result = check(rank == 0)
    except Exception as e:  # noqa: BLE001 - every rank must reach the gather below, or the rest would hang
        error, refused = e, f"rank {rank}: {type(e).__name__}: {str(e)[:500]}"
    verdicts: list[Any] = [None] * world
    dist.all_gather_object(verdicts, refused)
    if error is not None:
        raise error
    bad = [v for v in verdicts if v]
    if bad:
        raise PlanMismatchError(f"the loaded plan was refused on another rank, so on every rank: {'; '.join(bad)}")
    return result


def optimizer_state_bytes(model: torch.nn.Module, optimizer: Any) -> int:
    """Bytes of optimizer state for the model's trainable parameters.

    optimizer: None/'none', 'sgd' (no momentum), 'sgd-momentum', 'adam', 'adamw',
    or a torch.optim.Optimizer instance (Adam-like state is assumed for unknown classes).
    """
    if optimizer is None:
        return 0
    per_param = {"none": 0, "sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2}
    if isinstance(optimizer, str):
        key = optimizer.lower()
        if key not in per_param:
            raise InputError(f"optimizer: {optimizer!r} is not one of {', '.join(per_param)}")
        states = per_param[key]
    elif isinstance(optimizer, torch.optim.SGD):
        states = 1 if optimizer.defaults.get("momentum", 0) else 0
    else:
        states = 2
    return states * sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
