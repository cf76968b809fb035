"""The race's choice in the timing store: an earlier run's choice read back where it is still a plan of this
graph within the budget (a store is a file anyone may edit, so it is re-simulated), and this run's written,
its rows handed to the cost model's refit (race/refit.py)."""

from __future__ import annotations

from typing import Any

from ...profile.timing_store import TimingStore
from ...solvers.plans import normalize_regions, normalize_saved
from ...solvers.problem import Problem, ProblemError, Solution
from ...solvers.simulate import simulate
from .refit import remember
from .rules import MAX_BAND, WHOLE_MODULES

__all__ = ["stored_choice", "keep_choice"]


def stored_choice(problem: Problem, entry: Any, budget: int, inner: int | None = None,
                  solver: str | None = None) -> tuple[tuple, tuple, tuple, dict[str, Any]] | None:
    """(regions, saved, module paths, record) of a choice an earlier run stored, when it is a plan of
    `problem` that fits `budget` now; else None (measured afresh). A store is a file anyone may edit, so
    its plan is re-simulated: it fits when predicted within `budget` (`inner` is unused, kept for callers).
    `solver`: the solver the
    user named; a stored plan another solver made (or a record naming none) is not the user's choice."""
    if not isinstance(entry, dict) or not isinstance(entry.get("record"), dict):
        return None
    try:
        regions = normalize_regions(problem, [(int(s), int(e)) for s, e in entry["regions"]])
        saved = normalize_saved(problem, regions, [int(i) for i in entry["saved"]])
        modules = tuple(entry.get("modules", ()))
        peak = simulate(problem, regions, saved=saved).peak_bytes
    except (ProblemError, KeyError, TypeError, ValueError):
        return None
    record = entry["record"]
    if record.get("budget_bytes") != budget or not regions or not all(isinstance(p, str) for p in modules):
        return None
    if peak > budget:
        return None
    if solver is not None and not _own_label(record.get("chosen"), solver):
        return None
    return regions, saved, modules, record


def _own_label(label: Any, solver: str) -> bool:
    """Whether a candidate's label names one of `solver`'s variants (`explicit_variants`)."""
    return isinstance(label, str) and (label == f"{solver} plan" or label.startswith(f"{solver} at "))


def keep_choice(store: TimingStore, key: str, problem: Problem, result: Solution, record: dict[str, Any],
                learn: bool) -> None:
    """Write the race's choice under `key`, and give its rows to the refit when `learn` and the rounds were
    quiet enough to tell plans apart (a band at MAX_BAND teaches nothing)."""
    store.keep("plans", key, {"regions": [list(r) for r in result.regions], "saved": list(result.saved),
                              "modules": list(result.stats.get(WHOLE_MODULES, ())), "record": record,
                              "offloaded": list(result.offloaded)})
    store.save()
    if learn and record.get("band", MAX_BAND) < MAX_BAND:
        remember(store, problem, record)
