"""What a newcomer meets in the first hour: every figure agrees with every other, the CLI says what it
checked, nothing alarms without cause, and an infeasible budget is refused before the model is timed."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import re

import pytest
import torch
from ckpt_planner import Planner, optimize
from ckpt_planner.cli.commands import main
from ckpt_planner.profile.profiler import ProfileConfig
from ckpt_planner.solvers import InfeasibleBudgetError
from torch import nn

from tests.models.examples import MLPChain

FAST = ProfileConfig(warmup=0, repeats=1, flop_times=True)  # deterministic costs
MEASURED = ProfileConfig(warmup=0, repeats=2)  # timed, as a user's default run is

FACTORY = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a_rather_long_projection_name_for_the_table = nn.Linear(32, 128)
        self.out = nn.Linear(128, 32)

    def forward(self, x):
        return self.out(torch.nn.functional.gelu(self.a_rather_long_projection_name_for_the_table(x)))


def make():
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(4)]), (torch.randn(64, 32),)
'''


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("first_hour")
    (d / "factory.py").write_text(FACTORY)
    return d


def _stages(caplog) -> list[str]:
    return [r.getMessage().split(":")[0] for r in caplog.records if r.getMessage().endswith("start") or ": start (" in r.getMessage()]


# -- 3. a fallback to torch.export is information -------------------------------------------------


class ShapeBranch(nn.Module):
    """symbolic_trace cannot branch on a shape; torch.export can (shapes are static there)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:
            x = x * 2
        return self.layers(x)


def test_export_fallback_is_a_plain_note_with_the_reason_at_debug(caplog):
    torch.manual_seed(0)
    model, x = ShapeBranch(), torch.randn(64, 32)
    with caplog.at_level(logging.DEBUG, logger="ckpt_planner"):
        plan = optimize(model, (x,), profile_config=FAST)
    assert plan.capture_method == "export"
    assert "captured with torch.export" in plan.notes
    assert not any("failed" in n for n in plan.notes) and "failed" not in plan.summary()
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any(m.startswith("symbolic_trace failed (") for m in debug)  # the reason, for whoever debugs
    assert not any("symbolic_trace failed" in r.getMessage() for r in caplog.records if r.levelno > logging.DEBUG)


# -- 6. profile tables keep full names ------------------------------------------------------------


def test_profile_table_keeps_full_node_and_module_names(work, capsys):
    assert main(["profile", f"{work}/factory.py:make", "--meta", "--json"]) == 0
    import json

    rows = json.loads(capsys.readouterr().out)["nodes"]
    assert main(["profile", f"{work}/factory.py:make", "--meta"]) == 0
    table = capsys.readouterr().out.splitlines()
    long = [r for r in rows if len(r["node"]) > 28 or len(r["module"]) > 24]
    assert long, "the factory's names are longer than the old fixed columns"
    for r in rows:
        line = next(ln for ln in table[1:] if ln.split()[0] == r["node"])  # the whole name, as its own word
        assert r["module"] in line and r["target"] in line


# -- 4. plan --verify says what it found ----------------------------------------------------------


def test_plan_verify_prints_the_demos_verdict_line(work, capsys):
    from ckpt_planner.cli.commands import verdict_line

    code = main(["plan", f"{work}/factory.py:make", "--solver", "uniform", "--activation-budget", "0.8", "--verify",
                 "--curve-points", "0", "-o", str(work / "v.json")])
    out = capsys.readouterr().out
    assert code == 0
    verdicts = [ln for ln in out.splitlines() if ln.startswith("verified: ")]
    assert len(verdicts) == 1
    assert verdicts[0].startswith("verified: outputs equal, gradients bitwise equal, buffers equal; measured peak")
    assert "within the budget" in verdicts[0]
    assert verdict_line.__module__ == "ckpt_planner.cli.commands"  # the demo prints the same function's line


