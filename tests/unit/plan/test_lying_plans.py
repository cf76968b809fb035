"""Plan files that lie are refused on `rebuild`, `apply` and the `apply` command: one line, exit 2.

* Every figure a plan states is re-derived from its re-simulation on the model: the baseline (the model as
  given), `stats.no_checkpoint_peak_bytes`, the predicted peak; a measured peak is measured again where
  the file says it was measured on this kind of device, and dropped where it cannot be.
* A plan predicted over its own budget is not applied.
* One training step of a loaded plan's module is checked against the model's own (the safety net).
* A kept op outside its region and an empty chunked region are bad files (PlanFileError), not tracebacks.

Every plan here is made on FLOP times (deterministic costs) and edited as JSON, as a person would.
"""

from __future__ import annotations

import importlib
import json

import pytest
import torch
import torch.nn as nn
from ckpt_planner import Plan, PlanFileError, PlanMismatchError, Planner, ProfileConfig
from ckpt_planner.cli.commands import main
from ckpt_planner.lower.apply import checkpointed_modules
from ckpt_planner.solvers.simulate import simulate
from ckpt_planner.verification import step_differences, verify

from tests.models.small import LOCAL
from tests.unit.plan.test_plan_file import save_mlp_plan

FLOPS = ProfileConfig(warmup=0, repeats=1, flop_times=True)

