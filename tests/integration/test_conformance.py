"""The conformance matrix (benchmarks/conformance.py): its harness, and a sample of its cells.

The harness tests check that a cell which crashes, hangs or raises a library's own exception is a FAIL, never a
missing row; the slow sample plans a handful of cells that pass today, each in a forked process as the
benchmark runs them, and asserts each is PASS or a one-line refusal.
"""

from __future__ import annotations

import os
import time

import pytest

conformance = pytest.importorskip("benchmarks.conformance")


def _run(cells, **kw):
    rows = {}
    conformance.run_matrix(cells, kw.pop("jobs", 1), lambda name, path, row: rows.__setitem__((name, path), row))
    return rows


def test_a_cell_that_crashes_or_hangs_is_a_fail_and_the_rest_still_run(monkeypatch):
    def cell(name, path):
        if name == "crash":
            os._exit(3)  # as a segfault in a kernel would end it: no row sent
        if name == "hang":
            time.sleep(60)
        return {"status": "PASS"}

    monkeypatch.setattr(conformance, "run_cell", cell)  # the forked cells call it
    monkeypatch.setattr(conformance, "DEFAULT_TIMEOUT_S", 2)
    rows = _run([("crash", "below"), ("hang", "below"), ("fine", "below")], jobs=2)
    assert rows[("crash", "below")]["status"] == "FAIL" and "exit code 3" in rows[("crash", "below")]["reason"]
    assert rows[("hang", "below")]["status"] == "FAIL" and rows[("hang", "below")]["timeout"]
    assert rows[("fine", "below")]["status"] == "PASS"


def test_only_the_planners_own_one_line_errors_are_refusals():
    from ckpt_planner.errors import InfeasibleBudgetError, InputError, ProfileError

    assert conformance._is_refusal(InputError("inputs: a bad shape"))
    assert conformance._is_refusal(InfeasibleBudgetError(10, 20, "dp"))
    assert not conformance._is_refusal(RuntimeError("a leaf Variable that requires grad"))  # torch's, raw
    assert not conformance._is_refusal(ValueError("a reshape cannot be chunked"))  # raw, even if the planner raised it
    assert not conformance._is_refusal(ProfileError("node 'x' failed"))  # the planner failing on a model that trains


SAMPLE = [
    ("gpt2", "above"),
    ("tied_autoencoder", "above"),
    ("custom_function", "below"),
    ("gpt2", "bf16_autocast"),
    ("custom_function", "cli"),
]


@pytest.mark.slow  # five cells, each planned and verified in a process of its own: about two minutes on 2 cores
def test_matrix_sample_passes_or_refuses_in_one_line():
    rows = _run(SAMPLE)
    assert set(rows) == set(SAMPLE)
    for cell, row in rows.items():
        assert row["status"] in ("PASS", "REFUSE"), (cell, row)
        if row["status"] == "REFUSE":
            assert "\n" not in row["reason"], (cell, row["reason"])
        else:
            assert row["measured_bytes"] <= row["budget_bytes"], (cell, row)
            assert row["exact"], (cell, row)
