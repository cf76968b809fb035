"""Selective regions on real models: exact, the kept ops not re-run, in the plan file, deterministic plans."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
import torch.nn as nn
from ckpt_planner import Plan, optimize
from ckpt_planner.api import Planner
from ckpt_planner.lower.rewrite import CheckpointRegion, rewrite
from ckpt_planner.lower.selective import saveable_flags
from ckpt_planner.profile.profiler import ProfileConfig
from ckpt_planner.profile.timing import anchor_times
from ckpt_planner.solvers import simulate, solve
from ckpt_planner.solvers.heuristics.basic import segment_runs
from ckpt_planner.solvers.heuristics.selective import is_heavy
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from tests.models.examples import TinyGPT
from tests.models.hazards import ConvBN, Noisy
from tests.support.steps import METHODS, compare, step


class OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def selective_module(model, x, method, keep=is_heavy):
    planner = Planner(model, x, capture_method=method)
    problem = planner.problem
    regions = segment_runs(problem)
    saved = [i for s, e in regions for i in range(s, e + 1) if problem.nodes[i].saveable and keep(problem.nodes[i].op)]
    assert saved, "the test needs kept ops"
    gm = planner.capture.graph_module
    return rewrite(gm, regions, model=model, saved=saved), rewrite(gm, regions, model=model)


def heavy_calls(module, model, x) -> int:
    counter = OpCount()
    with counter:
        step(module, model, x)
    return sum(v for k, v in counter.counts.items() if k in ("addmm", "mm", "convolution", "bmm"))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("make", [ConvBN, Noisy], ids=["batchnorm", "random"])
def test_selective_regions_exact_and_keep_their_ops(method, make):
    torch.manual_seed(0)
    model = make().train()
    x = torch.randn(4, 3, 8, 8) if make is ConvBN else torch.randn(8, 16)
    module, plain = selective_module(model, x, method)
    regions = [m for m in module.modules() if isinstance(m, CheckpointRegion)]
    assert regions and any(r.saved_positions for r in regions)
    before = dict(model.named_buffers())
    before = {k: v.clone() for k, v in before.items()}
    assert compare(model, module, x) == (True, True, True)  # outputs, gradients, buffers bitwise
    for k, v in model.named_buffers():
        if k.endswith("num_batches_tracked"):
            assert v.item() == before[k].item() + 1  # compare() restarts from the same buffers: one update
    # The kept matmuls/convolutions are not run again in backward; the plain region re-runs them.
    eager = heavy_calls(model, model, x)
    assert heavy_calls(module, model, x) < heavy_calls(plain, model, x)
    assert heavy_calls(module, model, x) >= eager


class WritesLater(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        h.mul_(2.0)  # h's value changes after `a` ran: a cached copy of a's output would be stale
        return self.b(torch.relu(h))


def test_outputs_written_in_place_are_not_saveable():
    planner = Planner(WritesLater().train(), torch.randn(4, 8), capture_method="symbolic_trace")
    flags = dict(zip((n.name for n in planner.cost.nodes), saveable_flags(planner.capture.graph_module)))
    assert flags["a"] is False and flags["mul_"] is False
    assert flags["b"] is True
    assert not planner.problem.nodes[0].saveable


def small_gpt():
    torch.manual_seed(0)
    model = TinyGPT(vocab=128, d=64, layers=3, heads=4, seq=32, dropout=0.1).train()
    x = torch.randint(0, 128, (2, 32))
    return model, (x, x)


def test_selective_plan_in_the_file_and_rebuilt(tmp_path):
    model, inputs = small_gpt()
    plan = optimize(model, inputs, activation_budget=0.95, solver="selective")
    kept = plan.saved_indices()
    assert kept and all(r.saved_ops for r in plan.regions)
    assert "predicted step time" in plan.summary()
    assert plan.to_dict()["regions"][0]["saved_ops"]
    assert plan.predicted_step_s > plan.eager_step_s > 0
    path = plan.save(tmp_path / "plan.json")
    loaded = Plan.load(path)
    assert loaded.saved_indices() == kept
    assert loaded.predicted_step_s == plan.predicted_step_s
    module = loaded.rebuild(model, inputs)
    assert any(m.saved_positions for m in module.modules() if isinstance(m, CheckpointRegion))
    assert compare(model, module, inputs) == (True, True, True)


def test_load_spikes_do_not_move_anchored_times():
    """A run where one layer's ops were slowed by a busy machine gives the same times as a quiet run."""
    model, inputs = small_gpt()
    planner = Planner(model, inputs, profile_config=ProfileConfig(anchor=True, overheads=False))
    quiet = dataclasses.replace(planner.cost, time_source="measured")  # every layer's op takes the same time
    noisy_nodes = tuple(
        dataclasses.replace(n, time=n.time * 3.0) if n.module.startswith("blocks.1") else n for n in quiet.nodes
    )
    noisy = dataclasses.replace(quiet, nodes=noisy_nodes)
    a, b = anchor_times(quiet), anchor_times(noisy)
    same_ops = sum(1 for n in a.nodes if n.module.startswith("blocks.1"))
    assert same_ops and [n.time for n in a.nodes] == [n.time for n in b.nodes]
    budget = simulate(a.to_problem(), ()).peak_bytes * 3 // 4
    plans = [solve(c.to_problem(), budget, "auto") for c in (a, b)]
    assert (plans[0].regions, plans[0].saved) == (plans[1].regions, plans[1].saved)


