"""The MILP backend never reaches the user.

* HiGHS (in-process) is the default backend when highspy is installed, CBC when it is not.
* CBC is never warm-started (`-mips`) under a time limit: CBC 2.10.3 segfaults that way.
* A backend that raises (pulp.PulpSolverError, as when the CBC process dies), answers an
  undefined status, or returns values that are not a plan is retried with the other backend;
  when both fail, `ilp` and `auto` still return a plan within the budget, from the other
  solvers, and say why in the stats.
"""

from __future__ import annotations

import sys

import pulp
import pytest
from ckpt_planner.solvers import simulate, solve
from ckpt_planner.solvers.exact import ilp as ilp_module
from ckpt_planner.solvers.exact import milp_backend, milp_model

from .test_solvers_edge import chain

PROBLEM = chain(12)
BASE = simulate(PROBLEM, ()).peak_bytes
BUDGET = PROBLEM.fixed_bytes + (BASE - PROBLEM.fixed_bytes) * 6 // 10


class Crashing(pulp.LpSolver):
    """What pulp raises when the CBC process dies (a segfault gives a non-zero exit)."""

    def actualSolve(self, lp, **kwargs):  # noqa: N802 - pulp's name
        raise pulp.PulpSolverError("Pulp: Error while trying to execute, use msg=True for more details")


class Undefined(pulp.LpSolver):
    def actualSolve(self, lp, **kwargs):  # noqa: N802
        lp.assignStatus(pulp.LpStatusUndefined, pulp.LpSolutionNoSolutionFound)
        return lp.status


class Garbage(pulp.LpSolver):
    """Claims optimality with every variable at 1: overlapping regions, not a plan."""

    def actualSolve(self, lp, **kwargs):  # noqa: N802
        for v in lp.variables():
            v.varValue = 1.0
        lp.assignStatus(pulp.LpStatusOptimal, pulp.LpSolutionOptimal)
        return lp.status


def broken(monkeypatch, stand_in: type[pulp.LpSolver], backends=("cbc", "highs")) -> list[str]:
    """Replace the named backends by `stand_in`; returns the list of backends asked for, in order."""
    real = milp_model._backend
    asked: list[str] = []

    def backend(name, *args, **kwargs):
        asked.append(name)
        if name in backends:
            return name, stand_in(msg=False)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(milp_model, "_backend", backend)
    return asked


def test_highs_is_the_default_when_installed():
    pytest.importorskip("highspy")
    solution = solve(PROBLEM, BUDGET, solver="ilp")
    assert solution.stats["backend"] == "highs" and "backend_failures" not in solution.stats
    assert solution.peak_bytes <= BUDGET


def test_cbc_is_the_default_without_highspy(monkeypatch):
    monkeypatch.setitem(sys.modules, "highspy", None)  # import highspy -> ImportError
    assert ilp_module.default_backend() == "cbc"
    solution = solve(PROBLEM, BUDGET, solver="ilp", time_limit=30)
    assert solution.stats["backend"] == "cbc" and solution.peak_bytes <= BUDGET


@pytest.mark.parametrize("time_limit, warm", [(0.8, False), (20.0, False), (None, True)])
def test_cbc_is_never_warm_started_under_a_time_limit(time_limit, warm):
    with pytest.warns(DeprecationWarning):  # pulp 3.x announces its 4.0 API
        _, solver = milp_backend._backend("cbc", time_limit, 0.0, "log", warm=True)
    assert bool(solver.optionsDict.get("warmStart")) is warm


@pytest.mark.parametrize("stand_in", [Crashing, Undefined, Garbage])
def test_a_failing_backend_is_retried_with_the_other(monkeypatch, stand_in):
    pytest.importorskip("highspy")
    asked = broken(monkeypatch, stand_in, backends=("highs",))
    solution = solve(PROBLEM, BUDGET, solver="ilp")
    assert asked[:2] == ["highs", "cbc"]
    assert solution.stats["backend"] == "cbc" and solution.peak_bytes <= BUDGET
    assert solution.stats["backend_failures"][0].startswith("highs: ")
    assert "ilp_fallback" not in solution.stats