def test_plan_verify_over_budget_exits_1_and_says_so(work, capsys, monkeypatch):
    import dataclasses

    verify_module = importlib.import_module("ckpt_planner.verification")
    real = verify_module.verify

    def over(*args, **kwargs):
        report = real(*args, **kwargs)
        return dataclasses.replace(report, measured_peak_bytes=report.budget_bytes + 1)

    monkeypatch.setattr(verify_module, "verify", over)
    code = main(["plan", f"{work}/factory.py:make", "--solver", "uniform", "--activation-budget", "0.8", "--verify",
                 "--curve-points", "0", "-o", str(work / "over.json")])
    captured = capsys.readouterr()
    assert code == 1 and not (work / "over.json").exists()
    assert any(ln.startswith("verified: ") and "OVER the budget" in ln for ln in captured.out.splitlines())
    assert "verification failed" in captured.err


# -- 5. one source for each figure ----------------------------------------------------------------


def test_summary_shows_one_overhead_whose_parts_add_up():
    torch.manual_seed(0)
    model, x = MLPChain(d=64, blocks=6), torch.randn(256, 64)
    plan = optimize(model, (x,), activation_budget=0.5, solver="dp", profile_config=MEASURED)
    assert plan.regions
    text = plan.summary()
    assert "% of the forward" not in text
    percents = [ln for ln in text.splitlines() if re.search(r"[+-]?\d+\.\d %", ln) and not ln.startswith("memory saved")]
    assert len(percents) == 1, percents  # one overhead figure
    m = re.search(r"([\d.]+) ms against ([\d.]+) ms eager: ([+-][\d.]+) % = recompute ([\d.]+) ms .* captured graph ([\d.]+) ms",
                  percents[0])
    assert m, percents[0]
    step, eager, pct, rec, graph = map(float, m.groups())
    assert abs((rec + graph) - (step - eager)) <= 0.15  # ms, the summary's rounding
    assert abs(pct - 100 * plan.predicted_overhead) <= 0.05


def test_plan_without_regions_runs_the_model_and_predicts_no_overhead():
    torch.manual_seed(0)
    model, x = MLPChain(d=32, blocks=3), torch.randn(64, 32)
    plan = optimize(model, (x,), budget_gb=100, profile_config=MEASURED)
    assert not plan.regions and plan.module is model
    assert plan.predicted_step_s == plan.eager_step_s > 0 and plan.predicted_overhead == 0.0
    assert "+0.0 %" in plan.summary()
    none = Planner(model, (x,), profile_config=MEASURED).plan(solver="none")
    assert none.module is model and none.predicted_overhead == 0.0


@pytest.mark.parametrize("bounded", [None, False], ids=["stagewise", "whole"])
def test_a_second_plan_in_one_process_is_priced_on_the_first_profile(monkeypatch, tmp_path, caplog, bounded):
    """Times measured later are lower here (a machine that got quieter): the second call must not see them,
    or a tighter budget could look cheaper than a looser one. Both budgets are below the plain step: by
    default profiled a stage at a time, else whole."""
    from ckpt_planner.profile.bytes_pass import PROFILES

    monkeypatch.setenv("CKPT_PLANNER_TIMINGS", str(tmp_path))
    PROFILES.clear()
    real, calls = importlib.import_module("ckpt_planner.profile.timing").robust_times, []

    def quieter(samples):
        calls.append(1)
        return {k: v / 4 ** len(calls) for k, v in real(samples).items()}

    for module in ("profiler", "stagewise"):
        monkeypatch.setattr(importlib.import_module(f"ckpt_planner.profile.{module}"), "robust_times", quieter)
    torch.manual_seed(0)
    model, x = MLPChain(d=64, blocks=6), torch.randn(256, 64)
    config = dataclasses.replace(MEASURED, bounded=bounded)
    with caplog.at_level(logging.INFO, logger="ckpt_planner"):
        loose = optimize(model, (x,), activation_budget=0.7, solver="dp", profile_config=config)
        tight = optimize(model, (x,), activation_budget=0.55, solver="dp", profile_config=config)
    profiles = [r.getMessage() for r in caplog.records if r.getMessage().startswith("profile: start")]
    first = ("profile: start (a stage at a time: bytes on fake tensors, each stage's own step on real ones)"
             if bounded is None else "profile: start (running each node)")
    assert len(calls) == 1 and profiles == [first,
                                            "profile: start (reused: this process measured the same graph, weights and inputs)"]
    assert _stages(caplog).count("bytes") == 1  # the second call has its profile: nothing to time, no byte pass
    assert [n.time for n in tight.problem.nodes] == [n.time for n in loose.problem.nodes]
    assert tight.eager_step_s == loose.eager_step_s and tight.graph_overhead_s == loose.graph_overhead_s
    assert tight.predicted_peak_bytes <= loose.predicted_peak_bytes
    assert tight.predicted_step_s >= loose.predicted_step_s
    x2 = x.clone()
    x2[0, 0] += 1  # other input values: measured afresh
    optimize(model, (x2,), activation_budget=0.55, solver="dp", profile_config=config)
    assert len(calls) == 2


