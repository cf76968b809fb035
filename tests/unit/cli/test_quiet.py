"""A quiet console: optimize() and verify() write nothing to stdout or stderr unless asked (progress=True or
the "ckpt_planner" logger); the user's own warnings still pass. The command line gives one line for what
a user did wrong, where it once exited silently or went ahead."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_planner import optimize
from ckpt_planner.cli.commands import main

from tests.models.small import mlp

REPO = Path(__file__).resolve().parents[3]

SCRIPT = r'''
import os
import warnings

import torch
from ckpt_planner import optimize, verify
from tests.models.small import mlp

# Kineto reads its log level once per process: a profiler session the user ran first (its lines sent
# nowhere here) leaves it printing 'USDT: ... profiler_start/stop' for every later session.
saved = os.dup(2)
null = os.open(os.devnull, os.O_WRONLY)
os.dup2(null, 2)
with torch.profiler.profile(profile_memory=True):
    torch.randn(4) * 2
os.dup2(saved, 2)


class Warns(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        warnings.warn("the user's own warning")
        return self.inner(x)


model, inputs = mlp()
model = Warns(model)
for solver in ("auto", "ilp"):
    plan = optimize(model, inputs, activation_budget=0.5, solver=solver)
    assert plan.regions, solver
    report = verify(model, plan, inputs, repeats=1)
    assert report.exact, solver
'''


def test_optimize_and_verify_leave_the_console_empty():
    """HiGHS's banner (stdout), Kineto's USDT lines (stderr, from C++): none of it; the user's warning: yes."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("KINETO_LOG_LEVEL", None)
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    assert any("UserWarning: the user's own warning" in ln for ln in lines), out.stderr
    # what remains once the user's warning (its line and the source line Python shows under it) is taken out
    rest = [ln for ln in lines if "the user's own warning" not in ln and "warnings.warn(" not in ln]
    assert rest == [], "\n".join(rest[:20])


BATCH_OF_ONE = r"""
from ckpt_planner import optimize
from tests.models.small import mlp

model, (x,) = mlp()
plan = optimize(model, (x[:1],), capture_method="export", solver="dp")
assert plan.module(x[:1]).shape == (1, x.shape[1])
"""


def test_batch_of_one_exports_without_specialization_warnings():
    """A size-1 dimension is not marked dynamic: export would specialize it and warn (through torch's
    logging, straight to the process's stderr), once per input."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", BATCH_OF_ONE], capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == "" and out.stderr == "", out.stderr[-3000:]


@pytest.fixture
def factory(tmp_path):
    (tmp_path / "factory.py").write_text(
        "import sys\nimport torch\nfrom ckpt_planner.cli.examples import MLPChain\n\n\n"
        "def make():\n    torch.manual_seed(0)\n    return MLPChain(d=32, blocks=4), (torch.randn(64, 32),)\n\n\n"
        "def exits():\n    sys.exit(7)\n"
    )
    return tmp_path / "factory.py"


@pytest.mark.parametrize(
    "argv,needles",
    [
        (["{f}:exits", "--curve-points", "0"], ["exits()", "sys.exit(7)"]),
        (["{f}:make", "--compile", "--device", "meta", "--curve-points", "0"], ["--compile", "real tensors"]),
    ],
    ids=["factory-exits", "compile-on-meta"],
)
def test_cli_one_line_and_exit_2(factory, tmp_path, capsys, argv, needles):
    out = tmp_path / "plan.json"
    code = main(["plan", *[a.format(f=factory) for a in argv], "-o", str(out)])
    stdout, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, err)
    assert all(n in lines[0] for n in needles), lines[0]
    assert "Traceback" not in err and stdout == "" and not out.exists()


def test_progress_still_shows_when_asked(capsys):
    model, inputs = mlp()
    optimize(model, inputs, activation_budget=0.5, solver="dp", progress=True)
    assert "ckpt_planner INFO capture: start" in capsys.readouterr().err
    assert torch.is_grad_enabled()
