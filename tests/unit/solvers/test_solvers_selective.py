"""Op-level selective recompute and the per-call costs in the simulator and the solvers.

* The simulator replays a selective region exactly: a hand-computed chain.
* `recompute_time` (solvers' objective) equals the simulator's, call costs included.
* Brute force over the selective space (flat plans x saved subsets) is never worse than over flat plans;
  dp and ilp with saved ops fit their budget, never beat that optimum and never lose to their own
  region-only plans.
* The `selective` baseline keeps the matmuls of one region per block.
"""

from __future__ import annotations

import dataclasses
import random

from ckpt_planner.solvers import InfeasibleBudgetError, Node, Problem, Storage, simulate, solve
from ckpt_planner.solvers.costs import recompute_time
from ckpt_planner.solvers.exact.bruteforce import bruteforce, enumerate_selective
from ckpt_planner.solvers.simulate import region_parents
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .test_solvers_problems import random_dag

SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def chain3(**overheads) -> Problem:
    """a -> b -> c: each makes 100 bytes that the next node's backward keeps; c's output is the output."""
    nodes = (
        Node(name="a", time=1.0, saveable=True),
        Node(name="b", time=2.0, inputs=(0,), reads=(0,), saveable=True),
        Node(name="c", time=3.0, inputs=(1,), reads=(1,), is_output=True, saveable=True),
    )
    storages = (
        Storage(producer=0, nbytes=100, last_use=1, saved_by=(1,)),
        Storage(producer=1, nbytes=100, last_use=2, saved_by=(2,)),
        Storage(producer=2, nbytes=100, last_use=2, is_output=True),
    )
    return Problem(nodes=nodes, storages=storages, **overheads)


def test_selective_region_by_hand():
    problem = chain3()
    plain = simulate(problem, [(0, 1)])
    assert plain.recompute_time == 3.0  # a and b re-run
    assert plain.peak_bytes == 300  # c's output + a and b recomputed at b's backward
    kept = simulate(problem, [(0, 1)], saved=[0], timeline=True)
    assert kept.recompute_time == 2.0  # only b re-runs; a's output comes from the cache
    # a's output stays from the forward to b's backward: the forward holds a, b and c at once.
    forward_peak = max(b for phase, _node, b in kept.timeline if phase == "forward")
    assert forward_peak == 300
    assert max(b for phase, _node, b in simulate(problem, [(0, 1)], timeline=True).timeline if phase == "forward") == 200
    assert kept.timeline[-1][2] == 100  # everything but the output is freed at the end


def test_call_costs_are_counted():
    problem = chain3(region_overhead_s=0.5, op_overhead_s=0.01)
    assert simulate(problem, [(0, 1)]).recompute_time == 3.5
    sim = simulate(problem, [(0, 1)], saved=[0])
    # 2 s of recompute, one call, and the policy on a's op plus its mode, in the forward and the recompute.
    assert abs(sim.recompute_time - (2.0 + 0.5 + 0.04)) < 1e-12
    assert abs(sim.call_time - 0.54) < 1e-12
    assert abs(recompute_time(problem, [(0, 1)], [0]) - sim.recompute_time) < 1e-12


def test_only_kept_nodes_pay_the_policy():
    """a -> b -> c -> d: b keeps a's output, c keeps nothing, so a region (a, c) recomputes up to b. A kept
    node pays the policy on its own ops plus one (entering its mode), in the forward and, where the
    recompute reaches it, again; the region's other nodes pay nothing."""
    nodes = (
        Node(name="a", time=1.0, saveable=True, dispatch_ops=3),
        Node(name="b", time=2.0, inputs=(0,), reads=(0,), saveable=True, dispatch_ops=1),
        Node(name="c", time=4.0, inputs=(1,), reads=(1,), saveable=True, dispatch_ops=5),
        Node(name="d", time=8.0, inputs=(2,), reads=(2,), is_output=True),
    )
    storages = (
        Storage(producer=0, nbytes=100, last_use=1, saved_by=(1,)),
        Storage(producer=1, nbytes=100, last_use=2),
        Storage(producer=2, nbytes=100, last_use=3, saved_by=(3,)),
        Storage(producer=3, nbytes=100, last_use=3, is_output=True),
    )
    problem = Problem(nodes=nodes, storages=storages, region_overhead_s=0.5, op_overhead_s=0.01)
    region = [(0, 2)]
    cases = {(): 0.5, (0,): 0.5 + 0.01 * 4 * 2, (2,): 0.5 + 0.01 * 6, (0, 2): 0.5 + 0.08 + 0.06, (1,): 0.5 + 0.01 * 2 * 2}
    for saved, calls in cases.items():
        sim = simulate(problem, region, saved=saved)
        assert abs(sim.call_time - calls) < 1e-12, saved
        assert abs(recompute_time(problem, region, saved) - sim.recompute_time) < 1e-12