def test_bench_header_and_rows_share_one_baseline():
    from ckpt_planner.cli.bench import bench, bench_table

    torch.manual_seed(0)
    model, x = MLPChain(d=32, blocks=4), torch.randn(64, 32)
    planner = Planner(model, (x,), profile_config=FAST)
    result = bench(planner, (x,), ["none", "uniform"], {"activation_budget": 0.8})
    rows = {r["solver"]: r for r in result["rows"]}
    assert [r["status"] for r in rows.values()] == ["ok", "ok"]
    base = result["baseline_step_s"]
    assert rows["none"]["step_s"] == base and rows["none"]["step_time_ratio"] == 1.0
    for r in rows.values():
        assert r["baseline_step_s"] == base and r["step_time_ratio"] == r["step_s"] / base
    table = bench_table({**result, "device": "cpu"})
    assert f"no-checkpointing step {base * 1e3:.2f} ms" in table
    none_line = next(ln for ln in table.splitlines() if ln.startswith("none "))
    assert f"{base * 1e3:.2f}" in none_line and " 1.00 " in none_line


# -- 8. infeasible before timing ------------------------------------------------------------------


# a GPT-2 of the Quickstart's size profiled in full: the slowest test of the file. In the default run
# test_cli_plan_refuses_an_infeasible_budget_before_timing checks the same refusal on a small model.
@pytest.mark.slow
def test_infeasible_budget_on_the_quickstart_model_is_refused_before_timing(monkeypatch, caplog):
    transformers = pytest.importorskip("transformers")
    api = importlib.import_module("ckpt_planner.api")
    profile_mod = importlib.import_module("ckpt_planner.profile.profiler")

    def no_timing(*args, **kwargs):
        raise AssertionError("the model was timed for a budget that cannot be met")

    def untimed_only(real):
        def run(gm, flat, config, *rest):
            if not config.flop_times:
                no_timing()
            return real(gm, flat, config, *rest)
        return run

    for name in ("_profile_real", "_profile_bounded"):  # the step whole, or a stage at a time
        monkeypatch.setattr(profile_mod, name, untimed_only(getattr(profile_mod, name)))
    monkeypatch.setattr(api, "with_step_times", no_timing)  # handed to the profile stage by the spine
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8192, use_cache=False)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 8192, (8, 128))
    batch = {"input_ids": ids, "labels": ids}
    with caplog.at_level(logging.INFO, logger="ckpt_planner"), pytest.raises(InfeasibleBudgetError) as refused:
        optimize(model, batch, budget_gb=0.05, profile_config=ProfileConfig())
    assert _stages(caplog) == ["capture", "bytes"]  # no "profile", no "step times"
    assert any(r.getMessage().startswith("bytes: failed after") for r in caplog.records)  # the stage and its seconds
    # The byte pass names the budget the whole pipeline names (bytes alone decide).
    with pytest.raises(InfeasibleBudgetError) as full:
        optimize(model, batch, budget_gb=0.05, profile_config=FAST)
    assert refused.value.smallest_bytes == full.value.smallest_bytes


# -- 5. the report's figures are the summary's -----------------------------------------------------


