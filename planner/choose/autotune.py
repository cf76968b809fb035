"""Measured choice: the few best plans that fit a budget, each timed on the device; the clock decides.

The simulator's step time is a prediction. On shapes it has not seen it can be off by 2x for plans of
many small regions (a held-out Llama: 13 one-op regions predicted +9.9 % of a step, measured +20 %,
against +16 % for transformers' every third layer). So after the solve, the solver's plan, its
runners-up and the plans people write by hand (solvers/structured.py) that fit the budget each run a
few interleaved training steps:

* one step per candidate on the allocator meter (`memory.py`) gives its measured peak; then rounds of
  one timed step each, every candidate and the plain captured graph in turn (the order rotating per
  round), give its fastest step (load only adds time; the median is recorded beside it);
* the fastest measured candidate whose measured peak is within the budget wins; the safety margin is
  for predictions, so a candidate predicted inside the margin, or over the budget by no more than the
  margin, takes part and fits when its measurement does. Candidates within the noise band of the
  fastest are ties, and ties go to the predicted-fastest, so two runs agree. The band is the spread of
  each candidate's step over the plain graph's step of the same round (1-5 %): a load that slows the
  whole round cancels, so the band is what tells plans apart, not how busy the machine was;
* after LEAVE_AFTER rounds, a candidate that does not fit, or whose fastest step is more than LEAVE_BEYOND
  slower than the leader's, is timed no more, and the race ends when one candidate is left: a clear
  winner costs a few rounds, not all of them;
* only what can change the answer races: a plan with the same checkpoint calls as one already in the race,
  predicted within MIN_BAND of a step of it, is a tie no round could break, so it is left out (`candidates`);
  and however few plans race, they get at most MAX_ROUNDS rounds;
* the whole costs at most `steps` model steps (default AUTOTUNE_STEPS = 30).

`tune` returns the choice and a JSON record of every candidate's predicted and measured figures (the
plan keeps it in `stats["autotune"]`; `plan_summary.autotune_rows` shows it). The caller stores the choice in the
timing store, so the same model and budget give the same plan on the next run without measuring.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import InputError
from ..lower.apply import checkpointed_copy, whole_module_spans
from ..lower.offload import targets_of
from ..lower.rewrite import rewrite
from ..model_state import ModelState
from ..profile.loss import default_loss
from ..profile.memory import measure_step_peaks
from ..profile.timing_store import TimingStore
from ..settings import PlanRequest
from ..solvers.heuristics.structured import structured_plans
from ..solvers.plans import normalize_regions, normalize_saved
from ..solvers.problem import Problem, ProblemError, Solution
from ..solvers.registry import InfeasibleBudgetError, solve
from ..solvers.simulate import simulate
from ..verification import step_differences
from .budget import inner_budget
from .cost_refit import remember
from .plan_store import plan_key
from .profiled import Profiled, whole_modules_allowed
from .safety_net import reference_module
from .solve import finish

__all__ = [
    "AUTOTUNE_STEPS", "LEAVE_AFTER", "LEAVE_BEYOND", "in_the_race", "model_steps", "MAX_CANDIDATES", "MAX_ROUNDS", "Candidate",
    "Measured", "Tuned", "candidates", "schedule", "choose",
    "tune", "device_measure", "stored_choice", "RUNNERS_UP", "autotune_solution",
    "steps_for", "race_steps", "AUTOTUNE_ENV", "WHOLE_MODULES", "autotuned", "explicit_variants",
]

AUTOTUNE_STEPS = 30
"""Model steps autotune may run in all, by default (measurement and the winner's exactness check)."""
MAX_CANDIDATES = 3
"""Plans measured at most: the solver's, the best hand-written one and the best of another solver (a fourth,
the next best predicted, is one of these kinds again and cost the Quickstart 1.6 s)."""
MAX_ROUNDS = 3
"""Timed rounds at most, however few candidates race: a field of two gets the rounds a field of four does,
not the whole cap (the noise of a fastest step does not depend on how many plans share the race). Three
fastest-of-three steps tell apart what this project's 2-core CPU can tell apart at all (its noise band is 3-5 %
of a step); a fourth round cost the Quickstart 2 s of its 15."""
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
AUTOTUNE_ENV = "CKPT_PLANNER_AUTOTUNE"
"""Set to off/0/no/false to make autotune's default off (an explicit `autotune=` still decides)."""
RUNNERS_UP = ("dp", "greedy", "uniform")
"""Solvers whose plans stand beside the solver's own (cheap to run once more)."""


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


def steps_for(autotune: bool | int | None, clock: bool) -> int:
    """Model steps autotune may run: `autotune` True -> AUTOTUNE_STEPS, False -> 0, an int -> that many;
    None (the default) -> AUTOTUNE_STEPS when the profile's times are on the clock (`clock`: measured
    on a real device, not FLOPs), the environment does not turn it off and no process group of several
    ranks is running, else 0."""
    if isinstance(autotune, bool):
        return AUTOTUNE_STEPS if autotune else 0
    if isinstance(autotune, int):
        if autotune < 0:
            raise InputError(f"autotune: {autotune} steps; pass True, False or a step count >= 0")
        return autotune
    if autotune is not None:
        raise InputError(f"autotune: {autotune!r}; pass True, False or a step count")
    off = os.environ.get(AUTOTUNE_ENV, "").strip().lower() in {"off", "0", "no", "false"}
    # Ranks that measured apart could choose apart, and a plan that differs between ranks can deadlock
    # collectives (FSDP): off by default under a process group of several ranks.
    dist = torch.distributed
    ranks = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    return AUTOTUNE_STEPS if clock and not off and not ranks else 0


def race_steps(steps: int, planning_s: float, step_s: float) -> int:
    """The model steps the default race may run: `steps`, but no more steps of `step_s` seconds than the
    planning before the race took (`planning_s`: capture, profile, solve, check), so that the race at most
    doubles the time to a plan. The steps a race needs grow with the model's step, the rest of planning
    less (identical stages are measured once): a 24-layer Llama's race took 30 s of its 51, the 4-layer
    one's 6.7 of 14. At least one, so that a choice kept in the timing store is still read back (a race
    with no room for two candidates is skipped, and says so in its record)."""
    if steps <= 0 or step_s <= 0:
        return steps
    return max(1, min(steps, int(planning_s / step_s)))


# fn(candidates, rounds, racing) -> (one Measured per candidate, the plain graph's step times). `racing`
# (may be None) takes the figures so far and gives the candidates to go on timing (`in_the_race`).
Racing = Callable[[list[Measured], list[float]], set[int]]
Measure = Callable[[Sequence[Candidate], int, Racing | None], tuple[list[Measured], list[float]]]


def _candidate(problem: Problem, label: str, regions, saved, finish, modules: tuple[str, ...] = (),
               offloaded: tuple[int, ...] = ()) -> Candidate | None:
    try:
        regions = normalize_regions(problem, finish(tuple(regions)) if finish else regions)
        saved = normalize_saved(problem, regions, tuple(i for i in saved if any(s <= i <= e for s, e in regions)))
        sim = simulate(problem, regions, saved=saved, **({"offloaded": offloaded} if offloaded else {}))
    except ProblemError:  # an offload its regions moved off no longer fits: not a candidate
        return None
    if not regions and not offloaded:
        return None
    return Candidate(label, tuple(regions), tuple(saved), sim.peak_bytes, sim.recompute_time, tuple(modules),
                     tuple(offloaded))


def candidates(
    problem: Problem, chosen: Candidate, budget: int, inner: int, runners_up: Sequence[tuple[str, Any, Any]] = (),
    *, limit: int = MAX_CANDIDATES, finish: Callable[[tuple], tuple] | None = None,
    modules: Callable[[tuple], list[tuple[tuple[int, int], str]] | None] | None = None,
    hand_written: bool = True,
) -> list[Candidate]:
    """The plans to measure: `chosen` (the solver's) first, then the best plain hand-written plan, the
    best runner-up, and the rest by predicted time, `limit` in all. A plan takes part when its predicted
    peak is within the budget widened by the safety margin on both sides (the margin, budget - `inner`,
    is the prediction's error allowance): its measured peak decides. `runners_up`: (label, regions,
    saved) of other solvers; `finish` moves regions off in-place writes as every plan's are.
    `modules(regions)`: the whole submodules (span, path) a hand-written plan's regions are, if any; such
    a plan races as the model's own code with those modules checkpointed (as transformers runs it: no
    captured graph to pay for), labelled "(modules)"; anything but a function (None, False) means none.
    `hand_written=False` races `runners_up` alone (a solver the user named: its own variants)."""
    if not callable(modules):  # "no whole-module maker" may arrive as False: never called
        modules = None
    admit = budget + max(0, budget - inner)
    pool: list[Candidate] = []
    seen = {(chosen.regions, chosen.saved)}
    plans = [(p.name, p.regions, p.saved) for p in structured_plans(problem, inner)] if hand_written else []
    plans += list(runners_up)
    for label, regions, saved in plans:
        whole = modules(tuple(regions)) if modules is not None and _hand_written(label) and not saved else None
        if whole:
            c = _candidate(problem, f"{label} (modules)", [sp for sp, _ in whole], (), None, tuple(p for _, p in whole))
        else:
            c = _candidate(problem, label, regions, saved, finish)
        if c is None or c.predicted_peak_bytes > admit or (c.regions, c.saved) in seen:
            continue
        seen.add((c.regions, c.saved))
        pool.append(c)
    pool.sort(key=lambda c: (c.predicted_extra_s, c.predicted_peak_bytes, c.label))
    untied: list[Candidate] = []
    tie = MIN_BAND * problem.base_step_s
    for c in pool:  # fastest predicted first: of a tie, the solver's plan or the predicted-fastest stays
        if not any(_same_calls(c, d) and abs(c.predicted_extra_s - d.predicted_extra_s) <= tie for d in [chosen, *untied]):
            untied.append(c)
    picked = [chosen]
    firsts = [
        next((c for c in untied if _hand_written(c.label) and "+kept" not in c.label), None),
        next((c for c in untied if not _hand_written(c.label)), None),  # a runner-up solver's plan
    ]
    for c in [*firsts, *untied]:
        if c is not None and c not in picked and len(picked) < limit:
            picked.append(c)
    return picked


def _same_calls(a: Candidate, b: Candidate) -> bool:
    """The same checkpoint calls (regions, whole modules, offloads): the plans differ in a few ops kept inside.
    Predicted within MIN_BAND of a step of each other, two such plans are a tie no race can break (its band is
    at least MIN_BAND): only one of them races, the solver's plan where it is one of them, else the
    predicted-fastest (where ties go), and the other's steps go to plans that differ."""
    return (a.regions, a.modules, a.offloaded) == (b.regions, b.modules, b.offloaded)


def _hand_written(label: str) -> bool:
    return label.startswith(("every_", "per_block"))


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


def stored_choice(problem: Problem, entry: Any, budget: int, inner: int | None = None,
                  solver: str | None = None) -> tuple[tuple, tuple, tuple, dict[str, Any]] | None:
    """(regions, saved, module paths, record) of a choice an earlier run stored, when it is a plan of
    `problem` that fits `budget` now; else None (measured afresh). A store is a file anyone may edit, so
    its plan is re-simulated: it fits when predicted within `budget`, or within the margin over it
    (budget - `inner`) where its own record says it measured within the budget. `solver`: the solver the
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
    if peak > budget and (peak > budget + max(0, budget - (budget if inner is None else inner))
                          or not _measured_within(record, regions, budget)):
        return None
    if solver is not None and not _own_label(record.get("chosen"), solver):
        return None
    return regions, saved, modules, record


def _measured_within(record: dict[str, Any], regions: tuple, budget: int) -> bool:
    """Whether `record` holds a chosen candidate of exactly `regions` measured within `budget`."""
    for c in record.get("candidates", ()):
        if isinstance(c, dict) and c.get("chosen") is True:
            try:
                same = tuple(tuple(int(x) for x in r) for r in c.get("regions", ())) == tuple(regions)
                return same and int(c.get("measured_peak_bytes")) <= budget
            except (TypeError, ValueError):
                return False
    return False


def _own_label(label: Any, solver: str) -> bool:
    """Whether a candidate's label names one of `solver`'s variants (`explicit_variants`)."""
    return isinstance(label, str) and (label == f"{solver} plan" or label.startswith(f"{solver} at "))


def explicit_variants(problem: Problem, solver: str, options: dict[str, Any], budget: int,
                      inner: int) -> list[tuple[str, Any, Any]]:
    """(label, regions, saved) of the plans the solver the user named makes between the budget the solvers
    plan for (`inner`) and the budget widened by the margin: its variants, which differ in how much of the
    margin they use. The clock decides among them; no other solver's plan takes part."""
    admit = budget + max(0, budget - inner)
    out = []
    for target in dict.fromkeys((inner, (inner + budget) // 2, budget, admit)):
        try:
            found = solve(problem, target, solver, **options)
        except (InfeasibleBudgetError, ProblemError, RuntimeError, ValueError, TypeError):
            continue  # a solver that cannot reach this target adds no variant
        out.append((f"{solver} at {target / 1e6:.2f} MB", found.regions, found.saved))
    return out


def device_measure(
    model: torch.nn.Module, graph: torch.fx.GraphModule, args: tuple, kwargs: dict, device: torch.device,
    build: Callable[[tuple, tuple, tuple], torch.nn.Module], baseline: tuple | None = ((), (), ()),
) -> Measure:
    """The measurement on the device: `build(regions, saved, modules)` gives a candidate's module (the
    rewriter, or the model with whole `modules` checkpointed); each round also times the `baseline`
    plan's step, `build(*baseline)` (the plain graph; or where the plain step was never run, the model's
    own code checkpointed per block; None: no baseline, where that step would not fit the budget either);
    its peak is one step on the allocator meter, its times those of interleaved timed steps. The
    caller restores the model's state (gradients, buffers, RNG)."""
    params = list(model.parameters())
    state = params + list(model.buffers())
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def step(module: torch.nn.Module) -> None:
        for p in params:
            p.grad = None
        default_loss(module(*args, **kwargs)).backward()

    def peak(module: torch.nn.Module) -> int:
        return measure_step_peaks(module, args, kwargs, params, state, default_loss, device)[0].allocator

    def timed(module: torch.nn.Module) -> float:
        sync()
        t0 = time.perf_counter()
        step(module)
        sync()
        return time.perf_counter() - t0

    def measure(cands: Sequence[Candidate], rounds: int, racing: Racing | None = None) -> tuple[list[Measured], list[float]]:
        built = [build(c.regions, c.saved, c.modules, *((c.offloaded,) if c.offloaded else ())) for c in cands]
        peaks: list[int] = []
        failed: dict[int, str] = {}
        for k, m in enumerate(built):
            # A candidate whose step raises (a whole module checkpointed by torch whose input a later op
            # writes in place) is dropped here: autotune only ever chooses among steps that run.
            try:
                peaks.append(peak(m))
            except Exception as e:  # noqa: BLE001
                peaks.append(0)
                failed[k] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        live = [k for k in range(len(built)) if k not in failed]
        modules = [built[k] for k in live]
        everyone = [*modules]
        if baseline is not None:
            everyone.insert(0, build(*baseline))
            step(everyone[0])  # warm-up
        first = 0 if baseline is None else 1  # index of the first candidate in `everyone`
        times: list[list[float]] = [[] for _ in modules]
        base: list[float] = []
        racing_now = set(range(first, len(everyone)))  # positions in `everyone` of the candidates still timed

        def so_far() -> list[Measured]:
            timed_of = dict(zip(live, times))
            return [Measured(peaks[k], tuple(timed_of.get(k, ())), failed.get(k)) for k in range(len(built))]

        for r in range(rounds):
            order = [(r + j) % len(everyone) for j in range(len(everyone))]  # the order rotates per round
            for k in order:
                if k < first or k in racing_now:
                    t = timed(everyone[k])
                    (base if k < first else times[k - first]).append(t)
            if racing is not None and r + 1 >= LEAVE_AFTER:
                staying = racing(so_far(), base)
                racing_now = {first + live.index(k) for k in staying if k in live}
                if len(racing_now) <= 1:
                    break  # the race is decided: one plan left, or none that fits
        for p in params:
            p.grad = None
        return so_far(), base

    return measure


def _as(problem: Problem, solution: Solution, regions, saved, stats: dict[str, Any], offloaded: tuple[int, ...] = ()) -> Solution:
    sim = simulate(problem, regions, saved=saved, **({"offloaded": offloaded} if offloaded else {}))
    return Solution(
        regions=tuple(regions), solver=solution.solver, peak_bytes=sim.peak_bytes, recompute_time=sim.recompute_time,
        budget_bytes=solution.budget_bytes, solve_time=solution.solve_time, stats={**solution.stats, **stats},
        saved=tuple(saved), **({"offloaded": tuple(offloaded)} if offloaded else {}),
    )


def autotune_solution(
    problem: Problem, solution: Solution, budget: int, inner: int, *, steps: int, key: str, store: TimingStore,
    measure: Measure, differs: Callable[[tuple, tuple, tuple], bool | None],
    finish: Callable[[tuple], tuple] | None = None, learn: bool = True,
    modules: Callable[[tuple], list[tuple[tuple[int, int], str]] | None] | None = None,
    solver: str | None = None, options: dict[str, Any] | None = None,
) -> tuple[Solution, list[str]]:
    """The plan to return after the solve (and its safety-net check): the choice stored under `key` by an
    earlier run where it is still a plan of this graph for this budget, else the measured choice among
    the candidates, which is then stored (and its rows given to the cost model's refit when `learn`).
    A winner other than `solution` passes the safety net's check (`differs(regions, saved, modules)`) or
    `solution` stands. Returns (plan, notes); the plan's stats carry the record under "autotune", and
    under WHOLE_MODULES the module paths when the winner runs as the model's own code (see `candidates`).
    `solver`: the solver the user named (None for "auto"): only its variants race (`explicit_variants`),
    since naming a solver is the user's choice of plan. Whatever wins, or comes from the store, is within
    the budget as predicted, or within the margin over it and measured within it."""
    notes: list[str] = []
    stored = stored_choice(problem, store.get("plans", key), budget, inner, solver)
    if stored is not None:
        regions, saved, paths, record = stored
        raw = store.get("plans", key).get("offloaded", ())
        offloaded = tuple(int(i) for i in raw) if isinstance(raw, list) and all(type(i) is int for i in raw) else ()
        same = (regions, saved, paths, offloaded) == (tuple(solution.regions), tuple(solution.saved), (),
                                                      tuple(solution.offloaded))
        if same or differs(regions, saved, paths, *((offloaded,) if offloaded else ())) is False:
            whole = {WHOLE_MODULES: list(paths)} if paths else {}
            try:
                return _as(problem, solution, regions, saved, {"autotune": {**record, "from_store": True}, **whole},
                           offloaded), notes
            except ProblemError:  # a stored offload this problem refuses: measured afresh
                pass
    chosen = _candidate(problem, f"{solution.solver} plan", solution.regions, solution.saved, None,
                        offloaded=tuple(solution.offloaded))
    if chosen is None:
        return solution, notes
    if solver is not None:
        chosen = dataclasses.replace(chosen, label=f"{solver} plan")
        runners = explicit_variants(problem, solver, dict(options or {}), budget, inner)
    else:
        runners = []
        for name in RUNNERS_UP:
            if name in (solution.solver, solution.stats.get("chosen")):
                continue
            try:
                found = solve(problem, inner, name)
            except (InfeasibleBudgetError, ProblemError, RuntimeError):
                continue
            runners.append((name, found.regions, found.saved))
    cands = candidates(problem, chosen, budget, inner, runners, finish=finish, modules=modules,
                       hand_written=solver is None)
    tuned = tune(cands, budget, measure, steps)
    record = {**tuned.record, "from_store": False}
    result = solution
    if tuned.index:  # a plan other than the solver's won: it passes the safety net or the solver's stands
        win = cands[tuned.index]
        verdict = differs(win.regions, win.saved, win.modules, *((win.offloaded,) if win.offloaded else ()))
        record["steps"] = record.get("steps", 0) + CHECK_STEPS
        if verdict is False:
            result = _as(problem, solution, win.regions, win.saved, {WHOLE_MODULES: list(win.modules)} if win.modules else {},
                         win.offloaded)
            if win.predicted_peak_bytes > budget:
                got = record["candidates"][tuned.index]["measured_peak_bytes"]
                notes.append(
                    f"autotune: {win.label} is predicted at {win.predicted_peak_bytes / 1e6:.2f} MB, over the budget "
                    f"({budget / 1e6:.2f} MB) by less than the safety margin, and measured at {got / 1e6:.2f} MB, "
                    "within it: the measurement decides")
        else:
            notes.append(f"autotune: {win.label} measured fastest but its step differs from the model's (or "
                         "could not be compared): the solver's plan stands")
            record["chosen"] = cands[0].label
            for c in record.get("candidates", []):
                c["chosen"] = c["label"] == cands[0].label
    elif tuned.index is None and record.get("candidates"):
        notes.append("autotune: no candidate measured within the budget; the solver's plan stands")
    result = _as(problem, result, result.regions, result.saved, {"autotune": record},
                 tuple(result.offloaded))
    if record.get("candidates"):
        store.keep("plans", key, {"regions": [list(r) for r in result.regions], "saved": list(result.saved),
                                  "modules": list(result.stats.get(WHOLE_MODULES, ())), "record": record,
                                  "offloaded": list(result.offloaded)})
        store.save()
        if learn and record.get("band", MAX_BAND) < MAX_BAND:  # rounds too noisy to tell plans apart teach nothing
            remember(store, problem, record)
    return result, notes


def autotuned(p: Profiled, solution: Solution, budget: int, request: PlanRequest,
              steps: int) -> tuple[Solution, list[str]]:
    """The measured choice among the plans of `p` that fit `budget` (bytes), kept in the timing store."""
    gm, model, cap = p.capture.graph_module, p.model, p.capture
    cfg = request.solve
    inner = inner_budget(budget, p.problem.fixed_bytes, request.budget.safety_margin)

    def build(regions, saved, paths, offloaded=()) -> torch.nn.Module:
        if paths:
            return checkpointed_copy(model, paths)
        return rewrite(gm, regions, model=model, saved=saved, offload=targets_of(p.problem, offloaded, regions, saved))

    reference = reference_module(p)

    def differs(regions, saved, paths, offloaded=()) -> bool | None:
        if not p.check:
            return False
        found = step_differences(model, build(regions, saved, paths, offloaded), cap.args, cap.kwargs,
                                 reference=reference)
        return None if found is None else bool(found)

    def modules(regions):
        return whole_module_spans(p.problem, model, regions)

    # Rounds are paired with the plain graph's step; where profiling never ran it, with the step
    # checkpointed per block if that fits the budget (else unpaired), and they teach the refit nothing.
    spans = p.reference_regions
    baseline = (spans, (), p.reference_paths) if not spans or p.reference_fits(budget) else None
    measure = device_measure(model, gm, cap.args, cap.kwargs, torch.device(p.cost.device), build, baseline=baseline)
    with ModelState(model).preserved():
        return autotune_solution(
            p.problem, solution, budget, inner, steps=steps, measure=measure, differs=differs, store=p.store(),
            key=plan_key(p.problem, inner, cfg.solver, dict(cfg.options), False) + "|autotune",
            finish=lambda r: finish(p, r, False)[0], learn=p.cost.time_source == "fitted" and not spans,
            modules=modules if whole_modules_allowed(p) else None,
            solver=None if cfg.solver == "auto" else cfg.solver, options=dict(cfg.options),
        )
