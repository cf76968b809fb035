"""The timing store is a file on disk: a bad time in it is dropped, and a file that is not the user's,
that others may write, or that is nested too deeply to read is ignored with one warning naming it."""

from __future__ import annotations

import json
import os
import warnings

import pytest
from ckpt_planner import ProfileConfig, solvers
from ckpt_planner.profile.timing_store import STORE_ENV, TimingStore, TimingStoreWarning, open_store

from .test_timing_store import _profiled, _tiny

BAD_TIMES = {"negative": -1.0, "zero": 0.0, "denormal": 1e-300, "nan": float("nan"), "inf": float("inf"),
             "year": 3.2e7, "text": "0.001", "flag": True, "null": None}


def _store_file(path, ops):
    path.write_text(json.dumps({"format": 5, "ops": ops, "overheads": {}, "graphs": {}, "steps": {}, "plans": {}}))
    return path


def test_bad_stored_times_are_dropped_and_measured_again(tmp_path):
    path = _store_file(tmp_path / "timings-x.json", {**BAD_TIMES, "good": 0.002})
    store = TimingStore(path)
    assert {k: store.get("ops", k) for k in [*BAD_TIMES, "good"]} == {**dict.fromkeys(BAD_TIMES), "good": 0.002}
    # a stored -1 is no longer "lower" than what this run measures: the measurement is stored
    store.data["ops"]["negative"] = -1.0  # as the old reader kept it
    store = TimingStore(path)
    assert store.settle("ops", "negative", 0.003, 0.7) == 0.003
    # and a bad measurement is never stored
    assert store.settle("ops", "zero", 0.0, 0.7) == 0.0
    assert store.settle("overheads", "call", {"region": -2.0, "each": 1e-3}, 0.7) == {"region": -2.0, "each": 1e-3}
    store.save()
    again = TimingStore(path)
    assert again.get("ops", "negative") == 0.003 and again.get("ops", "zero") is None
    assert again.get("overheads", "call") is None


def test_a_store_of_negative_times_gives_no_negative_plan(tmp_path, monkeypatch):
    """The issue's case: every stored time -1 made a plan predict a step of -191 s."""
    monkeypatch.setenv(STORE_ENV, str(tmp_path))
    model, cap = _tiny()
    config = ProfileConfig(warmup=0, repeats=1)
    _profiled(model, cap, config)
    path = next(tmp_path.glob("timings-*.json"))
    data = json.loads(path.read_text())
    for table in ("ops", "steps"):
        data[table] = dict.fromkeys(data[table], -1.0)
    data["overheads"] = {k: dict.fromkeys(v, -1.0) for k, v in data["overheads"].items()}
    path.write_text(json.dumps(data))
    cost = _profiled(model, cap, config)
    assert all(n.time > 0 for n in cost.nodes) and cost.step_time_s > 0
    assert cost.region_overhead_s >= 0 and cost.saved_overhead_s >= 0
    problem = cost.to_problem()
    sol = solvers.solve(problem, int(problem.fixed_bytes + 0.8 * (solvers.simulate(problem, ()).peak_bytes
                                                                  - problem.fixed_bytes)), "dp")
    assert sol.recompute_time >= 0


def _opened_with_one_warning(path, why: str) -> TimingStore:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = TimingStore(path)
        TimingStore(path)  # a second read of the same file says nothing more
    mine = [w for w in caught if issubclass(w.category, TimingStoreWarning)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    assert str(path) in str(mine[0].message) and why in str(mine[0].message)
    return store


def test_a_store_others_may_write_is_ignored_with_one_warning(tmp_path):
    path = _store_file(tmp_path / "timings-x.json", {"mm": 0.002})
    os.chmod(path, 0o666)
    store = _opened_with_one_warning(path, "writable by other users")
    assert store.get("ops", "mm") is None


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="giving a file away needs root")
def test_a_store_another_user_owns_is_ignored_with_one_warning(tmp_path):
    path = _store_file(tmp_path / "timings-x.json", {"mm": 0.002})
    os.chown(path, 4242, -1)
    store = _opened_with_one_warning(path, "belongs to another user")
    assert store.get("ops", "mm") is None


def test_a_store_too_deep_to_read_is_named_and_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv(STORE_ENV, str(tmp_path))
    path = open_store("cpu").path
    path.write_text('{"format": 5, "ops": ' + "[" * 200_000 + "]" * 200_000 + "}")
    store = _opened_with_one_warning(path, "nested too deeply")
    assert store.get("ops", "mm") is None
    store.settle("ops", "mm", 0.002, 0.7)
    store.save()  # the unreadable file is replaced by a readable one
    assert TimingStore(path).get("ops", "mm") == 0.002
