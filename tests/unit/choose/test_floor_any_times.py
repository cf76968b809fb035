"""The floor a refusal names does not depend on the profile's times: the command line plans each budget in a
fresh process, which times the model again, and the budget one process named must plan in the next.

The floor's last step, the polish (`lowest_polished`), is a local search that takes the move of least
(peak, recompute time): on a program exported from a DINOv2, FLOP times led it to a floor of 1,225,457 B
and other times to 1,225,392 B, so one profile named a budget the other refused (by 278 B of budget at
the 2 % margin). Both profiles here have deterministic times: the profiler's FLOP times, and times
proportional to each node's gradient bytes (as a memory-bound op's measured time would be).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from ckpt_planner.api import Planner
from ckpt_planner.choose.budget import budget_of, check_feasible, floor_of
from ckpt_planner.choose.solve import solve_budget
from ckpt_planner.cli.export import export_program
from ckpt_planner.errors import InfeasibleBudgetError
from ckpt_planner.profile.profiler import ProfileConfig
from ckpt_planner.settings import PlanRequest

transformers = pytest.importorskip("transformers")

FLOPS = ProfileConfig(warmup=0, repeats=1, flop_times=True)


def _profiles():
    """The exported DINOv2's profile on FLOP times, and the same problem on gradient-bytes times."""
    torch.manual_seed(0)
    cfg = transformers.Dinov2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, image_size=32,
                                    patch_size=4)
    inputs = {"pixel_values": torch.randn(2, 3, 32, 32)}  # [B, C, H, W]
    program, _ = export_program(transformers.Dinov2Model(cfg), inputs)
    on_flops = Planner(program.module(), inputs, profile_config=FLOPS).profiled
    problem = on_flops.problem
    nodes = tuple(dataclasses.replace(n, time=1.0 + n.grad_bytes) for n in problem.nodes)
    on_bytes = dataclasses.replace(on_flops, problem=dataclasses.replace(problem, nodes=nodes), floors={})
    return on_flops, on_bytes


def _named(p) -> int:
    with pytest.raises(InfeasibleBudgetError) as info:
        check_feasible(p, PlanRequest.of(activation_budget=0.5))
    return info.value.smallest_bytes


def test_floor_named_on_one_profile_plans_on_another():
    profiles = _profiles()
    # the polished floor (the target below every floor makes auto polish): the same bytes on both
    floors = [floor_of(p, "auto", {}, False, p.problem.fixed_bytes)[0] for p in profiles]
    assert floors[0] == floors[1]
    named = [_named(p) for p in profiles]
    assert named[0] == named[1]
    request = PlanRequest.of(budget_bytes=named[0])
    for p in profiles:
        check_feasible(p, request)  # not refused again
        solution, _ = solve_budget(p, budget_of(p, request), request)
        assert solution.peak_bytes <= named[0]
