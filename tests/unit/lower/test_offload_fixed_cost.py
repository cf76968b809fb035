"""A copy's fixed cost, measured and planned with: the offload hooks' host work per storage timed through the real
hooks (on the CPU their numpy path), kept in the timing store beside the bandwidth (the same healing rule), read
into the problem with a simulated bandwidth, given as a simulated figure (`offload_bandwidth=(d2h, h2d, s)`),
and recorded in the plan file so that a loaded plan is re-simulated at the cost it was planned at. No measured
time is asserted: the measurements are replaced by fixed figures wherever a value is compared."""

from __future__ import annotations

import json

import pytest
import torch
from ckpt_planner import Plan
from ckpt_planner.api import Planner
from ckpt_planner.choose.assemble import plan_from_solution
from ckpt_planner.errors import InputError
from ckpt_planner.lower.offload import targets_of
from ckpt_planner.profile import copy_bandwidth as cb
from ckpt_planner.profile.profiler import ProfileConfig
from ckpt_planner.settings import OffloadConfig
from ckpt_planner.solvers.copies import offloadable
from ckpt_planner.solvers.problem import Solution
from ckpt_planner.solvers.simulate import simulate

from tests.models.small import mlp
from tests.support.profiles import FLOP_TIMES_UNSTORED
from tests.support.steps import compare


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A timing store of this test's own, and no figure remembered from another test."""
    monkeypatch.setenv("CKPT_PLANNER_TIMINGS", str(tmp_path))
    monkeypatch.setattr(cb, "_fixed_memo", {})
    return tmp_path


def test_the_hooks_are_timed_through_their_cpu_path():
    pack, unpack = cb.measure_hooks(torch.device("cpu"), storages=2, repeats=1)
    assert pack >= cb.MIN_FIXED_S and unpack >= cb.MIN_FIXED_S


def test_the_fixed_cost_is_stored_and_heals_like_the_bandwidth(store, monkeypatch):
    monkeypatch.setattr(cb, "measure_hooks", lambda device: (2e-5, 1e-5))
    assert cb.fixed_seconds(torch.device("cpu")) == (2e-5, 1e-5)
    (path,) = store.glob("timings-*.json")
    assert json.loads(path.read_text())["copies"][cb.FIXED_KEY] == {"d2h": 2e-5, "h2d": 1e-5}
    # a later run measured under load (4x) reads the stored figure back; a quicker one (half) replaces it
    monkeypatch.setattr(cb, "_fixed_memo", {})
    monkeypatch.setattr(cb, "measure_hooks", lambda device: (8e-5, 4e-5))
    assert cb.fixed_seconds(torch.device("cpu")) == (2e-5, 1e-5)
    monkeypatch.setattr(cb, "_fixed_memo", {})
    monkeypatch.setattr(cb, "measure_hooks", lambda device: (1e-5, 5e-6))
    assert cb.fixed_seconds(torch.device("cpu")) == (1e-5, 5e-6)
    assert json.loads(path.read_text())["copies"][cb.FIXED_KEY] == {"d2h": 1e-5, "h2d": 5e-6}


def test_a_failed_measurement_reads_the_store(store, monkeypatch):
    monkeypatch.setattr(cb, "measure_hooks", lambda device: (3e-5, 2e-5))
    cb.fixed_seconds(torch.device("cpu"))
    monkeypatch.setattr(cb, "_fixed_memo", {})

    def fails(device):
        raise RuntimeError("no pinned memory")

    monkeypatch.setattr(cb, "measure_hooks", fails)
    assert cb.fixed_seconds(torch.device("cpu")) == (3e-5, 2e-5)


