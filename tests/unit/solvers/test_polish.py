"""Polishing the plan of least peak (solvers/heuristics/polish.py) and auto's use of it where nothing fits.

The fixture is a real problem: a stock Llama (4 layers x 128, vocabulary 4,096) at 2,048 tokens, its loss
alone returned and its token-wise work chunked (exact=False), on FLOP times, as the reach benchmark plans it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ckpt_planner.solvers import InfeasibleBudgetError, Problem, simulate, solve
from ckpt_planner.solvers.heuristics.polish import lower_peak
from ckpt_planner.solvers.plans import normalize_regions

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "llama_chunked_2048_problem.json"


@pytest.fixture(scope="module")
def llama() -> Problem:
    return Problem.from_dict(json.loads(FIXTURE.read_text()))


ILP_LOWEST = ((1, 62), (63, 88), (89, 94), (95, 95), (96, 102), (103, 103), (104, 110), (111, 111))
"""The MILP's plan of least peak on this problem (27.69 MB), as written here: the MILP runs on a clock."""


def test_polishing_lowers_the_peak_of_the_ilps_lowest_plan(llama):
    before = simulate(llama, ILP_LOWEST).peak_bytes
    regions, peak = lower_peak(llama, ILP_LOWEST)
    assert normalize_regions(llama, regions) == regions  # a plan: in bounds, recomputable, properly nested
    assert peak == simulate(llama, regions).peak_bytes
    # 27.69 MB -> 25.50 MB with flat moves, 24.06 MB with a region nested in one (measured in writing this test)
    assert peak <= 0.9 * before
    assert any(o != r and o[0] <= r[0] and r[1] <= o[1] for r in regions for o in regions)  # it took a nest
    for o in regions:  # at most one child at each end of a region, none in between
        kids = [r for r in regions if o != r and o[0] <= r[0] and r[1] <= o[1]]
        assert len(kids) <= 2 and all(k[0] == o[0] or k[1] == o[1] for k in kids)


def test_polishing_stops_at_the_target_and_never_raises_the_peak(llama):
    start = ((1, 62), (63, 88), (89, 94), (96, 102), (104, 110))
    before = simulate(llama, start).peak_bytes
    target = before - 1_000_000
    regions, peak = lower_peak(llama, start, target=target)
    assert peak <= target
    unbounded, lowest = lower_peak(llama, start)
    assert lowest <= peak <= before
    assert lower_peak(llama, start, max_work=0) == (start, before)  # no work: the plan as given


def test_a_region_may_hold_a_nested_region_at_each_end_and_none_between():
    from ckpt_planner.solvers.heuristics.polish import _nests

    inside = {plan[-1] for plan in _nests(((0, 9), (0, 3)), 12)}  # a child at the start already
    assert inside == {(a, 9) for a in range(4, 10)}  # only at the end, clear of the first child
    both = {plan[-1] for plan in _nests(((0, 9), (0, 3), (7, 9)), 12)}
    assert both == set()  # a child at each end: no third
    assert {plan[-1] for plan in _nests(((0, 3),), 12)} == {(0, 0), (0, 1), (0, 2), (1, 3), (2, 3), (3, 3)}


def test_a_nested_plan_is_returned_as_given(llama):
    nested = ((63, 110), (63, 94))
    regions, peak = lower_peak(llama, nested)
    assert regions == normalize_regions(llama, nested) and peak == simulate(llama, nested).peak_bytes


def test_auto_takes_the_polished_plan_where_nothing_else_fits(llama):
    budget = 25_600_000  # under the lowest peak of every plan of the portfolio, over the polished one's
    portfolio = ("uniform", "greedy", "dp")  # the clock-free solvers: the same plans on any machine
    for name in portfolio:
        with pytest.raises(InfeasibleBudgetError):
            solve(llama, budget, name)
    result = solve(llama, budget, "auto", solvers=portfolio)
    assert result.stats["chosen"].endswith(", polished")
    assert simulate(llama, result.regions, saved=result.saved).peak_bytes <= budget
    with pytest.raises(InfeasibleBudgetError) as refused:
        solve(llama, 24_000_000, "auto", solvers=portfolio)
    assert refused.value.smallest_bytes <= 25_600_000  # the smallest budget named is the polished peak


INPLACE = Path(__file__).resolve().parents[2] / "fixtures" / "llama_chunked_2048_inplace_problem.json"
"""The same Llama at 2,048 tokens with the chunked linears' weight gradients added in place (lower/chunk.py),
profiled with two torch threads: its peak sits in layer 3's attention backward, not at the head's."""


def test_one_region_around_a_run_of_regions_lowers_the_peak_where_nesting_alone_stops():
    from ckpt_planner.solvers.heuristics import polish

    problem = Problem.from_dict(json.loads(INPLACE.read_text()))
    start = ((1, 94), (95, 110), (111, 111))  # uniform's plan of least peak
    regions, peak = lower_peak(problem, start)
    assert peak == simulate(problem, regions).peak_bytes and normalize_regions(problem, regions) == regions
    # without the move: 25.06 MB (layers 0-1 and layer 2 apart); with it 24.42 MB (measured: 24.42 MB)
    original = polish._encloses
    try:
        polish._encloses = lambda regions_, n: iter(())
        _, without = lower_peak(problem, start)
    finally:
        polish._encloses = original
    assert peak <= without - 500_000


def test_the_regions_around_runs_of_regions_start_at_a_run_and_end_before_the_next():
    from ckpt_planner.solvers.heuristics.polish import _encloses

    added = [plan[-1] for plan in _encloses(((0, 2), (4, 5), (8, 9)), 12)]
    # (0..2, 4..5) to any end before 8; (0..2 .. 8..9) and (4..5, 8..9) to any end up to the last node
    assert sorted(added) == sorted([(0, 5), (0, 6), (0, 7), (0, 9), (0, 10), (0, 11), (4, 9), (4, 10), (4, 11)])
    nested = [plan[-1] for plan in _encloses(((0, 5), (0, 2), (6, 7)), 9)]  # a region's children are not a run
    assert sorted(nested) == [(0, 7), (0, 8)]


def test_the_lowest_of_several_polished_starts_is_taken():
    """The polish is a local search: greedy's plan here ends at 26.11 MB, uniform's at 24.42 MB. Given both
    (as auto and the floor give their portfolio's plans), the lower is taken, whichever comes first."""
    from ckpt_planner.solvers.heuristics.polish import lowest_polished

    problem = Problem.from_dict(json.loads(INPLACE.read_text()))
    greedy = ((1, 94), (97, 110))
    uniform = ((1, 88), (89, 95), (96, 101), (102, 108), (109, 110), (111, 111))
    alone = lower_peak(problem, greedy)[1]
    lowest = lower_peak(problem, uniform)[1]
    assert lowest < alone - 1_000_000
    for plans in ([greedy, uniform], [uniform, greedy]):
        regions, peak, start = lowest_polished(problem, plans)
        assert (peak, start) == (lowest, uniform) and simulate(problem, regions).peak_bytes == peak
    # with a target the first start within it ends the search
    _, peak, start = lowest_polished(problem, [greedy], target=alone)
    assert (peak, start) == (alone, greedy)
