"""The largest batch each contender trains within one fixed byte budget (part of tradeoff.py).

The budget is no checkpointing's measured peak at batch 4. For each contender
the batch grows over BATCHES until the measured peak of one step (the same
allocator meter as tradeoff.py) exceeds the budget, or our planner names the
budget infeasible; the largest batch measured within the budget is reported.
Our contenders re-plan at every batch (capture, profile, solve), as a user does.
"""

from __future__ import annotations

import copy
import math
import time

import torch
import torch.nn as nn
from ckpt_planner.api import Planner
from ckpt_planner.profile.profiler import ProfileConfig
from ckpt_planner.solvers import InfeasibleBudgetError

__all__ = ["largest_batches", "BATCHES"]

BATCHES = (4, 6, 8, 12, 16, 24, 32, 48, 64)
BASE_BATCH = 4


def resize(inputs: dict[str, torch.Tensor], batch: int) -> dict[str, torch.Tensor]:
    """The inputs with `batch` rows: the example's rows repeated (same sequence / image shape)."""
    out = {}
    for k, v in inputs.items():
        reps = math.ceil(batch / v.shape[0])
        out[k] = v.repeat(reps, *([1] * (v.dim() - 1)))[:batch].contiguous()
    return out


def _peak(module: nn.Module, inputs: dict, measure) -> int:
    return measure(module, (), inputs)


def largest_batches(case, measure, solvers: tuple[str, ...], log) -> dict:
    """{budget_bytes, contenders: {name: {batch, peak_bytes, tried}}} (see the module docstring).

    `measure(module, args, kwargs) -> bytes`: the measured peak of one step, parameters included.
    """
    t0 = time.perf_counter()
    base_inputs = resize(case.inputs, BASE_BATCH)
    budget = _peak(case.model, base_inputs, measure)
    result: dict = {"budget_bytes": budget, "base_batch": BASE_BATCH, "contenders": {}}

    def search(name: str, build) -> None:
        best, tried = None, []
        for b in BATCHES:
            inputs = resize(case.inputs, b)
            try:
                module = build(inputs)
                peak = _peak(module, inputs, measure)
            except InfeasibleBudgetError as e:
                # The least peak our planner reaches at this batch: what no plan of ours gets below.
                tried.append({"batch": b, "infeasible": True, "smallest_bytes": getattr(e, "smallest_bytes", None)})
                break
            except RuntimeError as e:  # out of memory on a device
                tried.append({"batch": b, "error": str(e)[:120]})
                break
            tried.append({"batch": b, "peak_bytes": peak})
            if peak > budget:
                break
            best = {"batch": b, "peak_bytes": peak}
        result["contenders"][name] = {**(best or {"batch": None}), "tried": tried}
        log(f"[{case.name}] largest batch within {budget / 1e6:.1f} MB, {name}: {best and best['batch']}")

    search("none", lambda inputs: case.model)
    per_block = case.per_block(copy.deepcopy(case.model))
    search("per-block", lambda inputs: per_block)
    for solver in solvers:
        def build(inputs, solver=solver):
            planner = Planner(case.model, inputs, profile_config=ProfileConfig(repeats=3, overheads=False))
            return planner.plan(budget_bytes=budget, solver=solver).module

        search(f"ours-{solver}", build)
    result["seconds"] = time.perf_counter() - t0
    return result