FACTORY = '''
import torch
from ckpt_planner.cli.examples import MLPChain


def make():
    torch.manual_seed(0)
    return MLPChain(d=16, blocks=4), (torch.randn(32, 16),)
'''


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A plan of the MLP chain at 0.6 of its activations, saved; returns (planner, plan, its JSON)."""
    planner, plan, path = save_mlp_plan(tmp_path_factory)
    return planner, plan, json.loads(path.read_text())


def edited(tmp_path, data: dict, **changes) -> Plan:
    data = json.loads(json.dumps(data))
    for key, value in changes.items():
        data[key] = value
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return Plan.load(path)


def refused(plan_of, match: str) -> None:
    """rebuild and apply (fresh models) both refuse with one line matching `match`; nothing is applied."""
    model, inputs = LOCAL["mlp"]()
    with pytest.raises(PlanMismatchError, match=match) as info:
        plan_of().rebuild(model, inputs)
    assert "\n" not in str(info.value)
    with pytest.raises(PlanMismatchError, match=match):
        plan_of().apply(model, inputs)
    assert checkpointed_modules(model) == ()


# -- item 5: figures ----------------------------------------------------------------------------------


def test_a_baseline_inflated_with_the_true_value_moved_to_stats_is_refused(saved, tmp_path):
    _, plan, data = saved
    stats = {**data["stats"], "no_checkpoint_peak_bytes": data["baseline_peak_bytes"]}
    lie = dict(baseline_peak_bytes=10 * data["baseline_peak_bytes"], stats=stats)
    refused(lambda: edited(tmp_path, data, **lie), r"plan baseline_peak_bytes: the file says")


def test_a_wrong_no_checkpoint_figure_is_refused(saved, tmp_path):
    _, _, data = saved
    stats = {**data["stats"], "no_checkpoint_peak_bytes": data["baseline_peak_bytes"] // 3}
    refused(lambda: edited(tmp_path, data, stats=stats), r"stats\.no_checkpoint_peak_bytes: the file says")


def test_an_honest_plan_keeps_its_figures(saved, tmp_path):
    planner, plan, data = saved
    model, inputs = LOCAL["mlp"]()
    loaded = edited(tmp_path, data)
    loaded.rebuild(model, inputs)
    assert loaded.baseline_peak_bytes == simulate(planner.problem, ()).peak_bytes
    assert loaded.predicted_peak_bytes == plan.predicted_peak_bytes <= loaded.budget_bytes


def _verified(tmp_path, data: dict) -> dict:
    """The plan file as `plan --verify` writes it: measured peaks, and the device they were measured on."""
    model, inputs = LOCAL["mlp"]()
    plan = edited(tmp_path, data)
    plan.rebuild(model, inputs)
    report = verify(model, plan, inputs, repeats=1)
    out = json.loads(json.dumps(data))
    out["measured_peak_bytes"] = report.measured_peak_bytes
    out["baseline_measured_peak_bytes"] = report.baseline_measured_peak_bytes
    out["stats"] = {**out["stats"], "verify": {"device": report.device,
                                               "measured_peak_bytes": report.measured_peak_bytes}}
    return out


def test_measured_peaks_are_measured_again_and_a_lie_is_refused(saved, tmp_path):
    _, _, data = saved
    honest = _verified(tmp_path, data)
    model, inputs = LOCAL["mlp"]()
    kept = edited(tmp_path, honest)
    kept.rebuild(model, inputs)  # the same step measures the same (within the tolerance)
    assert kept.measured_peak_bytes == honest["measured_peak_bytes"]
    for field in ("measured_peak_bytes", "baseline_measured_peak_bytes"):
        refused(lambda field=field: edited(tmp_path, honest, **{field: honest[field] // 10}),
                rf"plan {field}: the file says {honest[field] // 10} bytes but one step")


def test_measured_peaks_from_another_device_are_dropped_not_kept(saved, tmp_path):
    _, _, data = saved
    honest = _verified(tmp_path, data)
    elsewhere = {**honest["stats"], "verify": {**honest["stats"]["verify"], "device": "cuda"}}
    model, inputs = LOCAL["mlp"]()
    plan = edited(tmp_path, honest, stats=elsewhere, measured_peak_bytes=1)
    plan.rebuild(model, inputs)
    assert plan.measured_peak_bytes is None and plan.baseline_measured_peak_bytes is None
    assert any("measured peaks" in n and "dropped" in n for n in plan.notes)


# -- item 6: over its own budget ------------------------------------------------------------------------


def test_a_plan_predicted_over_its_own_budget_is_refused(saved, tmp_path):
    _, plan, data = saved
    budget = plan.predicted_peak_bytes // 2
    refused(lambda: edited(tmp_path, data, budget_bytes=budget), r"predicted_peak_bytes: .* is over the plan's own budget")
    # without inputs to check the figures against, the file's own figures still say it is over
    model, _ = LOCAL["mlp"]()
    with pytest.raises(PlanMismatchError, match="over the plan's own budget"):
        edited(tmp_path, data, budget_bytes=budget).apply(model)
    assert checkpointed_modules(model) == ()


@pytest.mark.parametrize("lie, said", [
    (lambda d: {"budget_bytes": d["predicted_peak_bytes"] // 2}, "over the plan's own budget"),
    (lambda d: {"baseline_peak_bytes": 10 * d["baseline_peak_bytes"],
                "stats": {**d["stats"], "no_checkpoint_peak_bytes": d["baseline_peak_bytes"]}}, "baseline_peak_bytes"),
], ids=["over-budget", "baseline-10x"])
def test_a_lying_plan_exits_2_on_the_command_line(tmp_path, capsys, lie, said):
    (tmp_path / "factory.py").write_text(FACTORY)
    fac = f"{tmp_path}/factory.py:make"
    path = tmp_path / "plan.json"
    assert main(["plan", fac, "--solver", "uniform", "--activation-budget", "0.7", "--curve-points", "2",
                 "--curve-solvers", "uniform", "--quiet", "-o", str(path)]) == 0
    data = json.loads(path.read_text())
    data.update(lie(data))
    path.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["apply", fac, str(path), "-o", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and said in err
    assert not (tmp_path / "out").exists()


# -- item 7: the safety net on loaded plans ----------------------------------------------------------


class _Draw(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return x + torch.tanh(self.drop(self.lin(x)))


class _Mixed(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.draw = _Draw(d)
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(3))

    def forward(self, x):
        x = self.draw(x)
        for m in self.mlps:
            x = x + m(x)
        return x


def _mixed():
    torch.manual_seed(0)
    return _Mixed().train(), (torch.randn(8, 16, 32),)


def test_a_hand_written_selective_region_whose_step_differs_is_refused(tmp_path, monkeypatch):
    """A region over the dropout block keeping its Linear, written by hand with figures that match: the
    simulator has nothing against it. Its replay is made blind to the generator (as a random op the
    planner does not see is), so its step differs from the model's: rebuild and apply must say so."""
    model, inputs = _mixed()
    planner = Planner(model, inputs, profile_config=FLOPS)
    names = [n.name for n in planner.problem.nodes]
    lin, last = names.index("draw_lin"), max(i for i, n in enumerate(names) if n.startswith("draw") or n == "tanh")
    base = planner.plan(budget_bytes=planner.baseline_peak_bytes, solver="uniform")
    data = json.loads(json.dumps(base.to_dict()))
    data["regions"] = [{"start": lin, "end": last, "first_node": names[lin], "last_node": names[last],
                        "modules": ["draw"], "saved_ops": [names[lin]], "saved_positions": [lin]}]
    data["predicted_peak_bytes"] = simulate(planner.problem, [(lin, last)], saved=[lin]).peak_bytes
    data["budget_bytes"] = None
    path = tmp_path / "hand.json"
    path.write_text(json.dumps(data))

    honest, _ = _mixed()
    Plan.load(path).rebuild(honest, inputs)  # replayed with the generator saved: the model's own step

    monkeypatch.setattr(importlib.import_module("ckpt_planner.lower.rewrite"), "uses_rng", lambda gm, n: False)
    fresh, _ = _mixed()
    unchecked = Plan.load(path)
    unchecked.rebuild(fresh, inputs, check_step=False)
    assert step_differences(fresh, unchecked.module, inputs, {})  # the fault is real
    with pytest.raises(PlanMismatchError, match="differs from the model's own") as info:
        Plan.load(path).rebuild(fresh, inputs)
    assert "\n" not in str(info.value)