def test_the_problem_prices_copies_at_the_given_or_measured_fixed_cost(store, monkeypatch):
    monkeypatch.setattr(cb, "measure_hooks", lambda device: (2e-5, 1e-5))
    model, x = mlp()
    given = Planner(model, x, capture_method="symbolic_trace", profile_config=FLOP_TIMES_UNSTORED,
                    offload_bandwidth=(2e9, 3e9, 4e-5), host_budget_gb=1.0).problem
    assert (given.d2h_bytes_per_s, given.h2d_bytes_per_s, given.d2h_fixed_s, given.h2d_fixed_s) == (2e9, 3e9, 4e-5, 4e-5)
    # FLOP times are not measured, nor is the copies' cost: the plan stays deterministic
    flops = Planner(model, x, capture_method="symbolic_trace", profile_config=FLOP_TIMES_UNSTORED,
                    offload_bandwidth=(2e9, 3e9), host_budget_gb=1.0).problem
    assert (flops.d2h_fixed_s, flops.h2d_fixed_s) == (0.0, 0.0)
    timed = Planner(model, x, capture_method="symbolic_trace", profile_config=ProfileConfig(warmup=0, repeats=1),
                    offload_bandwidth=(2e9, 3e9), host_budget_gb=1.0).problem
    assert (timed.d2h_fixed_s, timed.h2d_fixed_s) == (2e-5, 1e-5)
    # on the CPU without a bandwidth nothing is offloaded, so nothing is priced
    none = Planner(model, x, capture_method="symbolic_trace", profile_config=FLOP_TIMES_UNSTORED).problem
    assert (none.d2h_fixed_s, none.h2d_fixed_s, none.d2h_bytes_per_s) == (0.0, 0.0, 0.0)


def test_offload_config_takes_the_fixed_cost_as_a_number_a_pair_or_a_third_entry():
    assert OffloadConfig(bandwidth=(1e9, 2e9, 5e-6)).fixed_s == (5e-6, 5e-6)
    assert OffloadConfig(bandwidth=(1e9, 2e9, 5e-6)).bandwidth == (1e9, 2e9)
    assert OffloadConfig(bandwidth=(1e9, 2e9), fixed_s=(1e-6, 2e-6)).fixed_s == (1e-6, 2e-6)
    assert OffloadConfig(fixed_s=3e-6).fixed_s == (3e-6, 3e-6)
    for bad in (-1.0, (1e-6,), float("nan"), "1us"):
        with pytest.raises(InputError, match="fixed_s"):
            OffloadConfig(fixed_s=bad)
    with pytest.raises(InputError, match="offload_bandwidth"):
        OffloadConfig(bandwidth=(1e9, 2e9, 1e-6, 1e-6))


def test_a_loaded_plan_is_resimulated_at_the_fixed_cost_it_was_planned_at(tmp_path):
    """The fixed cost moves the peak (the forward's copies hold their bytes until the stream is done with
    them), so a plan file that did not record it would fail its own figures when loaded."""
    model, x = mlp()
    fixed = 1.0  # seconds: far above the FLOP-timed nodes, so the copies queue
    planner = Planner(model, x, capture_method="symbolic_trace", profile_config=FLOP_TIMES_UNSTORED,
                      offload_bandwidth=(1e12, 1e12, fixed), host_budget_gb=1.0)
    p = planner.profiled
    problem = p.problem
    offloaded = tuple(t.storage for t in targets_of(problem, offloadable(problem)))
    sim = simulate(problem, (), offloaded=offloaded)
    free = simulate(problem.__class__.from_dict({**problem.to_dict(), "d2h_fixed_s": 0.0, "h2d_fixed_s": 0.0}),
                    (), offloaded=offloaded)
    assert sim.peak_bytes > free.peak_bytes * 1.02  # a figure the check would see
    solution = Solution(regions=(), solver="offload", peak_bytes=sim.peak_bytes, recompute_time=sim.recompute_time,
                        budget_bytes=sim.peak_bytes, offloaded=offloaded)
    plan = plan_from_solution(p.cost, problem, solution, p.capture)
    plan.problem, plan.model_name = problem, "MLPChain"
    path = plan.save(tmp_path / "plan.json")
    info = json.loads(path.read_text())["stats"]["offload"]
    assert (info["d2h_fixed_s"], info["h2d_fixed_s"]) == (fixed, fixed)
    loaded = Plan.load(path)
    module = loaded.rebuild(model, x)
    assert loaded.problem.d2h_fixed_s == fixed
    assert compare(model, module, x[0]) == (True, True, True)
