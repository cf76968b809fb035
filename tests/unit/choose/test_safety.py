"""What cannot be planned is refused; every plan that leaves optimize/apply fits; budgets an error names hold.

Refusals (no_grad, inference_mode, an eval-mode export), plans re-simulated after their regions
move, the smallest budget named by an error accepted by a fresh call and nothing below it, a model
that checkpoints itself measured as given, and verify naming what differs.
"""

import dataclasses

import pytest
import torch
import torch.nn as nn
from ckpt_planner import InfeasibleBudgetError, InputError, Planner, UnplannableError, optimize, verify
from ckpt_planner.choose import regions as regions_module
from ckpt_planner.lower.apply import checkpointed_modules
from ckpt_planner.solvers import simulate
from ckpt_planner.verification import default_loss, measure_step
from torch.utils.checkpoint import checkpoint

from tests.models.small import LOCAL
from tests.support.profiles import TIMED_ONCE

# -- refusals -------------------------------------------------------------------------------------


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_no_grad_and_inference_mode_are_refused(context):
    model, inputs = LOCAL["mlp"]()
    with context(), pytest.raises(UnplannableError) as info:
        optimize(model, inputs, activation_budget=0.5, profile_config=TIMED_ONCE)
    message = str(info.value)
    assert isinstance(info.value, InputError) and "\n" not in message
    assert "nothing is saved for backward" in message and "outside" in message


def _bn_dropout_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout(0.1), nn.Flatten(), nn.Linear(144, 2))


@pytest.mark.parametrize("part", ["batchnorm", "dropout"])
def test_eval_mode_export_is_refused(tmp_path, part):
    layers = [nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)] if part == "batchnorm" else [nn.Linear(8, 8), nn.Dropout(0.2)]
    model = nn.Sequential(*layers).eval()
    x = torch.randn(2, 3, 8, 8) if part == "batchnorm" else torch.randn(2, 8)
    torch.export.save(torch.export.export(model, (x,)), tmp_path / "eval.pt2")
    gm = torch.export.load(tmp_path / "eval.pt2").module()
    with pytest.raises(UnplannableError) as info:
        optimize(gm, (x,), activation_budget=0.5, profile_config=TIMED_ONCE)
    message = str(info.value)
    assert "eval mode" in message and "model.train()" in message and "\n" not in message
    assert ("running statistics" if part == "batchnorm" else "dropout is off") in message


def test_train_mode_export_is_planned(tmp_path):
    model = _bn_dropout_net().train()
    x = torch.randn(2, 3, 8, 8)
    torch.export.save(torch.export.export(model, (x,)), tmp_path / "train.pt2")
    gm = torch.export.load(tmp_path / "train.pt2").module()
    for attr in ("train", "eval"):  # as the CLI's loader does: the graph keeps its mode, the flag is plain
        gm.__dict__.pop(attr, None)
    plan = optimize(gm, (x,), budget_bytes=10**9, profile_config=TIMED_ONCE)  # fits: a no-op plan, but planned
    assert plan.predicted_peak_bytes <= 10**9


def test_training_export_with_a_frozen_batchnorm_is_not_refused():
    from ckpt_planner.capture.own_checkpoint import check_training_graph

    model = _bn_dropout_net().train()
    model[1].eval()  # BatchNorm frozen on purpose; dropout still trains
    gm = torch.export.export(model, (torch.randn(2, 3, 8, 8),)).module()
    kinds = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert "aten.batch_norm.default" in kinds and "aten.dropout.default" in kinds
    check_training_graph(gm)  # no error: the dropout op is in training form


# -- budgets: the smallest named is feasible, minimal, and does not depend on timing ------------------


# cnn/dp and tiny_gpt/auto take 25-30 s each on 2 busy cores (two profiles and a search of budgets):
# they run with the slow tests (CI runs both); mlp/uniform keeps the check in the default run.
@pytest.mark.parametrize("name,solver", [
    ("mlp", "uniform"),
    pytest.param("cnn", "dp", marks=pytest.mark.slow),
    pytest.param("tiny_gpt", "auto", marks=pytest.mark.slow),
])
def test_named_smallest_budget_is_accepted_by_a_fresh_call_and_nothing_below(name, solver):
    model, inputs = LOCAL[name]()
    with pytest.raises(InfeasibleBudgetError) as info:
        optimize(model, inputs, budget_bytes=1, solver=solver, profile_config=TIMED_ONCE)
    smallest = info.value.smallest_bytes
    fresh = optimize(model, inputs, budget_bytes=smallest, solver=solver, profile_config=TIMED_ONCE)  # re-timed
    assert fresh.predicted_peak_bytes <= smallest
    assert smallest <= fresh.baseline_peak_bytes
    kept = [i for r in fresh.regions for i in r.saved_positions]
    assert simulate(fresh.problem, fresh.spans(), saved=kept).peak_bytes == fresh.predicted_peak_bytes
    with pytest.raises(InfeasibleBudgetError) as below:
        optimize(model, inputs, budget_bytes=int(smallest * 0.99), solver=solver, profile_config=TIMED_ONCE)
    assert below.value.smallest_bytes == smallest