@pytest.fixture(scope="module")
def reported():
    """A plan with kept ops (its peak counts them), its report data, and a bench of three solvers."""
    from ckpt_planner.cli.bench import bench
    from ckpt_planner.cli.report import plan_data

    from tests.models.small import tiny_gpt

    model, inputs = tiny_gpt()
    planner = Planner(model, inputs, profile_config=FAST)
    plan = planner.plan(activation_budget=0.85, solver="dp")
    assert plan.saved_indices(), "the case needs kept ops"
    plan.stats.update(plan_data(plan, planner.problem, ["dp", "uniform"], 4))
    result = bench(planner, inputs, ["none", "uniform", "dp"], {"activation_budget": 0.85})
    return plan, plan.to_dict(), result


def _summary_value(plan, key: str) -> str:
    line = next(ln for ln in plan.summary().splitlines() if ln.startswith(key))
    return line[len(key):].strip()


def test_report_summary_counts_and_overhead_are_the_summarys(reported):
    from ckpt_planner.cli.report import summary_rows

    plan, data, _ = reported
    rows = {key: text for key, _, _, text in summary_rows(data)}
    assert rows["regions"] == _summary_value(plan, "recomputed regions")  # same counts, same words
    assert rows["predicted_step_s"] == _summary_value(plan, "predicted step time")  # the one overhead
    assert "% of the forward" not in " ".join(rows.values())


def test_report_legend_peak_is_the_summarys_peak(reported):
    plan, data, _ = reported
    timeline = data["stats"]["timeline"]["plan"]
    assert timeline["peak_bytes"] == plan.predicted_peak_bytes == max(timeline["bytes"])  # the legend's peak


def test_report_star_is_the_plans_point_on_its_solvers_curve(reported):
    plan, data, _ = reported
    curves = data["stats"]["curves"]
    star = curves["plan"]
    assert star["peak_bytes"] == plan.predicted_peak_bytes and star["overhead"] == plan.predicted_overhead
    assert any((p["peak_bytes"], p["overhead"]) == (star["peak_bytes"], star["overhead"]) for p in curves["solvers"]["dp"])


def test_report_draws_every_measured_timeline_of_the_bench(reported, monkeypatch):
    pytest.importorskip("matplotlib")
    report = importlib.import_module("ckpt_planner.cli.report")
    plan, data, result = reported
    drawn: list[str] = []
    real = report._plot_series
    monkeypatch.setattr(report, "_plot_series", lambda ax, series, label, style: drawn.append(label) or real(ax, series, label, style))
    report.figures(data, result)
    measured = [label for label in drawn if label.endswith("measured")]
    assert measured == ["no checkpointing, measured", "uniform, measured", "dp, measured"]


def test_report_solver_statistics_are_a_table(reported):
    from ckpt_planner.cli.report import _solver_stats, render

    _, data, _ = reported
    data = {**data, "stats": {**data["stats"], "tried": {"dp": {"peak_bytes": 5, "fits": True}}, "attempts": [1, 2]}}
    rows = _solver_stats(data)
    assert ["tried.dp.peak_bytes", "5"] in rows and ["attempts", "1, 2"] in rows
    assert all(not value.startswith(("{", "[")) for _, value in rows)  # plain values, no raw JSON
    text = render(data, fmt="md")
    assert "| tried.dp.fits | True |" in text


def test_cli_plan_refuses_an_infeasible_budget_before_timing(work, capsys, monkeypatch):
    profile_mod = importlib.import_module("ckpt_planner.profile.profiler")
    real = profile_mod._profile_real

    def untimed_only(gm, flat, config, dev):
        assert config.flop_times, "the model was timed for a budget that cannot be met"
        return real(gm, flat, config, dev)

    monkeypatch.setattr(ProfileConfig, "or_default", classmethod(  # the user's default profile: timed
        lambda cls, config: config if config is not None else cls()))
    monkeypatch.setattr(profile_mod, "_profile_real", untimed_only)
    code = main(["plan", f"{work}/factory.py:make", "--budget-bytes", "100000", "--curve-points", "0",
                 "-o", str(work / "never.json")])
    captured = capsys.readouterr()
    assert code == 1 and "infeasible" in captured.err and "smallest budget" in captured.err
    assert not (work / "never.json").exists()
