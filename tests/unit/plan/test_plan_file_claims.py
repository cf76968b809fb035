"""What a plan file says about itself gates no check: a loaded plan is judged on figures re-derived from
the model and its own regions, whatever it claims about a compiled step, sharding, a race it won or the
bytes it copies to the host. Each lie below was accepted before these checks; each is refused with one
line (PlanMismatchError) on `rebuild` and `apply`, and exit 2 on the `apply` command, nothing written.

Every plan here is made on FLOP times (deterministic costs) and edited as JSON, as a person would.
"""

from __future__ import annotations

import json

import pytest
from ckpt_planner import Plan, PlanMismatchError
from ckpt_planner.cli.commands import main
from ckpt_planner.distributed import shard_problem
from ckpt_planner.lower.apply import checkpointed_modules
from ckpt_planner.solvers.simulate import simulate

from tests.models.small import LOCAL
from tests.unit.lower.test_offload import _offload_plan
from tests.unit.plan.test_lying_plans import FACTORY, edited, refused
from tests.unit.plan.test_plan_file import save_mlp_plan


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A plan of the MLP chain at 0.6 of its activations, saved; returns (planner, plan, its JSON)."""
    planner, plan, path = save_mlp_plan(tmp_path_factory)
    return planner, plan, json.loads(path.read_text())


def _race(data: dict) -> dict:
    """A one-entry race record saying these very regions were chosen and measured within the budget."""
    regions = [[r["start"], r["end"]] for r in data["regions"]]
    return {"candidates": [{"label": "dp plan", "chosen": True, "fits": True, "regions": regions}]}


# -- a compiled step --------------------------------------------------------------------------------------


@pytest.mark.parametrize("lowering", ["regions", "anything"])
def test_a_plan_saying_it_was_compiled_is_judged_on_its_eager_prediction(saved, tmp_path, lowering):
    _, _, data = saved
    stats = {**data["stats"], "compiled": {"lowering": lowering}}
    lie = dict(budget_bytes=data["predicted_peak_bytes"] // 2, measured_peak_bytes=None, stats=stats)
    refused(lambda: edited(tmp_path, data, **lie), r"predicted_peak_bytes: .* over the plan's own budget_bytes")


# -- sharding ---------------------------------------------------------------------------------------------


def test_a_plan_saying_it_was_sharded_is_simulated_at_the_ranks_that_run_it(saved, tmp_path):
    """Figures and budget consistent with 1024 fsdp ranks (each rank holding 1/1024 of the parameters), in
    one process: re-simulated as sharded it would pass; at this process's one rank it is refused."""
    planner, plan, data = saved
    model, _ = LOCAL["mlp"]()
    sharded, _ = shard_problem(planner.problem, model, world_size=1024, sharding="fsdp")
    base = simulate(sharded, ()).peak_bytes
    peak = simulate(sharded, plan.spans(), saved=plan.saved_indices()).peak_bytes
    assert peak < plan.predicted_peak_bytes  # the claim hides resident bytes
    lie = dict(baseline_peak_bytes=base, predicted_peak_bytes=peak, budget_bytes=peak,
               stats={**data["stats"], "sharding": {"world_size": 1024, "sharding": "fsdp"}})
    refused(lambda: edited(tmp_path, data, **lie), r"stats\.sharding: made for fsdp over 1024 ranks, but this process runs 1")


# -- offloads ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def offloading(tmp_path_factory):
    """(model, inputs, the JSON of a plan with offloads on a simulated bandwidth)."""
    model, x, plan, _ = _offload_plan(tmp_path_factory.mktemp("offload"))
    assert len(plan.offloaded) >= 2
    return model, x, plan.to_dict()


def _offload_refused(tmp_path, model, x, data: dict, match: str) -> None:
    path = tmp_path / "offload.json"
    path.write_text(json.dumps(data))
    for call in (lambda: Plan.load(path).rebuild(model, x), lambda: Plan.load(path).apply(model, x)):
        with pytest.raises(PlanMismatchError, match=match) as info:
            call()
        assert "\n" not in str(info.value)
    assert checkpointed_modules(model) == ()


@pytest.mark.parametrize("host", [1, None], ids=["one-byte", "absent"])
def test_offloads_over_the_plans_host_budget_are_refused(offloading, tmp_path, host):
    model, x, data = offloading
    data = json.loads(json.dumps(data))
    if host is None:
        data["stats"]["offload"].pop("host_budget_bytes")
    else:
        data["stats"]["offload"]["host_budget_bytes"] = host
    _offload_refused(tmp_path, model, x, data, r"plan offloaded: \d+ activations copy .* over the plan's own "
                                               r"stats\.offload\.host_budget_bytes")


