"""Region bookkeeping every plan goes through: re-simulated after its regions move, merged with the
model's own checkpoint spans, and moved off in-place writes (`finish_regions`).

Where only whole modules can be checkpointed (parameters sharded per submodule, a capture that
pinned every size), `module_candidates` searches that plan space: the nearest whole-module plan,
each repeated block, and a greedy pick of modules by memory saved per recompute second, each
simulated on the plan's Problem; `best_module_plan` keeps the one that fits with the least recompute."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..lower.apply import _unwrap, module_aligned
from ..lower.rewrite import safe_regions
from ..solvers.copies import offloadable
from ..solvers.plans import normalize_regions
from ..solvers.problem import Problem, Solution
from ..solvers.simulate import simulate

__all__ = ["Regions", "with_regions", "kept_offloads", "laminar", "merge_own", "kept_saved", "finish_regions", "per_block_regions",
           "ModuleCandidate", "module_candidates", "best_module_plan"]

Regions = tuple[tuple[int, int], ...]


def with_regions(problem: Problem, solution: Solution, regions, budget=None, stats=None) -> Solution:
    """`solution` with `regions` in place of its own (and the kept ops still inside them, and the offloads
    the new regions still keep from the forward to the backward), re-simulated."""
    saved = kept_saved(regions, solution.saved)
    offloaded = kept_offloads(problem, regions, saved, solution.offloaded)
    sim = simulate(problem, regions, saved=saved, offloaded=offloaded)
    return dataclasses.replace(
        solution,
        regions=tuple(regions),
        saved=saved,
        offloaded=offloaded,
        peak_bytes=sim.peak_bytes,
        recompute_time=sim.recompute_time,
        budget_bytes=solution.budget_bytes if budget is None else budget,
        stats={**solution.stats, **(stats or {})},
    )


def kept_offloads(problem: Problem, regions, saved, offloaded) -> tuple[int, ...]:
    """The offloads of a plan that its (moved) regions still keep from the forward to the backward: a region
    that grew over an offloaded storage recomputes it instead."""
    if not offloaded:
        return ()
    allowed = set(offloadable(problem, regions, saved))
    return tuple(sorted(t for t in offloaded if t in allowed))


def laminar(problem: Problem, spans) -> tuple[tuple[int, int], ...]:
    """The spans that nest properly, in order (a span crossing an earlier one is left out)."""
    kept: list[tuple[int, int]] = []
    for span in spans:
        try:
            kept = list(normalize_regions(problem, kept + [span]))
        except Exception:  # noqa: BLE001 - a crossing span is not kept
            continue
    return tuple(kept)


def merge_own(own, regions) -> list[tuple[int, int]]:
    """The model's own regions plus the solver's regions that are disjoint from them or contain them."""
    out = list(own)
    for s, e in regions:
        if all(e < a or b < s or (s <= a and b <= e and (s, e) != (a, b)) for a, b in own):
            out.append((s, e))
    return out


def kept_saved(regions, saved) -> tuple[int, ...]:
    """Saved ops still inside a region after the regions moved (a moved region's cache may not reach them)."""
    return tuple(i for i in saved if any(s <= i <= e for s, e in regions))


def finish_regions(problem: Problem, graph_module, regions, own: Regions = ()) -> tuple[Regions, list[str]]:
    """A solver's regions after what happens to every plan: the model's own regions merged in (`own`,
    when they are kept), cuts moved off in-place writes (safe_regions). Returns (regions, notes)."""
    regions = list(regions)
    if own:
        regions = merge_own(own, regions)
    notes: list[str] = []
    for _ in range(4):  # until stable: rewrite() runs safe_regions again on what it is given
        safe, moved = safe_regions(graph_module, regions)
        notes += moved
        if sorted(safe) == sorted(tuple(r) for r in regions):
            break
        regions = safe
    return normalize_regions(problem, safe), notes


def per_block_regions(problem: Problem, graph_module) -> Regions:
    """The step checkpointed per block (one region per numbered block, else about sqrt(n) even runs),
    finished as every plan is: where the plain step was never run, what a plan's step is compared and
    raced with (its recompute is the model's own forward, so its step equals the plain step's)."""
    from ..solvers.costs import trim_flat_regions
    from ..solvers.heuristics.basic import uniform
    from ..solvers.heuristics.selective import block_regions

    regions = block_regions(problem) or trim_flat_regions(problem, uniform(problem).regions)
    return finish_regions(problem, graph_module, regions)[0]


# -- whole modules only -----------------------------------------------------------------


@dataclass(frozen=True)
class ModuleCandidate:
    """A plan made of whole modules, simulated on the plan's Problem."""

    name: str
    """'as planned' (the plan's own regions are whole modules), 'nearest', 'per block' or 'greedy'."""
    spans: tuple[tuple[int, int], ...]
    paths: tuple[str, ...]
    peak_bytes: int
    recompute_s: float

    def fits(self, budget_bytes: int | None) -> bool:
        return budget_bytes is None or self.peak_bytes <= budget_bytes


def _candidate(name: str, problem: Problem, spans: Sequence[tuple[int, int]], paths_of: dict) -> ModuleCandidate:
    spans = sorted(set(spans), key=lambda sp: (sp[0], -sp[1]))
    sim = simulate(problem, spans)
    return ModuleCandidate(name, tuple(spans), tuple(paths_of[sp] for sp in spans), sim.peak_bytes, sim.recompute_time)


def _blocks(spans: dict[tuple[int, int], str], model: torch.nn.Module) -> list[tuple[int, int]]:
    """Spans of the outermost modules held in a ModuleList or Sequential of two or more (the repeated blocks)."""
    modules = dict(model.named_modules())
    out = []
    for sp, path in spans.items():
        parent = path.rpartition(".")[0]
        container = modules.get(parent)
        if isinstance(container, (torch.nn.ModuleList, torch.nn.Sequential)) and len(container) > 1:
            out.append(sp)
    return [sp for sp in out if not any(o != sp and o[0] <= sp[0] and sp[1] <= o[1] for o in out)]


def _greedy(problem: Problem, spans: dict[tuple[int, int], str], budget_bytes: int | None) -> list[tuple[int, int]]:
    """Disjoint whole modules added one at a time, the most peak lowered per recompute second first,
    until the budget is met; then modules whose removal keeps it met are dropped."""
    target = budget_bytes if budget_bytes is not None else 0
    chosen: list[tuple[int, int]] = []
    sim = simulate(problem, chosen)
    while sim.peak_bytes > target:
        best = None
        for sp in spans:
            if any(not (sp[1] < c[0] or c[1] < sp[0]) for c in chosen):
                continue
            trial = simulate(problem, [*chosen, sp])
            gain = sim.peak_bytes - trial.peak_bytes
            if gain <= 0:
                continue
            score = gain / max(trial.recompute_time - sim.recompute_time, 1e-9)
            if best is None or score > best[0]:
                best = (score, sp, trial)
        if best is None:
            break
        chosen.append(best[1])
        sim = best[2]
    limit = max(target, sim.peak_bytes)
    for sp in sorted(chosen, key=lambda s: s[1] - s[0]):
        trial = [c for c in chosen if c != sp]
        if simulate(problem, trial).peak_bytes <= limit:
            chosen = trial
    return chosen


def module_candidates(plan: Any, model: torch.nn.Module) -> list[ModuleCandidate]:
    """Whole-module plans for `plan` (which must carry its Problem), each simulated: the plan itself
    when its regions are whole modules, else the nearest whole-module plan, every repeated block, and
    a greedy pick by peak lowered per recompute second."""
    problem: Problem | None = getattr(plan, "problem", None)
    if problem is None:
        raise ValueError("plan: no Problem (a plan loaded from a file); plan with optimize() first")
    model = _unwrap(model)
    nearest, spans, misaligned = module_aligned(problem, model, plan.spans(), plan.budget_bytes)
    if not misaligned and not any(r.saved_positions for r in plan.regions):
        return [_candidate("as planned", problem, nearest, spans)]
    out = [_candidate("nearest", problem, nearest, spans)]
    blocks = _blocks(spans, model)
    if blocks:
        out.append(_candidate("per block", problem, blocks, spans))
    out.append(_candidate("greedy", problem, _greedy(problem, spans, plan.budget_bytes), spans))
    return out


def best_module_plan(candidates: Sequence[ModuleCandidate], budget_bytes: int | None) -> ModuleCandidate:
    """The candidate within the budget with the least recompute (then the lower peak); else the lowest peak."""
    fitting = [c for c in candidates if c.fits(budget_bytes)]
    if fitting:
        return min(fitting, key=lambda c: (c.recompute_s, c.peak_bytes))
    return min(candidates, key=lambda c: (c.peak_bytes, c.recompute_s))
