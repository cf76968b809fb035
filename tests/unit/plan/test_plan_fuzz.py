"""A plan file mutated at random, read by every command that reads plans: the answer is a plan or our
one-line error (exit 2), never a traceback.

Each example takes the valid plan file the `plan` command wrote, replaces one field at any depth with a
hostile value (infinity, NaN, a string, a 5,000-digit integer, a lone surrogate, deep nesting, a huge
string or list, another type), deletes it, or damages the bytes, and hands the file to `Plan.load`,
`report` (HTML and Markdown), `apply` and `Plan.rebuild` / `load_applied`. 1,050 examples in all: the slow run's `full` cases; the
default run's `quick` cases draw a fifth as many (210) from the same derandomized stream.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from ckpt_planner.cli.commands import main
from ckpt_planner.cli.loading import load_applied
from ckpt_planner.errors import InputError, PlanFileError, PlanMismatchError
from ckpt_planner.plan import Plan
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.models.examples import MLPChain

FACTORY = '''
import torch
from ckpt_planner.cli.examples import MLPChain


def make():
    torch.manual_seed(0)
    return MLPChain(d=16, blocks=3), (torch.randn(64, 16),)
'''

OURS = (PlanFileError, PlanMismatchError, InputError)


def _examples(full: int):
    """`examples`, a test's example count: a fifth in the default run, `full` in the slow run (CI runs both)."""
    return pytest.mark.parametrize("examples", [
        pytest.param(full // 5, id="quick"),
        pytest.param(full, id="full", marks=pytest.mark.slow),
    ])


def _fixed(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("fuzz")
    (d / "factory.py").write_text(FACTORY)
    fac = f"{d}/factory.py:make"
    plan = d / "plan.json"
    assert main(["plan", fac, "--solver", "uniform", "--activation-budget", "0.7", "--curve-points", "2",
                 "--curve-solvers", "uniform", "--quiet", "-o", str(plan)]) == 0
    assert main(["apply", fac, str(plan), "-o", str(d / "applied"), "--quiet"]) == 0
    data = json.loads(plan.read_text())
    assert data["regions"] and data["stats"]["timeline"] and data["stats"]["curves"]
    return {"dir": d, "factory": fac, "data": data, "text": plan.read_text()}


HOSTILE = st.one_of(
    st.sampled_from([float("inf"), float("-inf"), float("nan"), 1e308, -1, -(2**63), 2**64, 0, 1.5, True, None,
                     "", "12", "inf", "\ud800", "x\udfffy", [], {}, [[[]]], {"a": {"b": None}}]),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.just(("RAW", "9" * 5000)),  # spliced in as written: 5,000 digits, which Python's json refuses
    st.integers(min_value=100, max_value=5000).map(lambda n: ("RAW", "[" * n + "]" * n)),
    st.integers(min_value=1, max_value=3).map(lambda k: "x" * (100_000 * k)),
    st.lists(st.integers(), max_size=5),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)


def _paths(value, prefix=()):
    """Every path into the plan (object keys and list indices), the top level's fields included."""
    out = []
    if isinstance(value, dict):
        for k, v in value.items():
            out.append((*prefix, k))
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value[:3]):  # the first items stand for the rest
            out.append((*prefix, i))
            out += _paths(v, (*prefix, i))
    return out


MARK = "__MUTATED_VALUE__"


@st.composite
def mutated(draw, data: dict) -> bytes:
    """A plan file's bytes with one mutation."""
    doc = json.loads(json.dumps(data))
    how = draw(st.sampled_from(["replace", "replace", "replace", "replace", "delete", "bytes"]))
    if how == "bytes":
        raw = bytearray(json.dumps(doc).encode())
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(raw) - 1))
            raw[i] = draw(st.sampled_from(list(b'{}[]",:0-9eE.\\ \xff\x00')))
        if draw(st.booleans()):
            raw = raw[: draw(st.integers(0, len(raw)))]
        return bytes(raw)
    paths = _paths(doc)
    path = paths[draw(st.integers(0, len(paths) - 1))]
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if how == "delete":
        del parent[path[-1]]
        return json.dumps(doc).encode()
    value = draw(HOSTILE)
    raw_splice = value[1] if isinstance(value, tuple) else None
    parent[path[-1]] = MARK if raw_splice is not None else value
    text = json.dumps(doc)  # NaN and Infinity as Python writes them
    if raw_splice is not None:
        text = text.replace(json.dumps(MARK), raw_splice)
    return text.encode("utf-8", "surrogatepass")


def _write(setup: dict, raw: bytes) -> Path:
    path = setup["dir"] / "mutated.json"
    path.write_bytes(raw)
    return path


