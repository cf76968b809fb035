"""Checkpoint placement solvers on plain data (no torch).

    from ckpt_planner.solvers import Problem, solve
    solution = solve(problem, budget_bytes=2**30, solver="uniform")
"""

# Importing a solver's module registers it (`registry.register`).
from . import auto  # noqa: F401
from .exact import bruteforce, dp, ilp, ilp_offload  # noqa: F401
from .figures import SimResult
from .heuristics import basic, greedy, selective, structured  # noqa: F401
from .problem import Node, Problem, ProblemError, Solution, Storage
from .registry import SOLVERS, InfeasibleBudgetError, UnknownSolverError, get_solver, register, solve
from .simulate import simulate
from .sweep import knee, sweep

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
    "sweep",
    "knee",
]
