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
                          capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "gpu-dry.json").read_text())
    sections = results["sections"]
    assert list(sections) == ["env", "cap", "cap_segments", "frontier", "zoo", "tests", "compile", "offload"]
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