def _cli(argv: list, capsys) -> None:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "Traceback" not in out, err
    assert code in (0, 2), (code, err)
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ckpt-planner: "), err


@_examples(600)
def test_plan_load(setup, examples):
    @_fixed(examples)
    @given(st.data())
    def check(data):
        path = _write(setup, data.draw(mutated(setup["data"])))
        try:
            Plan.load(path).summary()
        except PlanFileError:
            pass

    check()


@_examples(250)
def test_report(setup, capsys, examples):
    out = setup["dir"] / "report"

    @_fixed(examples)
    @given(st.data(), st.sampled_from(["html", "md"]))
    def check(data, fmt):
        path = _write(setup, data.draw(mutated(setup["data"])))
        _cli(["report", path, "--format", fmt, "-o", f"{out}.{fmt}", "--quiet"], capsys)

    check()


@_examples(100)
def test_apply(setup, capsys, examples):
    out = setup["dir"] / "applied-fuzz"

    @_fixed(examples)
    @given(st.data())
    def check(data):
        path = _write(setup, data.draw(mutated(setup["data"])))
        _cli(["apply", setup["factory"], path, "-o", out, "--quiet"], capsys)

    check()


@_examples(100)
def test_rebuild(setup, examples, tmp_path):
    """Plan.rebuild on the model, and load_applied on an apply folder whose plan.json is the mutated file."""
    folder = tmp_path / "applied-copy"
    shutil.copytree(setup["dir"] / "applied", folder)
    torch.manual_seed(0)
    model, inputs = MLPChain(d=16, blocks=3), (torch.randn(64, 16),)

    @_fixed(examples)
    @given(st.data(), st.booleans())
    def check(data, via_folder):
        raw = data.draw(mutated(setup["data"]))
        try:
            if via_folder:
                (folder / "plan.json").write_bytes(raw)
                load_applied(folder, trust_code=True)
            else:
                Plan.load(_write(setup, raw)).rebuild(model, inputs)
        except OURS:
            pass

    check()


def test_the_issues_fields_name_the_field(setup, capsys):
    """The fields the issue found: each gives exit 2 and one line naming the field, in report and apply."""
    cases = [
        (("baseline_peak_bytes",), float("inf"), "baseline_peak_bytes"),
        (("regions", 0, "start"), float("inf"), "regions[0].start"),
        (("baseline_breakdown", "optimizer"), float("inf"), "baseline_breakdown.optimizer"),
        (("stats", "sharding"), {"world_size": "2"}, "stats.sharding.world_size"),
        (("stats", "no_checkpoint_peak_bytes"), "5", "stats.no_checkpoint_peak_bytes"),
        (("baseline_breakdown", "optimizer"), "0", "baseline_breakdown.optimizer"),
        (("model",), "\ud800", "model"),
        (("regions", 0, "modules"), ["a\udc00"], "regions[0].modules[0]"),
    ]
    for path, value, field in cases:
        doc = json.loads(json.dumps(setup["data"]))
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = value
        plan = _write(setup, json.dumps(doc).encode("utf-8", "surrogatepass"))
        for argv in (["report", plan, "-o", setup["dir"] / "r.html"],
                     ["apply", setup["factory"], plan, "-o", setup["dir"] / "applied-named"]):
            code = main([str(a) for a in argv])
            _, err = capsys.readouterr()
            assert code == 2 and "Traceback" not in err, (field, err)
            assert len(err.strip().splitlines()) == 1 and field in err, (field, err)
    doc = json.loads(json.dumps(setup["data"]))
    text = json.dumps(doc).replace(f'"num_nodes": {doc["num_nodes"]}', '"num_nodes": ' + "7" * 5000)
    plan = _write(setup, text.encode())
    code = main(["report", str(plan), "-o", str(setup["dir"] / "r.html")])
    _, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1 and "not valid JSON" in err, err


def test_a_bench_file_beside_the_plan_is_held_to_the_same_limits(setup, capsys):
    plan = setup["dir"] / "plan.json"
    for field, value in (("model", "\ud800"), ("budget_bytes", float("inf"))):
        bench = setup["dir"] / "bench.json"
        text = json.dumps({"schema": "ckpt-planner/bench", "model": "m", "budget_bytes": 1, "rows": [], field: value})
        bench.write_bytes(text.encode("utf-8", "surrogatepass"))
        code = main(["report", str(plan), "--bench", str(bench), "-o", str(setup["dir"] / "rb.html")])
        _, err = capsys.readouterr()
        assert code == 2 and len(err.strip().splitlines()) == 1 and f"field {field}" in err, err
