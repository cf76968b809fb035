"""Sizes that depend on values (a boolean-mask index in a masked loss, nonzero, unique) are planned, not refused.

On fake tensors such an op has no size; the profile takes the largest it can make (every mask element
true) and says so in the plan's notes. With an all-ones mask the bound is the real size, so the bytes equal
a real step's; with half the mask zero the plan is on the safe side: predicted above measured, within the
budget. On the meta device the bound is the only figure and the note says why. An op without a bound
(`bincount`) is sized from the example's real values, where those come from the inputs alone.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from ckpt_planner import optimize, verify
from ckpt_planner.capture.trace import capture, flatten_for_graph
from ckpt_planner.errors import ProfileError
from ckpt_planner.model_state import rng_preserved
from ckpt_planner.profile import profiler
from ckpt_planner.profile.dynamic_shapes import ValueSizes
from torch._subclasses.fake_tensor import FakeTensorMode

FLOPS = profiler.ProfileConfig(warmup=0, repeats=1, flop_times=True)  # deterministic costs: plans repeat
B, T, V, D, C = 8, 64, 128, 64, 16  # batch, tokens, vocabulary, width, classes


class MaskedLoss(nn.Module):
    """Embedded tokens through an MLP stack, whose loss keeps the tokens its mask marks: `logits[mask]` (a
    boolean index, [K, C] with K = the mask's true elements) against `labels[mask]`."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D)) for _ in range(layers))
        self.head = nn.Linear(D, C)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        logits = self.head(x).view(-1, C)  # [B*T, C]
        active = mask.view(-1) == 1
        return F.cross_entropy(logits[active], labels.view(-1)[active])


def inputs(keep: float = 1.0, device: str = "cpu") -> tuple:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.zeros(B, T, dtype=torch.long)
    mask[:, : int(T * keep)] = 1  # padding at the end of each row
    labels = torch.randint(0, C, (B, T), generator=g)
    return tuple(t.to(device) for t in (ids, mask, labels))


def model(device: str = "cpu") -> MaskedLoss:
    torch.manual_seed(0)
    with torch.device(device):
        return MaskedLoss()


def fake_cost(m: nn.Module, example: tuple, *, policy: bool = False):
    """The fake bytes pass; `policy`: with the selective policy's figures, counted in a forward of their own."""
    cap = capture(m, example)
    gm = cap.graph_module
    with rng_preserved():
        cost, figures = profiler._profile_fake(gm, flatten_for_graph(gm, cap.args, cap.kwargs), FLOPS,
                                               torch.device("cpu"), ops_priced=True)
    return (cost, figures) if policy else cost


def test_an_all_ones_mask_counts_the_bytes_of_a_real_step():
    """The fake bytes pass (which refused with `aten.nonzero` before) bounds the mask at every element
    true, which an all-ones mask is: every storage, saved and made, as a real step has it."""
    m, example = model(), inputs()
    fake = fake_cost(m, example)
    real = profiler.profile(capture(m, example), FLOPS)
    assert fake.total_saved_bytes == real.total_saved_bytes
    assert [s.nbytes for s in fake.storages] == [s.nbytes for s in real.storages]
    assert any("data-dependent sizes planned at their largest" in n for n in fake.notes)


def test_a_half_mask_is_bounded_above_its_real_size():
    m, example = model(), inputs(keep=0.5)
    fake = fake_cost(m, example)
    real = profiler.profile(capture(m, example), FLOPS)
    assert fake.total_saved_bytes > real.total_saved_bytes  # the selected logits: all B*T rows, not half
    (line,) = [n for n in fake.notes if "data-dependent" in n]
    assert f"{B * T}; the example {B * T // 2}" in line  # the bound, and what this example keeps


def test_on_real_tensors_the_notes_give_the_example_against_the_largest():
    """Where the step is profiled whole on real tensors, the sizes are the example's: the notes say how far
    that is from the largest a batch of these shapes can make."""
    (line,) = [n for n in profiler.profile(capture(model(), inputs(0.5)), FLOPS).notes if "data-dependent" in n]
    assert f"{B * T // 2} of at most {B * T}" in line and "needs more memory than planned" in line
    (line,) = [n for n in profiler.profile(capture(model(), inputs()), FLOPS).notes if "data-dependent" in n]
    assert "at their largest in the example" in line


class Unmasked(MaskedLoss):
    """The same model and loss without the boolean index: what an all-ones mask computes."""

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return F.cross_entropy(self.head(x).view(-1, C), labels.view(-1))


def planned(m: nn.Module, example: tuple, solver: str):
    plan = optimize(m, example, activation_budget=0.7, solver=solver, profile_config=FLOPS)
    report = verify(m, plan, example)
    assert report.exact
    assert report.measured_peak_bytes <= plan.budget_bytes
    assert any("data-dependent sizes" in n for n in plan.notes) == (not isinstance(m, Unmasked))
    return plan, report


@pytest.mark.parametrize("solver", ["auto", "dp"])
def test_an_all_ones_mask_plans_as_the_loss_without_it(solver):
    """Below the plain step the profile goes stage by stage from the fake bytes: the plan fits and gives
    the model's gradients bit for bit, predicted as the same model without the mask is (the boolean index
    adds no error of its own)."""
    torch.manual_seed(0)
    plan, report = planned(model(), inputs(), solver)
    torch.manual_seed(0)
    twin_plan, twin = planned(Unmasked(), inputs(), solver)
    assert plan.predicted_peak_bytes == twin_plan.predicted_peak_bytes
    assert report.measured_peak_bytes == pytest.approx(twin.measured_peak_bytes, rel=0.01)


@pytest.mark.parametrize("solver", ["auto", "dp"])
def test_a_half_mask_plans_on_the_safe_side(solver):
    plan, report = planned(model(), inputs(keep=0.5), solver)
    assert report.predicted_peak_bytes >= report.measured_peak_bytes


def test_on_the_meta_device_the_bound_is_the_only_figure():
    """No values to count: planned at the bound, which for an all-ones mask is a real step's bytes."""
    m, example = model("meta"), inputs(device="meta")
    plan = optimize(m, example, device="meta", activation_budget=0.5, profile_config=FLOPS)
    (line,) = [n for n in plan.notes if "data-dependent" in n]
    assert "the meta device holds no values" in line and "the example" not in line
    meta = fake_cost(m, example)
    real = profiler.profile(capture(model(), inputs()), FLOPS)
    assert [s.nbytes for s in meta.storages] == [s.nbytes for s in real.storages]


def run_fake(fn, *tensors, sizes=None):
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(t) for t in tensors]
    with mode, sizes or ValueSizes():
        return fn(*fakes)


