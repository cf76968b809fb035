"""Offloading kept storages to pinned host memory: the simulator's model (sweep == replay, the copy schedule on
hand-built graphs), what a plan may offload, and the solvers (exact against brute force where the MILP's
model is the simulator's, never worse than recompute-only, nothing changes without bandwidth)."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
from ckpt_planner.solvers import InfeasibleBudgetError, Node, Problem, ProblemError, Storage, simulate, solve
from ckpt_planner.solvers.copies import backward_prefix, backward_uses, fetch_step, fetch_steps, offloadable, timing
from ckpt_planner.solvers.exact.bruteforce import enumerate_plans
from ckpt_planner.solvers.exact.dp import DPSearch
from ckpt_planner.solvers.offload import choose_offloads
from ckpt_planner.solvers.simulate import replay

from .test_solvers_problems import random_chain, random_dag
from .test_solvers_simulate import figures, kept_ops, nested_plan, with_costs

INF = float("inf")


def offloading(problem: Problem, bandwidth: float, host: int = 10**9) -> Problem:
    return dataclasses.replace(problem, d2h_bytes_per_s=bandwidth, h2d_bytes_per_s=bandwidth, host_budget_bytes=host)


def chain(n: int, nbytes: int = 100, time: float = 1.0) -> Problem:
    """Node i reads a_{i-1} and saves it for its backward (as a Linear saves its input); a_{n-1} is the output."""
    nodes = tuple(
        Node(name=f"n{i}", time=time, inputs=(i - 1,) if i else (), reads=(i - 1,) if i else (), grad_bytes=1)
        for i in range(n)
    )
    storages = tuple(
        Storage(producer=i, nbytes=nbytes, last_use=min(i + 1, n - 1), saved_by=(i + 1,) if i + 1 < n else (i,),
                is_output=i == n - 1)
        for i in range(n)
    )
    return Problem(nodes=nodes, storages=storages, param_bytes=7, name="chain")


def mlp(n: int, a: int = 60) -> Problem:
    """Node i reads a_{i-1} (`a` bytes, saved by node i) and makes a hidden b_i (100 bytes) its own backward
    keeps: recomputing alone still holds every region input at once, offloading holds one or two."""
    nodes, storages = [], []
    for i in range(n):
        nodes.append(Node(name=f"n{i}", time=1.0, inputs=(i - 1,) if i else (), reads=(2 * i - 2,) if i else (), grad_bytes=1))
        storages.append(Storage(producer=i, nbytes=a, last_use=min(i + 1, n - 1), saved_by=(i + 1,) if i + 1 < n else (),
                                is_output=i == n - 1))
        storages.append(Storage(producer=i, nbytes=100, last_use=i, saved_by=(i,)))
    return Problem(nodes=tuple(nodes), storages=tuple(storages), param_bytes=7, name="mlp")


def off_figures(sim) -> tuple:
    return (*figures(sim), sim.offload_time, sim.host_bytes)


def sweeps_match_replays(rng: random.Random, problem: Problem, rounds: int) -> list:
    """`rounds` random nested plans with random offloads, each simulated by the fast sweep and the step-by-step
    replay, which must give the same figures; each plan's (sweep's result, regions, kept ops)."""
    sims = []
    for _ in range(rounds):
        regions = nested_plan(rng, problem)
        saved = kept_ops(rng, problem, regions)
        offloaded = [t for t in offloadable(problem, regions, saved) if rng.random() < 0.6]
        sweep = simulate(problem, regions, saved=saved, offloaded=offloaded)
        assert off_figures(sweep) == off_figures(replay(problem, regions, saved=saved, offloaded=offloaded))
        sims.append((sweep, regions, saved))
    return sims


@pytest.mark.parametrize("seed", range(40))
def test_sweep_equals_replay_with_offloads(seed):
    rng = random.Random(seed)
    base = random_dag(rng, rng.randint(1, 14)) if seed % 2 else random_chain(rng, rng.randint(1, 10))
    problem = offloading(with_costs(rng, base), rng.choice([0.7, 3.0, 40.0, INF]))
    problem = dataclasses.replace(problem, h2d_bytes_per_s=rng.choice([problem.d2h_bytes_per_s, 2.0, INF]))
    for sweep, regions, saved in sweeps_match_replays(rng, problem, rounds=6):
        assert sweep.recompute_time == simulate(problem, regions, saved=saved).recompute_time + sweep.offload_time or (
            sweep.offload_time == 0
        )


def test_no_offloads_changes_nothing():
    rng = random.Random(5)
    problem = random_dag(rng, 12)
    regions = nested_plan(rng, problem)
    plain = simulate(problem, regions)
    assert figures(simulate(offloading(problem, 10.0), regions, offloaded=())) == figures(plain)
    assert plain.offload_time == 0.0 and plain.host_bytes == 0


def test_copy_schedule_on_a_chain():
    problem = chain(3)  # forward ends at 1, 2, 3 s; backward steps take 2 s each
    # a_0: copied from 1 s, 1 s long, done when node 1 (its last reader) ends: off the device from then.
    fast = simulate(offloading(problem, 100.0), offloaded=[0])
    assert fast.offload_time == 0.0 and fast.host_bytes == 100
    at_node_2 = [b for phase, node, b in simulate(offloading(problem, 100.0), offloaded=[0], timeline=True).timeline
                 if (phase, node) == ("forward", 2)]
    assert max(at_node_2) == max(b for phase, node, b in simulate(problem, timeline=True).timeline
                                 if (phase, node) == ("forward", 2)) - 100
    # 4 s to copy: 2 s past the forward's end; 10 s back: issued at step 2, needed at step 1 (2 s later).
    slow = dataclasses.replace(problem, d2h_bytes_per_s=25.0, h2d_bytes_per_s=10.0, host_budget_bytes=100)
    sim = simulate(slow, offloaded=[0])
    assert sim.offload_time == pytest.approx(2.0 + 8.0)
    assert sim.recompute_time == sim.offload_time
    assert off_figures(sim) == off_figures(replay(slow, offloaded=[0]))


def test_prefetches_that_share_the_stream_are_issued_early_enough_to_be_on_time():
    """Two copies of 4 s back, due at steps 1 and 2 of a 12 s backward: each issued where it would be on time
    alone (steps 3 and 4), a_0 waits 2 s behind a_1 on the one stream and arrives late. Laid out back to back
    from the one due last, a_1 is issued at step 5 and both are on time; a copy alone is issued as before."""
    problem = dataclasses.replace(chain(6), d2h_bytes_per_s=INF, h2d_bytes_per_s=25.0, host_budget_bytes=10**9)
    uses = backward_uses(problem, ())
    assert (uses[0][1], uses[1][1]) == (1, 2)
    prefix = backward_prefix(problem)
    assert (fetch_step(prefix, 1, 4.0), fetch_step(prefix, 2, 4.0)) == (3, 4)  # each alone
    both = timing(problem, (), (), {t: uses[t] for t in (0, 1)})
    assert both.fetch == {0: 3, 1: 5} and both.exposed_s == 0.0
    sim = simulate(problem, offloaded=[0, 1])
    assert sim.offload_time == 0.0 and sim.recompute_time == 0.0
    assert off_figures(sim) == off_figures(replay(problem, offloaded=[0, 1]))
    for t in (0, 1):
        assert timing(problem, (), (), {t: uses[t]}).fetch == {t: fetch_step(prefix, uses[t][1], 4.0)}


@pytest.mark.parametrize("seed", range(20))
def test_a_prefetch_is_never_issued_later_than_alone_nor_late_where_the_backward_can_hide_it(seed):
    """The joint schedule issues each copy no later than `fetch_step` would alone, and, under baseline compute,
    a copy is on time wherever the backward before its use is long enough for it and every copy due before it."""
    rng = random.Random(seed)
    n = rng.randint(2, 30)
    prefix = [float(x) for x in itertools.accumulate(rng.choice([0.5, 1.0, 2.0]) for _ in range(n))]
    uses = {t: rng.randrange(n) for t in range(rng.randint(1, 8))}
    seconds = {t: rng.choice([0.0, 0.3, 1.0, 2.5, 6.0]) for t in uses}
    fetch = fetch_steps(prefix, uses, seconds)
    assert all(fetch[t] >= fetch_step(prefix, uses[t], seconds[t]) for t in uses)
    assert fetch_steps(prefix, {0: uses[0]}, {0: seconds[0]}) == {0: fetch_step(prefix, uses[0], seconds[0])}
    # The stream as `timing` runs it, on baseline compute: issued in its order, each waiting for the one before.
    clock = stream = 0.0
    done: dict[int, float] = {}
    for k in range(n - 1, -1, -1):
        for t in sorted((t for t in uses if fetch[t] == k), key=lambda t: (-uses[t], t)):
            stream = max(clock, stream) + seconds[t]
            done[t] = stream
        for t in (t for t in uses if uses[t] == k):
            due = sum(seconds[u] for u in uses if uses[u] >= k)
            if prefix[-1] - prefix[k] >= due:  # room for this copy and every one due before it
                assert done[t] <= prefix[-1] - prefix[k] + 1e-9
        clock = prefix[-1] - prefix[k - 1] if k else prefix[-1]


def test_offloadable_storages_follow_the_plan():
    problem = offloading(chain(4), 100.0)
    assert offloadable(problem) == (0, 1, 2)  # a_3 is the output
    # Region [1, 2]: a_0 is its input (kept), a_1 is recomputed, a_2 is saved by node 3 outside it.
    assert offloadable(problem, [(1, 2)]) == (0, 2)


@pytest.mark.parametrize(
    ("regions", "offloaded", "words"),
    [((), [3], "not kept"), ((), [9], "not a storage"), ([(1, 2)], [1], "not kept")],
)
def test_a_storage_that_is_not_offloadable_is_refused(regions, offloaded, words):
    problem = offloading(chain(4), 100.0)
    with pytest.raises(ProblemError, match="offloaded") as info:
        simulate(problem, regions, offloaded=offloaded)
    assert words in str(info.value)
    with pytest.raises(ProblemError, match="offloaded"):
        replay(problem, regions, offloaded=offloaded)


def test_offloading_needs_bandwidth():
    with pytest.raises(ProblemError, match="offloaded.*bandwidth"):
        simulate(chain(4), offloaded=[0])


def test_problem_round_trip_keeps_the_new_fields_and_loads_old_ones():
    problem = dataclasses.replace(chain(3), d2h_bytes_per_s=1e10, h2d_bytes_per_s=2e10, host_budget_bytes=123)
    back = Problem.from_dict(problem.to_dict())
    assert (back.d2h_bytes_per_s, back.h2d_bytes_per_s, back.host_budget_bytes) == (1e10, 2e10, 123)
    old = {k: v for k, v in problem.to_dict().items() if k not in ("d2h_bytes_per_s", "h2d_bytes_per_s", "host_budget_bytes")}
    assert not Problem.from_dict(old).can_offload
    assert back.fingerprint() == chain(3).fingerprint()  # measured figures stay out of the fingerprint
    with pytest.raises(ProblemError, match="host_budget_bytes"):
        dataclasses.replace(problem, host_budget_bytes=-1)


def brute_force(problem: Problem, budget: int):
    """Least recompute + exposed copy time over flat saver-ended plans x offload sets that fit both budgets."""
    best = None
    for regions in enumerate_plans(problem, "flat_saver_ended"):
        cands = [t for t in offloadable(problem, regions) if problem.storages[t].nbytes > 0]
        for size in range(len(cands) + 1):
            for subset in itertools.combinations(cands, size):
                sim = simulate(problem, regions, offloaded=subset)
                if sim.peak_bytes <= budget and sim.host_bytes <= problem.host_budget_bytes:
                    best = sim.recompute_time if best is None else min(best, sim.recompute_time)
    return best


def small(seed: int, bandwidth: float) -> tuple[Problem, int]:
    rng = random.Random(seed)
    problem = random_dag(rng, rng.randint(2, 6)) if seed % 2 else random_chain(rng, rng.randint(2, 5))
    problem = offloading(problem, bandwidth, host=rng.choice([10, 1000]))
    return problem, rng.randint(problem.fixed_bytes, simulate(problem).peak_bytes)


@pytest.mark.parametrize("seed", range(30))
def test_ilp_offload_is_the_brute_force_optimum_when_copies_are_free(seed):
    problem, budget = small(seed, INF)
    best = brute_force(problem, budget)
    if best is None:
        return  # no flat plan fits: ilp_offload's fallback may still find a nested one
    solution = solve(problem, budget, solver="ilp_offload")
    assert solution.recompute_time == pytest.approx(best, abs=1e-9)
    assert solution.stats.get("host_bytes", 0) <= problem.host_budget_bytes


@pytest.mark.parametrize("seed", range(20))
def test_finite_bandwidth_fits_and_never_beats_brute_force(seed):
    problem, budget = small(seed, 8.0)
    best = brute_force(problem, budget)
    try:
        solution = solve(problem, budget, solver="auto")
    except InfeasibleBudgetError:
        assert best is None
        return
    assert solution.peak_bytes <= budget
    if best is not None and not any(b[0] <= a[1] for a, b in zip(solution.regions, solution.regions[1:])):
        assert solution.recompute_time >= best - 1e-9  # flat answers are in the brute-force space
    recompute_only = dataclasses.replace(problem, d2h_bytes_per_s=0.0, h2d_bytes_per_s=0.0)
    try:
        assert solution.recompute_time <= solve(recompute_only, budget, solver="auto").recompute_time + 1e-12
    except InfeasibleBudgetError:
        pass  # offloading reaches a budget recomputing alone does not


@pytest.mark.parametrize("seed", range(12))
def test_choose_offloads_is_exact_for_a_given_plan(seed):
    problem, budget = small(seed, 5.0)
    found = choose_offloads(problem, budget)
    cands = [t for t in offloadable(problem) if problem.storages[t].nbytes > 0]
    fits = [
        simulate(problem, offloaded=s).recompute_time
        for k in range(len(cands) + 1) for s in itertools.combinations(cands, k)
        if simulate(problem, offloaded=s).peak_bytes <= budget and sum(problem.storages[t].nbytes for t in s) <= problem.host_budget_bytes
    ]
    assert (found is None) == (not fits)
    if found is not None:
        assert found[1].recompute_time == min(fits)


@pytest.mark.parametrize("solver", ["auto", "ilp", "dp"])
@pytest.mark.parametrize("seed", range(6))
def test_zero_bandwidth_never_offloads_and_plans_are_unchanged(solver, seed):
    rng = random.Random(seed)
    problem = random_dag(rng, 10)
    budget = (problem.fixed_bytes + simulate(problem).peak_bytes) // 2
    for variant in (
        dataclasses.replace(problem, d2h_bytes_per_s=0.0, h2d_bytes_per_s=1e12, host_budget_bytes=10**9),
        dataclasses.replace(problem, d2h_bytes_per_s=1e12, h2d_bytes_per_s=1e12, host_budget_bytes=0),
    ):
        try:
            before = solve(problem, budget, solver=solver)
        except InfeasibleBudgetError as e:
            with pytest.raises(InfeasibleBudgetError) as again:
                solve(variant, budget, solver=solver)
            assert again.value.smallest_bytes == e.smallest_bytes
            continue
        after = solve(variant, budget, solver=solver)
        assert after.offloaded == ()
        assert (after.regions, after.saved, after.recompute_time, after.peak_bytes) == (
            before.regions, before.saved, before.recompute_time, before.peak_bytes,
        )


def smallest(problem: Problem) -> int:
    try:
        solve(problem, 0, solver="auto")
    except InfeasibleBudgetError as e:
        return e.smallest_bytes
    return 0


def test_huge_bandwidth_reaches_lower_budgets_at_less_cost_within_the_host_budget():
    problem = mlp(8)
    fast = offloading(problem, INF)
    budget = (smallest(problem) + simulate(problem).peak_bytes) // 2
    recompute = solve(problem, budget, solver="auto")
    offload = solve(fast, budget, solver="auto")
    assert recompute.recompute_time > 0 and offload.recompute_time == 0 and offload.offloaded
    assert smallest(fast) < smallest(problem)
    # A host budget of two hidden states: no more are offloaded, and the plan pays for the rest.
    tight = offloading(problem, INF, host=200)
    capped = solve(tight, budget, solver="auto")
    assert sum(problem.storages[t].nbytes for t in capped.offloaded) <= 200 and capped.stats["host_bytes"] <= 200
    assert capped.peak_bytes <= budget
    assert offload.recompute_time <= capped.recompute_time <= recompute.recompute_time


def test_a_storage_made_inside_its_op_is_never_offloaded():
    """The hidden states of `mlp` made not copyable (as a dropout mask or attention statistics are: a buffer
    the op hands autograd, no output of it where a copy could start): no solver offloads them, and a plan
    that names one is refused, naming the field."""
    problem = mlp(8)
    hidden = [t for t, st in enumerate(problem.storages) if st.nbytes == 100]
    sealed = dataclasses.replace(problem, storages=tuple(
        dataclasses.replace(st, copyable=False) if t in hidden else st for t, st in enumerate(problem.storages)))
    fast, fast_sealed = offloading(problem, INF), offloading(sealed, INF)
    assert set(hidden) <= set(offloadable(fast)) and not set(hidden) & set(offloadable(fast_sealed))
    budget = (smallest(problem) + simulate(problem).peak_bytes) // 2
    assert set(solve(fast, budget, solver="auto").offloaded) & set(hidden)  # the hidden states are worth offloading
    for solver in ("auto", "ilp_offload"):
        plan = solve(fast_sealed, budget, solver=solver)
        assert not set(plan.offloaded) & set(hidden) and plan.peak_bytes <= budget
    with pytest.raises(ProblemError, match=r"offloaded: storage .* \(not copyable\)"):
        simulate(fast_sealed, (), offloaded=(hidden[0],))
    assert sealed.fingerprint() == problem.fingerprint()  # where a copy can start is not the graph's shape


def test_auto_tries_the_recompute_plan_for_the_budget_plus_what_the_forward_can_copy():
    """mlp(12) at 20 B/s: its forward (12 s) moves 240 bytes to the host while compute hides the copies. dp's
    plan for the budget plus those bytes, offloaded down to the budget, recomputes 7 s; the looser budgets
    that follow the plain step's peak (`SPLITS`) keep either too little more or more than the stream moves."""
    plain = mlp(12)
    problem = offloading(plain, 20.0)
    budget = 780
    window = problem.total_time * problem.d2h_bytes_per_s
    base = DPSearch(problem).solve(int(budget + window))
    found = choose_offloads(problem, budget, base.regions, base.saved)
    assert found is not None and found[1].recompute_time == pytest.approx(7.0)
    plan = solve(problem, budget, solver="auto")
    assert plan.peak_bytes <= budget and plan.recompute_time <= found[1].recompute_time
    assert plan.recompute_time < solve(plain, budget, solver="auto").recompute_time
