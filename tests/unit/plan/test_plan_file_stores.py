"""Stores on disk are data too: a timing store that its group (or anyone) may write is ignored with one
warning naming it and its mode, as one another user owns is; a stored choice naming a module the model
does not have is set aside with a note, and planning goes on."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from ckpt_planner import ProfileConfig, optimize
from ckpt_planner.cli.examples import MLPChain
from ckpt_planner.profile.timing_store import STORE_ENV, TimingStore, TimingStoreWarning


@pytest.mark.parametrize("mode", [0o664, 0o660, 0o620, 0o666])
def test_a_timing_store_its_group_may_write_is_ignored_with_one_warning(tmp_path, mode):
    path = tmp_path / "timings-x.json"
    path.write_text(json.dumps({"format": 5, "ops": {"mm": 0.002}, "overheads": {}, "graphs": {}, "steps": {},
                                "plans": {}}))
    os.chmod(path, mode)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = TimingStore(path)
        TimingStore(path)  # a second read of the same file says nothing more
    mine = [str(w.message) for w in caught if issubclass(w.category, TimingStoreWarning)]
    assert len(mine) == 1 and str(path) in mine[0] and f"mode {mode:o}" in mine[0], mine
    assert store.get("ops", "mm") is None
    os.chmod(path, 0o600)  # the owner's alone: read
    assert TimingStore(path).get("ops", "mm") == 0.002


def test_a_stored_choice_naming_a_missing_module_is_set_aside_with_a_note(tmp_path, monkeypatch):
    """An earlier run's race result names 'no.such.module' (the model's code changed, or the file was
    edited): planning goes on with a note, and this run's choice replaces the entry."""
    monkeypatch.setenv(STORE_ENV, str(tmp_path))
    config = ProfileConfig(warmup=0, repeats=1)  # measured: the race runs, and stores its choice
    torch.manual_seed(0)
    model, inputs = MLPChain(d=16, blocks=4), (torch.randn(32, 16),)
    optimize(model, inputs, activation_budget=0.8, profile_config=config, autotune=True)
    path = next(tmp_path.glob("timings-*.json"))
    data = json.loads(path.read_text())
    raced = [k for k in data["plans"] if k.endswith("|autotune")]
    assert raced, list(data["plans"])
    for k in raced:
        data["plans"][k]["modules"] = ["no.such.module"]
    path.write_text(json.dumps(data))
    os.chmod(path, 0o600)
    plan = optimize(model, inputs, activation_budget=0.8, profile_config=config, autotune=True)
    said = [n for n in plan.notes if "no.such.module" in n]
    assert len(said) == 1 and "set aside" in said[0] and "\n" not in said[0]
    assert plan.regions and plan.predicted_peak_bytes <= plan.budget_bytes
    after = json.loads(path.read_text())["plans"]
    assert all("no.such.module" not in after[k].get("modules", []) for k in raced)