def test_optimize_twice_gives_the_same_plan():
    """dp (with kept ops): same model, inputs and budget, same plan. (auto adds the MILP, whose bundled
    CBC binary can crash on a loaded machine; its time limit could also cut it at another point.)"""
    model, inputs = small_gpt()
    model, inputs = model.to("meta"), tuple(x.to("meta") for x in inputs)  # FLOP-based times: no clock involved
    plans = [optimize(model, inputs, activation_budget=0.75, solver="dp", device="meta") for _ in range(2)]
    a, b = (p.to_dict() for p in plans)
    assert a["regions"] == b["regions"]  # regions, saved ops and the figures per region
    assert a["predicted_peak_bytes"] == b["predicted_peak_bytes"]


def test_random_ops_are_not_saveable():
    """Dropout fills its mask in place inside the op: a kept copy would be checked as mutated."""
    planner = Planner(Noisy().train(), torch.randn(8, 16), capture_method="symbolic_trace")
    flags = dict(zip((n.name for n in planner.cost.nodes), saveable_flags(planner.capture.graph_module)))
    assert flags["drop"] is False and flags["a"] is True


@torch.fx.wrap
def _scores_mix(q: torch.Tensor) -> torch.Tensor:
    """One fx node, many aten ops: the [n, n] intermediates are freed in eager before it returns."""
    return torch.softmax(q @ q.t() / 4.0, dim=-1) @ q