def saveable_dag(seed: int, n: int) -> Problem:
    rng = random.Random(seed)
    problem = random_dag(rng, n)
    nodes = tuple(dataclasses.replace(node, saveable=rng.random() < 0.6) for node in problem.nodes)
    return dataclasses.replace(problem, nodes=nodes, region_overhead_s=rng.choice([0.0, 0.1]), op_overhead_s=0.01)


@SETTINGS
@given(st.integers(0, 2**32), st.integers(1, 7), st.integers(0, 2**32))
def test_recompute_time_matches_simulate_selective(seed, n, pick):
    problem = saveable_dag(seed, n)
    pairs = list(enumerate_selective(problem))
    regions, saved = random.Random(pick).choice(pairs)
    assert abs(recompute_time(problem, regions, saved) - simulate(problem, regions, saved=saved).recompute_time) <= 1e-9


def _budget(problem: Problem, seed: int) -> int:
    rng = random.Random(seed)
    base = simulate(problem, ()).peak_bytes
    low = bruteforce(problem, 0, space="flat").stats["min_peak_bytes"]
    return rng.randint(min(low, base), base)


@SETTINGS
@given(st.integers(0, 2**32), st.integers(2, 7), st.integers(0, 2**32))
def test_solvers_against_selective_bruteforce(seed, n, bseed):
    problem = saveable_dag(seed, n)
    budget = _budget(problem, bseed)
    best_sel = bruteforce(problem, budget, space="selective")
    best_flat = bruteforce(problem, budget, space="flat")
    sel = simulate(problem, best_sel.regions, saved=best_sel.saved)
    flat = simulate(problem, best_flat.regions)
    if flat.peak_bytes > budget:
        return  # infeasible for regions alone (saved ops only add memory): nothing to compare
    assert sel.peak_bytes <= budget
    assert sel.recompute_time <= flat.recompute_time + 1e-12
    for name in ("ilp", "dp"):
        try:
            joint = solve(problem, budget, solver=name)
            alone = solve(problem, budget, solver=name, selective=False)
        except InfeasibleBudgetError:
            continue
        assert joint.peak_bytes <= budget
        assert joint.peak_bytes == simulate(problem, joint.regions, saved=joint.saved).peak_bytes
        if all(parent < 0 for parent in region_parents(tuple(joint.regions))):
            # the exhaustive space is flat regions with kept ops; dp may also nest, and a nested plan may beat it
            assert joint.recompute_time >= sel.recompute_time - 1e-9  # never beats the exhaustive optimum
        assert joint.recompute_time <= alone.recompute_time + 1e-12  # saved ops are added only when they pay
    assert abs(solve(problem, budget, solver="ilp", selective=False, nested=False).recompute_time - flat.recompute_time) <= 1e-9


def chain4() -> Problem:
    """a (1 s, 100 B) -> b (4 s, 10 B) -> c (1 s, 100 B) -> d (1 s, 10 B) -> out: keep b, recompute a."""
    sizes, times = [100, 10, 100, 10], [1.0, 4.0, 1.0, 1.0]
    nodes, storages = [], []
    for i, (nbytes, time) in enumerate(zip(sizes, times)):
        prev = (i - 1,) if i else ()
        nodes.append(Node(name=f"n{i}", time=time, inputs=prev, reads=prev, saveable=True))
        storages.append(Storage(producer=i, nbytes=nbytes, last_use=i + 1, saved_by=(i + 1,)))
    nodes.append(Node(name="out", time=1.0, inputs=(3,), reads=(3,), is_output=True))
    storages.append(Storage(producer=4, nbytes=1, last_use=4, is_output=True))
    return Problem(nodes=tuple(nodes), storages=tuple(storages), op_overhead_s=0.01)