def test_offload_entries_understating_their_bytes_are_refused(offloading, tmp_path):
    model, x, data = offloading
    data = json.loads(json.dumps(data))
    for o in data["offloaded"]:
        o["bytes"] = 1
    _offload_refused(tmp_path, model, x, data, r"plan offloaded\[0\]\.bytes: the file says 1 bytes but .* on this model")


# -- a race record ----------------------------------------------------------------------------------------


def test_a_forged_race_record_does_not_let_an_over_budget_plan_through(saved, tmp_path):
    """The margin over a budget is granted to a plan measured within it here, never to a record saying so."""
    _, _, data = saved
    lie = dict(budget_bytes=data["predicted_peak_bytes"] - 1, measured_peak_bytes=None,
               stats={**data["stats"], "autotune": _race(data)})
    refused(lambda: edited(tmp_path, data, **lie), r"predicted_peak_bytes: .* over the plan's own budget_bytes")
    # without example inputs nothing is measured: no margin either
    with pytest.raises(PlanMismatchError, match="over the plan's own budget_bytes"):
        edited(tmp_path, data, **lie).apply(LOCAL["mlp"]()[0])


def test_a_forged_race_record_with_a_measured_peak_from_another_device_gets_no_margin(saved, tmp_path):
    _, _, data = saved
    budget = data["predicted_peak_bytes"] - 1
    lie = dict(budget_bytes=budget, measured_peak_bytes=budget - 1,
               stats={**data["stats"], "autotune": _race(data), "verify": {"device": "cuda"}})
    refused(lambda: edited(tmp_path, data, **lie), r"predicted_peak_bytes: .* over the plan's own budget_bytes")


# -- the command line -------------------------------------------------------------------------------------


def _lie_compiled(data: dict) -> dict:
    return dict(budget_bytes=data["predicted_peak_bytes"] // 2, measured_peak_bytes=None,
                stats={**data["stats"], "compiled": {"lowering": "regions"}})


def _lie_race(data: dict) -> dict:
    return dict(budget_bytes=data["predicted_peak_bytes"] - 1, stats={**data["stats"], "autotune": _race(data)})


def _lie_sharded(data: dict) -> dict:
    return dict(stats={**data["stats"], "sharding": {"world_size": 1024, "sharding": "fsdp"}})


@pytest.mark.parametrize(("lie", "said"), [
    (_lie_compiled, "predicted_peak_bytes"), (_lie_race, "predicted_peak_bytes"), (_lie_sharded, "stats.sharding"),
], ids=["compiled", "race", "sharded"])
def test_a_plan_claiming_what_it_is_not_exits_2_on_the_command_line(tmp_path, capsys, lie, said):
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


def test_a_forged_race_record_does_not_let_an_over_budget_module_level_variant_through(tmp_path):
    """Greedy's regions split blocks: applied in place, the nearest whole-module plan is over the budget and
    refused. A record naming that variant as chosen and fitting (nothing measured) must not change that."""
    from ckpt_planner import InfeasibleBudgetError, Planner, ProfileConfig
    from ckpt_planner.lower.apply import module_aligned

    model, inputs = LOCAL["mlp"]()
    planner = Planner(model, inputs, profile_config=ProfileConfig(warmup=0, repeats=1, flop_times=True))
    base, fixed = planner.baseline_peak_bytes, planner.problem.fixed_bytes
    plan = planner.plan(budget_bytes=fixed + (base - fixed) * 6 // 10, solver="greedy", autotune=False)
    used, _, misaligned = module_aligned(plan.problem, model, plan.spans(), plan.budget_bytes)
    assert misaligned and simulate(plan.problem, used).peak_bytes > plan.budget_bytes  # the variant is over
    data = plan.to_dict()
    data["stats"]["autotune"] = {"candidates": [{"label": "greedy plan", "chosen": True, "fits": True,
                                                 "regions": [list(r) for r in used]}]}
    path = tmp_path / "forged.json"
    path.write_text(json.dumps(data))
    fresh, _ = LOCAL["mlp"]()
    with pytest.raises(InfeasibleBudgetError):
        Plan.load(path).apply(fresh, inputs)
    assert checkpointed_modules(fresh) == ()
