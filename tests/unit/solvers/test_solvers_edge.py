"""Table-driven edge cases for every solver."""

from __future__ import annotations

import subprocess
import sys

import pytest
from ckpt_planner.solvers import (
    SOLVERS,
    InfeasibleBudgetError,
    Node,
    Problem,
    Storage,
    UnknownSolverError,
    simulate,
    solve,
)

SOLVER_NAMES = ["uniform", "greedy", "dp", "ilp", "auto", "bruteforce"]


def chain(n: int, *, nbytes: int = 10, recomputable=None, param_bytes: int = 5) -> Problem:
    nodes, storages = [], []
    for i in range(n):
        storages.append(Storage(producer=i, nbytes=nbytes, last_use=min(i + 1, n - 1), saved_by=(min(i + 1, n - 1),)))
        nodes.append(
            Node(
                name=f"n{i}",
                time=1.0 + i % 3,
                grad_bytes=2,
                inputs=(i - 1,) if i else (),
                reads=(i - 1,) if i else (),
                recomputable=True if recomputable is None else recomputable[i],
            )
        )
    return Problem(nodes=tuple(nodes), storages=tuple(storages), param_bytes=param_bytes)


EMPTY = Problem(nodes=(), storages=())
SINGLE = chain(1)
EIGHT = chain(8)


@pytest.mark.parametrize("name", SOLVER_NAMES)
@pytest.mark.parametrize(
    "problem, budget, regions",
    [
        (EMPTY, None, ()),
        (EMPTY, 0, ()),
        (SINGLE, None, ()),
        (SINGLE, 10**9, ()),
        (EIGHT, 10**9, ()),  # above the baseline: nothing to recompute
    ],
    ids=["empty-none", "empty-zero", "single-none", "single-big", "eight-big"],
)
def test_trivial_cases(name, problem, budget, regions):
    solution = solve(problem, budget, solver=name)
    if budget is not None:
        assert solution.regions == regions
        assert solution.peak_bytes <= budget


@pytest.mark.parametrize("name", SOLVER_NAMES)
@pytest.mark.parametrize("problem", [SINGLE, EIGHT], ids=["single", "eight"])
def test_zero_budget_names_the_smallest_feasible_budget(name, problem):
    with pytest.raises(InfeasibleBudgetError) as info:
        solve(problem, 0, solver=name)
    smallest = info.value.smallest_bytes
    assert problem.fixed_bytes <= smallest <= simulate(problem, ()).peak_bytes
    if name in ("dp", "ilp", "bruteforce", "auto"):
        assert solve(problem, smallest, solver=name).peak_bytes <= smallest


@pytest.mark.parametrize("name", SOLVER_NAMES)
def test_non_recomputable_nodes_stay_outside_regions(name):
    frozen = [i % 3 == 1 for i in range(8)]
    problem = chain(8, recomputable=[not f for f in frozen])
    base = simulate(problem, ()).peak_bytes
    for budget in (base, base - 10, base - 20, base - 30):
        try:
            solution = solve(problem, budget, solver=name)
        except InfeasibleBudgetError:
            continue
        for s, e in solution.regions:
            assert not any(frozen[s : e + 1])


@pytest.mark.parametrize("name", SOLVER_NAMES)
def test_tight_budget_saves_memory_on_a_chain(name):
    base = simulate(EIGHT, ()).peak_bytes
    solution = solve(EIGHT, base - 20, solver=name)
    assert solution.peak_bytes <= base - 20 and solution.recompute_time > 0


def test_unknown_solver_lists_the_new_ones():
    with pytest.raises(UnknownSolverError) as info:
        solve(EIGHT, None, solver="nope")
    for name in ("dp", "ilp", "greedy", "auto", "bruteforce"):
        assert name in str(info.value) and name in SOLVERS


def test_ilp_options_and_stats():
    base = simulate(EIGHT, ()).peak_bytes
    for backend in ("cbc", "highs", "auto"):
        solution = solve(EIGHT, base - 20, solver="ilp", backend=backend, time_limit=5, gap=0.0)
        assert solution.stats["backend"] in ("cbc", "highs")
        assert solution.stats["gap"] <= 1e-9 and solution.stats["nodes"] == 8
    with pytest.raises(ValueError):
        solve(EIGHT, base - 20, solver="ilp", backend="gurobi")


def test_ilp_coarsens_large_graphs_and_still_fits():
    problem = chain(300)
    base = simulate(problem, ()).peak_bytes
    budget = (base + problem.fixed_bytes) // 2
    solution = solve(problem, budget, solver="ilp", max_nodes=12, time_limit=3)
    assert solution.stats["nodes"] == 300 and solution.stats["coarse_nodes"] <= 12
    assert solution.peak_bytes <= budget


def test_dp_reports_its_slots_and_reaches_log_memory():
    problem = chain(64, param_bytes=0)
    with pytest.raises(InfeasibleBudgetError) as info:
        solve(problem, 0, solver="dp")
    solution = solve(problem, info.value.smallest_bytes, solver="dp")
    assert solution.stats["slots"] > 1 and solution.stats["stages"] == 64
    depth = max(sum(1 for s2, e2 in solution.regions if s2 <= s and e <= e2) for s, e in solution.regions)
    assert depth >= 2  # nested: more than one level
    for flat in ("uniform", "greedy"):  # one level (Chen's sqrt(n)) does not reach that memory
        with pytest.raises(InfeasibleBudgetError):
            solve(problem, solution.peak_bytes, solver=flat)


def test_solvers_import_no_torch():
    code = (
        "import sys; sys.modules['torch'] = None; import ckpt_planner.solvers as solvers; "
        "from ckpt_planner.solvers.exact import bruteforce, dp, ilp; from ckpt_planner.solvers.heuristics import greedy; from ckpt_planner.solvers import auto, sweep; "
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(__import__("pathlib").Path(__file__).parents[3]))