class Composite(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        return self.b(torch.relu(_scores_mix(torch.tanh(self.a(x))))).sum(-1)


def test_composite_nodes_are_not_kept_where_the_cache_would_hold_more():
    from ckpt_planner.lower.selective import policy_costs
    from ckpt_planner.verification import measure_step_peaks

    torch.manual_seed(0)
    model, x = Composite().train(), torch.randn(64, 16)
    planner = Planner(model, x, capture_method="symbolic_trace", profile_config=ProfileConfig(flop_times=True))
    problem = planner.problem
    names = [n.name for n in problem.nodes]
    mix, linear = names.index("_scores_mix"), names.index("a")
    cached, ops = policy_costs(planner.capture.graph_module, [x])
    assert ops["_scores_mix"] >= 4 and problem.nodes[mix].dispatch_ops == ops["_scores_mix"]  # mm, t, div, softmax, mm
    produced = sum(st.nbytes for st in problem.storages if st.producer == mix)
    assert cached["_scores_mix"] > produced  # the 64 x 64 scores and probabilities besides its output
    assert not problem.nodes[mix].saveable
    assert problem.nodes[linear].saveable and cached["a"] <= sum(st.nbytes for st in problem.storages if st.producer == linear)
    # A selective plan over every saveable node: the prediction is what the allocator reads.
    region = ((0, problem.n - 1),)
    keep = [i for i in range(problem.n) if problem.nodes[i].saveable]
    assert keep
    module = rewrite(planner.capture.graph_module, region, model=model, saved=keep)
    state = list(model.parameters()) + list(model.buffers())
    peaks, _ = measure_step_peaks(module, (x,), {}, list(model.parameters()), state, lambda out: out.sum(), torch.device("cpu"))
    predicted = simulate(problem, region, saved=keep).peak_bytes
    assert abs(peaks.allocator - predicted) <= 0.005 * predicted  # a kept composite would add 32 KB (45 %)


def test_only_kept_nodes_run_under_the_policy(monkeypatch):
    """The kept-node mode is entered around each kept node alone: the region's other ops pay no Python
    dispatch, and the recompute's early stop inside a kept node leaves no mode behind."""
    from ckpt_planner.lower import selective

    seen = {False: 0, True: 0}  # ops the mode saw in the forward / the recompute
    real = selective._KeepMode.__torch_dispatch__

    def counting(self, func, types, args=(), kwargs=None):
        if func not in selective._IGNORED:  # checkpointing's own detach and metadata queries
            seen[self.replay] += 1
        return real(self, func, types, args, kwargs)

    monkeypatch.setattr(selective._KeepMode, "__torch_dispatch__", counting)
    torch.manual_seed(0)
    model, x = Composite().train(), torch.randn(64, 16)
    planner = Planner(model, x, capture_method="symbolic_trace", profile_config=ProfileConfig(flop_times=True))
    problem = planner.problem
    names = [n.name for n in problem.nodes]
    keep = [names.index("a"), names.index("b")]  # b: the recompute stops inside it (its input is saved)
    region = ((0, problem.n - 1),)
    module = rewrite(planner.capture.graph_module, region, model=model, saved=keep)
    assert compare(model, module, x) == (True, True, True)
    seen.update({False: 0, True: 0})
    step(module, model, x)
    kept_ops = sum(problem.nodes[i].dispatch_ops for i in keep)
    assert 0 < kept_ops < sum(node.dispatch_ops for node in problem.nodes)
    assert seen[False] == kept_ops and 0 < seen[True] <= kept_ops
    assert _get_current_dispatch_mode_stack() == []
    assert heavy_calls(module, model, x) < heavy_calls(rewrite(planner.capture.graph_module, region, model=model), model, x)


class MutatesCached(nn.Module):
    """One fx node whose second op writes in place into the first op's output: a cached copy would be stale."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(_scale_in_place(self.a(x))).sum()


@torch.fx.wrap
def _scale_in_place(h: torch.Tensor) -> torch.Tensor:
    y = h * 2.0
    y.mul_(0.5)  # mul's output, written after the op that made it
    return y


def test_a_cached_output_written_in_place_is_an_error_not_a_wrong_gradient():
    from ckpt_planner.errors import SelectiveReplayError

    torch.manual_seed(0)
    model, x = MutatesCached().train(), torch.randn(8, 16)
    planner = Planner(model, x, capture_method="symbolic_trace", profile_config=ProfileConfig(flop_times=True))
    names = [n.name for n in planner.problem.nodes]
    region = ((0, planner.problem.n - 1),)
    module = rewrite(planner.capture.graph_module, region, model=model, saved=[names.index("_scale_in_place")])
    with pytest.raises(SelectiveReplayError, match="written in place"):
        module(x).backward()


_USE_COS = [False]


@torch.fx.wrap
def _switchable(h: torch.Tensor) -> torch.Tensor:
    """sin, or cos once the test flips the switch: a recompute after the flip runs other ops."""
    return torch.cos(h) if _USE_COS[0] else torch.sin(h)


class Switchable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(_switchable(self.a(x))).sum()


def test_a_recompute_that_runs_other_ops_is_an_error():
    from ckpt_planner.errors import SelectiveReplayError

    torch.manual_seed(0)
    model, x = Switchable().train(), torch.randn(8, 16)
    planner = Planner(model, x, capture_method="symbolic_trace", profile_config=ProfileConfig(flop_times=True))
    names = [n.name for n in planner.problem.nodes]
    region = ((0, planner.problem.n - 1),)
    module = rewrite(planner.capture.graph_module, region, model=model, saved=[names.index("_switchable")])
    loss = module(x)  # the forward caches sin's output
    _USE_COS[0] = True
    try:
        with pytest.raises(SelectiveReplayError, match="depend on data"):
            loss.backward()
    finally:
        _USE_COS[0] = False
