"""The allocator meter: kernel workspaces that no tensor shows are measured, predicted and budgeted."""

import dataclasses

import pytest
import torch
from ckpt_planner.api import Planner
from ckpt_planner.errors import InfeasibleBudgetError
from ckpt_planner.profile.memory import AllocatorMeter
from ckpt_planner.solvers import simulate
from ckpt_planner.verification import verify

from tests.support.profiles import TIMED_ONCE


class DepthwiseNet(torch.nn.Module):
    """ConvNeXt-like blocks: 7x7 depthwise convolutions, whose oneDNN kernels use workspaces on CPU."""

    def __init__(self, c: int = 8, blocks: int = 3) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, c, 3, padding=1)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Conv2d(c, c, 7, padding=3, groups=c), torch.nn.GELU(), torch.nn.Conv2d(c, c, 1))
            for _ in range(blocks)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)  # [B, C, H, W]
        for b in self.blocks:
            x = x + b(x)
        return x.mean()


def test_meter_windows_count_bytes_exactly():
    with AllocatorMeter("cpu") as meter:
        meter.mark("a")
        t = torch.empty(1000, dtype=torch.float32)  # 4,000 bytes, kept
        meter.mark("b")
        u = torch.empty(500, dtype=torch.float64)  # 4,000 bytes, freed inside the window
        del u
        meter.mark("c")
    assert meter.available
    a, b, c = meter.windows()
    assert (a.name, a.start, a.peak, a.end) == ("a", 0, 4000, 4000)
    assert (b.name, b.start, b.peak, b.end) == ("b", 4000, 8000, 4000)
    assert (c.start, c.peak, c.end) == (4000, 4000, 4000)
    assert meter.peak == 8000
    del t


def test_meter_counts_only_frees_of_blocks_it_knows():
    """The profiler reports the free of a block allocated in an earlier session (it remembers the size
    by address); counted, a step's reading would depend on what earlier sessions left alive."""
    with AllocatorMeter("cpu"):  # an earlier session (the profile's forward, before its backward's meter)
        old = torch.empty(4000, dtype=torch.uint8)
        kept = torch.empty(2000, dtype=torch.uint8)  # declared to the next meter
    with AllocatorMeter("cpu", known=[kept]) as meter:
        meter.mark("a")
        del old  # not the meter's: its free does not count
        u = torch.empty(1000, dtype=torch.uint8)
        meter.mark("b")
        del kept  # declared: its free counts
        del u
    a, b = meter.windows()
    assert (a.start, a.peak, a.end) == (0, 1000, 1000)
    assert (b.start, b.peak, b.end) == (1000, 1000, -2000)
    assert meter.peak == 1000


def test_meter_is_off_on_meta():
    with AllocatorMeter("meta") as meter:
        meter.mark("a")
        torch.empty(1000)
    assert not meter.available and meter.peak == 0 and meter.windows() == []


# oneDNN picks its convolution kernels by thread count: on one thread a depthwise convolution's backward
# holds its workspace off the step's peak, and the profile, measured at the kernel, predicts +3.4 % there
# (0.0 % on two). An overestimate keeps the plan within budget; an underestimate is held to 3 %.
OVER = 0.05


def test_conv_workspace_is_predicted_and_budgeted_on_the_allocator():
    torch.manual_seed(0)
    model, x = DepthwiseNet(), torch.randn(4, 3, 32, 32)
    planner = Planner(model, (x,), profile_config=TIMED_ONCE)
    # the profile carries the convolution's workspace: forward transients beyond any tensor made
    convs = [
        n for n in planner.cost.nodes
        if n.op == "call_module" and isinstance(model.get_submodule(n.target), torch.nn.Conv2d)
    ]
    assert convs and any(n.temp_bytes > 0 for n in convs)
    none = planner.plan(solver="none")
    base = verify(model, none, (x,), repeats=1)
    # the allocator sees more than the live tensors (oneDNN workspaces), and that is what is predicted
    assert base.measured_peak_bytes > 1.05 * base.measured_live_peak_bytes
    assert base.baseline_measured_peak_bytes > base.baseline_measured_live_peak_bytes
    assert -0.03 <= base.prediction_error <= OVER, (none.predicted_peak_bytes, base.measured_peak_bytes)
    try:
        plan = planner.plan(solver="dp", activation_budget=0.5)
    except InfeasibleBudgetError as e:  # the smallest budget named must hold on the allocator too
        plan = planner.plan(solver="dp", budget_bytes=e.smallest_bytes)
    assert plan.regions
    report = verify(model, plan, (x,), repeats=1)
    assert report.exact
    assert report.measured_peak_bytes <= plan.budget_bytes, (report.measured_peak_bytes, plan.budget_bytes)
    assert report.within_budget
    assert -0.03 <= report.prediction_error <= OVER, (plan.predicted_peak_bytes, report.measured_peak_bytes)
    assert report.measured_peak_bytes < report.baseline_measured_peak_bytes


