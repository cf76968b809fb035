"""Plan files a person edited, or a model that changed since the plan was made, are refused.

* The fingerprint covers module types: a GELU swapped for a Tanh is another model.
* Edited regions that are not integers, negative, inverted, outside the graph or overlapping
  without nesting are refused on load, with one line naming the field; none is dropped.
* A loaded plan's peaks are re-simulated when it is rebuilt or applied on a model: a tampered
  figure, or regions whose figures no longer match, are refused before anything is rewritten.
"""

from __future__ import annotations

import json

import pytest
import torch
from ckpt_planner import Plan, PlanFileError, PlanMismatchError, Planner, ProfileConfig
from ckpt_planner.lower.apply import checkpointed_modules

from tests.models.small import LOCAL

FLOPS = ProfileConfig(warmup=0, repeats=1, flop_times=True)  # deterministic costs: plans do not follow noise


def save_mlp_plan(tmp_path_factory):
    """A plan of the MLP chain at 0.6 of its activations (two regions or more), saved; returns (planner,
    plan, path)."""
    model, inputs = LOCAL["mlp"]()
    planner = Planner(model, inputs, profile_config=FLOPS)
    base, fixed = planner.baseline_peak_bytes, planner.problem.fixed_bytes
    plan = planner.plan(budget_bytes=fixed + (base - fixed) * 6 // 10, solver="uniform")
    assert len(plan.regions) >= 2
    return planner, plan, plan.save(tmp_path_factory.mktemp("plan") / "plan.json")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A two-region plan of the MLP chain, saved; returns (path, its JSON)."""
    _, _, path = save_mlp_plan(tmp_path_factory)
    return path, json.loads(path.read_text())


def edited(tmp_path, data: dict, **changes) -> Plan:
    data = json.loads(json.dumps(data))
    for key, value in changes.items():
        data[key] = value
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return Plan.load(path)


def test_an_unedited_plan_rebuilds_and_applies(saved, tmp_path):
    path, _ = saved
    model, inputs = LOCAL["mlp"]()
    module = Plan.load(path).rebuild(model, inputs)
    module(*inputs).sum().backward()
    app = Plan.load(path).apply(model, inputs)
    assert app.modules and checkpointed_modules(model) == app.modules
    assert app.predicted_peak_bytes is not None  # checked against the re-simulated problem


def test_a_module_type_swap_is_another_model(saved):
    path, _ = saved
    model, inputs = LOCAL["mlp"]()
    model.blocks[0][1] = torch.nn.Tanh()  # same names, same wiring, same weights: another function
    with pytest.raises(PlanMismatchError, match="another model"):
        Plan.load(path).rebuild(model, inputs)
    with pytest.raises(PlanMismatchError, match="another model"):
        Plan.load(path).apply(model, inputs)
    assert checkpointed_modules(model) == ()
    approx, _ = LOCAL["mlp"]()
    approx.blocks[0][1] = torch.nn.GELU(approximate="tanh")  # the same type with other settings
    with pytest.raises(PlanMismatchError, match="another model"):
        Plan.load(path).rebuild(approx, inputs)


def region(data: dict, start, end) -> dict:
    return {**data["regions"][0], "start": start, "end": end}


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda d: [region(d, -1, 3)], r"regions\[0\]\.start: -1 is negative"),
        (lambda d: [region(d, 5, 2)], r"regions\[0\]\.end: 2 is before its start 5 \(inverted\)"),
        (lambda d: [region(d, 0, d["num_nodes"])], r"regions\[0\]\.end: \d+ is outside the graph's \d+ nodes"),
        (lambda d: [region(d, 1.5, 3)], r"regions\[0\]\.start: 1\.5 is not an integer"),
        (lambda d: [region(d, 0, 4), region(d, 2, 6)], r"regions\[1\] \(2\.\.6\) and regions\[0\] \(0\.\.4\) overlap"),
        (lambda d: [region(d, 3, 8), region(d, 0, 5)], r"regions\[0\] \(3\.\.8\) and regions\[1\] \(0\.\.5\) overlap"),
    ],
    ids=["negative", "inverted", "out-of-range", "not-an-integer", "overlapping", "overlapping-unsorted"],
)
def test_broken_regions_are_refused_naming_the_field(saved, tmp_path, make, field):
    _, data = saved
    with pytest.raises(PlanFileError, match=field) as info:
        edited(tmp_path, data, regions=make(data))
    assert "\n" not in str(info.value)


def test_nested_regions_are_accepted(saved, tmp_path):
    _, data = saved
    plan = edited(tmp_path, data, regions=[region(data, 0, 8), region(data, 2, 5), region(data, 9, 9)])
    assert plan.spans() == [(0, 8), (2, 5), (9, 9)]


@pytest.mark.parametrize("field", ["predicted_peak_bytes", "baseline_peak_bytes"])
def test_a_tampered_peak_is_refused_on_rebuild_and_apply(saved, tmp_path, field):
    _, data = saved
    claimed = data[field] // 2  # a plan that claims half the memory it takes
    model, inputs = LOCAL["mlp"]()
    with pytest.raises(PlanMismatchError, match=rf"{field}: the file says .* re-simulated .* give"):
        edited(tmp_path, data, **{field: claimed}).rebuild(model, inputs)
    with pytest.raises(PlanMismatchError, match=field):
        edited(tmp_path, data, **{field: claimed}).apply(model, inputs)
    assert checkpointed_modules(model) == ()  # refused before anything was applied


def test_figures_that_no_longer_match_the_regions_are_refused(saved, tmp_path):
    # Valid regions, but fewer than the figures were computed for: the recorded peak is no longer true.
    _, data = saved
    model, inputs = LOCAL["mlp"]()
    plan = edited(tmp_path, data, regions=data["regions"][:1])
    with pytest.raises(PlanMismatchError, match="predicted_peak_bytes"):
        plan.rebuild(model, inputs)
    assert plan.module is None


def test_flop_times_are_deterministic():
    model, inputs = LOCAL["mlp"]()
    a, b = Planner(model, inputs, profile_config=FLOPS), Planner(model, inputs, profile_config=FLOPS)
    assert [n.time for n in a.problem.nodes] == [n.time for n in b.problem.nodes]
    assert a.cost.time_source == "flops" and all(n.time > 0 for n in a.problem.nodes if n.name.startswith("blocks"))
