"""`ckpt-planner demo`: one figure per quantity. The summary's predicted step overhead is the chosen plan's
predicted overhead in the autotune rows (one source: the plan's predicted step over eager), every figure is
marked predicted or measured, and no overhead is shown below zero without saying what the noise says."""

from __future__ import annotations

import re

import pytest
from ckpt_planner.cli.commands import main

_PCT = re.compile(r"(?<![/\d])([+-]\d+\.\d) %")  # a figure, not a noise band's "+/-4.6 %"


@pytest.fixture(scope="module")
def demo_out() -> str:
    mp = pytest.MonkeyPatch()
    # the race runs afresh, not a stored choice; --autotune: the tests' profiles are FLOP-timed, where the race
    # is off by default (the predicted figures are the FLOPs', the measured ones the clock's)
    mp.setenv("CKPT_PLANNER_TIMINGS", "off")
    try:
        import contextlib
        import io

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["demo", "--batch", "2", "--seq", "64", "--layers", "2", "--fraction", "0.7", "--autotune"])
    finally:
        mp.undo()
    assert code == 0
    return out.getvalue()


def _row(text: str, key: str) -> str:
    return next(ln for ln in text.splitlines() if ln.startswith(key))


def test_summary_and_race_rows_give_the_plan_one_predicted_overhead(demo_out):
    step = _row(demo_out, "predicted step time")
    summary = float(re.search(r"eager: ([+-]\d+\.\d) %", step).group(1))
    tuned = _row(demo_out, "autotune")
    assert "not run" not in tuned, demo_out
    chosen = next(ln for ln in demo_out.splitlines() if ln.startswith("  * "))
    assert float(re.search(r"predicted ([+-]\d+\.\d) %", chosen).group(1)) == summary, demo_out
    # the other candidates are on the same scale: over eager, with the captured graph's overhead
    assert "against the eager step" in tuned


def test_every_time_figure_is_marked_and_no_negative_overhead_is_bare(demo_out):
    lines = [ln for ln in demo_out.splitlines() if ln.startswith(("  ", "predicted step time", "verified"))]
    assert lines
    for ln in lines:
        for part in ln.split(";"):
            if "predicted vs measured" in part:  # the peak's prediction error, not an overhead
                continue
            for m in _PCT.finditer(part):
                assert "predicted" in part or "measured" in part, ln  # each figure says which it is
                if float(m.group(1)) < 0:
                    assert "noise" in part[m.end():], ln
    measured = [part for ln in lines for part in ln.split(";")
                if "measured" in part and " %" in part and "predicted vs measured" not in part]
    for part in measured:  # a measured time figure carries its noise band
        if _PCT.search(part.split("measured", 1)[1]):
            assert "+/-" in part, part


def test_race_rows_say_a_negative_measured_overhead_is_noise():
    from ckpt_planner.plan_summary import autotune_rows

    cand = {"label": "dp", "chosen": True, "predicted_extra_s": 0.02, "predicted_peak_bytes": 10**6,
            "measured_peak_bytes": 10**6, "fits": True}
    rec = {"chosen": "dp", "steps": 12, "rounds": 3, "band": 0.05, "graph_step_s": 1.0}
    within = autotune_rows({"autotune": {**rec, "candidates": [{**cand, "measured_extra_s": -0.03}]}}, 0.2, 0.0, 0.1)
    beyond = autotune_rows({"autotune": {**rec, "candidates": [{**cand, "measured_extra_s": -0.25}]}}, 0.2, 0.0, 0.1)
    assert "predicted +10.0 %" in within[1][1]  # the plan's own figure, over eager (0.2 s), not the race's 1.0 s
    assert "measured -3.0 % +/-5.0 % (within the noise" in within[1][1]
    assert "measured -25.0 % +/-5.0 % (below the plain graph's step by more than the noise band" in beyond[1][1]
