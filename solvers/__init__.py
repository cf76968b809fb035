"""Checkpoint placement solvers on plain data (no torch).

    from solvers import Problem, solve
    solution = solve(problem, budget_bytes=2**30, solver="uniform")
"""

from . import basic  # noqa: F401  (registers "none" and "uniform")
from .problem import Node, Problem, ProblemError, Solution, Storage
from .registry import SOLVERS, InfeasibleBudgetError, UnknownSolverError, get_solver, register, solve
from .simulate import SimResult, simulate

__all__ = [
    "Node",
    "Storage",
    "Problem",
    "Solution",
    "ProblemError",
    "SimResult",
    "simulate",
    "SOLVERS",
    "register",
    "get_solver",
    "solve",
    "UnknownSolverError",
    "InfeasibleBudgetError",
]