class Noisy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.drop = torch.nn.Dropout(0.1)
        self.b = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.drop(self.a(x)))).sum()


def test_only_random_regions_save_the_rng_state():
    from ckpt_planner.capture.rng import rng_state_bytes

    torch.manual_seed(0)
    model, x = Noisy(), torch.randn(32, 64)
    planner = Planner(model, (x,), profile_config=TIMED_ONCE)
    names = [n.name for n in planner.cost.nodes]
    state = rng_state_bytes(torch.device("cpu"))
    assert state == torch.get_rng_state().numel()  # bytes (uint8)
    assert [n.name for n in planner.cost.nodes if n.rng_state_bytes] == ["drop"]
    assert all(n.rng_state_bytes in (0, state) for n in planner.cost.nodes)
    problem = planner.problem
    d, a = names.index("drop"), names.index("a")
    regions = [(a, d), (d + 1, d + 2)]  # Linear + dropout; ReLU + Linear
    # The simulator holds the random region's state from its forward to its backward, and only its.
    blind = dataclasses.replace(problem, nodes=tuple(dataclasses.replace(n, rng_state_bytes=0) for n in problem.nodes))
    fwd = [t for p, _, t in simulate(problem, regions, timeline=True).timeline if p == "forward"]
    fwd_blind = [t for p, _, t in simulate(blind, regions, timeline=True).timeline if p == "forward"]
    assert fwd[-1] - fwd_blind[-1] == state
    from ckpt_planner.lower.rewrite import CheckpointRegion, rewrite

    gm = rewrite(planner.capture.graph_module, regions, model=model)
    assert [r.random for r in gm.modules() if isinstance(r, CheckpointRegion)] == [True, False]
    # and the step is exact; the allocator's figures are checked in the next test
    plan = planner.plan(solver="none")
    plan.module = gm
    plan.predicted_peak_bytes = simulate(problem, regions).peak_bytes
    report = verify(model, plan, (x,), repeats=1)
    assert report.exact
    # The prediction is never low here; it is high by the dropout's output, which the recompute never
    # makes: early stop ends it when the mask is saved, before the multiply runs (not modelled yet).
    assert 0 <= plan.predicted_peak_bytes - report.measured_peak_bytes <= 8192, (report.measured_peak_bytes, plan.predicted_peak_bytes)


def test_a_random_regions_recompute_holds_a_second_rng_state():
    """The recompute forks the generator (`torch.random.fork_rng`): while it runs, the allocator holds the
    state saved in the forward and the caller's, restored after it. The step peaks in that recompute."""
    from ckpt_planner.capture.rng import rng_state_bytes
    from ckpt_planner.lower.rewrite import rewrite

    torch.manual_seed(0)
    model, x = Noisy(), torch.randn(32, 64)
    planner = Planner(model, (x,), profile_config=TIMED_ONCE)
    names = [n.name for n in planner.cost.nodes]
    problem = planner.problem
    regions = [(names.index("a"), names.index("relu"))]  # Linear + dropout + ReLU: its recompute ends saving ReLU's output
    state = rng_state_bytes(torch.device("cpu"))
    sim = simulate(problem, regions, timeline=True)
    assert sim.peak_phase == "recompute"
    blind = dataclasses.replace(problem, nodes=tuple(dataclasses.replace(n, rng_state_bytes=0) for n in problem.nodes))
    recompute = [t for p, _, t in sim.timeline if p == "recompute"]
    recompute_blind = [t for p, _, t in simulate(blind, regions, timeline=True).timeline if p == "recompute"]
    assert [a - b for a, b in zip(recompute, recompute_blind)] == [2 * state] * len(recompute)
    plan = planner.plan(solver="none")
    plan.module = rewrite(planner.capture.graph_module, regions, model=model)
    plan.predicted_peak_bytes = sim.peak_bytes
    report = verify(model, plan, (x,), repeats=1)
    assert report.exact
    # Within a few bytes (a 4-byte scalar the profile places a little off); one state fewer would be 5,056 B low.
    assert abs(report.measured_peak_bytes - sim.peak_bytes) <= 8, (report.measured_peak_bytes, sim.peak_bytes)


@pytest.mark.parametrize("solver", ["dp", "uniform"])
def test_verify_reports_both_meters(solver):
    torch.manual_seed(0)
    model, x = Noisy(), torch.randn(32, 64)
    planner = Planner(model, (x,), profile_config=TIMED_ONCE)
    plan = planner.plan(solver=solver, budget_bytes=planner.baseline_peak_bytes)
    report = verify(model, plan, (x,), repeats=1)
    for alloc, live in (
        (report.measured_peak_bytes, report.measured_live_peak_bytes),
        (report.baseline_measured_peak_bytes, report.baseline_measured_live_peak_bytes),
    ):
        params = sum(p.numel() * p.element_size() for p in model.parameters()) + x.numel() * x.element_size()
        assert live > params and alloc >= live