def test_fresh_profiles_give_the_same_bytes():
    model, inputs = LOCAL["tiny_gpt"]()
    a, b = (Planner(model, inputs, profile_config=TIMED_ONCE).problem for _ in range(2))

    def sizes(p):
        nodes = [(n.name, n.temp_bytes, n.grad_bytes, n.param_grad_bytes, n.backward_temp_bytes) for n in p.nodes]
        return nodes, p.storages, p.fixed_bytes

    assert sizes(a) == sizes(b)


class _LSTMNet(nn.Module):
    """One LSTM op: the step's peak is inside its own backward, which no checkpoint plan lowers."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(16, 64, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0].sum()


def test_peak_inside_one_ops_backward_names_the_no_checkpoint_peak():
    torch.manual_seed(0)
    model, x = _LSTMNet(), torch.randn(8, 32, 16)
    planner = Planner(model, (x,), profile_config=TIMED_ONCE)
    base = planner.no_checkpoint_peak_bytes
    with pytest.raises(InfeasibleBudgetError) as info:
        planner.plan(budget_bytes=base - 1, solver="auto")
    assert info.value.smallest_bytes <= base
    assert "no checkpoint plan lowers the peak" in str(info.value) and "own backward" in str(info.value)
    plan = planner.plan(budget_bytes=info.value.smallest_bytes, solver="auto")
    assert plan.predicted_peak_bytes <= info.value.smallest_bytes


def test_margin_never_lifts_the_named_budget_above_the_no_checkpoint_peak():
    model, inputs = LOCAL["mlp"]()
    planner = Planner(model, inputs, profile_config=TIMED_ONCE)
    with pytest.raises(InfeasibleBudgetError) as info:
        planner.plan(budget_bytes=1, solver="uniform", safety_margin=0.9)  # a margin far larger than the savings
    assert info.value.smallest_bytes <= planner.no_checkpoint_peak_bytes
    assert planner.plan(budget_bytes=info.value.smallest_bytes, solver="uniform", safety_margin=0.9)


# -- every plan is re-simulated after its last change ----------------------------------------------


def test_regions_moved_after_solving_are_tightened_or_refused(monkeypatch):
    model, inputs = LOCAL["mlp"]()
    planner = Planner(model, inputs, profile_config=TIMED_ONCE)
    base = planner.no_checkpoint_peak_bytes
    real = regions_module.safe_regions

    def drop_first(gm, regions):  # a move after solving that raises the peak
        safe, notes = real(gm, regions)
        return safe[1:], notes + (["first region dropped"] if safe else [])

    monkeypatch.setattr(regions_module, "safe_regions", drop_first)
    planner.profiled.floors.clear()  # floor plans are finished with safe_regions: made again under the patch
    fixed = planner.problem.fixed_bytes
    for frac in (0.3, 0.5, 0.7):
        budget = int(fixed + frac * (base - fixed))
        try:
            plan = planner.plan(budget_bytes=budget, solver="uniform")
        except InfeasibleBudgetError as e:
            assert e.smallest_bytes > budget
            continue
        assert plan.predicted_peak_bytes <= budget, frac
        assert simulate(planner.problem, plan.spans(), saved=plan.saved_indices()).peak_bytes == plan.predicted_peak_bytes
    monkeypatch.setattr(regions_module, "safe_regions", lambda gm, regions: ([], ["every region dropped"]))
    planner.profiled.floors.clear()
    with pytest.raises(InfeasibleBudgetError) as info:
        planner.plan(budget_bytes=int(fixed + 0.5 * (base - fixed)), solver="uniform")
    assert info.value.smallest_bytes == base  # nothing lowers the peak once every region is dropped


class _InPlaceResidual(nn.Module):
    def __init__(self, d: int = 64, blocks: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 1.0
        for layer in self.layers:
            y = torch.relu(layer(x))
            x.add_(y)  # in place: cuts next to it are moved after solving
        return x.sum()


def test_plans_of_a_model_with_in_place_writes_fit_their_budget():
    torch.manual_seed(0)
    model, x = _InPlaceResidual(), torch.randn(128, 64)
    planner = Planner(model, (x,), profile_config=TIMED_ONCE)
    base, fixed = planner.no_checkpoint_peak_bytes, planner.problem.fixed_bytes
    notes = []
    for frac in (0.5, 0.9, 0.95):
        budget = int(fixed + frac * (base - fixed))
        for solver in ("uniform", "greedy", "dp"):
            try:
                plan = planner.plan(budget_bytes=budget, solver=solver)
            except InfeasibleBudgetError as e:
                assert budget < e.smallest_bytes <= base
                assert planner.plan(budget_bytes=e.smallest_bytes, solver=solver).predicted_peak_bytes <= e.smallest_bytes
                continue
            notes += plan.notes
            assert plan.predicted_peak_bytes <= budget, (frac, solver)
            assert simulate(planner.problem, plan.spans(), saved=plan.saved_indices()).peak_bytes == plan.predicted_peak_bytes
    assert any("writes in place" in n for n in notes)  # regions were moved after solving, and still fit


def test_every_plan_of_one_profile_fits_its_budget():
    model, inputs = LOCAL["cnn"]()  # BatchNorm and in-place ReLU
    planner = Planner(model, inputs, profile_config=TIMED_ONCE)
    with pytest.raises(InfeasibleBudgetError) as info:
        planner.plan(budget_bytes=1, solver="dp")
    low, base = info.value.smallest_bytes, planner.no_checkpoint_peak_bytes
    for k in range(12):
        budget = low + (base - low) * k // 12
        plan = planner.plan(budget_bytes=budget, solver="dp")
        assert plan.predicted_peak_bytes <= budget, (k, budget)
        assert simulate(planner.problem, plan.spans(), saved=plan.saved_indices()).peak_bytes == plan.predicted_peak_bytes


def test_apply_over_budget_raises_unless_allowed():
    model, inputs = LOCAL["mlp"]()
    plan = optimize(model, inputs, activation_budget=0.6, solver="uniform", profile_config=TIMED_ONCE)
    tight = dataclasses.replace(plan, budget_bytes=plan.problem.fixed_bytes + 1, module=None)
    with pytest.raises(InfeasibleBudgetError) as info:
        tight.apply(model)
    assert "allow_over_budget=True" in str(info.value)
    assert checkpointed_modules(model) == ()  # nothing was changed
    app = tight.apply(model, allow_over_budget=True)
    assert app.modules and app.within_budget is False
    assert any("over budget" in n for n in app.notes)
    tight.remove(model)


# -- a model that checkpoints itself -----------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


class SelfCheckpointing(nn.Module):
    """Calls torch.utils.checkpoint on every other block in its own forward."""

    def __init__(self, d: int = 64, blocks: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(d) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = checkpoint(block, x, use_reentrant=False) if i % 2 == 0 else block(x)
        return x.sum()


def _measured(model, x) -> int:
    params = list(model.parameters())
    peak, _ = measure_step(model, (x,), {}, params, params + list(model.buffers()), default_loss, torch.device("cpu"))
    for p in params:
        p.grad = None
    return peak


def test_self_checkpointing_model_is_measured_as_given():
    torch.manual_seed(0)
    model, x = SelfCheckpointing(), torch.randn(256, 64)
    planner = Planner(model, (x,), profile_config=TIMED_ONCE)
    assert len(planner.own_regions) == 2
    given = _measured(model, x)
    assert planner.baseline_peak_bytes < planner.no_checkpoint_peak_bytes
    assert abs(planner.baseline_peak_bytes - given) <= 0.05 * given, (planner.baseline_peak_bytes, given)
    with pytest.raises(InfeasibleBudgetError) as info:
        planner.plan(budget_bytes=1, solver="dp")
    budget = (info.value.smallest_bytes + planner.baseline_peak_bytes) // 2
    plan = planner.plan(budget_bytes=budget, solver="dp")
    assert plan.baseline_peak_bytes == planner.baseline_peak_bytes
    assert plan.predicted_peak_bytes <= plan.budget_bytes < plan.baseline_peak_bytes
    report = verify(model, plan, (x,), repeats=1)
    assert report.exact
    assert report.baseline_measured_peak_bytes == given  # verify's baseline is the model as given
    assert report.measured_peak_bytes < given  # "memory saved" is against the model as given, and true
    text = plan.summary()
    assert "own checkpointing" in text and "replaced" in text
    assert "model as given" in text


def test_own_checkpointing_keep_and_default_budget():
    torch.manual_seed(0)
    model, x = SelfCheckpointing(), torch.randn(256, 64)
    planner = Planner(model, (x,), profile_config=TIMED_ONCE)
    with pytest.raises(InfeasibleBudgetError) as info:
        planner.plan(budget_bytes=1, solver="dp", own_checkpointing="keep")
    budget = (info.value.smallest_bytes + planner.baseline_peak_bytes) // 2
    kept = planner.plan(budget_bytes=budget, solver="dp", own_checkpointing="keep")
    assert set(planner.own_regions) <= set(kept.spans())
    assert kept.predicted_peak_bytes <= kept.budget_bytes < planner.baseline_peak_bytes
    assert len(kept.spans()) > len(planner.own_regions)  # regions added beside the model's own
    assert kept.stats["own_checkpointing"] == "kept" and "kept" in kept.summary()
    free = planner.plan(solver="dp")  # no budget: never worse than the model as given
    assert free.predicted_peak_bytes <= planner.baseline_peak_bytes
    assert free.stats["own_checkpointing"] == "replaced"
    with pytest.raises(InputError):
        planner.plan(activation_budget=0.7, own_checkpointing="both")


def test_hf_gradient_checkpointing_is_the_baseline():
    from tests.models.small import hf_gpt2

    model, inputs = hf_gpt2()
    model.gradient_checkpointing_enable()
    planner = Planner(model, inputs, profile_config=TIMED_ONCE)
    assert [c.module for c in planner.capture.own_checkpoints] == ["transformer.h.0", "transformer.h.1"]
    assert len(planner.own_regions) == 2
    params = list(model.parameters())
    given, _ = measure_step(model, (), inputs, params, params + list(model.buffers()), default_loss, torch.device("cpu"))
    assert abs(planner.baseline_peak_bytes - given) <= 0.05 * given, (planner.baseline_peak_bytes, given)
    with pytest.raises(InfeasibleBudgetError) as info:
        planner.plan(budget_bytes=1, solver="dp")
    plan = planner.plan(budget_bytes=(info.value.smallest_bytes + given) // 2, solver="dp")
    report = verify(model, plan, inputs, repeats=1)
    assert report.exact and report.measured_peak_bytes < report.baseline_measured_peak_bytes
    assert model.transformer.h[0].gradient_checkpointing  # the model keeps its own flag


def test_hf_activation_checkpointing_every_n_layers_is_seen_per_layer():
    """transformers' newer `activation_checkpointing_enable(every_n_layers=2)` flags every other layer:
    the capture finds exactly the flagged ones."""
    from tests.models.small import hf_gpt2

    model, inputs = hf_gpt2()
    if not hasattr(model, "activation_checkpointing_enable"):
        pytest.skip("this transformers has no activation_checkpointing_enable")
    model.activation_checkpointing_enable(every_n_layers=2)
    flagged = [n for n, m in model.named_modules() if getattr(m, "gradient_checkpointing", False) and n.startswith("transformer.h.")]
    assert flagged == ["transformer.h.0"]
    planner = Planner(model, inputs, profile_config=TIMED_ONCE)
    assert [c.module for c in planner.capture.own_checkpoints] == flagged


# -- verify names what differs ---------------------------------------------------------------------


class _BumpsBuffer(nn.Module):
    """The model's step, then one BatchNorm statistic moved: only the buffers differ."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args):
        out = self.model(*args)
        with torch.no_grad():
            next(m for m in self.model.modules() if isinstance(m, nn.BatchNorm2d)).num_batches_tracked.add_(2)
        return out


def test_verify_message_names_the_buffers_that_differ():
    model, inputs = LOCAL["cnn"]()
    plan = optimize(model, inputs, budget_bytes=10**9, profile_config=TIMED_ONCE)
    plan.module = _BumpsBuffer(model)
    report = verify(model, plan, inputs, repeats=1)
    assert report.outputs_equal and report.grads_equal and not report.buffers_equal
    message = report.mismatch()
    assert message.startswith("buffers differ") and "num_batches_tracked" in message and "diff 2" in message
    assert "gradients" not in message and "outputs" not in message


@pytest.mark.parametrize("case", ["frozen", "returns_none"])
def test_nothing_to_plan_is_said_by_the_api(case):
    """optimize() on a model whose step saves nothing names that, not an 'infeasible budget'."""
    from ckpt_planner import NothingToPlanError

    class NoOutput(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            self.lin(x)
            return None

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    if case == "frozen":
        model.requires_grad_(False)
    else:
        model = NoOutput()
    with pytest.raises(NothingToPlanError, match="nothing to plan"):
        optimize(model, (torch.randn(4, 8),), budget_bytes=1, solver="uniform")
