"""In-flight microbatches counted from the schedule's own action order, against hand-worked schedules."""

import pytest
from ckpt_planner.errors import InputError
from ckpt_planner.pipeline import in_flight, pipeline_step_s, schedule_orders
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe


@pytest.mark.parametrize("p,n", [(4, 8), (4, 4), (2, 5), (8, 16)])
def test_gpipe_holds_every_microbatch_on_every_stage(p, n):
    # GPipe runs all n forwards before the first backward, on every stage
    assert [in_flight(ScheduleGPipe, p, n, s) for s in range(p)] == [n] * p


@pytest.mark.parametrize("p,n", [(4, 8), (4, 4), (8, 32), (2, 3)])
def test_1f1b_stage_s_holds_p_minus_s(p, n):
    # 1F1B: stage s warms up with p - s forwards, then alternates one backward and one forward
    assert [in_flight(Schedule1F1B, p, n, s) for s in range(p)] == [p - s for s in range(p)]


def test_orders_number_microbatches_in_the_order_each_rank_runs_them():
    # torch's 1F1B order numbers the last stage's first forward 1; the runtime runs microbatch 0 first
    last = schedule_orders(Schedule1F1B, 4, 8)[3]
    assert last[:4] == [("F", 3, 0), ("B", 3, 0), ("F", 3, 1), ("B", 3, 1)]


def test_step_of_equal_stages_is_the_textbook_bubble():
    # equal stages, forward 1 s and backward 2 s: (n + p - 1) x (f + b) for GPipe and 1F1B alike
    for schedule in (ScheduleGPipe, Schedule1F1B):
        assert pipeline_step_s(schedule, 8, [1.0] * 4, [2.0] * 4) == pytest.approx(11 * 3.0)
    # one slow backward on the first stage: 1F1B waits on it for every microbatch
    assert pipeline_step_s(Schedule1F1B, 8, [1.0] * 4, [3.0, 2.0, 2.0, 2.0]) > 33.0


def test_refusals_are_one_line():
    with pytest.raises(InputError, match="stage: 4 is not in"):
        in_flight(Schedule1F1B, 4, 8, 4)
    with pytest.raises(InputError, match="microbatches"):
        in_flight(Schedule1F1B, 4, 2, 0)  # 1F1B needs at least as many microbatches as stages
    with pytest.raises(InputError, match="one-stage-per-rank"):
        in_flight(object, 4, 8, 0)
