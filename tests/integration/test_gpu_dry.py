"""The GPU run rehearsed on the CPU: `python -m benchmarks.gpu --dry` runs every section at tiny shapes,
so a device run never fails on a typo, and its figures hold where the CPU can judge them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_dry_run_runs_every_section_and_its_plans_hold(tmp_path):
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--dry", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=2000)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "gpu-dry.json").read_text())
    sections = results["sections"]
    assert list(sections) == ["env", "cap", "cap_segments", "frontier", "zoo", "tests", "compile", "offload", "autocast",
                             "conformance"]
    assert all(s["status"] == "ok" for s in sections.values())
    assert "# On the GPU" in (tmp_path / "gpu-dry.md").read_text()

    for name in ("cap", "cap_segments"):
        cap = sections[name]["rows"][0]
        assert cap["planned"] and cap["within_cap"] and cap["cap_bytes"] * 2 <= cap["plain_bytes"] + 1
    points = [r for r in sections["frontier"]["rows"] if r.get("kind") == "point"]
    assert len(points) == 2  # every_n_layers 1 and 2 (offload needs a device)
    for p in points:  # fp32 on the CPU: every plan within its point's peak, gradients bitwise
        assert p["fits"] and p["grads_bitwise"], p
        assert p["contender_overhead"] is not None and p["ours_overhead"] is not None
    zoo = [r for r in sections["zoo"]["rows"] if "model" in r]
    assert {(r["model"], r["precision"]) for r in zoo} == {(m, p) for m in ("gpt2", "unet") for p in ("fp32", "bf16")}
    assert all(r["exact"] and not r.get("failed") for r in zoo)
    assert all(r["within_budget"] for r in zoo if r["precision"] == "fp32")
    assert "skipped" in sections["tests"]["rows"][0]["summary"]  # the CUDA tests skip without a device
    comp = sections["compile"]["rows"][0]
    assert comp["planned"] and comp["fits"] and comp["ratio"] > 0
    check_offload_rows(sections["offload"]["rows"])
    for r in sections["autocast"]["rows"]:  # bf16 autocast on the CPU: the peak as predicted, measured each way
        for way in ("default_bytes", "caller_thread_bytes", "early_stop_off_bytes"):
            assert abs(r["predicted_bytes"] - r[way]) <= 0.01 * r[way], r
    conf = [r for r in sections["conformance"]["rows"] if "model" in r]  # held-out models, planned as a user plans
    assert {(r["model"], r["path"]) for r in conf} == {("tv_vgg", p) for p in ("fp32", "bf16_autocast", "bf16_model")} | {
        ("albert", "fp32")}
    assert not [r for r in conf if r.get("failed")], conf
    for r in conf:  # the stage-wise profile below the plain step; the step timed for the step-time model
        assert r["profile"] == "stages" and r["exact"] and r["plain_ms"] > 0 and r["ours_ms"] > 0, r
    assert all(r["within_budget"] for r in conf if r["path"] == "fp32")


def check_offload_rows(rows: list[dict]) -> None:
    """The offload section on a simulated bandwidth: both plans made at each point, within the point's budget
    and bitwise, predicted peaks as measured, and the plans priced with copies offload something."""
    points = [r for r in rows if r.get("kind") == "point"]
    assert {r["plan"] for r in points} == {"recompute", "offload"}
    assert all("infeasible" not in r for r in points), points
    for r in points:
        assert r["fits"] and r["grads_bitwise"], r
        assert abs(r["predicted_peak_bytes"] - r["peak_bytes"]) <= 0.01 * r["peak_bytes"], r
    assert all(r["offloaded"] == 0 for r in points if r["plan"] == "recompute")
    assert any(r["offloaded"] > 0 for r in points if r["plan"] == "offload")
    floors = next(r for r in rows if r.get("kind") == "floors")  # offload only adds choices: never a higher floor
    assert floors["offload_floor_bytes"] <= floors["recompute_floor_bytes"], floors
    assert {r["point"] for r in points} >= {"per-layer peak", "recompute floor"}


def test_runs_merge_section_by_section_keeping_each_date(tmp_path):
    """A device lends minutes per command, so one set of figures is merged from several runs."""
    env = {"status": "ok", "seconds": 1, "rows": [{"device": "NVIDIA H100 80GB HBM3", "torch": "2.11"}]}
    first = {"command": "a", "date": "d1", "seconds": 10, "sections": {
        "env": env, "cap": {"status": "ok", "seconds": 2, "rows": [], "date": "d1"},
        "tests": {"status": "ok", "seconds": 3, "rows": []}}}
    second = {"command": "b", "date": "d2", "seconds": 20, "sections": {
        "env": env, "cap": {"status": "out of time after 60 s", "seconds": 60, "rows": [], "date": "d2"}}}
    paths = []
    for i, run in enumerate((first, second)):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(run))
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--merge", *map(str, paths), "--out", str(tmp_path),
                           "--note", "two runs"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    merged = json.loads((tmp_path / "gpu-h100.json").read_text())
    assert merged["command"] == "a; b" and merged["seconds"] == 30 and merged["notes"] == ["two runs"]
    assert merged["sections"]["cap"]["status"].startswith("out of time")  # the later run wins
    assert merged["sections"]["tests"]["date"] == "d1"  # a section only the first run has keeps that run's date
    md = (tmp_path / "gpu-h100.md").read_text()
    assert "- two runs" in md and "| tests | ok | 3 | d1 |" in md
