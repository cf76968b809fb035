"""Bad input on the command line: one line on stderr naming the argument, the right exit code, no traceback,
nothing written; Ctrl-C exits 130; a factory's prints never reach --json stdout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from ckpt_planner.cli.commands import main

REPO = Path(__file__).resolve().parents[3]

FACTORY = '''
import sys
import time

import torch
from ckpt_planner.cli.examples import MLPChain


def make():
    torch.manual_seed(0)
    return MLPChain(d=32, blocks=4), (torch.randn(64, 32),)


def chatty():
    print("building the model...")
    return make()


def big():
    torch.manual_seed(0)
    return MLPChain(d=16, blocks=12), (torch.randn(8, 16),)


class NoneOut(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(32, 32)
        self.b = torch.nn.Linear(32, 32)

    def forward(self, x):
        self.b(torch.relu(self.a(x)))
        return None


def none_out():
    return NoneOut(), (torch.randn(64, 32),)


def frozen():
    model, inputs = make()
    model.requires_grad_(False)
    return model, inputs


def slow():
    open(sys.argv[-1] + ".started", "w").close()
    time.sleep(120)
'''


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("cli_errors")
    (d / "factory.py").write_text(FACTORY)
    from tests.models.examples import MLPChain

    torch.manual_seed(0)
    torch.export.save(torch.export.export(MLPChain(d=32, blocks=4), (torch.randn(64, 32),)), d / "mlp.pt2")
    assert main(["plan", f"{d}/factory.py:make", "--solver", "uniform", "--activation-budget", "0.7",
                 "--curve-points", "2", "--curve-solvers", "uniform", "--quiet", "-o", str(d / "plan.json")]) == 0
    return d


def run(argv: list, capsys) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def tampered_plan(work: Path, name: str, edit) -> Path:
    data = json.loads((work / "plan.json").read_text())
    edit(data)
    path = work / f"{name}.json"
    path.write_text(json.dumps(data))
    return path


def _cases(work: Path, out: Path) -> list[tuple[str, list, int, list[str]]]:
    fac = f"{work}/factory.py"
    plan = ["--curve-points", "0", "-o", out / "plan.json"]

    def cli(**changes):
        return lambda d: d["stats"]["cli"].update(changes)

    big_inputs = tampered_plan(work, "big_inputs", cli(inputs=["100000,100000,100000"]))
    bad_seed = tampered_plan(work, "bad_seed", cli(inputs=["64,32"], seed="x"))
    huge_seed = tampered_plan(work, "huge_seed", cli(inputs=["64,32"], seed=2**70))
    not_list = tampered_plan(work, "not_list", cli(inputs="64,32"))
    bad_spec = tampered_plan(work, "bad_spec", cli(inputs=["64,32:int64:0-1e400"]))
    timeline = tampered_plan(work, "timeline", lambda d: d["stats"].update(timeline={"plan": {"bytes": "abc"}}))
    curves = tampered_plan(work, "curves", lambda d: d["stats"]["curves"]["solvers"].update(dp=[{"peak_bytes": "x"}]))
    budget_list = tampered_plan(work, "budget_list", lambda d: d.update(budget_bytes=[]))
    notes_ints = tampered_plan(work, "notes_ints", lambda d: d.update(notes=[1]))
    (work / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (work / "deep_stats.json").write_text((work / "plan.json").read_text().rstrip()[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    return [
        ("budget nan", ["plan", f"{fac}:make", "--budget-gb", "nan", *plan], 2, ["--budget-gb", "finite"]),
        ("budget inf", ["plan", f"{fac}:make", "--budget-gb", "inf", *plan], 2, ["--budget-gb", "finite"]),
        ("budget negative", ["plan", f"{fac}:make", "--budget-gb", "-1", *plan], 2, ["--budget-gb", "> 0"]),
        ("activation budget", ["plan", f"{fac}:make", "--activation-budget", "1.5", *plan], 2, ["--activation-budget"]),
        ("int range 1e30", ["plan", f"{fac}:make", "--input", "2,64:int64:0-1e30", *plan], 2, ["2,64:int64:0-1e30", "outside"]),
        ("int range 1e400", ["plan", f"{fac}:make", "--input", "2,64:int64:0-1e400", *plan], 2, ["0-1e400", "finite"]),
        ("int range fraction", ["plan", f"{fac}:make", "--input", "2,64:int64:0.2-0.7", *plan], 2, ["integer LOW-HIGH"]),
        ("uint8 range", ["plan", f"{fac}:make", "--input", "2,64:uint8:0-1000", *plan], 2, ["uint8", "256"]),
        ("shape too large", ["plan", f"{fac}:make", "--input", "100000,100000,100000", *plan], 2, ["100000,100000,100000", "memory"]),
        ("size beyond int64", ["plan", f"{fac}:make", "--input", "99999999999999999999", *plan], 2, ["2**63"]),
        ("seed", ["plan", f"{fac}:make", "--seed", "99999999999999999999999", *plan], 2, ["--seed"]),
        ("curve points", ["plan", f"{fac}:make", "--curve-points", "-3", "-o", out / "p.json"], 2, ["--curve-points"]),
        ("bruteforce large", ["plan", f"{fac}:big", "--solver", "bruteforce", *plan], 2, ["bruteforce", "'dp'"]),
        ("factory wrong width", ["plan", f"{fac}:make", "--input", "64,31", *plan], 2, ["--input '64,31'", "(64, 32)"]),
        ("factory wrong rank", ["plan", f"{fac}:make", "--input", "64,32,3", *plan], 2, ["--input '64,32,3'", "(64, 32)"]),
        ("factory wrong dtype", ["plan", f"{fac}:make", "--input", "64,32:int64", *plan], 2, ["--input '64,32:int64'", "(64, 32) float32"]),
        ("pt2 wrong width", ["plan", work / "mlp.pt2", "--input", "64,31", *plan], 2, ["--input '64,31'", "expected shape (64, 32) float32"]),
        ("pt2 wrong dtype", ["plan", work / "mlp.pt2", "--input", "64,32:float64", *plan], 2, ["expected shape (64, 32) float32"]),
        ("pt2 wrong count", ["plan", work / "mlp.pt2", "--input", "64,32", "--input", "3", *plan], 2, ["takes 1 tensor input"]),
        ("forward returns None", ["plan", f"{fac}:none_out", "--budget-gb", "1e-6", *plan], 2, ["nothing to plan", "returns no tensor"]),
        ("frozen model", ["plan", f"{fac}:frozen", "--budget-gb", "1e-6", *plan], 2, ["nothing to plan", "frozen"]),
        ("bench bogus", ["bench", f"{fac}:make", "--solvers", "bogus", "-o", out / "b.json"], 2, ["solvers", "bogus"]),
        ("bench infeasible", ["bench", f"{fac}:make", "--solvers", "uniform,dp", "--budget-bytes", "1000", "-o", out / "b.json"],
         1, ["no solver produced a plan", "smallest budget"]),
        ("tampered inputs", ["apply", f"{fac}:make", big_inputs, "-o", out / "a"], 2, ["100000,100000,100000", "memory"]),
        ("tampered seed", ["apply", f"{fac}:make", bad_seed, "-o", out / "a"], 2, ["stats.cli.seed"]),
        ("tampered huge seed", ["apply", f"{fac}:make", huge_seed, "-o", out / "a"], 2, ["stats.cli.seed"]),
        ("tampered inputs type", ["apply", f"{fac}:make", not_list, "-o", out / "a"], 2, ["stats.cli.inputs"]),
        ("tampered spec", ["apply", f"{fac}:make", bad_spec, "-o", out / "a"], 2, ["0-1e400"]),
        ("malformed timeline", ["report", timeline, "-o", out / "r.html"], 2, ["stats.timeline", "malformed"]),
        ("malformed curves", ["report", curves, "-o", out / "r.html"], 2, ["stats.curves", "malformed"]),
        ("malformed budget", ["report", budget_list, "-o", out / "r.html"], 2, ["budget_list.json", "malformed"]),
        ("malformed notes", ["report", notes_ints, "-o", out / "r.html"], 2, ["notes_ints.json", "malformed"]),
        ("deep JSON", ["report", work / "deep.json", "-o", out / "r.html"], 2, ["deep.json", "nested too deeply"]),
        ("deep JSON in stats", ["report", work / "deep_stats.json", "-o", out / "r.md"], 2, ["nested too deeply"]),
    ]


def test_bad_input_is_one_line_and_exit_2(work, capsys):
    out = work / "out"
    out.mkdir()
    failures = []
    for name, argv, want_code, needles in _cases(work, out):
        code, stdout, err = run(argv, capsys)
        lines = err.strip().splitlines()
        ok = code == want_code and len(lines) == 1 and "Traceback" not in err and all(n in lines[0] for n in needles)
        if not ok or os.listdir(out):
            failures.append((name, code, err[-600:], os.listdir(out)))
    assert not failures, "\n".join(map(repr, failures))


def test_mathtext_breaking_names_render(work, capsys):
    """Names with `$`, `\\` and `^` are plain text in the plots (matplotlib would parse them as mathtext)."""
    def edit(d):
        d["solver"] = "$\\frac{"
        d["stats"]["curves"]["solvers"]["a$b^{"] = d["stats"]["curves"]["solvers"].pop("uniform")
        d["stats"]["curves"]["plan"]["solver"] = "$\\undefined$"

    plan = tampered_plan(work, "mathtext", edit)
    out = work / "mathtext.html"
    code, _, err = run(["report", plan, "-o", out, "--quiet"], capsys)
    assert code == 0 and err == "", err
    assert out.read_text().count("data:image/png;base64,") == 2


def test_factory_print_does_not_corrupt_json(work, capsys):
    code, stdout, err = run(["plan", f"{work}/factory.py:chatty", "--solver", "uniform", "--activation-budget", "0.7",
                             "--curve-points", "0", "--json"], capsys)
    assert code == 0
    assert json.loads(stdout)["regions"]
    assert "building the model..." in err and "building" not in stdout


def _interruptible() -> None:
    """In the child: Ctrl-C as a user's terminal sends it. A runner that starts the tests in the background
    (a shell without job control) has SIGINT ignored, which a child inherits and Python then keeps."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _cli(*argv: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "ckpt_planner", *argv], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, preexec_fn=_interruptible,
    )


def test_wrong_shapes_in_a_real_process_print_one_line(work):
    """torch logs go straight to the process's stderr (not to pytest's capture): check them where a user sees them."""
    for model, spec in ((f"{work}/factory.py:make", "64,31"), (str(work / "mlp.pt2"), "64,32,3")):
        proc = _cli("plan", model, "--input", spec, "--curve-points", "0", cwd=work)
        _, err = proc.communicate(timeout=300)
        lines = err.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and f"--input '{spec}'" in lines[0], err[-2000:]


def test_sigint_exits_130_with_one_line(work):
    flag = work / "sigint"
    proc = _cli("plan", f"{work}/factory.py:slow", "--input", "2,2", "-o", str(flag), cwd=work)
    started = Path(f"{flag}.started")
    deadline = time.monotonic() + 120
    while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert started.exists(), proc.communicate(timeout=10)
    proc.send_signal(signal.SIGINT)
    stdout, err = proc.communicate(timeout=60)
    lines = err.strip().splitlines()
    assert proc.returncode == 130 and len(lines) == 1 and "interrupted" in lines[0], err[-2000:]
    assert not flag.exists() and stdout == ""
