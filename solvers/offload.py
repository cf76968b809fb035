"""Offloading as a solver step: the offloads to add to a recompute plan so that it fits a budget.

The copy model (which storages a plan may offload, the copy streams, the host bytes) is `copies.py`, which
`simulate` prices; this module searches over it. `ilp_offload` (exact/) chooses regions and offloads in
one MILP; `auto` also adds `choose_offloads` to its best recompute-only plan.
"""

from __future__ import annotations

import itertools

from .copies import backward_prefix, backward_uses, d2h_seconds, h2d_seconds, host_bytes, offloadable
from .plans import normalize_regions, normalize_saved
from .problem import Problem
from .simulate import simulate

__all__ = ["EXHAUSTIVE_CANDIDATES", "choose_offloads", "most_offloaded"]

EXHAUSTIVE_CANDIDATES = 10
"""Offloadable storages up to which `choose_offloads` tries every subset (exact); above, it is greedy."""


def choose_offloads(
    problem: Problem,
    budget_bytes: int,
    regions=(),
    saved=(),
    *,
    exhaustive: int = EXHAUSTIVE_CANDIDATES,
):
    """The offloads to add to a recompute plan so that it fits `budget_bytes` and the host budget with the
    least exposed copy time: (offloaded, SimResult), or None when no offload set it tries fits.

    Exact (every subset of the offloadable storages judged by `simulate`) when at most `exhaustive` of
    them hold bytes; otherwise greedy: storages added cheapest copy first (largest first on ties) until the
    plan fits, then each dropped again when the plan still fits without it."""
    regions = normalize_regions(problem, regions)
    saved = normalize_saved(problem, regions, saved)
    base = simulate(problem, regions, saved=saved)
    if base.peak_bytes <= budget_bytes:
        return (), base
    if not problem.can_offload:
        return None
    storages = problem.storages
    cands = [t for t in offloadable(problem, regions, saved) if storages[t].nbytes > 0]
    cap = problem.host_budget_bytes
    best = None

    def consider(subset) -> None:
        nonlocal best
        sim = simulate(problem, regions, saved=saved, offloaded=subset)
        if sim.peak_bytes <= budget_bytes and (best is None or (sim.recompute_time, sim.peak_bytes) < best[0]):
            best = ((sim.recompute_time, sim.peak_bytes), tuple(subset), sim)

    if len(cands) <= exhaustive:
        for size in range(1, len(cands) + 1):
            for subset in itertools.combinations(cands, size):
                if host_bytes(problem, subset) <= cap:
                    consider(subset)
        return None if best is None else (best[1], best[2])
    prefix = backward_prefix(problem)
    uses = backward_uses(problem, regions, saved)

    def alone(t: int) -> float:
        """The copy's exposure when it has both streams to itself (the cheapest it can be). # seconds"""
        st = storages[t]
        forward_after = sum(node.time for node in problem.nodes[st.producer + 1 :])
        use = uses[t][1]
        return max(0.0, d2h_seconds(problem, st.nbytes) - forward_after) + max(
            0.0, h2d_seconds(problem, st.nbytes) - (prefix[-1] - prefix[use])
        )

    chosen: list[int] = []
    used = 0
    for t in sorted(cands, key=lambda t: (alone(t), -storages[t].nbytes, t)):
        if used + storages[t].nbytes > cap:
            continue
        chosen.append(t)
        used += storages[t].nbytes
        if simulate(problem, regions, saved=saved, offloaded=chosen).peak_bytes <= budget_bytes:
            break
    else:
        return None
    for t in sorted(chosen, key=lambda t: (-alone(t), storages[t].nbytes, t)):  # costliest first
        fewer = [u for u in chosen if u != t]
        if simulate(problem, regions, saved=saved, offloaded=fewer).peak_bytes <= budget_bytes:
            chosen = fewer
    consider(chosen)
    return None if best is None else (best[1], best[2])


def most_offloaded(problem: Problem, plan) -> tuple[int, ...]:
    """The plan's offloadable storages, largest first, as many as the host budget holds: its lowest-peak
    offload set when copies are quick (a bound for the smallest budget a solver names)."""
    regions = normalize_regions(problem, plan.regions)
    uses = backward_uses(problem, regions, normalize_saved(problem, regions, plan.saved))
    out, used = [], 0
    for t in sorted(uses, key=lambda t: (-problem.storages[t].nbytes, t)):
        if 0 < problem.storages[t].nbytes and problem.storages[t].copyable and used + problem.storages[t].nbytes <= problem.host_budget_bytes:
            out.append(t)
            used += problem.storages[t].nbytes
    return tuple(sorted(out))
