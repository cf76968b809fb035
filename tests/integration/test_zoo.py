"""Model zoo: every registered solver's plan on real architectures is exact and keeps its memory promise.

Models (tests/models/zoo.py): GPT-2, Llama, BERT, T5 (with labels), ViT, Swin, ResNet, ConvNeXt,
Whisper, Mixtral and Qwen2-MoE (MoE) from tiny transformers configs with random weights, and a U-Net with long
skips, BatchNorm and in-place ReLU. Each model is captured and profiled once; every solver plans it
at 50 % and 25 % of its no-checkpointing activation memory. A budget the solver reports infeasible
must name a smallest budget that is feasible; the plan at that budget is checked instead.
Checked for every plan: outputs, gradients and buffers bitwise equal to the original's, the
allocator's measured peak within the budget, predicted peak within 3 % of the allocator's. The larger graphs are marked slow.
benchmarks/zoo.py writes the same checks as a table.
"""

from __future__ import annotations

import warnings

import pytest
from ckpt_planner.api import Planner
from ckpt_planner.profile.profiler import ProfileConfig

from tests.models.zoo import ZOO, build, run_case, solver_names

FRACTIONS = (0.5, 0.25)
SLOW = {"gpt2", "llama", "t5", "swin", "whisper", "mixtral", "qwen2_moe", "bert"}  # the largest graphs: capture dominates
FLOPS = ProfileConfig(warmup=0, repeats=1, flop_times=True)  # deterministic costs: plans do not follow timing noise
OPTIONS = {"ilp": {"time_limit": 2.0}, "auto": {"time_limit": 2.0}}  # seconds per MILP solve, for test time

_planners: dict[str, tuple] = {}


def _planned(name: str):
    if name not in _planners:
        model, inputs = build(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _planners[name] = (model, inputs, Planner(model, inputs, profile_config=FLOPS), {})
    return _planners[name]


def _params():
    for name in ZOO:
        for solver in solver_names():
            # the MILP's two solves of up to 2 s each: the default run keeps it on the U-Net, and `auto`
            # (which runs the MILP's answer among others) on every model
            slow = name in SLOW or (solver == "ilp" and name != "unet")
            yield pytest.param(name, solver, marks=[pytest.mark.slow] if slow else [], id=f"{name}-{solver}")


@pytest.mark.parametrize("name,solver", list(_params()))
def test_zoo(name: str, solver: str) -> None:
    model, inputs, planner, cache = _planned(name)
    gaps = []
    for fraction in FRACTIONS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            row = run_case(planner, model, inputs, solver, fraction, solver_options=OPTIONS.get(solver), cache=cache)
        where = f"{name}/{solver} at {int(fraction * 100)} %"
        assert not row.get("failed"), f"{where}: {row.get('failed')}"
        if row["skipped"]:
            assert "max_nodes" in row["skipped"] and len(planner.problem.nodes) > 14, row["skipped"]
            continue
        if not row["feasible"]:
            assert row["smallest_feasible"] and row["smallest_bytes"] == row["budget_bytes"]
        assert row["outputs_equal"], f"{where}: outputs differ"
        assert row["grads_equal"], f"{where}: gradients differ by {row['max_abs_grad_diff']}"
        assert row["buffers_equal"], f"{where}: buffers differ"
        if not row["within_budget"] or abs(row["prediction_error"]) > 0.03:
            gaps.append(
                f"{where}: measured {row['measured_bytes']} B, budget {row['budget_bytes']} B, "
                f"predicted {row['predicted_bytes']} B ({row['prediction_error'] * 100:+.1f} %)"
            )
    assert not gaps, "; ".join(gaps)
