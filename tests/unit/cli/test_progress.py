"""optimize()/verify() report their stages and the solver's steps through logging, not only on a TTY."""

from __future__ import annotations

import logging

from ckpt_planner import optimize, verify
from ckpt_planner.profile.profiler import ProfileConfig

from tests.models.small import mlp

# bytes: the byte pass that decides feasibility before any timing (profile/bytes_pass.py); check: the safety net
STAGES = ("capture", "bytes", "profile", "solve", "check", "rewrite")


def _plan(**kw):
    model, inputs = mlp()
    config = ProfileConfig(warmup=0, repeats=1)
    return model, inputs, optimize(model, inputs, activation_budget=0.5, profile_config=config, **kw)


def test_stages_and_solver_steps_go_to_the_logger(caplog) -> None:
    from ckpt_planner.profile.bytes_pass import PROFILES

    PROFILES.clear()  # a fresh profile: every stage runs
    with caplog.at_level(logging.INFO, logger="ckpt_planner"):
        model, inputs, plan = _plan(solver="auto")
        verify(model, plan, inputs, repeats=1)
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("ckpt_planner")]
    for name in (*STAGES, "verify"):
        assert any(m.startswith(f"{name}: start") for m in messages), name
        assert any(m.startswith(f"{name}: done in") for m in messages), name
    # the order of the pipeline
    starts = [m.split(":")[0] for m in messages if ": start" in m]
    # half the plain step's activations: the plain step does not fit, so it is profiled a stage at a time
    # and calibrated on checkpointed steps (no plain step is timed)
    assert starts == ["capture", "bytes", "profile", "step times", "solve", "check", "rewrite", "verify"]
    # the portfolio's own steps, from the torch-free solvers package
    solver_records = [r for r in caplog.records if r.name.startswith("ckpt_planner.solvers")]
    assert any("auto: running dp" in r.getMessage() for r in solver_records)
    assert any("verify: measured peak" in m for m in messages)
    assert plan.regions


def test_progress_true_writes_to_stderr_without_a_tty(capsys) -> None:
    from ckpt_planner.profile.bytes_pass import PROFILES

    PROFILES.clear()  # a fresh profile: every stage runs
    logger = logging.getLogger("ckpt_planner")
    handlers, level = list(logger.handlers), logger.level
    _plan(solver="dp", progress=True)
    err = capsys.readouterr().err  # captured stderr: not a terminal
    for name in STAGES:
        assert f"{name}: start" in err and f"{name}: done in" in err
    assert "ckpt_planner INFO solve: dp chose" in err
    assert logger.handlers == handlers and logger.level == level  # nothing left behind


def test_quiet_by_default(capsys) -> None:
    _plan(solver="dp")
    assert "capture: start" not in capsys.readouterr().err
