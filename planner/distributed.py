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
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from .errors import InputError
from .solvers import Problem

__all__ = ["SHARDINGS", "check_sharding", "shard_problem"]

SHARDINGS = ("ddp", "fsdp")


def check_sharding(world_size: int, sharding: str | None) -> None:
    """Validate optimize()'s world_size / sharding arguments."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InputError(f"world_size: {world_size!r} must be a positive integer")
    if sharding is not None and sharding not in SHARDINGS:
        raise InputError(f"sharding: {sharding!r} is not one of {', '.join(SHARDINGS)}")
    if world_size > 1 and sharding is None:
        raise InputError(f"sharding: give 'ddp' or 'fsdp' with world_size={world_size}")


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
