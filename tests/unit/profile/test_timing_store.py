"""The device's timing store: measured times are kept per device so that the same model plans the same on
every run, however loaded the machine is when it is profiled again."""

import importlib
import json

import torch
from ckpt_planner import ProfileConfig, solvers
from ckpt_planner.capture import capture
from ckpt_planner.choose.race import calibration as calibration_mod
from ckpt_planner.choose.race.calibration import with_step_times
from ckpt_planner.profile import profile
from ckpt_planner.profile import timing as timing_mod
from ckpt_planner.profile.timing_store import STORE_ENV, TimingStore, open_store

from tests.models.examples import TinyGPT


def _tiny():
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, seq=16).train()
    x = torch.randint(0, 64, (2, 16))
    return model, capture(model, (x, x))


def _profiled(model, cap, config):
    cost = profile(cap, config)
    cost = with_step_times(cost, model, cap.graph_module, cap.args, cap.kwargs, timing_store=config.timing_store)
    for p in model.parameters():
        p.grad = None
    return cost


def _plan(cost):
    problem = cost.to_problem()
    base = solvers.simulate(problem, ()).peak_bytes
    sol = solvers.solve(problem, int(problem.fixed_bytes + 0.8 * (base - problem.fixed_bytes)), "dp")
    return sol.regions, sol.saved


# Far beyond what a busy machine does to the real timings underneath (5-30x seen on two cores), so that
# "loaded" and "quiet" stay apart however the suite's neighbours slow the quiet runs down.
LOAD = 1000.0


def _loaded(monkeypatch, factor):
    """Every timed run reads `factor` times slower, as on a machine another job is loading."""
    real = timing_mod.robust_times
    profile_mod = importlib.import_module("ckpt_planner.profile.profiler")  # the package's `profile` is the function
    monkeypatch.setattr(profile_mod, "robust_times", lambda s: {k: v * factor for k, v in real(s).items()})
    fastest = timing_mod.with_fastest
    monkeypatch.setattr(profile_mod, "with_fastest", lambda c, s: fastest(c, {k: [v * factor for v in ts] for k, ts in s.items()}))
    real_step = timing_mod.step_times
    monkeypatch.setattr(calibration_mod, "step_times", lambda *a, **k: tuple(t * factor for t in real_step(*a, **k)))
    real_calls = timing_mod.call_timings
    monkeypatch.setattr(timing_mod, "call_timings", lambda *a: {k: v * factor for k, v in real_calls(*a).items()})


def test_a_profile_on_a_loaded_machine_reads_the_stored_times_and_plans_alike(tmp_path, monkeypatch):
    monkeypatch.setenv(STORE_ENV, str(tmp_path))
    model, cap = _tiny()
    config = ProfileConfig(warmup=0, repeats=1)
    first = _profiled(model, cap, config)
    assert first.time_source == "fitted" and first.step_time_s > 0
    assert len(list(tmp_path.glob("timings-*.json"))) == 1
    _loaded(monkeypatch, LOAD)
    again = _profiled(model, cap, config)
    assert [n.time for n in again.nodes] == [n.time for n in first.nodes]
    assert (again.step_time_s, again.recompute_scale, again.region_overhead_s, again.saved_overhead_s) == (
        first.step_time_s, first.recompute_scale, first.region_overhead_s, first.saved_overhead_s)
    assert _plan(first)[0] and _plan(again) == _plan(first)
    # Without the store the same load shows: every timed figure moves with it.
    fresh = _profiled(model, cap, ProfileConfig(warmup=0, repeats=1, timing_store=False))
    assert sum(n.time for n in fresh.nodes) > 2 * sum(n.time for n in first.nodes)
    assert fresh.step_time_s > 2 * first.step_time_s


def test_a_first_profile_that_load_slowed_down_heals_on_a_quiet_run(tmp_path, monkeypatch):
    """Load only ever adds time: a later run that measures a node time two grid steps lower, a step time
    lower at all, or a snapshot of side-by-side timings (the call costs', the calibration's) clearly
    lower in total, replaces the stored one; and what healed is what every later run reads."""
    monkeypatch.setenv(STORE_ENV, str(tmp_path))
    model, cap = _tiny()
    config = ProfileConfig(warmup=0, repeats=1)
    with monkeypatch.context() as m:
        _loaded(m, LOAD)
        slow = _profiled(model, cap, config)
    slow_store = TimingStore(next(tmp_path.glob("*.json")))
    quiet = _profiled(model, cap, config)
    quiet_store = TimingStore(next(tmp_path.glob("*.json")))
    assert sum(n.time for n in quiet.nodes) < sum(n.time for n in slow.nodes) / 2
    assert quiet.step_time_s < slow.step_time_s / 2
    for table in ("overheads", "graphs"):
        [(key, before)] = slow_store.data[table].items()
        after = quiet_store.data[table][key]
        assert set(after) == set(before) and sum(after.values()) < sum(before.values()) / 2, table
    # and what healed is what the next run reads, loaded or not
    with monkeypatch.context() as m:
        _loaded(m, LOAD)
        again = _profiled(model, cap, config)
    assert [n.time for n in again.nodes] == [n.time for n in quiet.nodes]
    figures = ("step_time_s", "graph_overhead_s", "recompute_scale", "op_overhead_s", "region_overhead_s",
               "saved_overhead_s")
    assert [getattr(again, f) for f in figures] == [getattr(quiet, f) for f in figures]


