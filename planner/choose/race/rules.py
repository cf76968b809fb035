"""The race's rules, pure: how many candidates and rounds fit a cap of model steps, the rounds' noise band, who
stays in the race and who wins. Measurements come in as numbers (`Measure`), so every rule is tested without
a clock (planner/choose/autotune.py runs the race; race/device.py measures on the device).

* the fastest measured candidate whose measured peak is within the budget wins. Candidates within the noise
  band of the fastest are ties, and ties go to the predicted-fastest, so two runs agree. The band is the
  spread of each candidate's step over the plain graph's step of the same round (1-5 %): a load that slows
  the whole round cancels, so the band is what tells plans apart, not how busy the machine was;
* after LEAVE_AFTER rounds, a candidate that does not fit, or whose fastest step is more than LEAVE_BEYOND
  slower than the leader's, is timed no more, and the race ends when one candidate is left;
* however few plans race, they get at most MAX_ROUNDS rounds; the whole costs at most `steps` model steps.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "AUTOTUNE_STEPS", "MAX_ROUNDS", "MIN_BAND", "MAX_BAND", "LEAVE_AFTER", "LEAVE_BEYOND", "CHECK_STEPS",
    "WHOLE_MODULES", "Candidate", "Measured", "Tuned", "Racing", "Measure", "race_steps", "schedule", "noise_band",
    "choose", "in_the_race", "model_steps", "tune",
]

AUTOTUNE_STEPS = 30
"""Model steps autotune may run in all, by default (measurement and the winner's exactness check)."""
MAX_ROUNDS = 3
"""Timed rounds at most, however few candidates race: a field of two gets the rounds a field of four does,
not the whole cap (the noise of a fastest step does not depend on how many plans share the race). Three
fastest-of-three steps tell apart what a loaded CPU can tell apart at all (its noise band is 3-5 % of a step)."""
MIN_BAND, MAX_BAND = 0.01, 0.05
"""The noise band (a fraction of a step) is the rounds' own paired spread, held between these."""
LEAVE_AFTER = 2
"""Rounds every candidate runs before one can leave the race."""
LEAVE_BEYOND = 0.15
"""A candidate leaves the race when its fastest step is slower than the leader's fastest by more than this
fraction, unpaired and paired with the plain graph's step of the same round alike: three times the widest
noise band, so that only a plan no later round could make a tie stops being timed."""
CHECK_STEPS = 2
"""Steps kept back from the cap for the winner's exactness check (one of the plan, one of the model)."""
WHOLE_MODULES = "whole_modules"
"""The plan's stats key for the module paths of a plan that runs as the model's own code."""


@dataclass(frozen=True)
class Candidate:
    """One plan in the race, with what the simulator predicts for it."""

    label: str
    regions: tuple[tuple[int, int], ...]
    saved: tuple[int, ...]
    predicted_peak_bytes: int
    predicted_extra_s: float
    """Predicted seconds per step over the plain captured graph (recompute, calls, hooks, policy)."""
    modules: tuple[str, ...] = ()
    """Paths of whole submodules: this plan runs as the model's own code with them checkpointed
    (`checkpointed_copy`), not as the captured graph; empty: the captured graph, rewritten."""
    offloaded: tuple[int, ...] = ()
    """Storages the plan copies to host memory between forward and backward (lower/offload.py)."""


@dataclass(frozen=True)
class Measured:
    """What the device measured for one candidate."""

    peak_bytes: int
    """The allocator's peak of one step (bytes, resident state included): what the budget is judged on."""
    times: tuple[float, ...]
    """Seconds of each timed step."""
    failed: str | None = None
    """Why the candidate's step raised (then it has no times and is never chosen)."""

    @property
    def step_s(self) -> float:
        """The fastest timed step: load on the machine only ever adds time (the calibration's rule)."""
        return min(self.times) if self.times else math.inf

    @property
    def median_s(self) -> float:
        return statistics.median(self.times) if self.times else math.inf


@dataclass(frozen=True)
class Tuned:
    """The choice: the winning candidate's index (None: none fit on the clock) and the JSON record."""

    index: int | None
    record: dict[str, Any] = field(default_factory=dict)


def race_steps(steps: int, planning_s: float, step_s: float) -> int:
    """The model steps the default race may run: `steps`, but no more steps of `step_s` seconds than the
    planning before the race took (`planning_s`: capture, profile, solve, check), so that the race at most
    doubles the time to a plan. The steps a race needs grow with the model's step, the rest of planning
    less (identical stages are measured once). At least one, so that a choice kept in the timing store is still read back (a race
    with no room for two candidates is skipped, and says so in its record)."""
    if steps <= 0 or step_s <= 0:
        return steps
    return max(1, min(steps, int(planning_s / step_s)))


# fn(candidates, rounds, racing) -> (one Measured per candidate, the plain graph's step times). `racing`
# (may be None) takes the figures so far and gives the candidates to go on timing (`in_the_race`).
Racing = Callable[[list[Measured], list[float]], set[int]]
Measure = Callable[[Sequence[Candidate], int, Racing | None], tuple[list[Measured], list[float]]]


def schedule(n_candidates: int, steps: int) -> tuple[int, int]:
    """(candidates, timed rounds) within `steps` model steps: each candidate one peak step and a step per
    round, the plain graph a warm-up step and one per round, CHECK_STEPS kept for the winner's check; at
    most MAX_ROUNDS rounds. Fewer candidates before fewer than three rounds; (0, 0) when not even two
    candidates fit."""
    room = steps - CHECK_STEPS
    n = n_candidates
    while n >= 2:
        rounds = min(MAX_ROUNDS, room // (n + 1) - 1)
        if rounds >= 3 or (n == 2 and rounds >= 1):
            return n, rounds
        n -= 1
    return 0, 0


def noise_band(measured: Sequence[Measured], base: Sequence[float]) -> float:
    """The rounds' own spread: the median over the candidates of (upper quartile - lower) / median of
    the candidate's step over the plain graph's step in the same round (paired, so a load that slows a
    whole round cancels); without the plain graph's steps, of the candidate's steps alone."""
    spreads = []
    for m in measured:
        series = [t / b for t, b in zip(m.times, base) if b > 0] if base else list(m.times)
        if len(series) >= 2:
            q = statistics.quantiles(series, n=4, method="inclusive")
            spreads.append((q[2] - q[0]) / max(1e-12, statistics.median(series)))
    band = statistics.median(spreads) if spreads else MAX_BAND
    return min(MAX_BAND, max(MIN_BAND, band))


def choose(cands: Sequence[Candidate], measured: Sequence[Measured], budget: int, band: float) -> int | None:
    """Index of the winner: among candidates whose measured peak is within `budget`, those within `band`
    of the fastest step are ties, won by the least predicted time (then the earlier listed)."""
    fits = [k for k, m in enumerate(measured) if m.peak_bytes <= budget and m.failed is None]
    if not fits:
        return None
    fastest = min(measured[k].step_s for k in fits)
    ties = [k for k in fits if measured[k].step_s <= fastest * (1 + band)]
    return min(ties, key=lambda k: (cands[k].predicted_extra_s, k))


def in_the_race(measured: Sequence[Measured], base: Sequence[float], budget: int) -> set[int]:
    """The candidates still worth timing: their step ran, their measured peak is within `budget`, and their
    fastest step is within LEAVE_BEYOND of the leader's, unpaired or paired with the plain graph's step of
    the same round (either is enough to stay: a load on one round must not push a plan out)."""
    fits = [k for k, m in enumerate(measured) if m.failed is None and m.peak_bytes <= budget and m.times]
    if not fits:
        return set()

    def paired(m: Measured) -> float:
        ratios = [t / b for t, b in zip(m.times, base) if b > 0]
        return min(ratios) if ratios else m.step_s

    lead, lead_paired = min(measured[k].step_s for k in fits), min(paired(measured[k]) for k in fits)
    return {k for k in fits
            if measured[k].step_s <= lead * (1 + LEAVE_BEYOND) or paired(measured[k]) <= lead_paired * (1 + LEAVE_BEYOND)}


def model_steps(measured: Sequence[Measured], base: Sequence[float], warm_up: bool) -> int:
    """Model steps a race ran: a peak step per candidate, the plain graph's warm-up, every timed step."""
    return len(measured) + int(warm_up) + len(base) + sum(len(m.times) for m in measured)


def tune(cands: Sequence[Candidate], budget: int, measure: Measure, steps: int = AUTOTUNE_STEPS) -> Tuned:
    """Measure `cands` (the solver's plan first) within `steps` model steps and choose (see the module
    docstring); a candidate that cannot win any more leaves the race (`in_the_race`). Returns
    Tuned(None, record) when fewer than two candidates can be measured or none fits."""
    n, rounds = schedule(len(cands), steps)
    if n < 2:
        why = "one candidate" if len(cands) < 2 else f"a cap of {steps} steps leaves no room for two candidates"
        return Tuned(None, {"skipped": why, "steps": 0})
    cands = list(cands[:n])
    t0 = time.perf_counter()
    measured, base = measure(cands, rounds, lambda ms, b: in_the_race(ms, b, budget))
    band = noise_band(measured, base)
    winner = choose(cands, measured, budget, band)
    base_s = min(base) if base else 0.0
    record = {
        "steps": model_steps(measured, base, warm_up=bool(base)),
        "rounds": rounds,
        "band": band,
        "seconds": time.perf_counter() - t0,
        "budget_bytes": budget,
        "graph_step_s": base_s,
        "chosen": cands[winner].label if winner is not None else None,
        "candidates": [_entry(c, m, base_s, budget, k == winner) for k, (c, m) in enumerate(zip(cands, measured))],
    }
    return Tuned(winner, record)


def _entry(c: Candidate, m: Measured, base_s: float, budget: int, chosen: bool) -> dict[str, Any]:
    return {
        "label": c.label,
        "regions": [list(r) for r in c.regions],
        "saved": list(c.saved),
        "predicted_peak_bytes": c.predicted_peak_bytes,
        "predicted_extra_s": c.predicted_extra_s,
        "measured_peak_bytes": None if m.failed else m.peak_bytes,
        "measured_step_s": None if m.failed else m.step_s,
        "measured_median_s": None if m.failed else m.median_s,
        "measured_extra_s": m.step_s - base_s if base_s > 0 and not m.failed else None,
        "fits": m.peak_bytes <= budget and not m.failed,
        **({"failed": m.failed} if m.failed else {}),
        "chosen": chosen,
        "modules": list(c.modules),
    }