def test_joint_choice_on_a_hand_chain():
    problem, budget = chain4(), 150
    assert simulate(problem).peak_bytes == 221
    best = bruteforce(problem, budget, space="selective")
    assert best.regions == ((0, 1),) and best.saved == (1,)  # b kept: only a re-runs
    assert abs(simulate(problem, best.regions, saved=best.saved).recompute_time - (1.0 + 4 * 0.01)) < 1e-12
    for name in ("ilp", "dp"):
        joint = solve(problem, budget, solver=name)
        assert (joint.regions, joint.saved) == (((0, 1),), (1,)), name
        assert solve(problem, budget, solver=name, selective=False).recompute_time == 5.0


def block_problem(layers: int = 3) -> Problem:
    """Per block: mm (big time, 8 bytes), gelu (cheap, 8 bytes), each saved by the next node."""
    nodes, storages = [], []
    for b in range(layers):
        for k, (op, time) in enumerate((("aten.mm.default", 4.0), ("aten.gelu.default", 0.5))):
            i = len(nodes)
            prev = (i - 1,) if i else ()
            nodes.append(
                Node(
                    name=f"n{i}",
                    time=time,
                    inputs=prev,
                    reads=tuple(t for t in range(len(storages)) if storages[t].producer == i - 1),
                    module=f"h.{b}.{'mlp' if k else 'fc'}",
                    op=op,
                    saveable=True,
                )
            )
            storages.append(Storage(producer=i, nbytes=8, last_use=i + 1, saved_by=(i + 1,)))
    last = len(nodes)
    nodes.append(Node(name="head", time=1.0, inputs=(last - 1,), reads=(len(storages) - 1,), is_output=True, op="aten.sum.default"))
    storages.append(Storage(producer=last, nbytes=1, last_use=last, is_output=True))
    storages[-2] = dataclasses.replace(storages[-2], last_use=last, saved_by=(last,))
    return Problem(nodes=tuple(nodes), storages=tuple(storages))


def test_selective_baseline_keeps_matmuls_per_block():
    problem = block_problem()
    result = solve(problem, None, solver="selective")
    assert result.regions == ((0, 1), (2, 3), (4, 5))
    assert result.saved == (0, 2, 4)  # the mm of each block
    # Only the gelus would re-run, but each block's gelu output is saved by the next block: no savers left
    # to trigger its recompute except within the block.
    assert result.recompute_time <= simulate(problem, result.regions).recompute_time


def test_a_plain_plan_that_recomputes_less_replaces_the_solvers_own():
    """dp's stages or a coarsened, time-limited MILP can miss a plain plan (one region per block) that a
    candidate list holds; when it fits and recomputes less, `with_saved` returns it even though it keeps
    no op (it used to want a saved op before it replaced the solver's plan)."""
    from ckpt_planner.solvers.heuristics.selective import with_saved
    from ckpt_planner.solvers.registry import SolverResult

    nodes, storages = [], []
    for i in range(6):  # a chain; node i's backward keeps node i-1's output; only the last node is saveable
        storages.append(Storage(producer=i, nbytes=100, last_use=min(i + 1, 5), saved_by=(i + 1,) if i < 5 else ()))
        nodes.append(Node(name=f"n{i}", time=1.0 + i, inputs=(i - 1,) if i else (), reads=(i - 1,) if i else (),
                          saveable=i == 5))
    problem = Problem(nodes=tuple(nodes), storages=tuple(storages))
    solvers_own, plain = ((0, 5),), ((0, 2), (3, 4))
    budget = simulate(problem, solvers_own).peak_bytes
    assert simulate(problem, plain).peak_bytes <= budget
    assert recompute_time(problem, plain) < recompute_time(problem, solvers_own)
    out = with_saved(problem, budget, SolverResult(regions=solvers_own), [plain])
    assert (out.regions, out.saved) == (plain, ())
    assert out.stats["region_plan_recompute_time"] == recompute_time(problem, solvers_own)