def test_apply_checks_the_module_level_step_before_changing_the_model(saved, tmp_path, monkeypatch):
    from ckpt_planner import verification

    _, _, data = saved
    model, inputs = LOCAL["mlp"]()
    monkeypatch.setattr(verification, "step_differences", lambda *a, **k: ["blocks.0.0.weight"])
    with pytest.raises(PlanMismatchError, match=r"differs from the model's own \(blocks\.0\.0\.weight\)"):
        edited(tmp_path, data).apply(model, inputs)
    assert checkpointed_modules(model) == ()
    monkeypatch.setattr(verification, "step_differences", lambda *a, **k: None)  # nothing to compare with
    with pytest.raises(PlanMismatchError, match="cannot be checked"):
        edited(tmp_path, data).apply(model, inputs)
    assert checkpointed_modules(model) == ()


# -- item 13: bad files are PlanFileError ----------------------------------------------------------------


def test_a_kept_op_outside_its_region_is_a_bad_file(saved, tmp_path):
    _, _, data = saved
    r = data["regions"][0]
    outside = r["end"] + 1
    bad = [{**r, "saved_ops": ["x"], "saved_positions": [outside]}, *data["regions"][1:]]
    with pytest.raises(PlanFileError, match=r"regions\[0\]\.saved_positions: node \d+ is outside the region"):
        edited(tmp_path, data, regions=bad)
    lengths = [{**r, "saved_ops": ["x", "y"], "saved_positions": [r["start"]]}]
    with pytest.raises(PlanFileError, match=r"regions\[0\]\.saved_positions: 1 positions for 2 saved_ops"):
        edited(tmp_path, data, regions=lengths)


@pytest.mark.parametrize("chunks, field", [
    ([{"nodes": [], "chunks": 2}], r"stats\.chunks\[0\]\.nodes is malformed: an empty list"),
    ([{"chunks": 2}], r"stats\.chunks\[0\]\.nodes is malformed: missing"),
    ([{"nodes": ["a"], "chunks": 0}], r"stats\.chunks\[0\]\.chunks is malformed"),
    ([["a"]], r"stats\.chunks\[0\] is malformed: must be an object"),
], ids=["empty", "no-nodes", "zero-chunks", "not-an-object"])
def test_a_broken_chunked_region_is_a_bad_file(saved, tmp_path, chunks, field):
    _, _, data = saved
    with pytest.raises(PlanFileError, match=field) as info:
        edited(tmp_path, data, stats={**data["stats"], "chunks": chunks})
    assert "\n" not in str(info.value)


def test_the_command_line_says_one_line_for_a_broken_chunk(tmp_path, capsys):
    (tmp_path / "factory.py").write_text(FACTORY)
    fac = f"{tmp_path}/factory.py:make"
    path = tmp_path / "plan.json"
    assert main(["plan", fac, "--solver", "uniform", "--activation-budget", "0.7", "--curve-points", "2",
                 "--curve-solvers", "uniform", "--quiet", "-o", str(path)]) == 0
    data = json.loads(path.read_text())
    data["stats"]["chunks"] = [{"nodes": [], "chunks": 2}]
    path.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["apply", fac, str(path), "-o", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "stats.chunks[0].nodes" in err
