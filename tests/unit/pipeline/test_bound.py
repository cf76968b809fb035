"""The pipeline benchmark's bound: every stage at the least recompute found for it, a stage whose
no-checkpointing peak is over the budget (forced to recompute) counted at its least, not at zero."""

from types import SimpleNamespace

import pytest
from ckpt_planner import ProfileConfig
from ckpt_planner.pipeline import pipeline_step_s, plan_stage, stage_figures
from torch.distributed.pipelining import Schedule1F1B

from benchmarks.pipeline import bound_step_s, least_recompute_s, llama_stages

FAST = ProfileConfig(warmup=0, repeats=1, flop_times=True)  # deterministic costs


def _stage(forward_s: float, backward_s: float, recompute_s: float) -> SimpleNamespace:
    return SimpleNamespace(forward_s=forward_s, backward_s=backward_s, figures=SimpleNamespace(recompute_s=recompute_s))


def test_bound_counts_a_forced_stage_after_the_first_at_its_least_recompute():
    # stage 0 plans 0.5 s of recompute where 0.4 s is the least found; stage 1 is forced to 0.3 s at least
    pp = SimpleNamespace(stages=[_stage(1.0, 2.5, 0.5), _stage(1.0, 2.3, 0.3)])
    bound = bound_step_s(pp, 4, [0.4, 0.3])
    assert bound == pipeline_step_s(Schedule1F1B, 4, [1.0, 1.0], [2.4, 2.3])
    # stage 1 at zero recompute, as if it were not forced: a shorter step, which no plan reaches
    assert bound > bound_step_s(pp, 4, [0.4, 0.0])


@pytest.fixture(scope="module")
def second_stage():
    stages, batch, _ = llama_stages(4, d=16, hidden=32, batch=8, seq=8)
    x = stages[0](batch[:2]).detach().requires_grad_()
    kw = dict(schedule=Schedule1F1B, n_microbatches=8, stage=1, n_stages=4, profile_config=FAST, check_step=False,
              per_layer="blocks", solver="dp")
    free = plan_stage(stages[1], (x,), budget_bytes=1 << 30, **kw)
    return stages[1], x, kw, free


def test_least_recompute_is_zero_where_no_checkpointing_fits_and_counted_where_forced(second_stage):
    module, x, kw, free = second_stage
    none = stage_figures(free.plan.problem, free.spec).peak_bytes
    assert least_recompute_s(free, none) == (0.0, "none")
    budget = (free.per_layer.peak_bytes + none) // 2  # stage 1 holds 3 microbatches: forced to recompute
    tight = plan_stage(module, (x,), budget_bytes=budget, **kw)
    least, found_by = least_recompute_s(tight, budget)
    assert 0 < least <= tight.figures.recompute_s and found_by != "none"
