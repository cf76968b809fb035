"""`KeptSearch`: exact figures of one region plan under many sets of kept ops, priced on one layout of
`simulate`'s interval sweep (`figures.layout_of`), for the searches over kept ops (`heuristics/selective.py`)."""

from __future__ import annotations

import numpy as np

from .figures import layout_of
from .plans import normalize_regions, normalize_saved
from .problem import Problem
from .simulate import simulate

__all__ = ["KeptSearch", "WALK_CELLS"]

WALK_CELLS = 1 << 20
"""Most (step x slot) entries `KeptSearch` holds at once while it walks (8 MB of int64)."""


class KeptSearch:
    """Exact figures of one region plan under many sets of kept ops, for searches that try hundreds of them.

    Keeping a node moves only its own storages' live intervals (`_Layout.kept_terms`), so the bytes live at
    each observation are the plan's with none kept plus one term per kept node, whatever else is kept. A walk
    that keeps (or stops keeping) one more node at each step is then a running sum over those terms, and the
    peaks of all its steps come out of one pass over a (step x slot) table instead of a simulation per step.
    Every figure equals `simulate`'s for the same plan, to the byte and to the last bit of the seconds.

    `candidates`: every node the search may keep, checked once here (saveable, inside a flat region).
    """

    def __init__(self, problem: Problem, regions, candidates=()) -> None:
        self.problem = problem
        self.regions = normalize_regions(problem, regions)
        self.candidates = normalize_saved(problem, self.regions, candidates)
        self._known = frozenset(self.candidates)
        # The interval sweep holds where no size is negative; elsewhere every set is replayed.
        self._layout = layout_of(problem, self.regions) if problem.n and problem.arrays.nonnegative else None

    def _checked(self, saved) -> tuple[int, ...]:
        """`saved` sorted, checked like `simulate` checks it unless every node is a candidate checked already."""
        saved = tuple(sorted({int(i) for i in saved}))
        return saved if self._known.issuperset(saved) else normalize_saved(self.problem, self.regions, saved)

    def _live(self, saved: tuple[int, ...]) -> np.ndarray:
        layout = self._layout
        if not saved:
            return layout.live
        kept = layout.kept_terms(self.problem, np.array(saved, dtype=np.int64))
        return np.cumsum(layout.delta_with(kept)[: layout.T]) + layout.temps

    def _peak_of(self, live: np.ndarray) -> int:
        fixed = self._layout.fixed
        return max(int(live.max()) + fixed, fixed)

    def peak(self, saved=()) -> int:
        """Peak bytes of the plan with `saved` kept (`simulate(...).peak_bytes`)."""
        saved = self._checked(saved)
        if self._layout is None:
            return simulate(self.problem, self.regions, saved=saved).peak_bytes
        return self._peak_of(self._live(saved))

    def seconds(self, saved=()) -> float:
        """Recompute seconds of the plan with `saved` kept (`simulate(...).recompute_time`)."""
        saved = self._checked(saved)
        if self._layout is None:
            return simulate(self.problem, self.regions, saved=saved).recompute_time
        seconds, _, calls = self._layout.seconds(self.problem, saved)
        return seconds + calls

    def _step_table(self, nodes: list[int], sign: int) -> np.ndarray:
        """Row j: the change of the live bytes at each slot when nodes[j] is kept (sign 1) or no longer
        kept (sign -1). # bytes int64, shape [len(nodes), T]"""
        layout = self._layout
        terms = layout.kept_terms(self.problem, np.array(nodes, dtype=np.int64))
        rows = np.concatenate([terms.owner, terms.owner, terms.spared_owner, terms.spared_owner])
        slots = np.concatenate([terms.plain_end, terms.cached_end, terms.spared_start, terms.spared_end])
        sizes = sign * np.concatenate([terms.nbytes, -terms.nbytes, -terms.spared, terms.spared])
        table = np.zeros((len(nodes), layout.T + 1), dtype=np.int64)
        np.add.at(table, (rows, slots), sizes)
        return np.cumsum(table[:, : layout.T], axis=1)

    def _chunks(self, nodes: list[int]) -> list[list[int]]:
        """`nodes` in runs short enough that a table of their rows stays under WALK_CELLS."""
        size = max(1, WALK_CELLS // (self._layout.T + 1))
        return [nodes[lo : lo + size] for lo in range(0, len(nodes), size)]

    def peaks_walked(self, saved, steps, *, dropping: bool = False, until: int | None = None) -> list[int]:
        """Peaks of the sets a walk from `saved` passes: [peak(saved), peak(saved + steps[:1]), ...,
        peak(saved + steps)], each step keeping one more node, or with `dropping` keeping one fewer.

        `until`: a budget; the walk stops at the first set whose peak fits it (the list ends there).
        """
        saved, steps = self._checked(saved), [int(i) for i in steps]
        held = set(saved)
        if len(set(steps)) != len(steps) or not (held.issuperset(steps) if dropping else held.isdisjoint(steps)):
            raise ValueError("steps: each node once, " + ("all kept at the start" if dropping else "none kept at the start"))
        if not dropping:
            self._checked(steps)
        if self._layout is None:
            return self._replayed(saved, steps, dropping, until)
        live = self._live(saved)
        peaks = [self._peak_of(live)]
        if until is not None and peaks[0] <= until:
            return peaks
        fixed = self._layout.fixed
        for part in self._chunks(steps):
            # Summed down the rows: the live bytes after each step.
            rows = np.cumsum(self._step_table(part, -1 if dropping else 1), axis=0)
            rows += live
            for value in (rows.max(axis=1) + fixed).tolist():
                peaks.append(max(int(value), fixed))
                if until is not None and peaks[-1] <= until:
                    return peaks
            live = rows[-1].copy()
        return peaks

    def peaks_each(self, saved, nodes) -> list[int]:
        """peak(saved + [i]) for each i of `nodes` (none of them kept in `saved`)."""
        saved, nodes = self._checked(saved), [int(i) for i in nodes]
        if not set(saved).isdisjoint(nodes):
            raise ValueError("nodes: one is kept already")
        self._checked(nodes)
        if self._layout is None:
            return [simulate(self.problem, self.regions, saved=tuple(sorted({*saved, i}))).peak_bytes for i in nodes]
        live, fixed, peaks = self._live(saved), self._layout.fixed, []
        for part in self._chunks(nodes):
            rows = self._step_table(part, 1)
            rows += live
            peaks += [max(int(v), fixed) for v in (rows.max(axis=1) + fixed).tolist()]
        return peaks

    def _replayed(self, saved, steps, dropping: bool, until: int | None) -> list[int]:
        """`peaks_walked` by a simulation per set (sizes below zero: the sweep does not hold)."""
        peaks, current = [], set(saved)
        for k in range(len(steps) + 1):
            if k:
                current = current - {steps[k - 1]} if dropping else current | {steps[k - 1]}
            peaks.append(simulate(self.problem, self.regions, saved=tuple(sorted(current))).peak_bytes)
            if until is not None and peaks[-1] <= until:
                break
        return peaks