def test_each_op_gets_its_largest_size_on_fake_tensors():
    x, mask = torch.randn(6, 5), torch.rand(6, 5) > 0.5
    assert run_fake(lambda x: torch.nonzero(x), x).shape == (30, 2)
    assert [t.shape for t in run_fake(lambda m: torch.where(m), mask)] == [(30,), (30,)]
    assert run_fake(lambda x, m: x[m], x, mask).shape == (30,)
    assert run_fake(lambda x, m: x[m[:, 0]], x, mask).shape == (6, 5)
    assert run_fake(lambda x, m: torch.masked_select(x, m), x, mask).shape == (30,)
    values, inverse, counts = run_fake(lambda x: torch.unique(x, return_inverse=True, return_counts=True), x)
    assert (values.shape, inverse.shape, counts.shape) == ((30,), (6, 5), (30,))
    assert run_fake(lambda x: torch.unique(x, dim=1), x).shape == (6, 5)


def test_an_op_without_a_bound_is_sized_from_values_or_refused_in_one_line():
    counts = torch.tensor([0, 3, 3, 1])
    sizes = ValueSizes(lambda t, **_: counts if t.shape == counts.shape else None)
    assert run_fake(lambda c: torch.bincount(c), counts, sizes=sizes).shape == (4,)
    with pytest.raises(ProfileError, match="aten.bincount.*meta device holds no values"):
        run_fake(lambda c: torch.bincount(c), counts, sizes=ValueSizes(no_values="the meta device holds no values"))


class Weighted(MaskedLoss):
    """Class weights from counts of the labels (`from_logits`: of the predicted classes): `bincount`, whose
    size has no largest, sized from values the example's inputs (and the model's parameters) compute."""

    def __init__(self, from_logits: bool) -> None:
        super().__init__()
        self.from_logits = from_logits

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        logits = self.head(x).view(-1, C)
        counts = torch.bincount(logits.argmax(-1) if self.from_logits else labels.view(-1), minlength=C)
        weight = (counts.sum() / counts.clamp(min=1).float())[:C]
        return F.cross_entropy(logits, labels.view(-1), weight=weight)


@pytest.mark.parametrize("from_logits", [False, True])
def test_a_size_without_a_bound_is_taken_from_the_example(from_logits):
    torch.manual_seed(0)
    m, example = Weighted(from_logits), inputs()
    assert fake_cost(m, example).total_saved_bytes == profiler.profile(capture(m, example), FLOPS).total_saved_bytes
    plan = optimize(m, example, activation_budget=0.7, profile_config=FLOPS)
    report = verify(m, plan, example)
    assert report.exact and report.measured_peak_bytes <= plan.budget_bytes
    assert any("taken from the example's values (no largest size exists): bincount" in n for n in plan.notes)
    with torch.device("meta"):
        on_meta = Weighted(from_logits)
    with pytest.raises(ProfileError, match=r"^node 'bincount' .*meta device holds no values: plan with real example inputs[^\n]*$"):
        fake_cost(on_meta, inputs(device="meta"))


@pytest.mark.parametrize("make", [lambda: model(), lambda: Weighted(from_logits=True)])
def test_the_policy_figures_are_counted_past_a_data_dependent_op(make):
    """The selective policy's own forward on fake tensors meets the same ops: it takes the recording's sizes
    (a failed count would leave the figures out, and only single-op nodes could be kept)."""
    torch.manual_seed(0)
    _, (cached, ops) = fake_cost(make(), inputs(0.5), policy=True)
    assert cached is not None and ops is not None and ops


@pytest.mark.slow  # an export capture and two profiles: half a minute on a loaded CPU
def test_electra_counts_its_masked_loss_as_a_real_step_does():
    """ELECTRA's discriminator loss indexes its logits with the attention mask (`logits[active_loss]`): an
    export graph's `aten.index` on a boolean mask, which the bytes pass refused before."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.ElectraConfig(vocab_size=256, embedding_size=32, hidden_size=64, num_hidden_layers=3,
                                     num_attention_heads=4, intermediate_size=128)
    m = transformers.ElectraForPreTraining(cfg)
    ids = torch.randint(0, 256, (8, 64))
    example = {"input_ids": ids, "attention_mask": torch.ones(8, 64, dtype=torch.long), "labels": ids % 2}
    cap = capture(m, example)
    with rng_preserved():
        fake, _ = profiler._profile_fake(cap.graph_module, flatten_for_graph(cap.graph_module, cap.args, cap.kwargs),
                                         FLOPS, torch.device("cpu"), ops_priced=True)
    real = profiler.profile(cap, FLOPS)
    assert [s.nbytes for s in fake.storages] == [s.nbytes for s in real.storages]
    assert any("index_1 (aten.index, 512; the example 512)" in n for n in fake.notes)
