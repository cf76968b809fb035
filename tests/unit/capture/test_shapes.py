"""Input shapes other than the planned one: smaller ones run the plan exactly and within budget,
larger ones raise ShapeError or are re-planned per shape; ExportedPrograms are accepted."""

import pytest
import torch
from ckpt_planner import InfeasibleBudgetError, InputError, Planner, ShapeError, optimize, verify
from ckpt_planner.capture.shapes import ShapeGuard, input_shapes

from tests.models.examples import ResidualCNN
from tests.support.profiles import TIMED_ONCE


def gpt2(batch: int = 4, seq: int = 48):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=3, n_embd=64, n_head=2, vocab_size=128, n_positions=128, use_cache=False)
    return GPT2LMHeadModel(cfg), {"input_ids": torch.randint(0, 128, (batch, seq))}


def ids(batch: int, seq: int) -> dict:
    return {"input_ids": torch.randint(0, 128, (batch, seq))}


def midway(planner: Planner, frac: float = 0.5, **kwargs):
    with pytest.raises(InfeasibleBudgetError) as info:
        planner.plan(budget_bytes=1, solver="uniform")
    low = info.value.smallest_bytes
    budget = int(low + frac * (planner.baseline_peak_bytes - low))
    return planner.plan(budget_bytes=budget, solver="uniform", **kwargs)


def check_exact_within_budget(model, plan, inputs, *, saves: bool = True):
    report = verify(model, plan, inputs, repeats=1)
    assert report.outputs_equal and report.grads_equal and report.buffers_equal, report
    assert report.max_abs_grad_diff == 0.0
    assert report.measured_peak_bytes <= plan.budget_bytes, report
    if saves:  # the plan still checkpoints at this shape: less memory than the model itself
        assert report.measured_peak_bytes < report.baseline_measured_peak_bytes, report
    return report


@pytest.fixture(scope="module")
def gpt2_plan():
    model, inputs = gpt2()
    planner = Planner(model, inputs, profile_config=TIMED_ONCE)
    return model, planner, midway(planner)


def test_transformers_smaller_batch_and_sequence_exact_within_budget(gpt2_plan):
    model, planner, plan = gpt2_plan
    assert planner.capture.method == "export" and planner.capture.dynamic_dims
    assert plan.regions
    torch.manual_seed(1)
    # the planned shape, a shorter last batch, a shorter sequence, both, and a single short row
    peaks = {}
    for batch, seq in ((4, 48), (3, 48), (4, 40), (2, 33), (1, 5)):
        inputs = ids(batch, seq)
        report = check_exact_within_budget(model, plan, inputs, saves=batch * seq >= 96)
        assert report.measured_peak_bytes <= plan.budget_bytes
        peaks[batch, seq] = report.measured_peak_bytes
    # peak is monotone in the shape: a smaller batch needs no more than the planned one (its step measured above)
    small = verify(model, plan, ids(2, 48), repeats=1).measured_peak_bytes
    assert small < peaks[4, 48]


def test_larger_shape_raises_one_line_shape_error_before_running(gpt2_plan):
    model, _, plan = gpt2_plan
    params = list(model.parameters())
    for p in params:
        p.grad = None
    before = [b.clone() for b in model.buffers()]
    for batch, seq in ((5, 48), (4, 49)):
        with pytest.raises(ShapeError) as info:
            plan.module(**ids(batch, seq))
        message = str(info.value)
        assert "\n" not in message
        assert "input_ids [4, 48]" in message and f"input_ids [{batch}, {seq}]" in message
        assert "on_larger_shape='replan'" in message
    assert isinstance(info.value, InputError)
    assert all(p.grad is None for p in params)
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers()))
    assert any("smaller shapes run this plan" in n for n in plan.notes)


@pytest.mark.slow  # plans twice (two shapes): ~13 s on 2 busy cores
def test_larger_shape_replanned_once_per_shape_exact_within_budget():
    model, inputs = gpt2(batch=2, seq=32)
    planner = Planner(model, inputs, profile_config=TIMED_ONCE)
    big = Planner(model, ids(3, 40), profile_config=TIMED_ONCE)  # the larger shape's own range
    with pytest.raises(InfeasibleBudgetError) as info:
        big.plan(budget_bytes=1, solver="uniform")
    budget = int(info.value.smallest_bytes + 0.5 * (big.baseline_peak_bytes - info.value.smallest_bytes))
    assert budget > planner.baseline_peak_bytes  # a no-op plan at the planned shape, not at the larger one
    plan = planner.plan(budget_bytes=budget, solver="uniform", on_larger_shape="replan")
    assert not plan.regions
    guard = plan.module.shape_guard
    plan.module(**ids(3, 40))  # the first larger call plans that shape; the step measured below runs its plan
    assert len(guard.replanned) == 1
    torch.manual_seed(2)
    check_exact_within_budget(model, plan, ids(3, 40))
    assert len(guard.replanned) == 1
    (shape, module), = guard.replanned.items()
    assert shape == input_shapes((), ids(3, 40))
    assert any(name.startswith("checkpoint_") for name, _ in module.named_children())
    check_exact_within_budget(model, plan, ids(3, 40))  # cached: no second plan
    assert len(guard.replanned) == 1 and guard.replanned[shape] is module
    check_exact_within_budget(model, plan, ids(2, 32), saves=False)  # the planned shape runs the planned module
    assert len(guard.replanned) == 1


