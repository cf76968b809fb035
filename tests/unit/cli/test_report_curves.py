"""The memory/overhead curve is the report's, not the plan's: `plan` writes none by default (tens of solves
that nobody asked for on the way to the plan), and `report --model` computes it for a plan file that has none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ckpt_planner.cli.commands import main

FACTORY = '''
import torch
from ckpt_planner.cli.examples import MLPChain


def make():
    torch.manual_seed(0)
    return MLPChain(d=32, blocks=4), (torch.randn(64, 32),)


def other():
    torch.manual_seed(0)
    return MLPChain(d=32, blocks=3), (torch.randn(64, 32),)
'''


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("curves")
    (d / "factory.py").write_text(FACTORY)
    assert main(["plan", f"{d}/factory.py:make", "--solver", "uniform", "--activation-budget", "0.7", "--no-autotune",
                 "--quiet", "-o", str(d / "plan.json")]) == 0
    return d


def test_plan_writes_the_timeline_but_no_curve(planned):
    stats = json.loads((planned / "plan.json").read_text())["stats"]
    assert stats["timeline"]["plan"]["bytes"]  # two replays: cheap, kept
    assert "curves" not in stats


def test_report_without_the_model_says_how_to_get_the_curve(planned, capsys):
    out = planned / "plain.md"
    assert main(["report", str(planned / "plan.json"), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "no memory/overhead curve" in err and "--model" in err
    assert "Memory / overhead trade-off" not in out.read_text()


def test_report_with_the_model_computes_the_curve_with_the_plans_point(planned, capsys):
    out = planned / "curve.md"
    plan = json.loads((planned / "plan.json").read_text())
    assert main(["report", str(planned / "plan.json"), "--model", f"{planned}/factory.py:make", "--curve-points", "3",
                 "--curve-solvers", "uniform,dp", "--quiet", "-o", str(out)]) == 0
    assert "no memory/overhead curve" not in capsys.readouterr().err
    assert "Memory / overhead trade-off" in out.read_text()
    # The page is made from the plan file's figures; the curve is not written back into the plan file.
    assert "curves" not in json.loads((planned / "plan.json").read_text())["stats"]
    assert json.loads((planned / "plan.json").read_text()) == plan


def test_report_refuses_a_model_the_plan_was_not_made_for(planned, capsys):
    code = main(["report", str(planned / "plan.json"), "--model", f"{planned}/factory.py:other", "--curve-points", "2",
                 "--curve-solvers", "uniform", "--quiet", "-o", str(planned / "other.md")])
    err = capsys.readouterr().err
    assert code == 2 and "not the graph the plan file" in err
    assert not (planned / "other.md").exists()


def test_curves_for_puts_the_plans_point_on_its_solvers_curve(planned):
    import torch
    from ckpt_planner.api import Planner
    from ckpt_planner.cli.examples import MLPChain
    from ckpt_planner.cli.report_data import curves_for
    from ckpt_planner.plan import Plan

    torch.manual_seed(0)
    model, x = MLPChain(d=32, blocks=4), torch.randn(64, 32)
    plan = Plan.load(planned / "plan.json")
    curves = curves_for(plan, Planner(model, (x,)).problem, ["uniform"], 3)
    star = curves["plan"]
    assert (star["peak_bytes"], star["overhead"]) == (plan.predicted_peak_bytes, plan.predicted_overhead)
    assert any(p.get("this_plan") and p["peak_bytes"] == star["peak_bytes"] for p in curves["solvers"]["uniform"])
