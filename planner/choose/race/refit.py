"""The cost model learns from the clock: per-device refit of what the simulator gets wrong.

Every autotune round (planner/choose/autotune.py) times a few plans against the plain graph, beside
what the simulator predicted for each. The prediction has two parts the profile measures on tiny
tensors or one calibration plan, and that held-out shapes get wrong: the node times a recompute re-runs
(with their saved-tensor hooks and policy dispatch) and the fixed cost of each region (the checkpoint
call, the RNG state it saves, allocator churn). Each measured candidate is one row

    measured extra seconds  ~  scale * (predicted extra - regions * call cost)  +  per_region * regions

and the rows of every round on the device (the last MAX_ROWS, each weighted by 1 / its step so that
models of every size count alike) are fitted by least squares: `scale` multiplies every node time and
the hook and dispatch costs, `per_region` replaces the measured call cost. The rows are kept in the
timing store (table `learned`: records, not times, so its rows are checked here), so the next solve on that device, on any model,
predicts with the refit. Rows are stored in the terms of the unrefitted profile, so a refit never
feeds on itself.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...profile.timing_store import TimingStore
from ...solvers.problem import Problem

__all__ = ["KEY", "MAX_ROWS", "Fit", "rows_of", "fit", "remember", "learned"]

TABLE = "learned"  # the timing store's table of records (its rows are checked here, not as times)
KEY = "learned"
MAX_ROWS = 64
MIN_ROWS = 3
SCALE_RANGE = (0.5, 4.0)


@dataclasses.dataclass(frozen=True)
class Fit:
    scale: float
    """Factor on every node time, hook and dispatch cost."""
    per_region_s: float
    """Seconds per checkpoint region per step (in place of the profile's call cost)."""
    rows: int


def rows_of(problem: Problem, record: dict[str, Any]) -> list[list[float]]:
    """Rows [x, regions, measured extra, weight, call cost] from an autotune record, in the terms of the
    unrefitted profile (`problem.meta["learned"]` says what refit `problem` carries)."""
    applied = problem.meta.get("learned") or {}
    scale = float(applied.get("scale", 1.0)) or 1.0
    call_s = float(applied.get("raw_region_s", problem.region_overhead_s))
    step = float(record.get("graph_step_s") or 0.0)
    out = []
    for c in record.get("candidates", []):
        y = c.get("measured_extra_s")
        if y is None or step <= 0:
            continue
        k = len(c.get("regions", []))
        x = (float(c["predicted_extra_s"]) - k * problem.region_overhead_s) / scale
        out.append([x, float(k), float(y), 1.0 / step, call_s])
    return out


def fit(rows: Sequence[Sequence[float]]) -> Fit | None:
    """Weighted least squares of the rows (see the module docstring); None with fewer than MIN_ROWS.
    When the two terms cannot be told apart (every row the same region count) or the per-region cost
    comes out negative, only the scale is fitted, with the profile's call cost."""
    if len(rows) < MIN_ROWS:
        return None
    a = np.asarray(rows, dtype=float)
    x, k, y, w, call = a[:, 0], a[:, 1], a[:, 2], a[:, 3], a[:, 4]
    lo, hi = SCALE_RANGE
    design = np.stack([x, k], axis=1) * w[:, None]
    if np.linalg.matrix_rank(design) == 2:
        (scale, per_region), *_ = np.linalg.lstsq(design, y * w, rcond=None)
        if per_region >= 0 and lo <= scale <= hi:
            return Fit(float(scale), float(per_region), len(rows))
    rest = (y - k * call) * w
    xs = x * w
    denom = float(xs @ xs)
    if denom <= 0:
        return None
    scale = min(hi, max(lo, float(xs @ rest) / denom))
    return Fit(scale, float(np.median(call)), len(rows))


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _rows(entry: Any) -> list[list[float]]:
    """The stored rows that are rows: five finite numbers each (a hand-edited store loses the rest)."""
    rows = entry.get("rows", []) if isinstance(entry, dict) else []
    return [r for r in rows if isinstance(r, list) and len(r) == 5 and all(_finite(v) for v in r)] if isinstance(rows, list) else []


def remember(store: TimingStore, problem: Problem, record: dict[str, Any]) -> None:
    """Add an autotune record's rows to the store's (the last MAX_ROWS kept) and save."""
    rows = rows_of(problem, record)
    if not rows:
        return
    entry = store.get(TABLE, KEY)
    old = _rows(entry)
    store.keep(TABLE, KEY, {"rows": (old + rows)[-MAX_ROWS:]})
    store.save()


def learned(problem: Problem, store: TimingStore) -> tuple[Problem, Fit | None]:
    """`problem` with the device's refit applied (node times, hooks and dispatch scaled; the call cost
    replaced), and the fit; `problem` itself when the store has too few rows."""
    entry = store.get(TABLE, KEY)
    found = fit(_rows(entry))
    if found is None:
        return problem, None
    s = found.scale
    nodes = tuple(dataclasses.replace(n, time=n.time * s) for n in problem.nodes)
    meta = {**problem.meta, "learned": {"scale": s, "per_region_s": found.per_region_s,
                                        "raw_region_s": problem.region_overhead_s, "rows": found.rows}}
    return dataclasses.replace(
        problem, nodes=nodes, saved_overhead_s=problem.saved_overhead_s * s, op_overhead_s=problem.op_overhead_s * s,
        region_overhead_s=found.per_region_s, meta=meta,
    ), found
