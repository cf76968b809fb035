"""The plans people write by hand, as plans of our own space.

transformers' `activation_checkpointing_enable(every_n_layers=n)` checkpoints the decoder layers whose
index is a multiple of n; Megatron and torch.compile's selective policy keep matmul, convolution and
attention outputs inside one region per block. They are the first thing users try, so every solve
builds them too, prices them with the same simulator and keeps them where they win:

* `every_n`: one region per repeated block (`selective.block_regions`), for the blocks 0, n, 2n, ...
  (n = 1 ... L), each also with the last block left out (its activations are the first the backward
  needs, so checkpointing it often saves nothing at the peak and always costs a recompute);
* `per_block_selective`: the `selective` policy at the budget;
* each of these region plans again with the kept ops that pay for themselves (`refine_saved`).

`structured_plans` lists them (name, regions, kept ops); the `structured` solver returns the one with
the least predicted recompute that fits, and `auto` runs it beside the others.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..costs import recompute_time
from ..figures import SimResult
from ..problem import Problem
from ..registry import SolverResult, register
from ..simulate import simulate
from .selective import block_regions, refine_saved, selective

__all__ = ["Structured", "structured_plans", "every_n_plans", "structured"]

REFINED = 2
"""Region plans (the fastest that fit) given kept ops by `refine_saved`."""


@dataclass(frozen=True)
class Structured:
    """One hand-written plan: a name a person recognises, its regions and kept ops."""

    name: str
    """'every_2', 'every_2_but_last', 'per_block_selective', with '+kept' when kept ops were added."""
    regions: tuple[tuple[int, int], ...]
    saved: tuple[int, ...] = ()


def every_n_plans(problem: Problem) -> list[Structured]:
    """Blocks 0, n, 2n, ... checkpointed (n = 1 ... L), and each without the last block; duplicates once."""
    blocks = block_regions(problem)
    out: list[Structured] = []
    seen: set[tuple[tuple[int, int], ...]] = set()
    for n in range(1, len(blocks) + 1):
        chosen = tuple(blocks[::n])
        variants = [(f"every_{n}", chosen)]
        if chosen and chosen[-1] == blocks[-1] and len(chosen) > 1:
            variants.append((f"every_{n}_but_last", chosen[:-1]))
        for name, regions in variants:
            if regions and regions not in seen:
                seen.add(regions)
                out.append(Structured(name, regions))
    return out


def structured_plans(problem: Problem, budget_bytes: int | None, *, refine: bool = True) -> list[Structured]:
    """Every hand-written plan of `problem` (see the module docstring); with a budget and `refine`, each
    region plan also with the kept ops that lower its predicted time while it fits."""
    return [plan for plan, _ in _priced_plans(problem, budget_bytes, refine)]


def _priced_plans(problem: Problem, budget_bytes: int | None, refine: bool) -> list[tuple[Structured, SimResult]]:
    """`structured_plans` with each plan's simulated figures: every plan is simulated once (on a model of L
    blocks there are about 2 L of them, each a region plan of its own)."""
    plans = every_n_plans(problem)
    if not plans:
        return []
    sel = selective(problem, budget_bytes)
    if sel.regions:
        plans.append(Structured("per_block_selective", tuple(sel.regions), tuple(sel.saved)))
    priced = [(plan, simulate(problem, plan.regions, saved=plan.saved)) for plan in plans]
    if refine and budget_bytes is not None and any(node.saveable for node in problem.nodes):
        # Kept ops only add memory: refine the fastest few region plans that fit (refine_saved runs
        # dozens of simulations per plan).
        fitting = sorted(
            (sim.recompute_time, k, plan) for k, (plan, sim) in enumerate(priced)
            if not plan.saved and sim.peak_bytes <= budget_bytes
        )
        for _, _, plan in fitting[:REFINED]:
            saved, _, peak = refine_saved(problem, plan.regions, budget_bytes, plan.saved)
            if saved != plan.saved and peak <= budget_bytes:
                kept = Structured(f"{plan.name}+kept", plan.regions, saved)
                priced.append((kept, simulate(problem, kept.regions, saved=kept.saved)))
    return priced


@register("structured")
def structured(problem: Problem, budget_bytes: int | None = None) -> SolverResult:
    """The hand-written plan with the least predicted recompute that fits; with no budget, or when none
    fits, the one with the lowest peak (the caller reports it)."""
    priced = _priced_plans(problem, budget_bytes, True)
    if not priced:
        return SolverResult(regions=(), stats={"blocks": 0, "min_peak_bytes": simulate(problem, ()).peak_bytes})
    scored = []
    for plan, sim in priced:
        fits = budget_bytes is not None and sim.peak_bytes <= budget_bytes
        key = (not fits, sim.recompute_time if fits else sim.peak_bytes, sim.peak_bytes, plan.name)
        scored.append((key, plan, sim.peak_bytes))
    scored.sort(key=lambda t: t[0])
    _, best, _ = scored[0]
    stats = {
        "structured": best.name,
        "candidates": len(priced),
        "min_peak_bytes": min(p for _, _, p in scored),
        "recompute_time": recompute_time(problem, best.regions, best.saved),
    }
    return SolverResult(regions=best.regions, saved=best.saved, stats=stats)
