"""Garbage collections during a profile walk only the objects made inside it (profile/memory.py)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from ckpt_planner.profile.bytes_pass import profile_for_planning
from ckpt_planner.profile.memory import collections_of_new_objects


class _Cycle:
    """An object in a reference cycle: only the collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_inside_new_garbage_is_collected_and_the_heap_is_given_back():
    gc.unfreeze()  # the suite freezes each test's heap (conftest): here the process's own state is the subject
    old = _Cycle()
    old_ref = weakref.ref(old)
    del old  # garbage made before: collected on entry, as a full collection would
    alive = _Cycle()
    alive_ref = weakref.ref(alive)
    with collections_of_new_objects():
        assert old_ref() is None
        assert gc.get_freeze_count() > 0  # what was alive on entry is set aside
        del alive  # garbage now, but it was alive on entry: set aside, so no collection inside walks it
        new = _Cycle()
        new_ref = weakref.ref(new)
        del new
        gc.collect()
        assert new_ref() is None  # garbage made inside is collected
        assert alive_ref() is not None  # the set-aside objects were not walked back in
    assert gc.get_freeze_count() == 0  # everything rejoins the collector's generations
    gc.collect()
    assert alive_ref() is None  # and is collected again as usual


def test_a_process_that_froze_its_own_objects_keeps_them_frozen():
    # Counting frozen objects would flake: one freed by its reference count leaves the count. A frozen
    # cycle that becomes garbage shows it instead: only an unfreeze lets the collector free it.
    kept = _Cycle()
    kept_ref = weakref.ref(kept)
    gc.freeze()
    del kept
    with collections_of_new_objects():
        pass
    gc.collect()
    assert kept_ref() is not None  # not unfrozen: that would release the process's own objects too
    gc.unfreeze()
    gc.collect()
    assert kept_ref() is None


def test_the_planning_profile_runs_inside(monkeypatch):
    from ckpt_planner.profile import bytes_pass

    seen = []

    def first_step(*_args, **_kwargs):  # the profile's first step: looking up a profile made earlier
        seen.append(gc.get_freeze_count())
        raise RuntimeError("seen")

    monkeypatch.setattr(bytes_pass.PROFILES, "key", first_step)
    gc.unfreeze()
    with pytest.raises(RuntimeError, match="seen"):
        profile_for_planning(torch.nn.Linear(2, 2), None, bytes_pass.ProfileConfig(bounded=False))
    assert seen and seen[0] > 0  # inside: the heap alive on entry was set aside
    assert gc.get_freeze_count() == 0  # given back, though the profile raised
