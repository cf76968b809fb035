"""Plan searches live in choose/: the stages below it (capture/, lower/, profile/) and the plan layer (the
modules at the top of planner/) neither define a function that picks among candidate plans nor run a solver
that searches. The stages above choose/ (compile/, the API, cli/, integrations/, pipeline/) call it."""

from __future__ import annotations

import ast
import pathlib

ROOT = next(p for p in pathlib.Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
PLANNER = ROOT / "planner"
BELOW_CHOOSE = ("capture", "lower", "profile")
"""Folders of planner/ that run before the choice; the plan layer's modules (planner/*.py) are checked too."""

SEARCHES = {"module_candidates", "best_module_plan", "_greedy", "ModuleCandidate"}
"""Names of the searches that were found outside choose/ (whole-module plans for the callbacks)."""

_APPLY = ("apply_plan maps a plan, one loaded from a file too, onto whole modules when it is applied: the "
          "lowering's own step until the Plan record carries the aligned spans")
KEPT = {
    "lower/apply.py: defines module_aligned": _APPLY,
}
"""Searches that stay below choose/, each with its reason; the check fails when one moves, so the list shrinks."""

SEARCH_SOLVERS = ("solvers.heuristics", "solvers.exact", "solvers.auto", "solvers.sweep", "solvers.offload",
                  "solvers.kept_search")
"""Solver modules whose functions search for plans (`solvers.simulate`, `costs`, `plans` and the data model judge
or describe a plan, and `registry` names the solvers: those may be read anywhere)."""


def _checked_files() -> list[pathlib.Path]:
    files = [p for p in sorted(PLANNER.glob("*.py")) if p.name != "__init__.py"]
    for folder in BELOW_CHOOSE:
        files += sorted((PLANNER / folder).rglob("*.py"))
    return files


def _searches_in(source: str, rel: str) -> list[str]:
    """What the module `rel` (its path under planner/) searches for plans: a search function or class defined
    there, an import of a searching solver, or a solver run by name (`registry.solve`, or what
    `get_solver(...)` returns, called)."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name in SEARCHES or node.name == "module_aligned":
                found.append(f"{rel}: defines {node.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = {a.name for a in node.names}
            if any(node.module.endswith(m) or f"{m}." in node.module for m in SEARCH_SOLVERS):
                found.append(f"{rel}: imports {', '.join(sorted(names))} from {node.module}")
            elif node.module.endswith("solvers.registry") and "solve" in names:
                found.append(f"{rel}: imports solve from {node.module}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Call):
            inner = node.func.func
            if isinstance(inner, ast.Name) and inner.id == "get_solver":
                found.append(f"{rel}: runs a solver (get_solver(...)(...)) at line {node.lineno}")
    return found


def test_plan_searches_live_in_choose():
    found = [f for p in _checked_files() for f in _searches_in(p.read_text(), str(p.relative_to(PLANNER)))]
    kept = set(KEPT)
    assert sorted(set(found) - kept) == [], "plan searches outside planner/choose/ (move them there)"
    assert kept <= set(found), f"a search listed in KEPT moved: drop it from KEPT ({sorted(kept - set(found))})"


def test_the_check_sees_a_search_outside_choose():
    """The check reads definitions, imports of searching solvers and solvers run by name."""
    source = (
        "from ..solvers.heuristics.basic import uniform\n"
        "from ..solvers.registry import get_solver, solve\n\n\n"
        "def module_candidates(plan, model):\n    return get_solver('dp')(plan.problem, 1)\n"
    )
    assert sorted(_searches_in(source, "lower/probe.py")) == [
        "lower/probe.py: defines module_candidates",
        "lower/probe.py: imports solve from solvers.registry",
        "lower/probe.py: imports uniform from solvers.heuristics.basic",
        "lower/probe.py: runs a solver (get_solver(...)(...)) at line 6",
    ]