@pytest.mark.parametrize("stand_in", [Crashing, Undefined, Garbage])
def test_ilp_falls_back_to_the_other_solvers_when_every_backend_fails(monkeypatch, stand_in):
    asked = broken(monkeypatch, stand_in)
    solution = solve(PROBLEM, BUDGET, solver="ilp")
    assert {"cbc"} <= set(asked) and solution.peak_bytes <= BUDGET
    assert solution.stats["fallback_solver"] in ilp_module.FALLBACK_SOLVERS
    reason = solution.stats["ilp_fallback"]
    assert reason.startswith("MILP backend failed") and "cbc: " in reason
    expected = {Crashing: "PulpSolverError", Undefined: "Undefined", Garbage: "overlapping regions"}[stand_in]
    assert expected in reason
    # The fallback is the best of the portfolio: no solver in it does better within the budget.
    for name in ilp_module.FALLBACK_SOLVERS:
        try:
            other = solve(PROBLEM, BUDGET, solver=name)
        except ValueError:
            continue
        assert solution.recompute_time <= other.recompute_time + 1e-12


def test_ilp_without_fallback_raises_its_own_error(monkeypatch):
    broken(monkeypatch, Crashing)
    with pytest.raises(ilp_module.ILPSolveError, match="PulpSolverError"):
        solve(PROBLEM, BUDGET, solver="ilp", fallback=False)


def test_auto_keeps_its_plans_when_the_ilp_fails(monkeypatch):
    asked = broken(monkeypatch, Crashing)
    solution = solve(PROBLEM, BUDGET, solver="auto")
    assert asked and solution.peak_bytes <= BUDGET
    assert "PulpSolverError" in solution.stats["ilp_fallback"]
    assert "error" in solution.stats["tried"]["ilp"] and solution.stats["chosen"] != "ilp"
    assert {"uniform", "greedy", "dp"} <= set(solution.stats["tried"])


def test_an_unknown_backend_is_still_the_callers_error():
    with pytest.raises(ilp_module.ILPBackendError, match="gurobi"):
        solve(PROBLEM, BUDGET, solver="ilp", backend="gurobi")


def test_highs_banner_stays_off_stdout():
    """HiGHS prints a banner from C++ when a model is made; stdout must stay clean for --json callers."""
    import subprocess
    import sys

    pytest.importorskip("highspy")
    code = (
        "from ckpt_planner.solvers import Node, Problem, Storage, solve\n"
        "nodes = tuple(Node(f'n{i}', time=1.0 + i % 3, grad_bytes=2, inputs=(i - 1,) if i else (), "
        "reads=(i - 1,) if i else ()) for i in range(6))\n"
        "storages = tuple(Storage(i, 10, min(i + 1, 5), (min(i + 1, 5),)) for i in range(6))\n"
        "p = Problem(nodes=nodes, storages=storages, param_bytes=5)\n"
        "solve(p, 60, solver='ilp', backend='highs')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "", out.stdout
    assert out.stderr == "", out.stderr  # HiGHS's banner is dropped, not moved


def test_native_output_leaves_stdout_when_a_proxy_stands_in_for_it(capfd, monkeypatch):
    """A progress bar replaces sys.stdout with a proxy that has no descriptor; native code still writes
    to descriptor 1, and `ckpt-planner demo --json` once began with HiGHS's banner that way."""
    import io
    import os

    from ckpt_planner.solvers.exact.milp_backend import native_stdout_dropped

    monkeypatch.setattr(sys, "stdout", io.StringIO())
    os.write(1, b"before\n")
    with native_stdout_dropped():
        os.write(1, b"native banner\n")
    os.write(1, b"after\n")
    out, err = capfd.readouterr()
    assert "native banner" not in out + err  # neither on stdout nor on stderr: the library is quiet
    assert out == "before\nafter\n"  # the descriptor is back where it was
