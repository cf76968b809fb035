"""Inputs built to fool the readers: an --input range past int64, a bench file holding a number Python refuses
to read, inputs the model cannot take; each answered with exit 2 and one line naming the fault. (Hostile
archives, .pt2 and torch.save files, are tested beside their checks: tests/unit/capture/test_pt2_*.py.)
"""

from __future__ import annotations

import json

import pytest
from ckpt_planner.cli.loading import make_inputs, parse_input_spec

from .cli_checks import one_line, run
from .test_security import FACTORY


def test_input_range_past_int64_is_one_line(tmp_path, capsys):
    (tmp_path / "factory.py").write_text(FACTORY)
    model = f"{tmp_path / 'factory.py'}:make"
    for spec in ("64,32:int64:0-9223372036854775808", "64,32:int64:-9223372036854775809-0"):
        code, err = run(["profile", model, "--input", spec], capsys)
        line = one_line(err)
        assert code == 2 and spec in line and "HIGH <= 9223372036854775807" in line, line
    # the largest int64 range torch.randint draws from is accepted, exactly (a float would round it up)
    (x,) = make_inputs([parse_input_spec("4:int64:9223372036854775806-9223372036854775807")])
    assert x.tolist() == [9223372036854775806] * 4


def test_bench_file_with_a_5000_digit_number_is_refused_in_one_line(tmp_path):
    from ckpt_planner.cli.bench import load_bench_file
    from ckpt_planner.errors import PlanFileError

    path = tmp_path / "bench.json"
    path.write_text('{"schema": "ckpt-planner/bench", "version": 1, "rows": [], "budget_bytes": ' + "9" * 5000 + "}")
    with pytest.raises(PlanFileError, match="bench file .* is not valid JSON") as e:
        load_bench_file(str(path))
    assert "\n" not in str(e.value)
    path.write_text(json.dumps({"schema": "ckpt-planner/bench", "version": 1, "rows": [], "budget_bytes": 2**70}))
    with pytest.raises(PlanFileError, match="budget_bytes"):
        load_bench_file(str(path))


def test_report_with_a_5000_digit_bench_number_exits_2_in_one_line(tmp_path, capsys):
    factory = tmp_path / "factory.py"
    factory.write_text(FACTORY)
    plan = tmp_path / "plan.json"
    assert run(["plan", f"{factory}:make", "--activation-budget", "0.8", "-o", plan], capsys)[0] == 0
    bench = tmp_path / "bench.json"
    bench.write_text('{"schema": "ckpt-planner/bench", "version": 1, "rows": [], "budget_bytes": ' + "9" * 5000 + "}")
    code, err = run(["report", plan, "--bench", bench, "-o", tmp_path / "report.html"], capsys)
    assert code == 2 and "bench file" in one_line(err)
    assert not (tmp_path / "report.html").exists()


@pytest.mark.parametrize("spec", ["64,0", "64,32:float64:0-1"])
def test_profile_with_inputs_the_model_cannot_take_exits_2_in_one_line(tmp_path, capsys, spec):
    factory = tmp_path / "factory.py"
    factory.write_text(FACTORY)
    code, err = run(["profile", f"{factory}:make", "--input", spec], capsys)
    line = one_line(err)
    assert code == 2 and "input" in line, line