def test_node_times_that_heal_later_leave_the_calibration_alone(tmp_path, monkeypatch):
    """The calibration's figures come from its snapshot alone: node times stored lower afterwards (as a heal
    does) are read, and the recompute scale and the policy's cost per op stay those of the snapshot."""
    monkeypatch.setenv(STORE_ENV, str(tmp_path))
    model, cap = _tiny()
    config = ProfileConfig(warmup=0, repeats=1)
    first = _profiled(model, cap, config)
    assert first.recompute_scale != 1.0 or first.op_overhead_s > 0
    path = next(tmp_path.glob("*.json"))
    data = json.loads(path.read_text())
    data["ops"] = {k: v / 4 for k, v in data["ops"].items()}
    path.write_text(json.dumps(data))
    _loaded(monkeypatch, LOAD)  # nothing this run measures heals
    again = _profiled(model, cap, config)
    assert (again.recompute_scale, again.op_overhead_s) == (first.recompute_scale, first.op_overhead_s)
    assert [b.time for b in again.nodes] == [a.time / 4 for a in first.nodes]


def test_a_snapshot_heals_whole_so_its_differences_come_from_one_run(tmp_path):
    """The call costs and the calibration are differences between side-by-side timings: a snapshot is
    replaced only whole, never one of its times on its own."""
    store = TimingStore(tmp_path / "timings-x.json")
    first = {"region": 3.0, "each": 4.0}
    assert store.settle("overheads", "call", first, 0.7) == first
    assert store.settle("overheads", "call", {"region": 1.0, "each": 5.0}, 0.7) == first  # total 6 > 0.7 x 7
    lower = {"region": 2.0, "each": 2.5}
    assert store.settle("overheads", "call", lower, 0.7) == lower  # total 4.5 <= 4.9: healed, both times
    store.save()
    assert TimingStore(store.path).get("overheads", "call") == lower
    # an entry of another shape (another version's) is measured again
    assert store.settle("overheads", "call", {"region": 9.0}, 0.7) == {"region": 9.0}


def test_settle_keeps_a_time_unless_clearly_lower(tmp_path):
    path = tmp_path / "timings-x.json"
    store = TimingStore(path)
    assert store.settle("ops", "mm", 1.0, 0.7) == 1.0
    assert store.settle("ops", "mm", 0.8, 0.7) == 1.0  # within the flicker of quiet runs: kept
    assert store.settle("ops", "mm", 3.0, 0.7) == 1.0  # a loaded run: kept
    assert store.settle("ops", "mm", 0.5, 0.7) == 0.5  # clearly lower: healed
    store.save()
    other = TimingStore(path)
    assert other.settle("ops", "mm", 0.9, 0.7) == 0.5
    stale = TimingStore(path)
    stale.data["ops"]["mm"] = 2.0  # a process that read the file before the heal...
    stale.settle("ops", "mm", 1.2, 0.7)
    stale.save()  # ...does not undo it
    assert TimingStore(path).get("ops", "mm") == 0.5


def test_store_off_in_the_environment_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(STORE_ENV, "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    model, cap = _tiny()
    cost = _profiled(model, cap, ProfileConfig(warmup=0, repeats=1))
    assert cost.time_source == "fitted"
    assert list(tmp_path.rglob("*.json")) == []


def test_two_writers_merge_and_the_lower_time_stays(tmp_path):
    """Two processes that read the file before either saved: the second to save keeps the first's entries
    and replaces one only where its own time heals it (here 1.0 against 2.0; 1.9 would not)."""
    path = tmp_path / "timings-x.json"
    a, b, c = TimingStore(path), TimingStore(path), TimingStore(path)
    a.settle("ops", "g", 2.0, 0.7)
    b.settle("ops", "g", 1.0, 0.7)
    b.settle("ops", "h", 3.0, 0.7)
    c.settle("ops", "h", 2.5, 0.7)
    for store in (a, b, c):
        store.save()
    data = json.loads(path.read_text())
    assert data["ops"] == {"g": 1.0, "h": 3.0}
    assert TimingStore(path).get("ops", "g") == 1.0
    assert [p.name for p in tmp_path.iterdir()] == ["timings-x.json"]  # no temporary file left behind


def test_an_unreadable_store_is_ignored_and_an_unwritable_one_is_no_error(tmp_path):
    path = tmp_path / "timings-x.json"
    path.write_text("{not json")
    store = TimingStore(path)
    assert store.get("ops", "mm") is None
    store.settle("ops", "mm", 1.0, 0.7)
    store.save()
    assert json.loads(path.read_text())["ops"] == {"mm": 1.0}
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    store = TimingStore(blocked / "timings-x.json")  # its folder cannot be made: a file is in the way
    store.settle("ops", "mm", 1.0, 0.7)
    store.save()
    assert store.get("ops", "mm") == 1.0


def test_meta_and_disabled_stores_keep_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(STORE_ENV, str(tmp_path))
    assert open_store("meta").path is None
    assert open_store("cpu", enabled=False).path is None
    assert open_store("cpu").path.parent == tmp_path


def test_raw_times_are_not_stored(tmp_path, monkeypatch):
    """Unfitted times (anchor=False) are this run's own: nothing of them is stored."""
    monkeypatch.setenv(STORE_ENV, str(tmp_path))
    model, cap = _tiny()
    cost = _profiled(model, cap, ProfileConfig(warmup=0, repeats=1, anchor=False, overheads=False))
    assert cost.time_source == "measured"
    assert list(tmp_path.glob("*.json")) == []
