"""The command line end to end: plan / apply / bench on .pt2, factory and pickled models, and every bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_planner.cli.commands import main
from ckpt_planner.cli.loading import load_applied, make_inputs, parse_input_spec
from ckpt_planner.lower.rewrite import CheckpointRegion

REPO = Path(__file__).resolve().parents[3]

FACTORY = '''
import torch
from ckpt_planner.cli.examples import MLPChain


def make():
    torch.manual_seed(0)
    return MLPChain(d=32, blocks=4), (torch.randn(64, 32),)


def bare():
    torch.manual_seed(0)
    return MLPChain(d=32, blocks=4)


def other():
    torch.manual_seed(0)
    return MLPChain(d=32, blocks=3)


def broken():
    raise RuntimeError("no such checkpoint on disk")
'''


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("cli")
    (d / "factory.py").write_text(FACTORY)
    return d


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def train_step_grads(module: torch.nn.Module, params: list[torch.nn.Parameter], x: torch.Tensor) -> list[torch.Tensor]:
    for p in params:
        p.grad = None
    module(x).sum().backward()
    return [p.grad.clone() for p in params]


# -- input specs ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, shape, dtype, low, high, name",
    [
        ("8,3,224,224", (8, 3, 224, 224), torch.float32, None, None, None),
        ("8,3,4,4:float16", (8, 3, 4, 4), torch.float16, None, None, None),
        ("2,128:int64:0-50257", (2, 128), torch.int64, 0, 50257, None),
        ("input_ids=2,16:int64:5-9", (2, 16), torch.int64, 5, 9, "input_ids"),
        ("4:bool", (4,), torch.bool, None, None, None),
        ("scalar", (), torch.float32, None, None, None),
        ("3,2:float32:-1-1", (3, 2), torch.float32, -1, 1, None),
    ],
)
def test_input_spec_parses(text, shape, dtype, low, high, name):
    spec = parse_input_spec(text)
    assert (spec.shape, spec.dtype, spec.low, spec.high, spec.name) == (shape, dtype, low, high, name)


@pytest.mark.parametrize("text", ["8,x", "8,3:floaty", "2,3:int64:9-1", "2:int64:a-b", "1:bool:0-1", "1:f:2:3"])
def test_bad_input_spec_is_an_input_error(text):
    from ckpt_planner.errors import InputError

    with pytest.raises(InputError, match="input"):
        parse_input_spec(text)


def test_made_inputs_respect_dtype_and_range():
    ids, x, mask = make_inputs([parse_input_spec(s) for s in ("64,128:int64:3-7", "5,6:float64:2-4", "9:bool")])
    assert ids.dtype == torch.int64 and ids.shape == (64, 128)
    assert ids.min().item() == 3 and ids.max().item() == 6  # HIGH is exclusive; 8192 draws hit both ends
    assert x.dtype == torch.float64 and 2 <= x.min().item() and x.max().item() < 4
    assert mask.dtype == torch.bool
    named = make_inputs([parse_input_spec("a=2,2"), parse_input_spec("b=3:int32")])
    assert list(named) == ["a", "b"] and named["b"].dtype == torch.int32


# -- end to end ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def factory_plan(work) -> tuple[Path, int, str]:
    """`plan --verify --json` on the factory model: (plan file, exit code, stdout)."""
    import contextlib
    import io

    plan_path = work / "fplan.json"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["plan", f"{work}/factory.py:make", "--solver", "uniform", "--activation-budget", "0.7", "--verify",
                     "--curve-points", "2", "--curve-solvers", "uniform", "--json", "--quiet", "-o", str(plan_path)])
    return plan_path, code, stdout.getvalue()


@pytest.mark.parametrize("flag, checks", [([], True), (["--no-check-step"], False), (["--no-exact-check"], False)])
def test_plan_runs_the_safety_net_unless_told_not_to(work, capsys, monkeypatch, flag, checks):
    import importlib

    safety_net = importlib.import_module("ckpt_planner.choose.safety_net")
    calls: list[int] = []
    real = safety_net.step_differences
    monkeypatch.setattr(safety_net, "step_differences", lambda *a, **k: calls.append(1) or real(*a, **k))
    code, _, _ = run(["plan", f"{work}/factory.py:make", "--solver", "uniform", "--activation-budget", "0.7",
                      "--curve-points", "0", "--quiet", "-o", work / f"p{len(flag)}.json", *flag], capsys)
    assert code == 0 and bool(calls) == checks


def test_factory_plan_verify_apply_and_train(work, factory_plan, capsys):
    plan_path, code, stdout = factory_plan
    out = work / "fapplied"
    assert code == 0
    data = json.loads(plan_path.read_text())
    assert json.loads(stdout)["fingerprint"] == data["fingerprint"]
    assert data["regions"], "a 0.7 activation budget needs checkpointing"
    assert data["predicted_peak_bytes"] <= data["budget_bytes"] < data["baseline_peak_bytes"]
    assert data["measured_peak_bytes"] <= data["budget_bytes"]  # --verify recorded the measurement
    assert data["stats"]["verify"]["grads_equal"] and data["stats"]["verify"]["outputs_equal"]
    assert data["stats"]["cli"]["model"] == f"{work}/factory.py:make"

    code, stdout, _ = run(["apply", f"{work}/factory.py:make", plan_path, "-o", out], capsys)
    assert code == 0 and "load_applied" in stdout
    regions = [f"{name}.py" for name, m in load_applied(out, trust_code=True).module.named_modules() if isinstance(m, CheckpointRegion)]
    assert len(regions) == len(data["regions"])
    assert sorted(p.name for p in (out / "code").iterdir()) == sorted(["module.py", *regions])
    state = torch.load(out / "state_dict.pt", weights_only=True)

    # Loads back and trains: same gradients as the original model, and an optimizer step changes the weights.
    applied = load_applied(out, trust_code=True)
    assert set(applied.module.state_dict()) == set(state)
    from tests.models.examples import MLPChain

    torch.manual_seed(0)
    reference = MLPChain(d=32, blocks=4)
    reference.load_state_dict(state)
    x = torch.randn(64, 32)
    params = list(applied.model.parameters())
    got = train_step_grads(applied.module, params, x)
    want = train_step_grads(reference, list(reference.parameters()), x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    before = [p.detach().clone() for p in params]
    torch.optim.SGD(params, lr=0.1).step()
    assert any(not torch.equal(a, p) for a, p in zip(before, params))


def test_pt2_plan_and_apply(work, capsys):
    from tests.models.examples import MLPChain

    torch.manual_seed(0)
    model, x = MLPChain(d=32, blocks=4), torch.randn(64, 32)
    torch.export.save(torch.export.export(model, (x,)), work / "mlp.pt2")
    plan_path, out = work / "pt2plan.json", work / "pt2applied"
    # No --input: the archive's example inputs are used.
    code, _, _ = run(["plan", work / "mlp.pt2", "--solver", "uniform", "--activation-budget", "0.7",
                      "--curve-points", "0", "--quiet", "-o", plan_path], capsys)
    assert code == 0
    data = json.loads(plan_path.read_text())
    assert data["regions"] and data["stats"]["cli"]["model_kind"] == "pt2"
    code, _, _ = run(["apply", work / "mlp.pt2", plan_path, "--input", "64,32", "-o", out, "--quiet"], capsys)
    assert code == 0 and (out / "model.pt2").is_file()
    applied = load_applied(out)
    assert any(isinstance(m, CheckpointRegion) for m in applied.module.modules())
    got = train_step_grads(applied.module, list(applied.model.parameters()), x)
    want = train_step_grads(model, list(model.parameters()), x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_pickled_model_needs_trust(work, capsys):
    from tests.models.examples import MLPChain

    torch.manual_seed(0)
    torch.save(MLPChain(d=32, blocks=4), work / "mlp.pt")
    plan_path = work / "pickled.json"
    argv = ["plan", work / "mlp.pt", "--input", "64,32", "--solver", "uniform", "--activation-budget", "0.7",
            "--curve-points", "0", "-o", plan_path]
    code, _, err = run(argv, capsys)
    assert code == 2 and "--trust-pickle" in err and len(err.strip().splitlines()) == 1
    assert not plan_path.exists()
    code, _, _ = run([*argv, "--trust-pickle", "--quiet"], capsys)
    assert code == 0 and json.loads(plan_path.read_text())["regions"]


def test_inputs_file_and_kwargs(work, capsys):
    torch.save({"x": torch.randn(64, 32)}, work / "inputs.pt")
    code, stdout, _ = run(["plan", f"{work}/factory.py:bare", "--inputs", work / "inputs.pt", "--solver", "none",
                           "--curve-points", "0", "--json"], capsys)
    assert code == 0
    assert json.loads(stdout)["stats"]["cli"]["inputs_file"] == str((work / "inputs.pt").resolve())


def test_bench_skips_unregistered_and_measures(work, capsys):
    bench_path = work / "bench.json"
    code, stdout, err = run(["bench", f"{work}/factory.py:make", "--solvers", "none,uniform,nosuch",
                             "--activation-budget", "0.7", "--json", "-o", bench_path], capsys)
    assert code == 0
    assert "skipping solver 'nosuch'" in err
    result = json.loads(stdout)
    assert result["skipped"] == ["nosuch"]
    rows = {r["solver"]: r for r in result["rows"]}
    assert set(rows) == {"none", "uniform"}
    assert rows["uniform"]["exact"] and rows["uniform"]["measured_peak_bytes"] <= result["budget_bytes"]
    assert rows["none"]["measured_peak_bytes"] > result["budget_bytes"]  # why the budget needs checkpointing
    assert rows["uniform"]["step_s"] > 0 and rows["uniform"]["step_time_ratio"] > 0
    saved = json.loads(bench_path.read_text())
    assert saved["rows"][1]["timeline"]["bytes"]  # the file keeps the measured timeline for the report


def test_help_has_an_example_per_command(capsys):
    for command in ("plan", "apply", "bench", "report", "demo", "profile"):
        code, out, _ = run([command, "--help"], capsys)
        assert code == 0 and "example:" in out, command


# -- bad input: one line on stderr, the right exit code, nothing written -------------------------


def _bad_cases(work: Path, out: Path) -> list[tuple[str, list, int, str]]:
    (work / "garbage.pt2").write_bytes(b"not a zip archive")
    (work / "a_file").write_text("x")
    fac = f"{work}/factory.py"
    plan_args = ["--solver", "uniform", "--curve-points", "0", "-o", out / "plan.json"]
    return [
        ("missing model", ["plan", work / "nope.pt2", *plan_args], 2, "does not exist"),
        ("missing factory file", ["plan", f"{work}/nope.py:make", *plan_args], 2, "does not exist"),
        ("unreadable model", ["plan", work / "garbage.pt2", *plan_args], 2, "not a torch.export archive"),
        ("factory raises", ["plan", f"{fac}:broken", *plan_args], 2, "no such checkpoint on disk"),
        ("bad shape", ["plan", f"{fac}:bare", "--input", "64,x", *plan_args], 2, "shape '64,x'"),
        ("unknown solver", ["plan", f"{fac}:make", "--solver", "magic", "-o", out / "plan.json"], 2, "unknown solver 'magic'"),
        ("infeasible budget", ["plan", f"{fac}:make", "--budget-bytes", "1000", *plan_args], 1, "infeasible"),
        ("another model", ["apply", f"{fac}:other", work / "fplan.json", "--input", "64,32", "-o", out / "applied"], 2, "another model"),
        ("unwritable output", ["plan", f"{fac}:make", "--solver", "uniform", "-o", work / "a_file" / "p.json"], 2, "does not exist"),
        ("missing output dir", ["report", work / "fplan.json", "-o", work / "no_dir" / "r.html"], 2, "does not exist"),
        ("missing plan", ["report", work / "nope.json", "-o", out / "r.html"], 2, "does not exist"),
        ("corrupt plan", ["report", work / "garbage.pt2", "-o", out / "r.html"], 2, "not valid JSON"),
        ("bad usage", ["plan"], 2, "required"),
    ] + ([] if torch.cuda.is_available() else [
        ("no cuda", ["plan", f"{fac}:make", "--device", "cuda", *plan_args], 2, "torch.cuda.is_available() is False"),
    ])


def test_bad_inputs_fail_cleanly(work, factory_plan, capsys):
    assert factory_plan[1] == 0  # the plan that "another model" misapplies
    out = work / "bad_out"
    out.mkdir()
    for name, argv, want_code, needle in _bad_cases(work, out):
        before = sorted(os.listdir(work))
        code, stdout, err = run(argv, capsys)
        lines = err.strip().splitlines()
        assert code == want_code, (name, err)
        assert len(lines) == 1 and needle in lines[0], (name, err)
        assert os.listdir(out) == [], (name, os.listdir(out))
        assert sorted(os.listdir(work)) == before, name


def test_entry_point_exit_code_and_one_line(work):
    """`python -m ckpt_planner` as a user runs it: an infeasible budget after a full profile gives exit 1 and one line."""
    out = work / "sub_plan.json"
    proc = subprocess.run(
        [sys.executable, "-m", "ckpt_planner", "plan", f"{work}/factory.py:make", "--solver", "uniform",
         "--budget-bytes", "1000", "-o", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "infeasible" in lines[0] and "smallest budget" in lines[0], proc.stderr
    assert not out.exists()


def test_failed_verification_exits_1_and_writes_nothing(work, capsys, monkeypatch):
    import dataclasses
    import importlib

    verify_module = importlib.import_module("ckpt_planner.verification")  # `ckpt_planner.verification` is the function
    real = verify_module.verify

    def wrong_gradients(*args, **kwargs):
        return dataclasses.replace(real(*args, **kwargs), grads_equal=False, max_abs_grad_diff=0.5)

    monkeypatch.setattr(verify_module, "verify", wrong_gradients)
    out = work / "unverified.json"
    code, _, err = run(["plan", f"{work}/factory.py:make", "--solver", "uniform", "--activation-budget", "0.7",
                        "--verify", "--curve-points", "0", "--quiet", "-o", out], capsys)
    assert code == 1
    assert err.count("\n") == 1 and "verification failed" in err and "0.5" in err
    assert not out.exists()


def test_profile_a_users_model(work, capsys):
    """`profile MODEL` takes the same MODEL and --input as `plan`: the table is that model's, with its input shape."""
    from ckpt_planner.capture.trace import capture

    from tests.models.examples import MLPChain

    code, out, err = run(["profile", f"{work}/factory.py:bare", "--input", "16,32", "--meta", "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    torch.manual_seed(0)
    expected = capture(MLPChain(d=32, blocks=4), (torch.randn(16, 32),))
    assert data["totals"]["capture"] == expected.method
    assert {r["node"] for r in data["nodes"]} <= {n.name for n in expected.graph_module.graph.nodes}
    assert data["totals"]["param_bytes"] == sum(p.numel() * 4 for p in MLPChain(d=32, blocks=4).parameters())
    # batch 16 x d 32 float32: the first linear's output is 16 x 128 x 4 bytes (hidden 4 d)
    assert data["nodes"][0]["out_bytes"] == 16 * 128 * 4
    # the factory's own example inputs when no --input is given; a human-readable table otherwise
    code, out, _ = run(["profile", f"{work}/factory.py:make", "--meta"], capsys)
    assert code == 0 and out.strip().splitlines()[-1].startswith("total:")


def test_profile_counts_the_nodes_timed_by_their_flops(work, capsys, monkeypatch):
    """Where a node's timed runs disagree (here: the second Linear of every block reads 8x its fastest run),
    profile counts the nodes whose time is the FLOP/bytes estimate instead."""
    import importlib

    from ckpt_planner.profile.timing_store import STORE_ENV

    monkeypatch.setenv(STORE_ENV, "off")  # a stored time would stand instead of the estimate
    profile_mod = importlib.import_module("ckpt_planner.profile.profiler")
    monkeypatch.setattr(
        profile_mod, "robust_times", lambda s: {k: min(v) * (8.0 if k.endswith("_2") else 1.0) for k, v in s.items()}
    )
    code, out, err = run(["profile", f"{work}/factory.py:bare", "--input", "16,32", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["totals"]["estimated_nodes"] == 4
    code, out, _ = run(["profile", f"{work}/factory.py:bare", "--input", "16,32"], capsys)
    assert code == 0 and "4 from FLOPs/bytes, their runs disagreed" in out.strip().splitlines()[-1]


def test_profile_usage_errors(work, capsys):
    code, _, err = run(["profile", f"{work}/factory.py:make", "--example", "cnn"], capsys)
    assert code == 2 and "give MODEL or --example" in err
    code, _, err = run(["profile", "--input", "4,4"], capsys)
    assert code == 2 and "--input" in err
    code, _, err = run(["profile", f"{work}/missing.py:make"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
