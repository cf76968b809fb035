"""`ilp` never loses to `dp`: its smallest budget is no larger, and at any budget dp fits, it fits with no
more recompute.

The MILP alone is exact over flat plans only; dp's nested (multi-level) plans reach lower peaks, and a
coarsened MILP can miss plans dp or uniform segments find on the fine graph. Costs are fixed numbers.
"""

from __future__ import annotations

import random

from ckpt_planner.solvers import InfeasibleBudgetError, Node, Problem, Storage, simulate, solve
from ckpt_planner.solvers.exact.bruteforce import bruteforce
from ckpt_planner.solvers.simulate import region_parents

from .test_solvers_problems import random_chain, random_dag

REL = 1e-9


def smallest(problem: Problem, solver: str, **options) -> int:
    """The smallest budget `solver` names (or the peak of its plan, when a budget of 0 fits)."""
    try:
        return solve(problem, 0, solver=solver, **options).peak_bytes
    except InfeasibleBudgetError as e:
        return e.smallest_bytes


def assert_not_worse(problem: Problem, **ilp_options) -> None:
    """ilp's smallest budget <= dp's, and at dp's smallest (and midway to no checkpointing) ilp fits with
    no more recompute than dp."""
    least_dp = smallest(problem, "dp")
    least_ilp = smallest(problem, "ilp", **ilp_options)
    assert least_ilp <= least_dp, (least_ilp, least_dp)
    for budget in sorted({least_dp, (least_dp + simulate(problem, ()).peak_bytes) // 2}):
        by_dp = solve(problem, budget, solver="dp")
        by_ilp = solve(problem, budget, solver="ilp", **ilp_options)  # raises when it fits nothing
        assert by_ilp.peak_bytes <= budget
        assert by_ilp.recompute_time <= by_dp.recompute_time + REL * max(1.0, problem.total_time)
    # The smallest budget ilp names is one it fits.
    assert solve(problem, least_ilp, solver="ilp", **ilp_options).peak_bytes <= least_ilp


def mlp_stack_bf16(blocks: int = 4) -> Problem:
    """An MLP stack (Linear 64->256, GELU, Linear 256->64, Tanh per block; batch 256) as captured under bf16
    autocast with FLOP times: each Linear also keeps a bf16 cast. # bytes, seconds"""
    nodes, storages = [], []
    last = 4 * blocks - 1
    for b in range(blocks):
        i, t = 4 * b, 6 * b  # first node and first storage of the block
        spec = [  # op, time, output-gradient bytes, parameter-gradient bytes, storages read
            ("Linear", 8.388608e-05, 131072, 66560, (t - 1,) if b else ()),
            ("GELU", 1.31072e-05, 131072, 0, (t,)),
            ("Linear", 8.388608e-05, 32768, 65792, (t + 2,)),
            ("Tanh", 3.2768e-06, 32768, 0, (t + 3,)),
        ]
        for j, (op, time, grad, param_grad, reads) in enumerate(spec):
            k = i + j
            nodes.append(
                Node(
                    name=f"_{b}_{j}", time=time, grad_bytes=grad, param_grad_bytes=param_grad,
                    backward_temp_bytes=97796 if k == 0 else (4 if k == last else 0),
                    inputs=(k - 1,) if k else (), reads=reads, is_output=k == last,
                    module=f"{b}.{j}", op=op, saveable=True,
                )
            )
        out_last = i + 3 == last
        storages += [
            Storage(producer=i, nbytes=131072, last_use=i + 1, saved_by=(i + 1,)),  # first Linear's output, bf16 [256, 256]
            Storage(producer=i, nbytes=32768, last_use=i, saved_by=(i,)),  # a bf16 cast the Linear saves, [256, 64]
            Storage(producer=i + 1, nbytes=131072, last_use=i + 2, saved_by=(i + 2,)),  # GELU's output, bf16 [256, 256]
            Storage(producer=i + 2, nbytes=32768, last_use=i + 3, saved_by=()),  # second Linear's output, bf16 [256, 64]
            Storage(producer=i + 2, nbytes=32768, last_use=i + 2, saved_by=(i + 2,)),  # a bf16 cast it saves, [256, 64]
            Storage(
                producer=i + 3, nbytes=32768, last_use=i + 3 if out_last else i + 4,
                saved_by=(i + 3,) if out_last else (i + 3, i + 4), is_output=out_last,
            ),  # Tanh out, the next block's input
        ]
    return Problem(nodes=tuple(nodes), storages=tuple(storages), param_bytes=529408, input_bytes=65536, name="mlp_bf16")


def test_mlp_stack_under_autocast_ilp_meets_dps_smallest_budget():
    problem = mlp_stack_bf16()
    assert smallest(problem, "dp") == 1483776  # a three-level nested plan on the first block
    assert_not_worse(problem)


def test_flat_only_ilp_keeps_to_flat_plans():
    problem = mlp_stack_bf16()
    least_flat = smallest(problem, "ilp", nested=False)
    assert least_flat == 1578240 > smallest(problem, "dp")  # the flat plans cannot reach dp's nested one
    plan = solve(problem, least_flat, solver="ilp", nested=False)
    assert all(parent < 0 for parent in region_parents(plan.regions))


def test_ilp_never_loses_to_dp_on_random_problems():
    for seed in range(10):
        rng = random.Random(seed)
        n = rng.randint(4, 12)
        assert_not_worse(random_chain(rng, n) if seed % 2 == 0 else random_dag(rng, n))


def test_coarsened_ilp_never_loses_to_dp_nor_uniform():
    options = {"max_nodes": 4, "time_limit": 5.0}
    for seed in range(6):
        rng = random.Random(100 + seed)
        n = rng.randint(10, 16)
        problem = random_chain(rng, n) if seed % 2 == 0 else random_dag(rng, n)
        assert_not_worse(problem, **options)
        least = smallest(problem, "ilp", **options)
        assert least <= min(smallest(problem, name) for name in ("uniform", "greedy")), seed


def test_ilp_matches_the_nested_brute_force_on_chains():
    """On chains whose every node saves something dp is exact over the rotor family, and ilp no worse."""
    for seed in range(8):
        rng = random.Random(200 + seed)
        problem = random_chain(rng, rng.randint(3, 6))
        least = bruteforce(problem, 0, space="rotor").stats["min_peak_bytes"]
        assert smallest(problem, "ilp") <= least, seed
        base = simulate(problem, ()).peak_bytes
        for budget in sorted({least, (least + base) // 2}):
            best = simulate(problem, bruteforce(problem, budget, space="rotor").regions)
            found = solve(problem, budget, solver="ilp", selective=False)
            assert found.recompute_time <= best.recompute_time + REL * problem.total_time, (seed, budget)
