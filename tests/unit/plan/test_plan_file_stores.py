"""Stores on disk are data too: a timing store that its group (or anyone) may write is ignored with one
warning naming it and its mode, as one another user owns is."""

from __future__ import annotations

import json
import os
import warnings

import pytest
from ckpt_planner.profile.timing_store import TimingStore, TimingStoreWarning


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
