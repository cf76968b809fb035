"""Random Problems for the solver tests, and checks of the generators and cost helpers."""

from __future__ import annotations

import random

from ckpt_planner.solvers import Node, Problem, Storage, simulate
from ckpt_planner.solvers.costs import grad_bytes_by_step, recompute_time, trim_flat_regions
from ckpt_planner.solvers.exact.bruteforce import enumerate_plans
from hypothesis import given, settings
from hypothesis import strategies as st


def random_chain(rng: random.Random, n: int, scale: int = 1) -> Problem:
    """A chain on which `dp`'s model is exact: node i reads only a_{i-1}; every node saves something.

    Node i makes its output a_i (read by i + 1, saved by a random subset of
    {i, i + 1}) and an internal storage b_i that its own backward keeps.
    """
    nodes, storages = [], []
    for i in range(n):
        last = i == n - 1
        a = len(storages)
        savers = tuple(k for k in (i, i + 1) if k < n and rng.random() < 0.5)
        storages.append(
            Storage(
                producer=i,
                nbytes=scale * rng.randint(0, 12),
                last_use=i if last else i + 1,
                saved_by=savers,
                is_output=last and rng.random() < 0.5,
            )
        )
        storages.append(Storage(producer=i, nbytes=scale * rng.randint(0, 12), last_use=i, saved_by=(i,)))
        nodes.append(
            Node(
                name=f"n{i}",
                time=rng.choice([0.5, 1.0, 1.5, 2.0, 3.0]),
                temp_bytes=scale * rng.randint(0, 6),
                grad_bytes=scale * rng.randint(0, 8),
                param_grad_bytes=scale * rng.choice([0, 0, 2, 4]),
                inputs=(i - 1,) if i else (),
                reads=(a - 2,) if i else (),
                recomputable=rng.random() < 0.9,
            )
        )
    return Problem(nodes=tuple(nodes), storages=tuple(storages), param_bytes=scale * rng.randint(0, 10), name="chain")


def random_dag(rng: random.Random, n: int) -> Problem:
    """A DAG with skip connections and multi-consumer storages; saved_by within readers and producer."""
    nodes: list[Node] = []
    produced: list[list[int]] = []  # storage indices made by each node
    spec: list[dict] = []
    for i in range(n):
        inputs = set()
        if i:
            inputs.add(i - 1)
            for j in range(i - 1):
                if rng.random() < 0.25:
                    inputs.add(j)
        inputs = tuple(sorted(inputs))
        reads = tuple(t for j in inputs for t in produced[j] if rng.random() < 0.8 or t == produced[j][0])
        produced.append([])
        for _ in range(rng.choice([1, 1, 2])):
            produced[i].append(len(spec))
            spec.append({"producer": i, "nbytes": rng.randint(0, 20), "readers": []})
        for t in reads:
            spec[t]["readers"].append(i)
        nodes.append(
            Node(
                name=f"n{i}",
                time=rng.choice([0.25, 0.5, 1.0, 2.0, 4.0]),
                temp_bytes=rng.randint(0, 4),
                grad_bytes=rng.randint(0, 4),
                param_grad_bytes=rng.choice([0, 0, 1]),
                inputs=inputs,
                reads=reads,
                recomputable=rng.random() < 0.9,
            )
        )
    storages = []
    for t, d in enumerate(spec):
        p, readers = d["producer"], d["readers"]
        pool = [p, *readers]
        saved = tuple(sorted({k for k in pool if rng.random() < 0.4}))
        storages.append(
            Storage(
                producer=p,
                nbytes=d["nbytes"],
                last_use=max([p, *readers]),
                saved_by=saved,
                is_output=(p == n - 1 and t == produced[p][0]) or rng.random() < 0.03,
            )
        )
    return Problem(
        nodes=tuple(nodes),
        storages=tuple(storages),
        param_bytes=rng.randint(0, 30),
        input_bytes=rng.randint(0, 5),
        name="dag",
    )


def chains(min_n: int = 1, max_n: int = 7):
    return st.builds(
        lambda seed, n, scale: random_chain(random.Random(seed), n, scale),
        st.integers(0, 2**32),
        st.integers(min_n, max_n),
        st.sampled_from([1, 1, 1000]),
    )


def dags(min_n: int = 1, max_n: int = 12):
    return st.builds(
        lambda seed, n: random_dag(random.Random(seed), n), st.integers(0, 2**32), st.integers(min_n, max_n)
    )


def random_plan(rng: random.Random, problem: Problem, space: str) -> tuple:
    plans = list(enumerate_plans(problem, space))
    return rng.choice(plans)


@settings(max_examples=40, deadline=None)
@given(dags(1, 9), st.integers(0, 2**32))
def test_recompute_time_matches_simulate(problem, seed):
    plan = random_plan(random.Random(seed), problem, "nested" if problem.n <= 6 else "flat")
    assert abs(recompute_time(problem, plan) - simulate(problem, plan).recompute_time) <= 1e-9


@settings(max_examples=40, deadline=None)
@given(dags(1, 9), st.integers(0, 2**32))
def test_trimming_flat_regions_never_hurts(problem, seed):
    plan = random_plan(random.Random(seed), problem, "flat")
    a, b = simulate(problem, plan), simulate(problem, trim_flat_regions(problem, plan))
    assert b.peak_bytes <= a.peak_bytes and b.recompute_time <= a.recompute_time + 1e-12


@settings(max_examples=30, deadline=None)
@given(dags(1, 10))
def test_gradient_bytes_are_plan_independent(problem):
    at, before = grad_bytes_by_step(problem)
    assert len(at) == len(before) == problem.n
    assert all(
        b <= a + problem.nodes[k].param_grad_bytes + sum(problem.nodes[j].grad_bytes for j in problem.nodes[k].inputs)
        for k, (a, b) in enumerate(zip(at, before))
    )


def test_generators_make_valid_problems():
    rng = random.Random(0)
    for n in range(0, 13):
        assert random_dag(rng, n).n == n
        assert random_chain(rng, n).n == n


def test_space_sizes():
    problem = random_chain(random.Random(1), 5)
    flat = list(enumerate_plans(problem, "flat"))
    assert len(flat) == len(set(flat))
    nested = list(enumerate_plans(problem, "nested"))
    assert len(nested) == len(set(nested)) and set(flat) <= set(nested)
    rotor = list(enumerate_plans(problem, "rotor"))
    assert set(rotor) <= set(nested)