def test_on_larger_shape_must_be_known():
    model, inputs = ResidualCNN(c=4, blocks=1), (torch.randn(2, 3, 8, 8),)
    with pytest.raises(InputError, match="on_larger_shape"):
        optimize(model, inputs, solver="uniform", on_larger_shape="grow")


@pytest.mark.parametrize("kind", ["symbolic_trace", "export"])
def test_cnn_smaller_batch_and_image_exact_within_budget(kind):
    if kind == "symbolic_trace":
        torch.manual_seed(0)
        model, key = ResidualCNN(c=8, blocks=3), None
    else:
        from transformers import ResNetConfig, ResNetModel

        torch.manual_seed(0)
        cfg = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic")
        model, key = ResNetModel(cfg), "pixel_values"

    def images(*shape):
        x = torch.randn(*shape)
        return {key: x} if key else (x,)

    planner = Planner(model, images(8, 3, 32, 32), profile_config=TIMED_ONCE)
    assert planner.capture.method == kind and planner.capture.dynamic_dims
    plan = midway(planner)
    assert plan.regions
    torch.manual_seed(3)
    for shape in ((8, 3, 32, 32), (6, 3, 32, 32), (8, 3, 24, 28), (1, 3, 16, 16)):
        check_exact_within_budget(model, plan, images(*shape), saves=shape[0] * shape[2] * shape[3] >= 4096)
    with pytest.raises(ShapeError, match=r"\[8, 3, 32, 32\]"):
        plan.module(*images(8, 3, 40, 32)) if key is None else plan.module(**images(8, 3, 40, 32))


def test_static_graph_replans_smaller_shapes():
    calls = []

    def replan(args, kwargs):
        calls.append(input_shapes(args, kwargs))
        return torch.nn.Identity()

    planned = input_shapes((torch.zeros(4, 8),), {})
    guard = ShapeGuard(planned, "error", replan, dynamic_dims=False)
    assert guard.module_for((torch.zeros(4, 8),), {}) is None
    module = guard.module_for((torch.zeros(2, 8),), {})
    assert isinstance(module, torch.nn.Identity) and len(calls) == 1
    assert guard.module_for((torch.zeros(2, 8),), {}) is module and len(calls) == 1
    with pytest.raises(ShapeError, match=r"args\[0\] \[5, 8\] \(planned \[4, 8\]\)"):
        guard.module_for((torch.zeros(5, 8),), {})
    dynamic = ShapeGuard(planned, "error", replan, dynamic_dims=True)
    assert dynamic.module_for((torch.zeros(2, 3),), {}) is None and len(calls) == 1


@pytest.mark.parametrize("given", ["program", "module"])
def test_exported_program_and_its_module_are_accepted(tmp_path, given):
    torch.manual_seed(0)
    model, x = ResidualCNN(c=8, blocks=3), torch.randn(8, 3, 32, 32)
    path = tmp_path / "model.pt2"
    torch.export.save(torch.export.export(model, (x,), strict=False), path)
    program = torch.export.load(path)
    target = program if given == "program" else program.module()
    plan = midway(Planner(target, None if given == "program" else (x,), profile_config=TIMED_ONCE), frac=0.3)
    assert plan.capture_method == "export" and plan.regions
    module = plan.module._original  # the module the plan was made on (the program's .module())
    report = verify(module, plan, (x,), repeats=1)
    # BatchNorm's num_batches_tracked is updated in place: kept in the graph, updated once per step
    assert report.outputs_equal and report.grads_equal and report.buffers_equal, report
    assert report.measured_peak_bytes <= plan.budget_bytes < report.baseline_measured_peak_bytes
    module.eval()  # the refusing overrides are gone
    assert not module.training


def test_rebuilt_plan_keeps_the_shape_check(tmp_path):
    torch.manual_seed(0)
    model, x = ResidualCNN(c=8, blocks=3), torch.randn(8, 3, 32, 32)
    plan = midway(Planner(model, (x,), profile_config=TIMED_ONCE))
    loaded = type(plan).load(plan.save(tmp_path / "plan.json"))
    loaded.rebuild(model, (x,))
    check_exact_within_budget(model, loaded, (torch.randn(4, 3, 24, 24),), saves=False)
    with pytest.raises(ShapeError, match=r"args\[0\] \[9, 3, 32, 32\]"):
        loaded.module(torch.randn(9, 3, 32, 32))
